"""GRPO / DAPO (docs/design.md §2, "Baselines"): group advantages, DAPO options, and the base class.

Groups are `group_size` consecutive rows of the batch (the G trajectories of one prompt).
`GRPO` is also the base of every other algorithm: they inherit its outcome advantages, DAPO
switches and clipped policy loss, and override `token_advantages` (PBSD, RLSD, GEAR) or `loss`
(OPSD).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from pbsd_jax.rl import credit
from pbsd_jax.rl.algorithms.inputs import AdvantageInputs
from pbsd_jax.rl.algorithms.policy_loss import AGGREGATIONS, policy_loss

Array = jax.Array


def _grouped(x: Array, group_size: int) -> Array:
  if x.shape[0] % group_size:
    raise ValueError(f"batch of {x.shape[0]} rows is not a whole number of groups of "
                     f"group_size={group_size}")
  return x.reshape(-1, group_size)


def group_advantages(rewards: Array, group_size: int, std_ddof: int = 1, eps: float = 1e-6,
                     normalize_std: bool = True) -> Array:
  """GRPO outcome advantages `A_i = (r_i - mean_g r) / (std_g r + eps)` (DESIGN §2).

  Args:
    rewards: `f32[B]`, groups of `group_size` consecutive rows.
    group_size: G.
    std_ddof: degrees of freedom of the group std (1: sample std, the default; 0: population).
    eps: added to the std.
    normalize_std: False gives `r_i - mean_g r` (Dr. GRPO).

  Returns:
    `f32[B]`; a group whose rewards are all equal gets 0.
  """
  if normalize_std and group_size <= std_ddof:
    raise ValueError(f"group_size={group_size} must exceed std_ddof={std_ddof}")
  r = _grouped(rewards.astype(jnp.float32), group_size)
  centred = r - jnp.mean(r, axis=1, keepdims=True)
  if normalize_std:
    centred = centred / (jnp.std(r, axis=1, ddof=std_ddof, keepdims=True) + eps)
  return centred.reshape(-1)


def dynamic_sampling_mask(rewards: Array, group_size: int) -> Array:
  """DAPO dynamic sampling: `bool[B]`, False on every row of a group whose rewards are equal.

  Such groups carry no GRPO signal; with static shapes they are masked out of the loss (and out
  of its normaliser) instead of being resampled.
  """
  r = _grouped(rewards, group_size)
  varied = jnp.max(r, axis=1) != jnp.min(r, axis=1)
  return jnp.repeat(varied, group_size)


def overlong_penalty(lengths: Array, max_len: int, buffer_len: int,
                     factor: float = 1.0) -> Array:
  """DAPO soft overlong punishment added to the reward, `f32[B]`.

  With `L` the generated (action) tokens and `L_exp = max_len - buffer_len`:
  0 for `L <= L_exp`; `factor * (L_exp - L) / buffer_len` for `L_exp < L <= max_len`;
  `-factor` for `L > max_len`.

  Args:
    lengths: `i32[B]` generated tokens per trajectory.
    max_len: the generation budget.
    buffer_len: width of the linear ramp before `max_len` (0: a hard cut at `max_len`).
    factor: the penalty at and beyond `max_len`.
  """
  lengths = lengths.astype(jnp.float32)
  expected = max_len - buffer_len
  ramp = (expected - lengths) / max(buffer_len, 1)
  penalty = jnp.where(lengths <= expected, 0.0, jnp.where(lengths <= max_len, ramp, -1.0))
  return factor * penalty


@dataclasses.dataclass(frozen=True, kw_only=True)
class GRPO:
  """GRPO with the DAPO options (DESIGN §2). PBSD, RLSD, GEAR and OPSD extend it.

  Token advantages are the outcome advantage `A_i` on every action token. The loss is
  `policy_loss` (clipped surrogate, aggregation modes, optional dual clip).

  Attributes:
    group_size: G trajectories per prompt (consecutive rows).
    std_ddof: ddof of the group std (default 1).
    adv_eps: added to the group std.
    normalize_std: divide by the group std (False: Dr. GRPO).
    eps_low, eps_high: ratio clip bounds (0.2 / 0.28).
    dual_clip: cap for A < 0 tokens (e.g. 3.0); None disables.
    aggregation: one of `AGGREGATIONS`.
    norm_len: the constant of `seq-mean-token-sum-norm` (None: padded length T).
    dynamic_sampling: DAPO: drop (mask) groups whose raw rewards are all equal.
    overlong_max_len: DAPO overlong penalty on the action-token count; None disables.
    overlong_buffer_len: the penalty's ramp width.
    overlong_factor: the penalty's magnitude.
  """

  name: ClassVar[str] = "grpo"
  # Optional `AdvantageInputs` fields the learner must fill for this algorithm.
  needs: ClassVar[frozenset] = frozenset()

  group_size: int = 8
  std_ddof: int = 1
  adv_eps: float = 1e-6
  normalize_std: bool = True
  eps_low: float = 0.2
  eps_high: float = 0.28
  dual_clip: float | None = None
  aggregation: str = "token-mean"
  norm_len: float | None = None
  dynamic_sampling: bool = False
  overlong_max_len: int | None = None
  overlong_buffer_len: int = 0
  overlong_factor: float = 1.0

  def __post_init__(self):
    self.validate()

  def _fail(self, field: str, value, why: str):
    raise ValueError(f"{type(self).__name__}.{field} {why}, got {value!r}")

  def validate(self):
    """Raises a ValueError naming the first inconsistent hyperparameter."""
    if self.group_size < 1:
      self._fail("group_size", self.group_size, "must be >= 1")
    if self.std_ddof not in (0, 1):
      self._fail("std_ddof", self.std_ddof, "must be 0 or 1")
    if self.normalize_std and self.group_size <= self.std_ddof:
      self._fail("group_size", self.group_size, f"must exceed std_ddof={self.std_ddof}")
    if not 0.0 <= self.eps_low < 1.0:
      self._fail("eps_low", self.eps_low, "must be in [0, 1)")
    if self.eps_high < 0.0:
      self._fail("eps_high", self.eps_high, "must be >= 0")
    if self.dual_clip is not None and self.dual_clip <= 1.0:
      self._fail("dual_clip", self.dual_clip, "must be > 1 (or None)")
    if self.aggregation not in AGGREGATIONS:
      self._fail("aggregation", self.aggregation, f"must be one of {AGGREGATIONS}")
    if self.norm_len is not None and self.norm_len <= 0:
      self._fail("norm_len", self.norm_len, "must be positive (or None)")
    if self.overlong_max_len is not None:
      if self.overlong_max_len <= 0:
        self._fail("overlong_max_len", self.overlong_max_len, "must be positive (or None)")
      if not 0 <= self.overlong_buffer_len <= self.overlong_max_len:
        self._fail("overlong_buffer_len", self.overlong_buffer_len,
                   f"must be in [0, overlong_max_len={self.overlong_max_len}]")

  @property
  def distillation_beta(self) -> float | None:
    """None: `loss` takes no distillation divergence (OPSD overrides)."""
    return None

  def advantages(self, inputs: AdvantageInputs) -> tuple[Array, Array, dict]:
    """Token advantages for a batch.

    Args:
      inputs: the batch arrays; the fields in `needs` must be set.

    Returns:
      `(advantages f32[B, T], loss_mask bool[B, T], metrics)`: advantages are 0 off
      `loss_mask`, which is `action_mask` minus the groups dropped by dynamic sampling.
    """
    for field in sorted(self.needs):
      if getattr(inputs, field) is None:
        raise ValueError(f"{self.name} needs AdvantageInputs.{field}, which is None")
    outcome, metrics = self.outcome_advantages(inputs)
    loss_mask = inputs.action_mask.astype(bool)
    if self.dynamic_sampling:
      keep = dynamic_sampling_mask(inputs.rewards, self.group_size)
      loss_mask = loss_mask & keep[:, None]
      metrics["frac_groups_kept"] = jnp.mean(keep.astype(jnp.float32))
    token_adv, extra = self.token_advantages(outcome, inputs)
    return jnp.where(loss_mask, token_adv, 0.0), loss_mask, {**metrics, **extra}

  def outcome_advantages(self, inputs: AdvantageInputs) -> tuple[Array, dict]:
    """`f32[B]` group-normalised outcome advantages `A_i` (after the overlong penalty) and
    the reward metrics."""
    rewards = inputs.rewards.astype(jnp.float32)
    metrics = {"reward_mean": jnp.mean(rewards)}
    if self.overlong_max_len is not None:
      penalty = overlong_penalty(inputs.response_length, self.overlong_max_len,
                                 self.overlong_buffer_len, self.overlong_factor)
      rewards = rewards + penalty
      metrics["overlong_penalty_mean"] = jnp.mean(penalty)
    outcome = group_advantages(rewards, self.group_size, self.std_ddof, self.adv_eps,
                               self.normalize_std)
    return outcome, metrics

  def turn_credit(self, outcome: Array, inputs: AdvantageInputs) -> credit.TurnCredit | None:
    """Per-turn evidence and weights behind the token advantages (the credit page), or None
    for an algorithm that computes no teacher-student evidence (GRPO)."""
    del outcome, inputs
    return None

  def token_advantages(self, outcome: Array, inputs: AdvantageInputs) -> tuple[Array, dict]:
    """Spreads `outcome: f32[B]` over tokens: `f32[B, T]` (GRPO: the same on every token)."""
    return jnp.broadcast_to(outcome[:, None], inputs.action_mask.shape), {}

  def loss(self, logp: Array, old_logp: Array, advantages: Array, loss_mask: Array, *,
           divergence: Array | None = None) -> tuple[Array, Array, dict]:
    """The clipped policy-gradient loss (`policy_loss`).

    Args:
      logp: `f32[B, T]` log-probs under the parameters being differentiated.
      old_logp: `f32[B, T]` pre-update log-probs (the student half of `dual_logprobs`).
      advantages, loss_mask: from `advantages`.
      divergence: must be None (only distillation losses take one).

    Returns:
      `(scalar loss, weight, metrics)`: the weight is what the loss is a mean over
      (`aggregate_loss`), so micro-batches accumulate exactly.
    """
    if divergence is not None:
      raise ValueError(f"{self.name} takes no divergence (distillation_beta is None)")
    return self.pg_loss(logp, old_logp, advantages, loss_mask)

  def pg_loss(self, logp, old_logp, advantages, loss_mask) -> tuple[Array, Array, dict]:
    """`policy_loss` with this algorithm's clip and aggregation settings."""
    return policy_loss(logp, old_logp, advantages, loss_mask, eps_low=self.eps_low,
                       eps_high=self.eps_high, dual_clip=self.dual_clip,
                       aggregation=self.aggregation, norm_len=self.norm_len)
