"""The learner's updates: SFT and RL (PPO-style) steps on a `TrainState`.

Data flow of one RL step (docs/design.md §3), all traceable, so a rollout can stand in front of it
inside the same `jax.jit`:

    Rollout --evidence.policy_batch--> PolicyBatch --update--> new TrainState, metrics

and inside either update, top to bottom:

    policy_outputs (the trained parameters' forward: log-probs, entropy, OPSD's divergence)
    policy_targets (the one place advantages are computed: old log-probs -> Targets)
    policy_objective (the algorithm's loss of the outputs against the targets, its weight)

`ppo_update` takes the old log-probs from the evidence pass, computes the targets once and runs
`epochs` passes over the batch, each split into `minibatches` shuffled mini-batches (one
optimiser update each, `lax.scan`); a mini-batch's gradient is accumulated over micro-batches
of `micro_batch_size` rows (`lax.scan`), weighted by the loss's own normaliser so the sum
equals the mini-batch gradient.

`on_policy_update` is the shortcut for a plan of one update in one pass
(`UpdatePlan.on_policy`): the parameters that score the old log-probs are the ones the update
differentiates, so the update's own forward supplies them (`jax.vjp`: the targets are computed
from the forward's values, then the objective's gradient is pulled back through it). The
result is the update `ppo_update` makes with a separate student pass; PBSD's only extra pass
is then the teacher forward. (TRL and Tunix do the same for one iteration.)

An update whose loss, gradient or resulting parameters are not finite is not applied --
parameters and optimiser state stay as they were -- and is counted in `skipped_updates`. The
learner never branches on an algorithm's name: it reads `algo.needs` and
`algo.distillation_beta` (the `pbsd_jax.rl.algorithms` protocol). Rematerialisation is the model
config's `remat` switch.

Token layout and padding: docs/design.md §3 (`pbsd_jax.agent.rollout`); every per-token array is `[B, T]`
with the column of the token it scores (`likelihood.token_logprobs`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pbsd_jax.models import ModelConfig
from pbsd_jax.parallel import sharding
from pbsd_jax.rl import credit_quality, likelihood
from pbsd_jax.rl.algorithms import AdvantageInputs, masked_mean
from pbsd_jax.rl.evidence import PolicyBatch, policy_batch, rollout_metrics
from pbsd_jax.rl.train_state import TrainState, learning_rate, train_state_shardings

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class UpdatePlan:
  """How one batch becomes optimiser updates (hashable: a static jit argument).

  Attributes:
    epochs: passes over the batch (PPO epochs).
    minibatches: optimiser updates per epoch; rows are shuffled into this many mini-batches.
    micro_batch_size: rows per forward/backward pass; a mini-batch's gradient is accumulated
      over its micro-batches. None: the whole mini-batch in one pass.
    chunk_size: LM-head chunk over the sequence (`likelihood.token_logprobs`); None: whole.
  """

  epochs: int = 1
  minibatches: int = 1
  micro_batch_size: int | None = None
  chunk_size: int | None = None

  def __post_init__(self):
    for name in ("epochs", "minibatches"):
      if getattr(self, name) < 1:
        raise ValueError(f"UpdatePlan.{name} must be >= 1, got {getattr(self, name)}")
    if self.micro_batch_size is not None and self.micro_batch_size < 1:
      raise ValueError(f"UpdatePlan.micro_batch_size must be >= 1, got "
                       f"{self.micro_batch_size}")
    if self.chunk_size is not None and self.chunk_size < 1:
      raise ValueError(f"UpdatePlan.chunk_size must be >= 1, got {self.chunk_size}")

  def on_policy(self, batch_size: int, batch_shards: int = 1) -> bool:
    """True when a batch makes exactly one optimiser update in one forward/backward pass.

    The log-probs under the pre-update parameters are then the update's own forward
    (`on_policy_update`), so no separate pass computes them.
    """
    return (self.epochs == self.minibatches == 1
            and self.micro_batches(batch_size, batch_shards)[0] == 1)

  def micro_batches(self, batch_size: int, batch_shards: int = 1) -> tuple[int, int]:
    """`(micro-batches per mini-batch, rows per micro-batch)` for a batch of `batch_size`.

    Raises:
      ValueError: rows that do not split evenly (into mini-batches, micro-batches, or over
        the `batch_shards` data-parallel devices); the message names the field.
    """
    if batch_size % self.minibatches:
      raise ValueError(f"batch of {batch_size} rows does not split into "
                       f"UpdatePlan.minibatches={self.minibatches}")
    rows = batch_size // self.minibatches
    micro = rows if self.micro_batch_size is None else self.micro_batch_size
    if rows % micro:
      raise ValueError(f"mini-batch of {rows} rows does not split into micro-batches of "
                       f"UpdatePlan.micro_batch_size={micro}")
    if micro % batch_shards:
      raise ValueError(f"micro-batch of {micro} rows does not split over the {batch_shards} "
                       "data-parallel devices of the mesh (data * fsdp)")
    return rows // micro, micro


class PolicyOutputs(NamedTuple):
  """The trained parameters' forward on a batch, each `f32[B, T]`.

  Attributes:
    logp: log-probs of the student sequence's tokens (differentiable).
    entropy: the student's next-token entropy (a metric).
    divergence: the distillation divergence against the frozen teacher (`algo.distillation_beta`
      set, OPSD), else None.
  """

  logp: Array
  entropy: Array
  divergence: Array | None


@struct.dataclass
class Targets:
  """What the policy objective compares the outputs with, each `[B, T]`.

  Attributes:
    old_logp: `f32` pre-update log-probs of the student sequence (the PPO ratio's base).
    advantages: `f32` token advantages, 0 off `loss_mask`.
    loss_mask: `bool` tokens that enter the loss (the algorithm's; a subset of the actions).
  """

  old_logp: Array
  advantages: Array
  loss_mask: Array


def sft_loss(params: Any, model: ModelConfig, tokens: Array, mask: Array, loss_mask: Array,
             chunk_size: int | None = None) -> tuple[Array, tuple[Array, dict]]:
  """Masked NLL `-sum(logp * loss_mask) / sum(loss_mask)`, its weight and metrics.

  Returns `(loss, (weight, metrics))` as `accumulate_gradients` reads them: the weight is
  `sum(loss_mask)`, what the mean divides by; metrics hold `entropy`.

  Args:
    params: model parameters.
    model: the model config.
    tokens: `i32[B, T]`; mask: `bool[B, T]` real tokens.
    loss_mask: `bool[B, T]` tokens trained on (SFT: the action tokens only).
    chunk_size: LM-head chunk over the sequence.
  """
  logp, entropy = likelihood.token_logprobs(params, model, tokens, mask, chunk_size=chunk_size,
                                            with_entropy=True)
  return -masked_mean(logp, loss_mask), (jnp.sum(loss_mask).astype(jnp.float32), {
      "entropy": masked_mean(jax.lax.stop_gradient(entropy), loss_mask)})


def accumulate_gradients(loss_fn: Callable[[Any, Any], tuple[Array, tuple[Array, dict]]],
                         params: Any, micro_batches: Any) -> tuple[Array, Any, dict, Array]:
  """Loss, gradient and metrics of a mini-batch from its micro-batches (`lax.scan`).

  `loss_fn(params, micro)` returns `(loss, (weight, metrics))`: a scalar loss that is a mean
  over `weight` items of the micro-batch (loss tokens for a token mean, rows with loss tokens
  for a sequence mean: the loss's own normaliser, `algorithms.aggregate_loss`) and a dict of
  scalar metrics. Micro-batch k counts with
  `weight_k / sum(weight)`, which makes the result the mini-batch's own mean.

  Args:
    loss_fn: `(params, micro) -> (loss, (weight, metrics))`.
    params: the parameters to differentiate.
    micro_batches: pytree of `[n_micro, micro, ...]` arrays.

  Returns:
    `(loss, grads, metrics, weight)`: the first three weighted means over micro-batches (0 if
    every weight is 0), then the total weight (0: the mini-batch has no loss item).
  """
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def body(acc, micro):
    (loss, (w, metrics)), grads = grad_fn(params, micro)
    # Zero-weight micro-batches are dropped with `where`, so a NaN there cannot leak in.
    scale = lambda x: jnp.where(w > 0, x * w, jnp.zeros_like(x))
    sums, total = acc
    sums = jax.tree.map(lambda a, x: a + scale(x), sums, (loss, grads, metrics))
    return (sums, total + w), None

  first = jax.tree.map(lambda x: x[0], micro_batches)
  (loss0, (_, metrics0)), grads0 = jax.eval_shape(grad_fn, params, first)
  # The sums are float32 whatever the parameters' dtype: 16-bit sums of micro-batch
  # gradients would round each one they add.
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.promote_types(s.dtype, jnp.float32)),
                       (loss0, grads0, metrics0))
  (sums, total), _ = jax.lax.scan(body, (zeros, jnp.float32(0.0)), micro_batches)
  loss, grads, metrics = jax.tree.map(lambda x: x / jnp.maximum(total, 1e-12), sums)
  grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
  return loss, grads, metrics, total


def apply_update(params: Any, opt_state: Any, grads: Any, loss: Array,
                 tx: optax.GradientTransformation, has_tokens: Array | bool = True
                 ) -> tuple[Any, Any, dict]:
  """One optimiser update, or none when the loss, the gradient or the updated parameters are
  not finite (a finite gradient times a huge learning rate or weight decay can overflow).

  A mini-batch without any loss token (`has_tokens` False, e.g. every group dropped by DAPO
  dynamic sampling) is not applied either: AdamW would still move the parameters through its
  momentum and weight decay on a zero gradient.

  Returns:
    `(params, opt_state, metrics)` with `grad_norm` (before clipping), `skipped` (1.0 when the
    update was not applied because of a non-finite value) and `empty` (1.0 when it was not
    applied for want of loss tokens).
  """
  grad_norm = optax.tree.norm(grads)
  finite_grads = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  # Non-finite gradients are zeroed before the optimiser sees them, so no NaN enters its
  # arithmetic; the result is then discarded in favour of the old state.
  safe = jax.tree.map(lambda g: jnp.where(finite_grads, g, jnp.zeros_like(g)), grads)
  updates, new_opt_state = tx.update(safe, opt_state, params)
  new_params = optax.apply_updates(params, updates)
  # Element-wise, not a norm: the norm of large finite parameters can itself overflow.
  finite = finite_grads & jax.tree.reduce(lambda ok, p: ok & jnp.all(jnp.isfinite(p)),
                                          new_params, jnp.bool_(True))
  apply = finite & has_tokens
  keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(apply, n, o), new, old)
  return (keep(new_params, params), keep(new_opt_state, opt_state),
          {"grad_norm": grad_norm, "skipped": 1.0 - finite.astype(jnp.float32),
           "empty": finite.astype(jnp.float32) * (1.0 - jnp.asarray(has_tokens, jnp.float32))})


def _split_micro(tree: Any, n_micro: int, micro: int) -> Any:
  return jax.tree.map(lambda x: x.reshape(n_micro, micro, *x.shape[1:]), tree)


def _shards(micro_sharding: NamedSharding | None) -> int:
  """Devices a micro-batch's rows are split over (1 without a sharding)."""
  if micro_sharding is None:
    return 1
  rows = micro_sharding.spec[1] if len(micro_sharding.spec) > 1 else None
  rows = () if rows is None else (rows,) if isinstance(rows, str) else rows
  return math.prod(micro_sharding.mesh.shape[a] for a in rows)


def sft_step(state: TrainState, tokens: Array, mask: Array, loss_mask: Array, *,
             model: ModelConfig, tx: optax.GradientTransformation,
             plan: UpdatePlan = UpdatePlan(), micro_sharding: NamedSharding | None = None
             ) -> tuple[TrainState, dict]:
  """One SFT update: masked NLL on `loss_mask` (the action tokens), micro-batch accumulated.

  Args:
    state: the train state.
    tokens: `i32[B, T]`; mask: `bool[B, T]` real tokens; loss_mask: `bool[B, T]`.
    model: the model config.
    tx: the optimiser.
    plan: `micro_batch_size` and `chunk_size` are used (one update per call).
    micro_sharding: optional sharding of a `[n_micro, micro, ...]` block (see `ppo_update`).

  Returns:
    `(new state, metrics)`: `loss` (the pre-update NLL), `entropy`, `grad_norm`,
    `learning_rate`, `skipped_updates` and `empty_updates` (0 or 1, see `apply_update`).
  """
  n_micro, micro = plan.micro_batches(tokens.shape[0], _shards(micro_sharding))
  batch = _split_micro((tokens, mask, loss_mask), n_micro, micro)
  if micro_sharding is not None:
    batch = jax.lax.with_sharding_constraint(batch, micro_sharding)
  loss_fn = lambda p, b: sft_loss(p, model, *b, chunk_size=plan.chunk_size)
  loss, grads, metrics, weight = accumulate_gradients(loss_fn, state.params, batch)
  params, opt_state, update = apply_update(state.params, state.opt_state, grads, loss, tx,
                                           weight > 0)
  new_state = state.replace(params=params, opt_state=opt_state, step=state.step + 1)
  return new_state, {"loss": loss, **metrics, "grad_norm": update["grad_norm"],
                     "learning_rate": learning_rate(opt_state),
                     "skipped_updates": update["skipped"], "empty_updates": update["empty"]}


def policy_outputs(params: Any, batch: PolicyBatch, *, model: ModelConfig, algo: Any,
                   chunk_size: int | None = None, teacher_params: Any = None) -> PolicyOutputs:
  """The forward of the parameters being trained, on the student sequence of `batch`.

  One student forward: with a distillation algorithm (`algo.distillation_beta` set, OPSD) it is
  `likelihood.token_divergence` against the frozen `teacher_params` on the teacher sequence,
  whose student half also gives the log-probs and the entropy; otherwise `token_logprobs`.
  Scores start at `batch.score_from`.
  """
  if algo.distillation_beta is None:
    logp, entropy = likelihood.token_logprobs(params, model, batch.tokens, batch.mask,
                                              chunk_size=chunk_size, with_entropy=True,
                                              score_from=batch.score_from)
    return PolicyOutputs(logp, entropy, None)
  if teacher_params is None:
    raise ValueError(f"{algo.name} distils from frozen teacher parameters: pass "
                     "teacher_params (the initial parameters)")
  scores = likelihood.token_divergence(
      params, teacher_params, model, batch.tokens, batch.mask, batch.teacher_tokens,
      batch.teacher_mask, beta=algo.distillation_beta, chunk_size=chunk_size,
      score_from=batch.score_from)
  return PolicyOutputs(scores.logp, scores.entropy, scores.divergence)


def policy_targets(algo: Any, inputs: AdvantageInputs, old_logp: Array,
                   turn_label: Array | None = None, turn_value: Array | None = None
                   ) -> tuple[Targets, dict]:
  """The algorithm's token advantages with `old_logp` as the student log-probs: `Targets`.

  The one place the learner computes advantages, whatever the update plan; `old_logp` is the
  evidence pass's student half or, on the on-policy plan, the update's own forward.

  Returns:
    `(Targets, metrics)`: the algorithm's advantage metrics, and with `turn_label` (the
    rollout's `gold_chain.turn_labels`, and `turn_value`, its `turn_values`) the
    credit-quality AUCs of its turn evidence and of the final turn credit
    (`credit_quality.quality_metrics`).
  """
  old_logp = jax.lax.stop_gradient(old_logp)
  inputs = inputs.replace(logp_student=old_logp)
  advantages, loss_mask, metrics = algo.advantages(inputs)
  if turn_label is not None:
    metrics = {**metrics, **credit_quality.batch_metrics(algo, inputs, advantages, turn_label,
                                                         turn_value)}
  return Targets(old_logp=old_logp, advantages=advantages, loss_mask=loss_mask), metrics


def policy_objective(outputs: PolicyOutputs, targets: Targets, action_mask: Array, algo: Any
                     ) -> tuple[Array, tuple[Array, dict]]:
  """The algorithm's loss of `outputs` against `targets`, its weight and metrics.

  Returns `(loss, (weight, metrics))` as `accumulate_gradients` reads them: the weight is the
  loss's own normaliser (`algo.loss`); metrics hold the algorithm's loss metrics and
  `entropy`, the student's next-token entropy, token-mean over `action_mask`.
  """
  loss, weight, metrics = algo.loss(outputs.logp, targets.old_logp, targets.advantages,
                                    targets.loss_mask, divergence=outputs.divergence)
  entropy = masked_mean(jax.lax.stop_gradient(outputs.entropy), action_mask)
  return loss, (weight, {**metrics, "entropy": entropy})


def policy_loss(params: Any, batch: PolicyBatch, targets: Targets, *, model: ModelConfig,
                algo: Any, chunk_size: int | None = None, teacher_params: Any = None
                ) -> tuple[Array, tuple[Array, dict]]:
  """`policy_objective` of `policy_outputs`: the loss `ppo_update` differentiates."""
  outputs = policy_outputs(params, batch, model=model, algo=algo, chunk_size=chunk_size,
                           teacher_params=teacher_params)
  return policy_objective(outputs, targets, batch.action_mask, algo)


def _summary(per_update: dict, opt_state: Any) -> dict:
  """Metrics of a step from its updates' `[U]` metrics: means over the applied updates (over
  all when none was applied), skipped and empty counts, the last learning rate."""
  skipped, empty = per_update.pop("skipped"), per_update.pop("empty")
  applied = (1.0 - skipped) * (1.0 - empty)
  weights = jnp.where(jnp.sum(applied) > 0, applied, jnp.ones_like(applied))
  mean = lambda x: jnp.sum(jnp.where(weights > 0, x, 0.0) * weights) / jnp.sum(weights)
  return {**{k: mean(v) for k, v in per_update.items()}, "skipped_updates": jnp.sum(skipped),
          "empty_updates": jnp.sum(empty), "learning_rate": learning_rate(opt_state)}


def ppo_update(state: TrainState, batch: PolicyBatch, *, model: ModelConfig,
               tx: optax.GradientTransformation, algo: Any, plan: UpdatePlan = UpdatePlan(),
               teacher_params: Any = None, micro_sharding: NamedSharding | None = None
               ) -> tuple[TrainState, dict]:
  """`plan.epochs x plan.minibatches` optimiser updates on one batch (module docstring).

  Args:
    state: the train state (its `rng` shuffles the rows of each epoch).
    batch: the `PolicyBatch`, B rows, with the evidence pass's `inputs.logp_student`.
    model: the model config.
    tx: the optimiser.
    algo: a `pbsd_jax.rl.algorithms` algorithm (its `advantages` and `loss`).
    plan: epochs, mini-batches, micro-batch size, LM-head chunk.
    teacher_params: frozen teacher parameters (required when `algo.distillation_beta` is set).
    micro_sharding: optional sharding of a `[n_micro, micro, ...]` block (rows over the data
      axes), so each device computes its own rows of every micro-batch.

  Returns:
    `(new state, metrics)`: the advantage metrics, the loss metrics (`loss`, `pg_clipfrac`,
    `entropy`, ...) and `grad_norm` averaged over the applied updates (over all when none was
    applied), `skipped_updates` and `empty_updates` (counts, see `apply_update`),
    `learning_rate` (after the last update).
  """
  if batch.inputs.logp_student is None:
    raise ValueError("ppo_update needs the evidence pass's student log-probs "
                     "(policy_batch(score_student=True)); a plan of one update in one pass "
                     "(UpdatePlan.on_policy) can take them from on_policy_update instead")
  b = batch.tokens.shape[0]
  n_micro, micro = plan.micro_batches(b, _shards(micro_sharding))
  targets, adv_metrics = policy_targets(algo, batch.inputs, batch.inputs.logp_student,
                                        batch.turn_label, batch.turn_value)
  rng, shuffle_rng = jax.random.split(state.rng)
  orders = [jax.random.permutation(jax.random.fold_in(shuffle_rng, e), b)
            for e in range(plan.epochs)]
  # [updates, n_micro, micro] row indices: epoch-major, then mini-batch.
  order = jnp.stack(orders).reshape(plan.epochs * plan.minibatches, n_micro, micro)
  # Every leaf has the row axis first.
  rows_only = (batch.replace(inputs=None, turn_label=None, turn_value=None), targets)
  loss_fn = lambda params, micro: policy_loss(params, *micro, model=model, algo=algo,
                                              chunk_size=plan.chunk_size,
                                              teacher_params=teacher_params)

  def update(carry, rows):
    params, opt_state = carry
    micro_batches = jax.tree.map(lambda x: x[rows], rows_only)
    if micro_sharding is not None:
      micro_batches = jax.lax.with_sharding_constraint(micro_batches, micro_sharding)
    loss, grads, metrics, weight = accumulate_gradients(loss_fn, params, micro_batches)
    params, opt_state, info = apply_update(params, opt_state, grads, loss, tx, weight > 0)
    return (params, opt_state), {"loss": loss, **metrics, **info}

  (params, opt_state), per_update = jax.lax.scan(update, (state.params, state.opt_state),
                                                 order)
  new_state = state.replace(params=params, opt_state=opt_state, step=state.step + 1, rng=rng)
  return new_state, {**adv_metrics, **_summary(per_update, opt_state)}


def on_policy_update(state: TrainState, batch: PolicyBatch, *, model: ModelConfig,
                     tx: optax.GradientTransformation, algo: Any, plan: UpdatePlan = UpdatePlan(),
                     teacher_params: Any = None, micro_sharding: NamedSharding | None = None
                     ) -> tuple[TrainState, dict]:
  """The one update of an on-policy plan, its old log-probs from its own forward.

  `jax.vjp` runs the forward of the pre-update parameters once; its log-probs, under
  `stop_gradient`, are the old log-probs and the student log-probs of the advantages
  (`policy_targets`); the objective's gradient with respect to the forward's outputs is then
  pulled back to the parameters. `batch.inputs.logp_student` is not read (the evidence pass
  can skip it: `policy_batch(score_student=False)`).

  Args: as `ppo_update`; `plan` must be `UpdatePlan.on_policy` for the batch.

  Returns:
    `(new state, metrics)` with the metrics of `ppo_update`.
  """
  b = batch.tokens.shape[0]
  if not plan.on_policy(b, _shards(micro_sharding)):
    raise ValueError(f"on_policy_update needs one update in one pass (UpdatePlan.on_policy), "
                     f"got {plan} for {b} rows")
  if micro_sharding is not None:  # rows over the data axes (the scalar step has no rows)
    rows = NamedSharding(micro_sharding.mesh, PartitionSpec(micro_sharding.spec[1]))
    batch = jax.tree.map(
        lambda x: jax.lax.with_sharding_constraint(x, rows) if x.ndim else x, batch)
  rng, _ = jax.random.split(state.rng)  # what ppo_update consumes, so the runs stay equal
  outputs, pullback = jax.vjp(
      lambda params: policy_outputs(params, batch, model=model, algo=algo,
                                    chunk_size=plan.chunk_size, teacher_params=teacher_params),
      state.params)
  targets, adv_metrics = policy_targets(algo, batch.inputs, outputs.logp, batch.turn_label,
                                        batch.turn_value)
  objective = lambda out: policy_objective(out, targets, batch.action_mask, algo)
  (loss, (weight, metrics)), d_outputs = jax.value_and_grad(objective, has_aux=True)(outputs)
  grads, = pullback(d_outputs)
  params, opt_state, info = apply_update(state.params, state.opt_state, grads, loss, tx,
                                         weight > 0)
  per_update = jax.tree.map(lambda x: jnp.asarray(x)[None], {"loss": loss, **metrics, **info})
  new_state = state.replace(params=params, opt_state=opt_state, step=state.step + 1, rng=rng)
  return new_state, {**adv_metrics, **_summary(per_update, opt_state)}


def rl_step(state: TrainState, rollout: Any, teacher_prompt: Array, teacher_prompt_mask: Array,
            teacher_params: Any = None, *, model: ModelConfig, tx: optax.GradientTransformation,
            algo: Any, max_turns: int, plan: UpdatePlan = UpdatePlan(),
            micro_sharding: NamedSharding | None = None) -> tuple[TrainState, dict]:
  """One RL iteration on a rollout: `evidence.policy_batch`, then the update (traceable).

  The update is `on_policy_update` when the plan makes one update in one pass (the evidence
  pass then skips the student log-probs), else `ppo_update`. The evidence pass scores the
  rows in the plan's micro-batches, as the update does.

  Args: as `evidence.policy_batch` and `ppo_update`.

  Returns:
    `(new state, metrics)`: the update's metrics and `evidence.rollout_metrics`.
  """
  on_policy = plan.on_policy(rollout.tokens.shape[0], _shards(micro_sharding))
  batch = policy_batch(state.params, rollout, teacher_prompt, teacher_prompt_mask, state.step,
                       model=model, algo=algo, max_turns=max_turns,
                       chunk_size=plan.chunk_size, score_student=not on_policy,
                       micro_batch_size=plan.micro_batch_size, micro_sharding=micro_sharding)
  update = on_policy_update if on_policy else ppo_update
  state, metrics = update(state, batch, model=model, tx=tx, algo=algo, plan=plan,
                          teacher_params=teacher_params, micro_sharding=micro_sharding)
  return state, {**rollout_metrics(rollout), **metrics}


def micro_batch_sharding(mesh: Mesh, rules=sharding.RULES) -> NamedSharding:
  """The sharding of a `[n_micro, micro, ...]` block of micro-batches: rows over the data
  axes."""
  rows = sharding.batch_sharding(mesh, rules).spec[0]
  return NamedSharding(mesh, PartitionSpec(None, rows))


def make_sft_step(model: ModelConfig, tx: optax.GradientTransformation,
                  plan: UpdatePlan = UpdatePlan(), mesh: Mesh | None = None,
                  rules=sharding.RULES) -> Callable:
  """`sft_step` jitted: `(state, tokens, mask, loss_mask) -> (state, metrics)`, state donated.

  With a mesh: explicit in/out shardings (state from `train_state_shardings`, batch rows over
  the data axes, metrics replicated).
  """
  fn = functools.partial(sft_step, model=model, tx=tx, plan=plan)
  if mesh is None:
    return jax.jit(fn, donate_argnums=0)
  fn = functools.partial(fn, micro_sharding=micro_batch_sharding(mesh, rules))
  state_sh, data = train_state_shardings(model, tx, mesh, rules), sharding.batch_sharding(
      mesh, rules)
  return jax.jit(fn, in_shardings=(state_sh, data, data, data),
                 out_shardings=(state_sh, sharding.replicated(mesh)), donate_argnums=0)


def make_rl_step(model: ModelConfig, tx: optax.GradientTransformation, algo: Any,
                 max_turns: int, plan: UpdatePlan = UpdatePlan(), mesh: Mesh | None = None,
                 rules=sharding.RULES) -> Callable:
  """`rl_step` jitted, state donated.

  Returns:
    `step(state, rollout, teacher_prompt, teacher_prompt_mask, teacher_params=None) ->
    (state, metrics)`. With a mesh, in/out shardings are explicit: state from
    `train_state_shardings`, rollout and prompts rows over the data axes, teacher params
    like the params, metrics replicated; each micro-batch is constrained to the data axes.
    The state's buffers are donated: pass OPSD's frozen `teacher_params` as a separate copy,
    never `state.params` itself.
  """
  fn = functools.partial(rl_step, model=model, tx=tx, algo=algo, max_turns=max_turns,
                         plan=plan)
  if mesh is None:
    return jit_with_optional_teacher(fn)
  fn = functools.partial(fn, micro_sharding=micro_batch_sharding(mesh, rules))
  state_sh = train_state_shardings(model, tx, mesh, rules)
  data = sharding.batch_sharding(mesh, rules)
  return jit_with_optional_teacher(fn, (state_sh, data, data, data), state_sh.params,
                                   (state_sh, sharding.replicated(mesh)))


def jit_with_optional_teacher(fn: Callable, in_shardings: tuple | None = None,
                              teacher_shardings: Any = None, out_shardings: Any = None
                              ) -> "OptionalTeacherStep":
  """`fn(state, a, b, c, teacher_params=None)` jitted with the state donated, as two programs:
  one taking frozen teacher parameters, one without (None has no sharding to give).

  Args:
    fn: the step.
    in_shardings: the shardings of `(state, a, b, c)`, or None to let jit infer them (and
      `out_shardings` too).
    teacher_shardings: the teacher parameters' shardings (with `in_shardings`).
    out_shardings: the outputs' shardings (with `in_shardings`).

  Returns:
    `OptionalTeacherStep`: `step(state, a, b, c, teacher_params=None)`.
  """
  if in_shardings is None:
    with_teacher = jax.jit(fn, donate_argnums=0)
    without = jax.jit(lambda s, a, b, c: fn(s, a, b, c), donate_argnums=0)
  else:
    with_teacher = jax.jit(fn, in_shardings=(*in_shardings, teacher_shardings),
                           out_shardings=out_shardings, donate_argnums=0)
    without = jax.jit(lambda s, a, b, c: fn(s, a, b, c), in_shardings=in_shardings,
                      out_shardings=out_shardings, donate_argnums=0)

  return OptionalTeacherStep(with_teacher, without)


@dataclasses.dataclass(frozen=True)
class OptionalTeacherStep:
  """A step jitted twice, with frozen teacher parameters and without; called or lowered
  (`jax.stages.Lowered`, for ahead-of-time compilation) as
  `step(state, a, b, c, teacher_params=None)`."""

  with_teacher: Callable
  without: Callable

  def __call__(self, state, a, b, c, teacher_params=None):
    if teacher_params is None:
      return self.without(state, a, b, c)
    return self.with_teacher(state, a, b, c, teacher_params)

  def lower(self, state, a, b, c, teacher_params=None):
    if teacher_params is None:
      return self.without.lower(state, a, b, c)
    return self.with_teacher.lower(state, a, b, c, teacher_params)
