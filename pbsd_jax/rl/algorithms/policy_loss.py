"""The clipped policy-gradient objective every algorithm shares (docs/design.md §2, GRPO / DAPO).

Per token: `rho = exp(logp - logp_old)`,
`loss = -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)` (asymmetric "clip-higher"
bounds, DAPO defaults 0.2 / 0.28); with dual clip `c`, tokens with `A < 0` are further capped at
`-c * A`, so one huge ratio on a negative-advantage token cannot dominate the batch.

Aggregation modes, and the invariance each preserves (`loss_mask` selects the tokens):
- `token-mean`: mean over every token of the batch; each token weighs the same whatever the
  length of its sequence (DAPO's token-level loss; default).
- `seq-mean-token-mean`: mean over each sequence's tokens, then over sequences; each sequence
  weighs the same (the original GRPO; long sequences' tokens weigh less).
- `seq-mean-token-sum`: sum over each sequence's tokens, then mean over sequences.
- `seq-mean-token-sum-norm`: like `seq-mean-token-sum` divided by a constant `norm_len`
  (default: the padded length T), so a token's weight depends on neither its sequence's
  length nor the batch's (Dr. GRPO).
"Sequences" are rows with at least one token in `loss_mask` (rows dropped by DAPO dynamic
sampling do not count).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                "seq-mean-token-sum-norm")


def clipped_surrogate(logp: Array, old_logp: Array, advantages: Array, mask: Array, *,
                      eps_low: float = 0.2, eps_high: float = 0.28,
                      dual_clip: float | None = None) -> tuple[Array, Array, Array]:
  """Per-token clipped surrogate loss.

  Args:
    logp: `f32[B, T]` log-probs under the parameters being trained.
    old_logp: `f32[B, T]` log-probs under the pre-update parameters.
    advantages: `f32[B, T]` token advantages.
    mask: `bool[B, T]` tokens that enter the loss.
    eps_low, eps_high: ratio clip bounds `[1 - eps_low, 1 + eps_high]`.
    dual_clip: `c > 1` caps the loss of `A < 0` tokens at `-c * A`; None disables.

  Returns:
    `(loss f32[B, T], clipped bool[B, T], dual_clipped bool[B, T])`: the loss is 0 off the
    mask; `clipped` marks tokens whose clipped branch is active, `dual_clipped` those capped by
    the dual clip.
  """
  # Masking the log-ratio first keeps exp() finite (and its gradient clean) on padding.
  ratio = jnp.exp(jnp.where(mask, logp - old_logp, 0.0))
  unclipped = -advantages * ratio
  clipped_loss = -advantages * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
  loss = jnp.maximum(unclipped, clipped_loss)
  clipped = mask & (clipped_loss > unclipped)
  dual_clipped = jnp.zeros_like(clipped)
  if dual_clip is not None:
    cap = -advantages * dual_clip
    negative = advantages < 0
    dual_clipped = mask & negative & (loss > cap)
    loss = jnp.where(negative, jnp.minimum(loss, cap), loss)
  return jnp.where(mask, loss, 0.0), clipped, dual_clipped


def aggregate_loss(token_loss: Array, mask: Array, mode: str = "token-mean",
                   norm_len: float | None = None) -> tuple[Array, Array]:
  """Reduces `token_loss: f32[B, T]` over `mask: bool[B, T]` to a scalar (module docstring).

  Args:
    token_loss: `f32[B, T]`.
    mask: `bool[B, T]`.
    mode: one of `AGGREGATIONS`.
    norm_len: the constant of `seq-mean-token-sum-norm` (default T).

  Returns:
    `(loss, weight)`: the loss and `f32[]` what it is a mean over -- the loss tokens for
    `token-mean`, the rows with loss tokens for the `seq-mean-*` modes. Weighting micro-batches
    by it makes their accumulated loss and gradient equal the whole batch's exactly
    (`learner.accumulate_gradients`).
  """
  if mode not in AGGREGATIONS:
    raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {mode!r}")
  mask = mask.astype(jnp.float32)
  loss = token_loss * mask
  if mode == "token-mean":
    count = jnp.sum(mask)
    return jnp.sum(loss) / jnp.maximum(count, 1.0), count
  per_row = jnp.sum(loss, axis=-1)
  tokens = jnp.sum(mask, axis=-1)
  rows = jnp.sum(tokens > 0).astype(jnp.float32)
  num_rows = jnp.maximum(rows, 1.0)
  if mode == "seq-mean-token-mean":
    return jnp.sum(per_row / jnp.maximum(tokens, 1.0)) / num_rows, rows
  if mode == "seq-mean-token-sum":
    return jnp.sum(per_row) / num_rows, rows
  norm = token_loss.shape[1] if norm_len is None else norm_len
  return jnp.sum(per_row) / (num_rows * norm), rows


def masked_mean(x: Array, mask: Array) -> Array:
  """Mean of `x` over `mask` (0 for an empty mask)."""
  mask = mask.astype(jnp.float32)
  return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def policy_loss(logp: Array, old_logp: Array, advantages: Array, mask: Array, *,
                eps_low: float = 0.2, eps_high: float = 0.28, dual_clip: float | None = None,
                aggregation: str = "token-mean",
                norm_len: float | None = None) -> tuple[Array, Array, dict]:
  """The aggregated clipped policy-gradient loss, its weight and its diagnostics.

  Args: as `clipped_surrogate` and `aggregate_loss`.

  Returns:
    `(scalar loss, weight, metrics)`: the weight of `aggregate_loss`; metrics `pg_loss`,
    `pg_clipfrac` (tokens whose ratio clip is active), `pg_clipfrac_lower` (tokens capped by
    the dual clip), `ppo_kl` (mean `old_logp - logp`).
  """
  token_loss, clipped, dual_clipped = clipped_surrogate(
      logp, old_logp, advantages, mask, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip)
  loss, weight = aggregate_loss(token_loss, mask, aggregation, norm_len)
  metrics = {
      "pg_loss": loss,
      "pg_clipfrac": masked_mean(clipped, mask),
      "pg_clipfrac_lower": masked_mean(dual_clipped, mask),
      "ppo_kl": masked_mean(jax.lax.stop_gradient(old_logp - logp), mask),
  }
  return loss, weight, metrics
