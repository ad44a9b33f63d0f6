"""The evidence pass: a rollout's fresh pre-update scores, what the algorithm's advantages read.

docs/design.md §2 "Non-replay evidence recomputation": the trainer scores the trajectories with the
current (pre-update) parameters, never with the sampler's log-probs, under `stop_gradient`:

- `dual_logprobs` (student and teacher in one batched pass) when the algorithm reads the
  teacher log-probs (PBSD, RLSD);
- `token_divergence` (one student and one teacher forward, giving divergence, entropy and the
  student's log-probs together) when it reads the divergence or the entropy (GEAR);
- the student pass alone otherwise (GRPO, OPSD: the PPO "old" log-probs).

Routing is fresh in every pass; only an algorithm with `replay_routing` (PBSD's MoE ablation)
scores under the routes the sampler recorded (`Rollout.routes`): the student's on every column,
and the same on the teacher's trajectory columns, its privileged prompt routed afresh.

`score_student=False` leaves the student log-probs out where only they would need a pass of
their own (the learner's on-policy plan takes them from the update's own forward). Every score
starts at the rollout's prompt width: action tokens lie in the trajectory, so the LM head never
runs on the prompt region.

Token layout and padding: docs/design.md §3 (`pbsd_jax.agent.rollout`); per-token arrays are `[B, T]`,
aligned like `likelihood.token_logprobs`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from pbsd_jax.agent import privileged
from pbsd_jax.models import ModelConfig
from pbsd_jax.rl import likelihood
from pbsd_jax.rl.algorithms import AdvantageInputs

Array = jax.Array


@struct.dataclass
class PolicyBatch:
  """What the policy-gradient update trains on (all `[B, T]`, the rollout's columns).

  Attributes:
    tokens, mask: the student sequence (ordinary prompt) and its real tokens.
    teacher_tokens, teacher_mask: the same trajectory under the privileged prompt (used by
      distillation losses).
    action_mask: `bool` tokens the policy sampled (the entropy metric's tokens).
    inputs: the algorithm's `AdvantageInputs`; `inputs.logp_student` is the pre-update
      student log-probs, the PPO ratio's base (None when the update's own forward supplies
      them: `UpdatePlan.on_policy`).
    score_from: static first column the loss and the entropy metric read (the rollout's
      prompt width), so the update's LM head skips the prompt region. 1 scores every column.
    turn_label, turn_value: `i32[B, K]` / `f32[B, K]` the rollout's turn labels and values
      (`gold_chain`), or None: the credit-quality metrics, never the loss.
  """

  tokens: Array
  mask: Array
  teacher_tokens: Array
  teacher_mask: Array
  action_mask: Array
  inputs: AdvantageInputs
  score_from: int = struct.field(pytree_node=False, default=1)
  turn_label: Array | None = None
  turn_value: Array | None = None


def policy_batch(params: Any, rollout: Any, teacher_prompt: Array, teacher_prompt_mask: Array,
                 step: Array, *, model: ModelConfig, algo: Any, max_turns: int,
                 chunk_size: int | None = None, score_student: bool = True,
                 micro_batch_size: int | None = None, micro_sharding: Any = None
                 ) -> PolicyBatch:
  """The evidence pass of a rollout (module docstring): its `PolicyBatch`.

  Args:
    params: the pre-update parameters.
    rollout: a `pbsd_jax.agent.rollout.Rollout` (tokens, action_mask, turn_ids, reward, mask).
    teacher_prompt: `i32[B, P]` left-padded privileged prompts (`privileged.dual_prompts`).
    teacher_prompt_mask: `bool[B, P]`.
    step: `i32[]` the train step (the algorithm's schedules).
    model: the model config.
    algo: a `pbsd_jax.rl.algorithms` algorithm (its `needs`).
    max_turns: K, the rollout's static number of turn slots.
    chunk_size: LM-head chunk over the sequence.
    score_student: False: no pass of its own for the student log-probs (module docstring).
    micro_batch_size: score this many rows at a time (`lax.map` over micro-batches), so the
      pass holds one micro-batch's activations and LM-head chunk, not the whole batch's;
      None: all rows at once. The scores are the same.
    micro_sharding: the sharding of a `[n_micro, micro, ...]` block (rows over the data
      axes: `learner.micro_batch_sharding`), so each device scores its own rows.
  """
  tokens, mask = rollout.tokens, rollout.mask
  teacher_tokens, teacher_mask = privileged.teacher_sequence(tokens, mask, teacher_prompt,
                                                             teacher_prompt_mask)
  routes = replayed_routes(rollout) if getattr(algo, "replay_routing", False) else None
  score = lambda *rows: _scores(params, *rows, model=model, algo=algo, chunk_size=chunk_size,
                                score_student=score_student,
                                score_from=rollout.prompt_width)
  rows_first = None if routes is None else jnp.moveaxis(routes, 2, 0)  # [B, 2, layers, T, k]
  logp_student, logp_teacher, divergence, entropy = _by_micro_batch(
      score, micro_batch_size, micro_sharding, tokens, mask, teacher_tokens, teacher_mask,
      rows_first)
  inputs = AdvantageInputs(rewards=rollout.reward, action_mask=rollout.action_mask,
                           turn_ids=rollout.turn_ids, step=step, max_turns=max_turns,
                           logp_student=logp_student, logp_teacher=logp_teacher,
                           divergence=divergence, entropy=entropy,
                           turn_value=(getattr(rollout, "turn_value", None)
                                       if "turn_value" in algo.needs else None))
  return PolicyBatch(tokens=tokens, mask=mask, teacher_tokens=teacher_tokens,
                     teacher_mask=teacher_mask, action_mask=rollout.action_mask.astype(bool),
                     inputs=jax.lax.stop_gradient(inputs), score_from=rollout.prompt_width,
                     turn_label=getattr(rollout, "turn_label", None),
                     turn_value=getattr(rollout, "turn_value", None))


def _by_micro_batch(fn, micro: int | None, micro_sharding: Any, *arrays):
  """`fn(*arrays)` over the rows in micro-batches of `micro` (`lax.map`), the results put
  back in row order; one call when `micro` is None or holds every row."""
  b = jax.tree.leaves(arrays)[0].shape[0]
  if micro is None or micro >= b:
    return fn(*arrays)
  if b % micro:
    raise ValueError(f"{b} rows do not split into micro-batches of {micro}")
  split = jax.tree.map(lambda x: x.reshape(b // micro, micro, *x.shape[1:]), arrays)
  if micro_sharding is not None:
    split = jax.lax.with_sharding_constraint(split, micro_sharding)
  out = jax.lax.map(lambda rows: fn(*rows), split)
  return jax.tree.map(lambda y: y.reshape(b, *y.shape[2:]), out)


def _scores(params: Any, tokens: Array, mask: Array, teacher_tokens: Array,
            teacher_mask: Array, routes: Any, *, model: ModelConfig, algo: Any,
            chunk_size: int | None, score_student: bool, score_from: int
            ) -> tuple[Array | None, Array | None, Array | None, Array | None]:
  """`(logp_student, logp_teacher, divergence, entropy)` of some rows, each `[rows, T]` or
  None where the algorithm does not read it (module docstring). `routes` has the rows
  first."""
  routes = None if routes is None else jnp.moveaxis(routes, 0, 2)
  logp_student = logp_teacher = divergence = entropy = None
  if "logp_teacher" in algo.needs:
    if score_student:
      logp_student, logp_teacher = likelihood.dual_logprobs(
          params, model, tokens, mask, teacher_tokens, teacher_mask, chunk_size=chunk_size,
          routes=routes, score_from=score_from)
    else:
      logp_teacher = likelihood.token_logprobs(
          params, model, teacher_tokens, teacher_mask, chunk_size=chunk_size,
          routes=None if routes is None else routes[1], score_from=score_from)
  if algo.needs & {"divergence", "entropy"}:
    scores = likelihood.token_divergence(params, params, model, tokens, mask, teacher_tokens,
                                         teacher_mask, beta=1.0, chunk_size=chunk_size,
                                         score_from=score_from)
    divergence, entropy = scores.divergence, scores.entropy
    if score_student and logp_student is None:
      logp_student = scores.logp
  if score_student and logp_student is None:
    logp_student = likelihood.token_logprobs(params, model, tokens, mask,
                                             chunk_size=chunk_size, score_from=score_from)
  return logp_student, logp_teacher, divergence, entropy


def replayed_routes(rollout: Any) -> Array:
  """`i32[2, layers, B, T, k]` the student's and the teacher's routes to replay: the sampler's
  (`rollout.routes`), with -1 (route afresh) on the teacher's privileged prompt columns."""
  if getattr(rollout, "routes", None) is None:
    raise ValueError("replay_routing needs the sampler's routes: the rollout recorded none "
                     "(Sampler.record_routes)")
  student = jnp.moveaxis(rollout.routes, 2, 0)  # [layers, B, T, k]
  prompt = jnp.arange(student.shape[2])[None, None, :, None] < rollout.prompt_width
  return jnp.stack([student, jnp.where(prompt, -1, student)])


def rollout_metrics(rollout: Any) -> dict:
  """`accuracy` (mean reward), `mean_turns` and `mean_action_tokens` of a rollout, and its
  `searches` and `failed_searches` (counts over the batch)."""
  mean = lambda x: jnp.mean(x.astype(jnp.float32))
  total = lambda x: jnp.sum(x.astype(jnp.float32))
  return {"accuracy": mean(rollout.reward), "mean_turns": mean(rollout.num_turns),
          "mean_action_tokens": mean(rollout.num_action_tokens),
          "searches": total(rollout.searches), "failed_searches": total(rollout.search_failures)}

