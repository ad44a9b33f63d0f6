"""GEAR baseline: granularity-adaptive advantage reweighting via self-distillation.

The original formula is not public; this is the reading of docs/design.md §2, with every constant a
field of `GEAR`:

1. `kl_j = KL(student || teacher)` of the next-token distributions at action token j, over the
   full vocabulary, current parameters, privileged teacher (`AdvantageInputs.divergence`).
2. An action token with `kl_j > kl_threshold` (0.4) is a *departure anchor*: it opens a segment
   (a later anchor opens a new one).
3. The segment continues over the following action tokens while their student entropy
   `H_j > entropy_threshold` (1.5); the first action token at or below it, or any non-action
   token (the end of the turn), closes the segment and is not part of it.
4. Tokens of a segment get `A_i * g(kl_anchor)` with the bounded
   `g(k) = 1 + segment_gain * tanh((k - kl_threshold) / kl_temperature)` in `[1, 1 + gain)`,
   continuous at the threshold; tokens outside segments keep `A_i`. So the uncertain stretch
   where the student left the answer-aware teacher carries more of the outcome, credit in a
   success and blame in a failure.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from pbsd_jax.rl.algorithms.grpo import GRPO
from pbsd_jax.rl.algorithms.inputs import AdvantageInputs
from pbsd_jax.rl.algorithms.policy_loss import masked_mean

Array = jax.Array

_NO_SEGMENT = -1.0  # anchor KLs are > kl_threshold >= 0


def gear_segments(divergence: Array, entropy: Array, action_mask: Array,
                  kl_threshold: float = 0.4,
                  entropy_threshold: float = 1.5) -> tuple[Array, Array]:
  """Departure segments (module docstring, steps 2-3).

  Each token either resets the state (an anchor sets it to its KL, a closing token to "no
  segment") or keeps it (a high-entropy continuation); "the last reset wins" is associative,
  so a parallel `associative_scan` replaces a sequential loop over T.

  Args:
    divergence: `f32[B, T]` per-token KL(student || teacher).
    entropy: `f32[B, T]` student next-token entropy.
    action_mask: `bool[B, T]`.
    kl_threshold: the anchor threshold.
    entropy_threshold: the continuation threshold.

  Returns:
    `(in_segment bool[B, T], anchor_kl f32[B, T])`; `anchor_kl` is the KL of the segment's
    anchor on segment tokens and -1 elsewhere.
  """
  action = action_mask.astype(bool)
  anchor = action & (divergence > kl_threshold)
  keep = action & ~anchor & (entropy > entropy_threshold)
  # A row starts outside any segment: its first slot always resets.
  reset = ~keep.at[:, 0].set(False)
  value = jnp.where(anchor, divergence, _NO_SEGMENT).astype(jnp.float32)

  def last_reset(left, right):
    left_reset, left_value = left
    right_reset, right_value = right
    return left_reset | right_reset, jnp.where(right_reset, right_value, left_value)

  _, anchor_kl = jax.lax.associative_scan(last_reset, (reset, value), axis=1)
  in_segment = anchor_kl > _NO_SEGMENT
  return in_segment, jnp.where(in_segment, anchor_kl, _NO_SEGMENT)


def gear_scale(anchor_kl: Array, kl_threshold: float = 0.4, segment_gain: float = 0.5,
               kl_temperature: float = 1.0) -> Array:
  """`g(k) = 1 + segment_gain * tanh((k - kl_threshold) / kl_temperature)`, elementwise."""
  return 1.0 + segment_gain * jnp.tanh((anchor_kl - kl_threshold) / kl_temperature)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GEAR(GRPO):
  """GEAR (module docstring). Attributes besides GRPO's: `kl_threshold` (0.4),
  `entropy_threshold` (1.5), `segment_gain` (0.5), `kl_temperature` (1.0)."""

  name: ClassVar[str] = "gear"
  needs: ClassVar[frozenset] = frozenset({"divergence", "entropy"})

  kl_threshold: float = 0.4
  entropy_threshold: float = 1.5
  segment_gain: float = 0.5
  kl_temperature: float = 1.0

  def validate(self):
    super().validate()
    for field in ("kl_threshold", "entropy_threshold", "segment_gain"):
      if getattr(self, field) < 0:
        self._fail(field, getattr(self, field), "must be >= 0")
    if not self.kl_temperature > 0:
      self._fail("kl_temperature", self.kl_temperature, "must be > 0")

  def token_advantages(self, outcome: Array, inputs: AdvantageInputs) -> tuple[Array, dict]:
    """`A_i * g(kl_anchor)` on segment tokens, `A_i` elsewhere; segment metrics under `gear/`."""
    divergence = jax.lax.stop_gradient(inputs.divergence)
    entropy = jax.lax.stop_gradient(inputs.entropy)
    in_segment, anchor_kl = gear_segments(divergence, entropy, inputs.action_mask,
                                          self.kl_threshold, self.entropy_threshold)
    scale = jnp.where(in_segment, gear_scale(anchor_kl, self.kl_threshold, self.segment_gain,
                                             self.kl_temperature), 1.0)
    metrics = {
        "gear/frac_tokens_in_segment": masked_mean(in_segment, inputs.action_mask),
        "gear/anchors_per_trajectory": jnp.mean(jnp.sum(
            inputs.action_mask & (divergence > self.kl_threshold), axis=1)),
        "gear/segment_scale_mean": masked_mean(scale, in_segment),
    }
    return outcome[:, None] * scale, metrics
