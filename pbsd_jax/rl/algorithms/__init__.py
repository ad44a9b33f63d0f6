"""Policy-optimisation algorithms behind one interface, so the learner never branches on a name.

`get(name, **hparams)` returns a frozen, hashable algorithm object (a valid static argument of
`jax.jit`) configured with its hyperparameters; unknown names or hyperparameters, and
inconsistent values, fail here with a `ValueError` naming the field. `names()` lists the
registered algorithms: `grpo`, `pbsd`, `opsd`, `rlsd`, `gear` (docs/design.md §2) and
`oracle_credit` (PBSD with the world's turn values as its evidence: an upper bound on the
embedded task). Every one is GRPO with the DAPO switches plus its own fields; see each class
for the defaults.

The protocol (what the learner calls, per step; the teacher view of a rollout is
`privileged.teacher_sequence(tokens, mask, teacher_prompt, teacher_prompt_mask)`;
`pbsd_jax.rl.evidence` and `pbsd_jax.rl.learner` implement it):

1. Evidence, under `stop_gradient`, with the pre-update parameters:
   - `logp = likelihood.dual_logprobs(params, config, student_tokens, student_mask,
     teacher_tokens, teacher_mask)` when `'logp_teacher'` is in `algo.needs`; `logp[0]` is the
     student half (also the PPO "old" log-probs), `logp[1]` the teacher half. Otherwise the
     student half alone (`token_logprobs`) is enough;
   - if `'divergence'` or `'entropy'` is in `algo.needs`: `likelihood.token_divergence(params,
     params, config, ..., beta=1.0)` gives the divergence, the entropy and the student
     log-probs from one student forward.
2. `advantages, loss_mask, metrics = algo.advantages(AdvantageInputs(rewards=..., action_mask=
   ..., turn_ids=..., step=..., max_turns=K, logp_student=logp[0], logp_teacher=logp[1],
   ...))`: `f32[B, T]`, `bool[B, T]`, dict of scalars. Fields in `algo.needs` are required.
   `algo.turn_credit(outcome, inputs)` gives the per-turn evidence behind them (None for an
   algorithm that computes none), for the credit page.
3. Inside the differentiated function of the trained parameters `p`:
   - `new_logp = likelihood.token_logprobs(p, config, student_tokens, student_mask)`, or, when
     `algo.distillation_beta is not None` (OPSD), the `logp` and `divergence` of one
     `likelihood.token_divergence(p, initial_params, config, ..., beta=algo.distillation_beta)`;
   - `loss, weight, metrics = algo.loss(new_logp, old_logp, advantages, loss_mask,
     divergence=divergence_or_None)`: a scalar, what it is a mean over (loss tokens or rows),
     and a dict of scalars (`pg_clipfrac`, ...).
"""

from __future__ import annotations

import dataclasses

from pbsd_jax.rl.algorithms.gear import GEAR, gear_scale, gear_segments
from pbsd_jax.rl.algorithms.grpo import (GRPO, dynamic_sampling_mask, group_advantages,
                                         overlong_penalty)
from pbsd_jax.rl.algorithms.inputs import AdvantageInputs
from pbsd_jax.rl.algorithms.opsd import OPSD, distillation_loss
from pbsd_jax.rl.algorithms.oracle_credit import OracleCredit
from pbsd_jax.rl.algorithms.pbsd import PBSD
from pbsd_jax.rl.algorithms.policy_loss import (AGGREGATIONS, aggregate_loss, clipped_surrogate,
                                                masked_mean, policy_loss)
from pbsd_jax.rl.algorithms.rlsd import RLSD, rlsd_credit, rlsd_lambda

Algorithm = GRPO  # every registered algorithm is a GRPO subclass

_REGISTRY: dict[str, type[GRPO]] = {cls.name: cls for cls in (GRPO, PBSD, OPSD, RLSD, GEAR,
                                                                OracleCredit)}


def names() -> tuple[str, ...]:
  """The registered algorithm names."""
  return tuple(_REGISTRY)


def hyperparameters(name: str) -> dict:
  """The hyperparameters of algorithm `name` with their defaults."""
  cls = _lookup(name)
  return {f.name: f.default for f in _fields(cls)}


def get(name: str, **hparams) -> GRPO:
  """The algorithm `name` configured with `hparams` (unset ones take their defaults).

  Raises:
    ValueError: unknown name, unknown hyperparameter, or an inconsistent value (the message
      names the field).
  """
  cls = _lookup(name)
  known = {f.name for f in _fields(cls)}
  unknown = sorted(set(hparams) - known)
  if unknown:
    raise ValueError(f"unknown hyperparameter(s) {unknown} for algorithm {name!r}; "
                     f"known: {sorted(known)}")
  return cls(**hparams)


def _lookup(name: str) -> type[GRPO]:
  if name not in _REGISTRY:
    raise ValueError(f"unknown algorithm {name!r}; registered: {list(_REGISTRY)}")
  return _REGISTRY[name]


def _fields(cls) -> list:
  """The init fields of an algorithm class: its hyperparameters."""
  return [f for f in dataclasses.fields(cls) if f.init]


__all__ = ["AGGREGATIONS", "AdvantageInputs", "Algorithm", "GEAR", "GRPO", "OPSD", "PBSD",
           "RLSD", "aggregate_loss", "clipped_surrogate", "distillation_loss",
           "dynamic_sampling_mask", "gear_scale", "gear_segments", "get", "group_advantages",
           "hyperparameters", "masked_mean", "names", "overlong_penalty", "policy_loss",
           "rlsd_credit", "rlsd_lambda"]
