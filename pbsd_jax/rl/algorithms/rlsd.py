"""RLSD baseline: per-token self-distillation evidence weights on GRPO (docs/design.md §2).

`D_j = sg(logp_T - logp_S)` (current model, privileged prompt), `w_j = exp(sign(A_i) D_j)`,
`credit_j = (1 - lam) + lam * clip(w_j, 1 - eps_w, 1 + eps_w)`, `A_{i,j} = A_i * credit_j`;
`lam` decays linearly from `lam_init` (0.5) to 0 over the first `lam_decay_steps` (50) steps,
after which RLSD is GRPO exactly.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from pbsd_jax.rl import credit
from pbsd_jax.rl.algorithms.grpo import GRPO
from pbsd_jax.rl.algorithms.inputs import AdvantageInputs
from pbsd_jax.rl.algorithms.policy_loss import masked_mean

Array = jax.Array


def rlsd_lambda(step: Array, lam_init: float = 0.5, decay_steps: int = 50) -> Array:
  """`f32[]` mixing weight: `lam_init * max(0, 1 - step / decay_steps)`."""
  if decay_steps <= 0:
    return jnp.zeros((), jnp.float32)
  frac = jnp.asarray(step, jnp.float32) / decay_steps
  return lam_init * jnp.clip(1.0 - frac, 0.0, 1.0)


def rlsd_credit(advantages: Array, logp_teacher: Array, logp_student: Array, lam: Array,
                eps_w: float = 0.2) -> Array:
  """`f32[B, T]` token credit `(1 - lam) + lam * clip(exp(sign(A_i) D_j), 1-eps_w, 1+eps_w)`.

  Args:
    advantages: `f32[B]` outcome advantages.
    logp_teacher, logp_student: `f32[B, T]` (stop-gradient is applied here).
    lam: scalar mixing weight (`rlsd_lambda`).
    eps_w: clip half-width of the evidence weight.
  """
  evidence = jax.lax.stop_gradient(logp_teacher - logp_student)
  w = jnp.exp(jnp.sign(advantages)[:, None] * evidence)
  return (1.0 - lam) + lam * jnp.clip(w, 1.0 - eps_w, 1.0 + eps_w)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLSD(GRPO):
  """RLSD (module docstring). Attributes besides GRPO's: `lam_init`, `lam_decay_steps`, `eps_w`."""

  name: ClassVar[str] = "rlsd"
  needs: ClassVar[frozenset] = frozenset({"logp_student", "logp_teacher"})

  lam_init: float = 0.5
  lam_decay_steps: int = 50
  eps_w: float = 0.2

  def validate(self):
    super().validate()
    if not 0.0 <= self.lam_init <= 1.0:
      self._fail("lam_init", self.lam_init, "must be in [0, 1]")
    if self.lam_decay_steps < 0:
      self._fail("lam_decay_steps", self.lam_decay_steps, "must be >= 0")
    if not 0.0 <= self.eps_w < 1.0:
      self._fail("eps_w", self.eps_w, "must be in [0, 1)")

  def token_advantages(self, outcome: Array, inputs: AdvantageInputs) -> tuple[Array, dict]:
    """`A_i * credit_j`; metrics `rlsd/lambda` and the mean credit over action tokens."""
    lam, token_credit = self._token_credit(outcome, inputs)
    return outcome[:, None] * token_credit, {
        "rlsd/lambda": lam,
        "rlsd/credit_mean": masked_mean(token_credit, inputs.action_mask)}

  def turn_credit(self, outcome: Array, inputs: AdvantageInputs) -> credit.TurnCredit:
    """Per turn: the mean evidence `D_j` (RLSD has no deadband: `filtered` is the same) and
    the mean token credit as the turn's weight."""
    _, token_credit = self._token_credit(outcome, inputs)
    log_ratio = jax.lax.stop_gradient(inputs.logp_teacher - inputs.logp_student)
    evidence = credit.turn_evidence(log_ratio, inputs.turn_ids, inputs.max_turns)
    weights = credit.turn_evidence(token_credit, inputs.turn_ids, inputs.max_turns)
    exists = credit.turn_token_counts(inputs.turn_ids, inputs.max_turns) > 0
    return credit.TurnCredit(evidence=evidence, filtered=evidence,
                             weights=jnp.where(exists, weights, 1.0))

  def _token_credit(self, outcome: Array, inputs: AdvantageInputs) -> tuple[Array, Array]:
    lam = rlsd_lambda(inputs.step, self.lam_init, self.lam_decay_steps)
    return lam, rlsd_credit(outcome, inputs.logp_teacher, inputs.logp_student, lam, self.eps_w)
