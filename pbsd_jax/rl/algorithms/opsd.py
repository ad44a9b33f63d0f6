"""OPSD baseline: on-policy self-distillation from the frozen initial model (docs/design.md §2).

The teacher is the *initial* parameters, frozen, on the privileged prompt; the student is the
current parameters on the ordinary prompt, both scoring the student's own rollout. Per action
token the loss is the generalised JSD(beta) between the two next-token distributions over the
full vocabulary (`likelihood.generalized_jsd`: beta = 1 is `KL(student || teacher)`, beta = 0
`KL(teacher || student)`), token-mean over the loss mask:

    L = mean_j JSD_beta(pi_theta(.|x, prefix_j) || pi_theta0(.|x, y*, prefix_j))
        + rl_coef * L_GRPO

The learner computes the divergence inside the differentiated function with
`likelihood.token_divergence(params, initial_params, config, student_tokens, student_mask,
teacher_tokens, teacher_mask, beta=algo.distillation_beta, chunk_size=...)`, which keeps the
teacher under `stop_gradient` and never holds `[B, T, V]` logits whole.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from pbsd_jax.rl.algorithms.grpo import GRPO
from pbsd_jax.rl.algorithms.policy_loss import masked_mean

Array = jax.Array


def distillation_loss(divergence: Array, mask: Array) -> Array:
  """Token-mean of `divergence: f32[B, T]` over `mask: bool[B, T]` (a scalar)."""
  return masked_mean(divergence, mask)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OPSD(GRPO):
  """OPSD (module docstring).

  Attributes (besides GRPO's, which shape the optional RL term):
    beta: JSD mixing weight in [0, 1] (1: reverse KL, the default).
    rl_coef: weight of the added GRPO loss (0: pure distillation).
  """

  name: ClassVar[str] = "opsd"

  beta: float = 1.0
  rl_coef: float = 0.0

  def validate(self):
    super().validate()
    if not 0.0 <= self.beta <= 1.0:
      self._fail("beta", self.beta, "must be in [0, 1]")
    if self.rl_coef < 0:
      self._fail("rl_coef", self.rl_coef, "must be >= 0")
    if self.rl_coef and self.aggregation != "token-mean":
      # Both terms must be means over the same items for micro-batches to accumulate exactly.
      self._fail("aggregation", self.aggregation,
                 "must be 'token-mean' (the distillation term's) when rl_coef > 0")

  @property
  def distillation_beta(self) -> float:
    """The learner passes `divergence=token_divergence(..., beta=this)` to `loss`."""
    return self.beta

  def loss(self, logp: Array, old_logp: Array, advantages: Array, loss_mask: Array, *,
           divergence: Array | None = None) -> tuple[Array, Array, dict]:
    """Distillation loss plus `rl_coef` times the GRPO loss.

    Args:
      logp, old_logp, advantages, loss_mask: as `GRPO.loss` (the PG metrics are always
        reported; the PG term enters the loss only when `rl_coef > 0`).
      divergence: `f32[B, T]` per-token JSD(beta) against the frozen teacher, differentiable
        in the student parameters. Required.

    Returns:
      `(scalar loss, weight, metrics)`: the weight is the loss tokens (a token mean);
      metrics `opsd/distill_loss` and the PG metrics.
    """
    if divergence is None:
      raise ValueError("opsd needs divergence=token_divergence(params, initial_params, ..., "
                       "beta=distillation_beta) in its loss")
    distill = distillation_loss(divergence, loss_mask)
    pg, _, metrics = self.pg_loss(logp, old_logp, advantages, loss_mask)
    loss = distill + self.rl_coef * pg if self.rl_coef else distill
    weight = jnp.sum(loss_mask).astype(jnp.float32)
    return loss, weight, {**metrics, "opsd/distill_loss": distill}
