"""PBSD: GRPO with turn-level credit from privileged self-distillation (docs/design.md §2).

PBSD adds no loss term: it reshapes the GRPO advantages with `credit.pbsd_advantages` and
trains the unchanged clipped policy gradient, so its `loss` is GRPO's.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax

from pbsd_jax.rl import credit
from pbsd_jax.rl.algorithms.grpo import GRPO
from pbsd_jax.rl.algorithms.inputs import AdvantageInputs

Array = jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class PBSD(GRPO):
  """`A_{i,t} = A_i * w_{i,t}`, `w = 1 + c tanh(sign(A_i) s~_{i,t} / delta)` (DESIGN §2).

  Evidence comes from `AdvantageInputs.logp_teacher - logp_student` (one fresh pre-update
  `dual_logprobs` pass; never the sampler's log-probs).

  Attributes (besides GRPO's):
    delta: evidence scale (0.1); delta -> infinity recovers GRPO.
    clip: weight half-width c (0.1): weights lie in [1 - c, 1 + c].
    eps_pos, eps_neg: deadband thresholds (0.001 / 0.003).
    reduction: per-turn evidence `'mean'` (default) or `'sum'`.
    form: `'tanh'` (default) or `'clipped_tanh'`.
    replay_routing: score the evidence of an MoE model under the sampler's recorded routes
      (the student's routes also for the teacher's trajectory tokens) instead of fresh routes
      (False, the paper's method; True only for its ablation, DESIGN §2).
  """

  name: ClassVar[str] = "pbsd"
  needs: ClassVar[frozenset] = frozenset({"logp_student", "logp_teacher"})

  delta: float = 0.1
  clip: float = 0.1
  eps_pos: float = 0.001
  eps_neg: float = 0.003
  reduction: str = "mean"
  form: str = "tanh"
  replay_routing: bool = False

  def validate(self):
    super().validate()
    if not self.delta > 0:
      self._fail("delta", self.delta, "must be > 0")
    if not 0.0 <= self.clip <= 1.0:
      self._fail("clip", self.clip, "must be in [0, 1]")
    for field in ("eps_pos", "eps_neg"):
      if getattr(self, field) < 0:
        self._fail(field, getattr(self, field), "must be >= 0")
    if self.reduction not in credit.REDUCTIONS:
      self._fail("reduction", self.reduction, f"must be one of {credit.REDUCTIONS}")
    if self.form not in credit.FORMS:
      self._fail("form", self.form, f"must be one of {credit.FORMS}")

  def token_advantages(self, outcome: Array, inputs: AdvantageInputs) -> tuple[Array, dict]:
    """`credit.pbsd_advantages` of the outcome advantages; metrics under `credit/`."""
    adv, _, metrics = self._credit(outcome, inputs)
    return adv, {f"credit/{k}": v for k, v in metrics.items()}

  def turn_credit(self, outcome: Array, inputs: AdvantageInputs) -> credit.TurnCredit:
    """Turn evidence `s`, deadbanded `s~` and weights `w`, as `token_advantages` uses them."""
    return self._credit(outcome, inputs)[1]

  def _credit(self, outcome: Array, inputs: AdvantageInputs):
    return credit.pbsd_advantages(
        outcome, inputs.logp_teacher, inputs.logp_student, inputs.turn_ids, inputs.max_turns,
        delta=self.delta, clip=self.clip, eps_pos=self.eps_pos, eps_neg=self.eps_neg,
        reduction=self.reduction, form=self.form)
