"""Decode attention in XLA: one query per row over the filled prefix of a `KVCache` layer.

The CPU runs `cpu_kernels.decode_attention` instead (the package's dispatch), the same
computation reading the cache in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pbsd_jax.models.attention.flash import layer_window, tiling

Array = jax.Array


# A decode step reads the cache in blocks of this many slots, up to the filled prefix.
DECODE_BLOCK = 256


def decode_attention(query: Array, keys: Array, values: Array, layer: Array | int,
                     key_mask: Array, last: Array) -> Array:
  """`f32[B, kv_heads, groups, head_dim]`: one query per row (a decode step; `query` scaled by
  `1/sqrt(head_dim)`) over layer `layer` of `keys, values` in the layout of `KVCache`, at the
  real slots (`key_mask: bool[B, S]`) up to each row's own (`last: i32[B]`).

  The keys are read in the blocks of `tiling(S, DECODE_BLOCK)`, up to the highest slot any row
  attends to (a traced trip count), with an online softmax across blocks (flash-decoding), so
  a step's cost follows the filled prefix, not the buffer. Within a block, attention is
  multiply-and-reduce: as a batched dot XLA:CPU runs B x kv_heads separate matrix-vector
  products. The scores reduce over `head_dim`, a major axis of the keys (`KVCache`), so the
  sums run across whole rows of slots (docs/benchmarks.md has the timings of both choices).
  """
  f32 = jnp.float32
  size = values.shape[-2]
  _, block = tiling(size, DECODE_BLOCK)
  query = query[..., None]  # [B, kvh, g, hd, 1]

  def step(i, carry):
    best, total, acc = carry
    start = jnp.minimum(i * block, size - block)  # the last block may overlap the one before
    k_blk = layer_window(keys, layer, start, block, f32, axis=4)
    v_blk = layer_window(values, layer, start, block, f32)
    slot = start + jnp.arange(block)
    ok = (jax.lax.dynamic_slice_in_dim(key_mask, start, block, 1)
          & (slot >= i * block)[None, :] & (slot[None, :] <= last[:, None]))
    scores = jnp.sum(query * k_blk[:, :, None], -2)  # [B, kvh, g, block]
    scores = jnp.where(ok[:, None, None], scores, -jnp.inf)
    new_best = jnp.maximum(best, jnp.max(scores, -1))
    probs = jnp.exp(scores - new_best[..., None])
    scale = jnp.exp(best - new_best)
    return (new_best, total * scale + jnp.sum(probs, -1),
            acc * scale[..., None] + jnp.sum(probs[..., None] * v_blk[:, :, None], -2))

  shape = query.shape[:3]
  # A finite floor for the running maximum: a block with no allowed slot leaves it, and
  # exp(-inf - floor) is 0 rather than NaN.
  carry = (jnp.full(shape, jnp.finfo(f32).min, f32), jnp.zeros(shape, f32),
           jnp.zeros((*shape, query.shape[3]), f32))
  with jax.named_scope("decode_blocks"):  # its trip count's name (`hlo_cost`)
    _, total, acc = jax.lax.fori_loop(0, (jnp.max(last) + block) // block, step, carry)
  return acc / total[..., None]
