"""PBSD turn-level credit: evidence per turn, low-SNR deadband, sign-aware modulation.

The math of docs/design.md §2 ("Turn-level evidence", "Low-SNR deadband", "Sign-aware tanh
modulation"), as pure functions over arrays in the token layout of docs/design.md §3: `turn_ids:
i32[B, T]` holds k on the action tokens of turn k and -1 on every other slot (prompt,
observation, padding), so a turn id of -1 is the padding convention here. `K = max_turns` is
static; a turn that has no action token ("a turn that does not exist") gets evidence 0 and
weight 1, and is left out of the metrics.

Evidence is a constant to the optimiser: `pbsd_advantages` applies `stop_gradient` to the
log-ratio, so PBSD only reshapes the advantages of the ordinary clipped policy gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

Array = jax.Array

REDUCTIONS = ("mean", "sum")
FORMS = ("tanh", "clipped_tanh")


def _turn_sums(values: Array, turn_ids: Array, max_turns: int) -> Array:
  """`f32[B, K]` per-turn sums of `values: f32[B, T]` (turn id -1 or >= K ignored)."""
  valid = (turn_ids >= 0) & (turn_ids < max_turns)
  # Slot K collects the ignored tokens and is cut off; each row is its own set of segments.
  ids = jnp.where(valid, turn_ids, max_turns)
  row_sums = lambda v, i: jax.ops.segment_sum(v, i, num_segments=max_turns + 1)
  return jax.vmap(row_sums)(values, ids)[:, :max_turns]


def turn_token_counts(turn_ids: Array, max_turns: int) -> Array:
  """`f32[B, K]` number of action tokens in each turn (0 for a turn that does not exist)."""
  return _turn_sums(jnp.ones(turn_ids.shape, jnp.float32), turn_ids, max_turns)


def turn_evidence(log_ratio: Array, turn_ids: Array, max_turns: int,
                  reduction: str = "mean") -> Array:
  """Turn evidence `s[b, k] = reduce_{j in turn k} log_ratio[b, j]` (DESIGN §2).

  Args:
    log_ratio: `f32[B, T]` per-token `log pi(tok | x, y*, prefix) - log pi(tok | x, prefix)`.
    turn_ids: `i32[B, T]` turn of each action token, -1 elsewhere (those tokens are ignored).
    max_turns: K, the static number of turn slots.
    reduction: `'mean'` (default: the paper's thresholds are on the scale of a per-token mean)
      or `'sum'` (the exact autoregressive log-likelihood ratio of the turn).

  Returns:
    `f32[B, K]` evidence; 0 for a turn without action tokens.
  """
  if reduction not in REDUCTIONS:
    raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
  if max_turns <= 0:
    raise ValueError(f"max_turns must be positive, got {max_turns}")
  sums = _turn_sums(log_ratio.astype(jnp.float32), turn_ids, max_turns)
  if reduction == "sum":
    return sums
  counts = turn_token_counts(turn_ids, max_turns)
  return sums / jnp.maximum(counts, 1.0)


def deadband(evidence: Array, eps_pos: float, eps_neg: float) -> Array:
  """Low-SNR deadband (DESIGN §2): keeps `s` where `s > eps_pos` or `s < -eps_neg`, else 0.

  The thresholds are direction-specific (PBSD's defaults: 0.001 / 0.003); a value exactly on
  a threshold is zeroed.

  Args:
    evidence: `f32[B, K]` turn evidence.
    eps_pos: threshold for teacher-higher evidence (>= 0).
    eps_neg: threshold for teacher-lower evidence (>= 0), as a magnitude.

  Returns:
    `f32[B, K]` filtered evidence `s~`.
  """
  keep = (evidence > eps_pos) | (evidence < -eps_neg)
  return jnp.where(keep, evidence, 0.0)


def modulation_weights(advantages: Array, evidence: Array, delta: float, clip: float,
                       form: str = "tanh") -> Array:
  """Sign-aware modulation weights `w[b, k]` (DESIGN §2).

  `'tanh'`:         `w = 1 + clip * tanh(sign(A) * s / delta)`
  `'clipped_tanh'`: `w = 1 + clip_to_[-clip, clip](tanh(sign(A) * s / delta))`

  Both stay in `[1 - clip, 1 + clip]`; `A = 0` or `s = 0` gives `w = 1`, and so does
  `delta -> infinity` (GRPO).

  Args:
    advantages: `f32[B]` group-normalised outcome advantages `A_i`.
    evidence: `f32[B, K]` (deadbanded) turn evidence `s~`.
    delta: evidence scale (> 0).
    clip: weight half-width `c`.
    form: `'tanh'` or `'clipped_tanh'`.

  Returns:
    `f32[B, K]` weights.
  """
  if form not in FORMS:
    raise ValueError(f"form must be one of {FORMS}, got {form!r}")
  signed = jnp.sign(advantages)[:, None] * evidence
  z = jnp.tanh(signed / delta)
  if form == "tanh":
    return 1.0 + clip * z
  return 1.0 + jnp.clip(z, -clip, clip)


def token_advantages(advantages: Array, weights: Array, turn_ids: Array) -> Array:
  """Broadcasts `A_i * w[i, k]` to every action token of turn k (DESIGN §2).

  Args:
    advantages: `f32[B]` outcome advantages.
    weights: `f32[B, K]` turn weights.
    turn_ids: `i32[B, T]` turn of each action token, -1 elsewhere.

  Returns:
    `f32[B, T]` token advantages; 0 where the turn id is -1 (or >= K).
  """
  max_turns = weights.shape[1]
  valid = (turn_ids >= 0) & (turn_ids < max_turns)
  w = jnp.take_along_axis(weights, jnp.clip(turn_ids, 0, max_turns - 1), axis=1)
  return jnp.where(valid, advantages[:, None] * w, 0.0)


def credit_metrics(evidence: Array, filtered: Array, weights: Array, exists: Array) -> dict:
  """The paper's credit diagnostics (DESIGN §2 "Metrics"), over turns that exist.

  Args:
    evidence: `f32[B, K]` raw turn evidence `s`.
    filtered: `f32[B, K]` deadbanded evidence `s~`.
    weights: `f32[B, K]` modulation weights.
    exists: `bool[B, K]` turns with at least one action token.

  Returns:
    Scalars `frac_evidence_pos` (s > 0, teacher-higher), `mean_abs_evidence`,
    `frac_deadband` (turns zeroed by the deadband), `weight_mean`, `weight_min`, `weight_max`.
    With no turn at all the fractions and means are 0 and the weight extremes 1.
  """
  n = jnp.maximum(jnp.sum(exists), 1).astype(jnp.float32)
  frac = lambda x: jnp.sum(exists & x) / n
  any_turn = jnp.any(exists)
  return {
      "frac_evidence_pos": frac(evidence > 0),
      "mean_abs_evidence": jnp.sum(jnp.where(exists, jnp.abs(evidence), 0.0)) / n,
      "frac_deadband": frac(filtered == 0),
      "weight_mean": jnp.sum(jnp.where(exists, weights, 0.0)) / n,
      "weight_min": jnp.where(any_turn, jnp.min(jnp.where(exists, weights, jnp.inf)), 1.0),
      "weight_max": jnp.where(any_turn, jnp.max(jnp.where(exists, weights, -jnp.inf)), 1.0),
  }


@struct.dataclass
class TurnCredit:
  """The per-turn quantities of PBSD's credit, each `f32[B, K]` (0 / 1 on absent turns).

  Attributes:
    evidence: turn evidence `s` (`turn_evidence`).
    filtered: deadbanded evidence `s~` (`deadband`).
    weights: modulation weights `w` (`modulation_weights`).
  """

  evidence: Array
  filtered: Array
  weights: Array


def pbsd_advantages(advantages: Array, logp_teacher: Array, logp_student: Array,
                    turn_ids: Array, max_turns: int, *, delta: float, clip: float,
                    eps_pos: float, eps_neg: float, reduction: str, form: str
                    ) -> tuple[Array, TurnCredit, dict]:
  """PBSD token advantages `A_{i,t} = A_i * w_{i,t}` (DESIGN §2), its turn credit and metrics.

  Composes `turn_evidence` of the (stop-gradient) teacher-student log-ratio, `deadband`,
  `modulation_weights` and `token_advantages`. The settings have no defaults here: they are
  `pbsd_jax.rl.algorithms.PBSD`'s fields, written once there.

  Args:
    advantages: `f32[B]` GRPO group-normalised outcome advantages.
    logp_teacher: `f32[B, T]` log-probs on the privileged (teacher) prompt.
    logp_student: `f32[B, T]` log-probs on the ordinary (student) prompt, same columns.
    turn_ids: `i32[B, T]` turn of each action token, -1 elsewhere.
    max_turns: K, the static number of turn slots.
    delta, clip, eps_pos, eps_neg, reduction, form: as in the functions above.

  Returns:
    `(f32[B, T] token advantages, TurnCredit, metrics)` with the metrics of
    `credit_metrics`.
  """
  log_ratio = jax.lax.stop_gradient(logp_teacher - logp_student)
  evidence = turn_evidence(log_ratio, turn_ids, max_turns, reduction)
  return credit_from_evidence(advantages, evidence, turn_ids, delta=delta, clip=clip,
                              eps_pos=eps_pos, eps_neg=eps_neg, form=form)


def credit_from_evidence(advantages: Array, evidence: Array, turn_ids: Array, *, delta: float,
                         clip: float, eps_pos: float, eps_neg: float, form: str
                         ) -> tuple[Array, TurnCredit, dict]:
  """`pbsd_advantages` from turn evidence `f32[B, K]` however it was found: `deadband`,
  `modulation_weights`, `token_advantages`, and the metrics of `credit_metrics`."""
  filtered = deadband(evidence, eps_pos, eps_neg)
  weights = modulation_weights(advantages, filtered, delta, clip, form)
  exists = turn_token_counts(turn_ids, evidence.shape[1]) > 0
  metrics = credit_metrics(evidence, filtered, weights, exists)
  return (token_advantages(advantages, weights, turn_ids),
          TurnCredit(evidence=evidence, filtered=filtered, weights=weights), metrics)
