"""Decoder-only transformer (Llama / Qwen2 / Qwen3 / Qwen3-MoE shapes) in Flax Linen.

Padding convention: `mask: bool[B, T]` marks real tokens. Rows may be left-padded (prompts) and
right-padded (unused buffer); a padded slot is never attended to, and RoPE positions count real
tokens only (`position = number of real tokens before this one`), so any amount of left padding
gives the same logits on the real tokens.

Slots and the KV cache: column `s` of a token buffer is cache slot `s`. A forward over new tokens
`tokens[b, j]` writes them at slots `write_index[b] + j` (rows advance independently); a query at
slot `q` attends to every real slot `s <= q`. The full forward is the same code with an empty,
implicit cache (`write_index = 0`), so prefill, decode and training share one path.

Every parameter carries logical axis names (`vocab, embed, heads, kv_heads, head_dim, mlp,
expert, layers`); `pbsd_jax.sharding` maps them to mesh axes. The model knows nothing of RL.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import math

import numpy as np
from flax import struct

from pbsd_jax.models import cpu_kernels
from pbsd_jax.models.config import ModelConfig, RopeScaling

Array = jax.Array
_INIT = nn.initializers.normal(stddev=0.02)


@struct.dataclass
class KVCache:
  """Keys and values of every layer, written at per-row slots.

  With the layer scan fully unrolled (`ModelConfig.scan_unroll >= num_layers`) `k` and `v` are
  tuples of one array per layer (each shaped as below without `layers`), and the layers run one
  after another over their own arrays: a decode step reads a layer's keys and values where they
  lie. Sliced out of an all-layer array, they were copied out first (XLA:CPU's fused
  reductions take whole buffers), a fifth of a decode step on the benchmark model.

  Attributes:
    k: `[layers, B, kv_heads, head_dim, S]` keys (RoPE already applied), slots last: a query's
      scores over a block of slots are then sums over `head_dim` of whole rows of slots
      (vectorised across the slots; over a minor `head_dim` they were horizontal reductions,
      a third of a CPU decode step), and a tile's scores a plain `[w, hd] x [hd, width]`
      product. Heads come before both, so attention reads each head's keys as they lie.
    v: `[layers, B, kv_heads, S, head_dim]` values.
    mask: `bool[B, S]`, True on slots that hold a real token.
  """

  k: Array | tuple[Array, ...]
  v: Array | tuple[Array, ...]
  mask: Array

  @classmethod
  def init(cls, config: ModelConfig, batch: int, size: int) -> "KVCache":
    """An empty cache of `size` slots per row, in `config.cache_dtype`."""
    v = jnp.zeros((batch, config.num_kv_heads, size, config.resolved_head_dim),
                  config.jnp_cache_dtype)
    k, mask = jnp.swapaxes(v, 2, 3), jnp.zeros((batch, size), bool)
    if config.scan_unroll >= config.num_layers:
      return cls(k=(k,) * config.num_layers, v=(v,) * config.num_layers, mask=mask)
    stack = lambda x: jnp.broadcast_to(x, (config.num_layers, *x.shape))
    return cls(k=stack(k), v=stack(v), mask=mask)

  @property
  def size(self) -> int:
    return self.mask.shape[1]


@struct.dataclass
class ModelOutput:
  """What a forward returns.

  Attributes:
    hidden: `[B, T, hidden_size]` final-normed hidden states (compute dtype).
    logits: `f32[B, T, V]`, or None when the forward was asked for hidden states only.
    cache: the updated `KVCache`, or None for a cache-less forward.
    routes: `i32[layers, B, T, num_experts_per_tok]` experts chosen per token (MoE), else None.
  """

  hidden: Array
  logits: Array | None = None
  cache: KVCache | None = None
  routes: Array | None = None


def real_before(mask: Array, index: Array, block: int = 4096) -> Array:
  """`i32[B]`: the real slots (`mask: bool[B, S]`) before slot `index[b]` of each row.

  Counted in the blocks of `tiling(S, block)` up to the largest index (a traced trip count),
  so a decode step in a long buffer counts what is filled, not the whole mask."""
  size = mask.shape[1]
  _, width = tiling(size, block)

  def add(i, total):
    start = jnp.minimum(i * width, size - width)  # the last block may overlap the one before
    slot = start + jnp.arange(width)
    new = (jax.lax.dynamic_slice_in_dim(mask, start, width, 1) & (slot >= i * width)[None]
           & (slot[None] < index[:, None]))
    return total + jnp.sum(new, -1, dtype=jnp.int32)

  return jax.lax.fori_loop(0, (jnp.max(index) + width - 1) // width, add,
                           jnp.zeros(mask.shape[:1], jnp.int32))


def positions_from_mask(mask: Array, offset: Array | int = 0) -> Array:
  """RoPE positions `i32[B, T]`: real tokens before each slot (plus `offset: i32[B]`)."""
  counts = jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1
  return jnp.maximum(counts, 0) + jnp.asarray(offset, jnp.int32).reshape(-1, 1)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None
                     ) -> tuple[Array, float]:
  """`(inv_freq f32[head_dim / 2], cos/sin multiplier)` of plain or scaled RoPE, computed as
  Hugging Face's `modeling_rope_utils` does."""
  dims = jnp.arange(0, head_dim // 2, dtype=jnp.float32) * 2 / head_dim
  inv_freq = 1.0 / (theta ** dims)
  s = scaling
  if s is None:
    return inv_freq, 1.0
  if s.kind == "llama3":
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > s.original_max_positions / s.low_freq_factor,
                       inv_freq / s.factor, inv_freq)
    smooth = ((s.original_max_positions / wavelen - s.low_freq_factor)
              / (s.high_freq_factor - s.low_freq_factor))
    medium = ((wavelen >= s.original_max_positions / s.high_freq_factor)
              & (wavelen <= s.original_max_positions / s.low_freq_factor))
    return jnp.where(medium, (1 - smooth) * scaled / s.factor + smooth * scaled, scaled), 1.0

  def correction_dim(rotations):  # the dimension that turns `rotations` times in the context
    return (head_dim * math.log(s.original_max_positions / (rotations * 2 * math.pi))
            / (2 * math.log(theta)))

  low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
  if s.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, head_dim - 1)
  ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low)
                  / (high - low if high != low else 0.001), 0, 1)
  keep = 1 - ramp  # 1: the original frequency (extrapolation); 0: divided by the factor
  interpolated = 1.0 / (s.factor * theta ** dims)
  return interpolated * (1 - keep) + inv_freq * keep, s.attention_factor


def apply_rope(x: Array, positions: Array, inv_freq: Array, scale: float = 1.0) -> Array:
  """Rotary embedding, half-split layout (as in Hugging Face Llama/Qwen). x: [B, T, H, D];
  `inv_freq, scale` from `rope_frequencies`."""
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
  cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
  if scale != 1.0:
    cos, sin = cos * scale, sin * scale
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


# Attention of more than one query per row runs in tiles of this many queries x keys
# (`tiled_attention`).
QUERY_BLOCK = 512
KEY_BLOCK = 512
# A decode step reads the cache in blocks of this many slots, up to the filled prefix.
DECODE_BLOCK = 256


def tiling(size: int, block: int) -> tuple[int, int]:
  """`(count, width)` of equal blocks of at most `block` slots that tile `size` slots: block
  `i` starts at `min(i * width, size - width)` (the last may overlap the one before it, so a
  buffer is read in place, never padded)."""
  count = -(-size // block)
  return count, -(-size // count)


def layer_window(x: Array, layer: Array | int, start: Array | int, width: int, dtype,
                 axis: int = 3) -> Array:
  """Slots `[start, start + width)` (along `axis`: 4 for the keys, 3 for the values) of layer
  `layer` of an all-layer cache array (`KVCache`), or of one layer's array (rank 4; `layer`
  is then 0), read in place, in `dtype`."""
  if x.ndim == 4:
    x = x[None]
  starts = [layer, 0, 0, 0, 0]
  starts[axis] = start
  sizes = [1, *x.shape[1:]]
  sizes[axis] = width
  return jax.lax.dynamic_slice(x, starts, sizes)[0].astype(dtype)


def needed_tiles(query_slots: Array, key_mask: Array, size: int, q_block: int, k_block: int
                 ) -> Array:
  """`bool[query blocks, key blocks]`: the tiles of `tiled_attention` in which some row has a
  real key at or before one of its real queries (a query is real where `key_mask` holds its
  slot). Query blocks are `q_block` wide; key blocks follow `tiling(size, k_block)`."""
  b, t = query_slots.shape
  nq, (nk, k_width) = -(-t // q_block), tiling(size, k_block)
  real = (jnp.take_along_axis(key_mask, jnp.clip(query_slots, 0, size - 1), axis=1)
          & (query_slots < size))
  last = jnp.pad(jnp.where(real, query_slots, -1), ((0, 0), (0, nq * q_block - t)),
                 constant_values=-1)
  last = jnp.max(last.reshape(b, nq, q_block), axis=-1)  # [B, nq]: each block's last real query
  blocks = jnp.minimum(jnp.arange(nk) * k_width, size - k_width)[:, None] + jnp.arange(k_width)
  owned = blocks >= jnp.arange(nk)[:, None] * k_width  # [nk, width]: not in the block before
  first = jnp.min(jnp.where(key_mask[:, blocks] & owned, blocks, size), axis=-1)  # [B, nk]
  return jnp.any(first[:, None, :] <= last[:, :, None], axis=0)


def decode_attention(query: Array, keys: Array, values: Array, layer: Array | int,
                     key_mask: Array, last: Array) -> Array:
  """`f32[B, kv_heads, groups, head_dim]`: one query per row (a decode step; `query` scaled by
  `1/sqrt(head_dim)`) over layer `layer` of `keys, values` in the layout of `KVCache`, at the
  real slots (`key_mask: bool[B, S]`) up to each row's own (`last: i32[B]`).

  The keys are read in the blocks of `tiling(S, DECODE_BLOCK)`, up to the highest slot any row
  attends to (a traced trip count), with an online softmax across blocks (flash-decoding), so
  a step's cost follows the filled prefix, not the buffer. Within a block, attention is
  multiply-and-reduce: as a batched dot XLA:CPU runs B x kv_heads separate matrix-vector
  products (a 64-row step on the benchmark model: 14 -> 8.4 ms at 192 slots). The scores
  reduce over `head_dim`, a major axis of the keys (`KVCache`), so the sums run across whole
  rows of slots (that step: 5.5 -> 4.5 ms). On the CPU `Attention` runs
  `cpu_kernels.decode_attention` instead, the same computation reading the cache in place.
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
  _, total, acc = jax.lax.fori_loop(0, (jnp.max(last) + block) // block, step, carry)
  return acc / total[..., None]


def tiled_attention(q: Array, keys: Array, values: Array, layer: Array | int,
                    query_slots: Array, key_mask: Array, q_block: int | None = None,
                    k_block: int | None = None) -> Array:
  """Exact attention of `q: [B, T, kv_heads, groups, head_dim]` over layer `layer` of
  `keys, values` in the layout of `KVCache` (read in place), a query at slot
  `query_slots[b, t]` attending to the real slots (`key_mask: bool[B, S]`) at or before it.

  Flash attention: the queries run in blocks of `q_block` (default `QUERY_BLOCK`), the keys
  in the blocks of `tiling(S, k_block)` (default `KEY_BLOCK`) with an online softmax. A tile in
  which no row has a real key at or before one of its real queries (`needed_tiles`: the
  causal future, padding, the empty end of a cache) is skipped by a `lax.cond`, so the cost
  follows the real tokens' causal triangle. The backward pass is its own (`jax.custom_vjp`):
  it recomputes each needed tile's probabilities from the saved log-normalisers, so memory is
  linear in the row's length wherever the attention sits (autodiff of the loops, even
  rematerialised, kept every tile's probabilities inside the layer scan). A query with no key
  it may attend to gets zeros.
  """
  blocks = (min(q_block or QUERY_BLOCK, q.shape[1]), k_block or KEY_BLOCK)
  return _flash(q, keys, values, layer, query_slots, key_mask, blocks)


def _flash_layout(q, keys, query_slots, key_mask, blocks):
  """Shared by the forward and backward passes: the tiling and the per-tile helpers."""
  q_width, k_block = blocks
  b, t = q.shape[:2]
  size = key_mask.shape[1]
  nq, (nk, k_width) = -(-t // q_width), tiling(size, k_block)
  pad = nq * q_width - t
  needed = needed_tiles(query_slots, key_mask, size, q_width, k_block)

  def split(x, fill=0):  # [B, T, ...] -> [nq, B, q_width, ...]
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
    return jnp.moveaxis(x.reshape(b, nq, q_width, *x.shape[2:]), 1, 0)

  def merge(x):  # [nq, B, q_width, ...] -> [B, T, ...]
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(b, nq * q_width, *x.shape[3:])[:, :t]

  def tile_scores(query, slots, j, layer, keys, values):
    """Scaled scores `f32[B, kvh, g, w, width]` of one tile (-inf where not allowed), its
    keys and values, and its first slot."""
    start = jnp.minimum(j * k_width, size - k_width)
    k_tile = layer_window(keys, layer, start, k_width, q.dtype, axis=4)
    v_tile = layer_window(values, layer, start, k_width, q.dtype)
    key_slot = start + jnp.arange(k_width)
    ok = (jax.lax.dynamic_slice_in_dim(key_mask, start, k_width, 1)[:, None, :]
          & (key_slot >= j * k_width)[None, None, :]
          & (key_slot[None, None, :] <= slots[:, :, None]))  # [B, w, width]
    scores = jnp.einsum("bkgqd,bkds->bkgqs", query, k_tile,
                        preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(q.shape[-1]))
    return jnp.where(ok[:, None, None], scores, -jnp.inf), k_tile, v_tile, start

  return nk, k_width, needed, split, merge, tile_scores


def _flash_forward(q, keys, values, layer, query_slots, key_mask, blocks):
  """`(out [B, T, kvh, g, hd], log-normaliser f32[B, kvh, g, T])`; +inf where no key.

  The slots and the key mask pass an optimisation barrier with the queries: to JAX's partial
  evaluation they then depend on the layer's input. Otherwise, inside the differentiated
  layer scan, JAX hoists their loop-invariant tile masks out of the scan, one per (query
  block, key block) pair: memory quadratic in the row (7 GB at 16K tokens).
  """
  f32 = jnp.float32
  q, query_slots, key_mask = jax.lax.optimization_barrier((q, query_slots, key_mask))
  b, _, kvh, g, hd = q.shape
  nk, _, needed, split, merge, tile_scores = _flash_layout(q, keys, query_slots, key_mask,
                                                           blocks)

  def query_block(args):
    q_blk, slots, needed_row = args
    query = jnp.moveaxis(q_blk, 1, 3)  # [B, kvh, g, w, hd]

    def tile(carry, inputs):
      def attend(carry):
        best, total, acc = carry
        scores, _, v_tile, _ = tile_scores(query, slots, inputs[0], layer, keys, values)
        new_best = jnp.maximum(best, jnp.max(scores, -1))
        probs = jnp.exp(scores - new_best[..., None])
        scale = jnp.exp(best - new_best)
        return (new_best, total * scale + jnp.sum(probs, -1), acc * scale[..., None]
                + jnp.einsum("bkgqs,bksd->bkgqd", probs.astype(q.dtype), v_tile,
                             preferred_element_type=f32))
      return jax.lax.cond(inputs[1], attend, lambda c: c, carry), None

    shape = (b, kvh, g, q_blk.shape[1])
    # A finite floor for the running maximum: a tile with no allowed slot leaves it, and
    # exp(-inf - floor) is 0 rather than NaN.
    carry = (jnp.full(shape, jnp.finfo(f32).min, f32), jnp.zeros(shape, f32),
             jnp.zeros((*shape, hd), f32))
    (best, total, acc), _ = jax.lax.scan(tile, carry, (jnp.arange(nk), needed_row))
    out = acc / jnp.where(total > 0, total, 1.0)[..., None]
    lse = jnp.where(total > 0, best + jnp.log(total), jnp.inf)
    return jnp.moveaxis(out, 3, 1).astype(q.dtype), jnp.moveaxis(lse, 3, 1)

  out, lse = jax.lax.map(query_block, (split(q), split(query_slots, -1), needed))
  return merge(out), jnp.moveaxis(merge(lse), 1, 3)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _flash(q, keys, values, layer, query_slots, key_mask, blocks):
  return _flash_forward(q, keys, values, layer, query_slots, key_mask, blocks)[0]


def _flash_fwd(q, keys, values, layer, query_slots, key_mask, blocks):
  out, lse = _flash_forward(q, keys, values, layer, query_slots, key_mask, blocks)
  return out, (q, keys, values, layer, query_slots, key_mask, out, lse)


def _flash_bwd(blocks, residuals, d_out):
  """FlashAttention's backward: per needed tile, `p = exp(s - lse)`,
  `ds = p * (d_out . v - delta)` with `delta = sum(d_out * out)`; `dq += ds k`,
  `dk += ds^T q`, `dv += p^T d_out`, the key gradients accumulated in place."""
  q, keys, values, layer, query_slots, key_mask, out, lse = residuals
  q, query_slots, key_mask = jax.lax.optimization_barrier((q, query_slots, key_mask))
  f32 = jnp.float32
  scale = 1.0 / jnp.sqrt(f32(q.shape[-1]))
  nk, k_width, needed, split, merge, tile_scores = _flash_layout(q, keys, query_slots,
                                                                 key_mask, blocks)
  delta = jnp.sum(d_out.astype(f32) * out.astype(f32), -1)  # [B, T, kvh, g]

  def query_block(carry, args):
    q_blk, slots, needed_row, lse_blk, delta_blk, d_blk = args
    query = jnp.moveaxis(q_blk, 1, 3)  # [B, kvh, g, w, hd]
    d_o = jnp.moveaxis(d_blk, 1, 3).astype(q.dtype)
    lse_blk, delta_blk = jnp.moveaxis(lse_blk, 1, 3), jnp.moveaxis(delta_blk, 1, 3)

    def tile(inner, inputs):
      def backward(inner):
        dq, dk, dv = inner
        scores, k_tile, v_tile, start = tile_scores(query, slots, inputs[0], layer, keys,
                                                    values)
        probs = jnp.exp(scores - lse_blk[..., None])  # 0 where not allowed or no key
        dp = jnp.einsum("bkgqd,bksd->bkgqs", d_o, v_tile, preferred_element_type=f32)
        ds = (probs * (dp - delta_blk[..., None]) * scale).astype(q.dtype)
        dq = dq + jnp.einsum("bkgqs,bkds->bkgqd", ds, k_tile, preferred_element_type=f32)
        add = lambda acc, x, axis: jax.lax.dynamic_update_slice_in_dim(
            acc, jax.lax.dynamic_slice_in_dim(acc, start, k_width, axis) + x, start, axis)
        dk = add(dk, jnp.einsum("bkgqs,bkgqd->bkds", ds, query, preferred_element_type=f32), 3)
        dv = add(dv, jnp.einsum("bkgqs,bkgqd->bksd", probs.astype(q.dtype), d_o,
                                preferred_element_type=f32), 2)
        return dq, dk, dv
      return jax.lax.cond(inputs[1], backward, lambda c: c, inner), None

    dq = jnp.zeros(query.shape, f32)
    (dq, dk, dv), _ = jax.lax.scan(tile, (dq, *carry), (jnp.arange(nk), needed_row))
    return (dk, dv), jnp.moveaxis(dq, 3, 1)

  zeros = lambda x: jnp.zeros(x.shape[1:], f32)
  (dk, dv), dq = jax.lax.scan(query_block, (zeros(keys), zeros(values)), (
      split(q), split(query_slots, -1), needed, split(jnp.moveaxis(lse, 3, 1), jnp.inf),
      split(delta), split(d_out)))
  place = lambda g, like: jnp.zeros(like.shape, like.dtype).at[layer].set(g.astype(like.dtype))
  return (merge(dq).astype(q.dtype), place(dk, keys), place(dv, values), None, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


def splash_attention(q: Array, keys: Array, values: Array, mask: Array,
                     interpret: bool = False) -> Array:
  """Causal attention of a forward without a cache through the Pallas splash-attention kernel.

  `q: [B, T, kv_heads, groups, head_dim]`, `keys, values: [B, kv_heads, T, head_dim]`,
  `mask: bool[B, T]` real tokens (contiguous in each row). Rows are padded to a multiple of
  128 slots; a row's real tokens are segment 1 of the kernel's segment ids and every other slot
  segment 0, so a real query attends to the real keys at or before it, as in
  `tiled_attention`, and a padded query's output is set to zero. `interpret` runs the kernel
  in Pallas's interpreter (any backend; slow).
  """
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  b, t, kvh, groups, hd = q.shape
  width = -(-t // 128) * 128
  pad = lambda x: jnp.pad(x, [(0, 0), (0, 0), (0, width - t), (0, 0)])
  query = pad(jnp.moveaxis(q.reshape(b, t, kvh * groups, hd), 1, 2) * (1.0 / math.sqrt(hd)))
  keys, values = (pad(jnp.repeat(x, groups, axis=1)) for x in (keys, values))
  segments = jnp.pad(mask.astype(jnp.int32), [(0, 0), (0, width - t)])
  kernel = _splash_kernel(kvh * groups, width, interpret)
  out = jax.vmap(kernel)(query, keys, values,
                         segment_ids=sk.SegmentIds(q=segments, kv=segments))
  out = jnp.moveaxis(out[:, :, :t], 1, 2).reshape(q.shape)
  return jnp.where(mask[:, :, None, None, None], out, 0).astype(q.dtype)


def _splash_kernel(heads: int, width: int, interpret: bool):
  """The splash kernel of a causal mask over `width` slots for `heads` heads, its block
  masks as concrete arrays whatever trace asks for it (built anew per trace: a kernel kept
  across traces leaks the first one's tracers into the next)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
  block = next(size for size in (512, 256, 128) if width % size == 0)
  sizes = sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                        block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                        block_q_dq=block, block_kv_dq=block)
  mask = sm.MultiHeadMask([sm.CausalMask((width, width))] * heads)
  with jax.ensure_compile_time_eval():
    return sk.make_splash_mha(mask, head_shards=1, q_seq_shards=1, block_sizes=sizes,
                              interpret=interpret)


def dense(x: Array, kernel: Array, axes: int = 1) -> Array:
  """Contracts the last `axes` axes of `x` with the first `axes` of `kernel`, as one 2-D matmul.

  `x: [..., *in]`, `kernel: [*in, *out]` -> `[..., *out]`. Folding the leading axes into one
  row axis is the same product as `einsum("btd,dhk->bthk")`, but XLA:CPU runs the backward
  of a dot with several batch-like axes about twice as slow as the folded one.
  """
  lead, fan_in = x.shape[:x.ndim - axes], kernel.shape[:axes]
  size = int(np.prod(fan_in))
  matmul = _cpu_matmul if jax.default_backend() == "cpu" else jnp.matmul
  y = matmul(x.reshape(-1, size), kernel.reshape(size, -1))
  return y.reshape(*lead, *kernel.shape[axes:])


@jax.custom_vjp
def _cpu_matmul(x: Array, w: Array) -> Array:
  """`x @ w` for `x: [N, K]`, `w: [K, M]`, whose weight gradient runs in YNNPACK on XLA:CPU.

  The weight gradient `x.T @ dy` contracts both operands over their leading axis. XLA:CPU
  folds a transpose into the dot's dimensions, and YNNPACK takes no dot whose left operand
  contracts over its leading axis, so the product falls back to Eigen at about 60 % of
  YNNPACK's speed (the update's weight gradients are a third of its FLOPs). The backward here
  transposes the smaller operand into a row-major copy behind an optimisation barrier (which
  keeps it from being folded back), so the product is a plain row-major matmul.
  """
  return x @ w


def _cpu_matmul_fwd(x, w):
  return x @ w, (x, w)


def _cpu_matmul_bwd(residuals, dy):
  x, w = residuals
  kept = jax.lax.optimization_barrier
  if x.shape[1] <= dy.shape[1]:
    dw = kept(kept(x.T) @ dy)
  else:
    dw = kept(kept(dy.T) @ x).T
  return (dy @ w.T).astype(x.dtype), dw.astype(w.dtype)


_cpu_matmul.defvjp(_cpu_matmul_fwd, _cpu_matmul_bwd)


def _param(module: nn.Module, name: str, shape, axes, init=_INIT):
  """A parameter in `param_dtype` with logical axis names."""
  return module.param(name, nn.with_logical_partitioning(init, axes), shape,
                      module.config.jnp_param_dtype)


class RMSNorm(nn.Module):
  """x * rsqrt(mean(x^2) + eps) * scale, computed in float32."""
  config: ModelConfig
  axis_name: str = "embed"

  @nn.compact
  def __call__(self, x: Array) -> Array:
    scale = _param(self, "scale", (x.shape[-1],), (self.axis_name,), nn.initializers.ones)
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True)
                                 + self.config.rms_norm_eps)
    return (normed * scale.astype(jnp.float32)).astype(x.dtype)


class Attention(nn.Module):
  """Grouped-query attention with RoPE, optional QKV bias (Qwen2) and q/k norm (Qwen3)."""
  config: ModelConfig

  @nn.compact
  def __call__(self, x, positions, query_slots, key_mask, cache):
    """`cache`: None, or `(k, v, layer)`: every layer's keys and values and this layer's index
    (or this layer's own arrays, rank 4, and 0), or `(k, v, layer, mask)` for an empty cache
    filled from slot 0 (a prefill): the new tokens, real where `mask: bool[B, T]`, then
    attend among themselves only, through the same kernels as a forward without a cache.

    The new keys and values are written straight into the all-layer arrays (which the
    layer scan carries), so a decode step updates the cache in place instead of slicing
    it out and stacking it back (a copy of the whole cache per step): on the CPU by
    `cpu_kernels.write_cache`, elsewhere by XLA's scatter.
    """
    c = self.config
    dt, hd, h, kvh = c.jnp_dtype, c.resolved_head_dim, c.num_heads, c.num_kv_heads
    backend = jax.default_backend()

    def project(name, heads):
      kernel = _param(self, f"{name}_kernel", (c.hidden_size, heads, hd),
                      ("embed", "heads" if heads == h else "kv_heads", "head_dim"))
      y = dense(x, kernel.astype(dt))
      if c.qkv_bias:
        bias = _param(self, f"{name}_bias", (heads, hd),
                      ("heads" if heads == h else "kv_heads", "head_dim"), nn.initializers.zeros)
        y = y + bias.astype(dt)
      return y

    q, k, v = project("q", h), project("k", kvh), project("v", kvh)
    if c.qk_norm:
      q = RMSNorm(c, "head_dim", name="q_norm")(q)
      k = RMSNorm(c, "head_dim", name="k_norm")(k)
    inv_freq, scale = rope_frequencies(hd, c.rope_theta, c.rope_scaling)
    q, k = apply_rope(q, positions, inv_freq, scale), apply_rope(k, positions, inv_freq, scale)

    k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, kv_heads, T, head_dim]
    if cache is None:
      new_cache = None
    else:
      # Slots past the end of the buffer are dropped (the kernel skips them, XLA's scatter
      # has mode="drop"), not clamped (dynamic_update_slice would silently shift the write).
      cache_k, cache_v, layer = cache[:3]
      written = None
      if backend == "cpu":  # in place, where the kernel is built
        written = cpu_kernels.write_cache(cache_k, cache_v, layer, k, v, query_slots)
      if written is None:
        lead = () if cache_k.ndim == 4 else (layer,)  # one layer's arrays, or all layers'
        rows, heads = jnp.arange(k.shape[0])[:, None, None], jnp.arange(kvh)[None, :, None]
        slots = query_slots[:, None, :]
        written = (cache_k.at[(*lead, rows, heads, slice(None), slots)].set(
                       k.astype(cache_k.dtype), mode="drop"),
                   cache_v.at[(*lead, rows, heads, slots)].set(
                       v.astype(cache_v.dtype), mode="drop"))
      new_cache = (*written, layer, *cache[3:])
    local = cache is None or len(cache) == 4  # the new tokens attend among themselves only
    if not local:
      all_keys, all_values, layer = new_cache[:3]  # read in place: never copied out
    else:
      all_keys, all_values, layer = jnp.swapaxes(k, 2, 3)[None], v[None], 0
      if cache is not None:
        key_mask = cache[3]
        query_slots = jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32), key_mask.shape)
    size = all_values.shape[-2]
    b, t = q.shape[:2]
    q = q.reshape(b, t, kvh, h // kvh, hd)

    def read(start, width):
      """This layer's keys and values of slots `[start, start + width)`, in the compute dtype."""
      return (layer_window(all_keys, layer, start, width, dt, axis=4),
              layer_window(all_values, layer, start, width, dt))

    def attend_library(q):
      """`jax.nn.dot_product_attention`: cuDNN's fused kernel on GPU in 16-bit floats."""
      gpu = backend == "gpu" and dt in (jnp.bfloat16, jnp.float16)
      keys, values = read(0, size)
      allowed = key_mask[:, None, :] & (jnp.arange(size)[None, None, :]
                                        <= query_slots[:, :, None])
      out = jax.nn.dot_product_attention(
          q.reshape(*q.shape[:2], h, hd), jnp.moveaxis(keys, 3, 1), jnp.swapaxes(values, 1, 2),
          mask=allowed[:, None], implementation="cudnn" if gpu else "xla")
      return out.reshape(q.shape)

    tpu = backend == "tpu"
    if t == 1:
      query = q[:, 0].astype(jnp.float32) / jnp.sqrt(jnp.float32(hd))
      last = query_slots[:, 0]  # each row attends to the slots up to its own
      out = None
      if backend == "cpu":  # the kernel, where it is built
        out = cpu_kernels.decode_attention(query, all_keys, all_values, layer, key_mask, last)
      if out is None:
        out = decode_attention(query, all_keys, all_values, layer, key_mask, last)
      out = out[:, None].astype(dt)
    elif local and (c.attention == "splash" or (c.attention == "dot_product" and tpu)):
      out = splash_attention(q, k, v, key_mask, interpret=not tpu)
    elif c.attention in ("dot_product", "splash"):
      out = attend_library(q)
    else:
      out = tiled_attention(q, all_keys, all_values, layer, query_slots, key_mask)
    out = out.reshape(b, t, h, hd)
    o_kernel = _param(self, "o_kernel", (h, hd, c.hidden_size), ("heads", "head_dim", "embed"))
    out = dense(out, o_kernel.astype(dt), axes=2)
    if c.o_bias:
      out = out + _param(self, "o_bias", (c.hidden_size,), ("embed",),
                         nn.initializers.zeros).astype(dt)
    return out, new_cache


class MLP(nn.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""
  config: ModelConfig

  @nn.compact
  def __call__(self, x):
    c, dt = self.config, self.config.jnp_dtype
    gate = _param(self, "gate_kernel", (c.hidden_size, c.mlp_dim), ("embed", "mlp"))
    up = _param(self, "up_kernel", (c.hidden_size, c.mlp_dim), ("embed", "mlp"))
    down = _param(self, "down_kernel", (c.mlp_dim, c.hidden_size), ("mlp", "embed"))
    hidden = jax.nn.silu(dense(x, gate.astype(dt))) * dense(x, up.astype(dt))
    return dense(hidden, down.astype(dt))


class MoE(nn.Module):
  """Qwen3-MoE sparse block: softmax router, top-k experts, optional renormalised weights.

  Routing replay: when `routes: i32[B, T, k]` is given, those experts are used instead of the
  router's own top-k; their gate weights are still the current router's probabilities (the
  replayed quantity is the discrete choice, as in the PBSD ablation). A token whose routes are
  -1 is routed afresh (one the sampler never saw, e.g. a privileged prompt). Experts are evaluated
  densely and combined with a sparse weight matrix, which is exact and simple; a dispatching
  kernel is a drop-in replacement for large expert counts.
  """
  config: ModelConfig

  @nn.compact
  def __call__(self, x, routes=None):
    c, dt = self.config, self.config.jnp_dtype
    e, m = c.num_experts, c.resolved_expert_mlp_dim
    router = _param(self, "router_kernel", (c.hidden_size, e), ("embed", "expert"))
    probs = jax.nn.softmax((x @ router.astype(dt)).astype(jnp.float32), axis=-1)  # [B,T,E]
    _, fresh = jax.lax.top_k(probs, c.num_experts_per_tok)
    routes = fresh if routes is None else jnp.where(routes >= 0, routes, fresh)
    top = jnp.take_along_axis(probs, routes, axis=-1)
    if c.norm_topk_prob:
      top = top / jnp.sum(top, axis=-1, keepdims=True)
    combine = jnp.sum(jax.nn.one_hot(routes, e, dtype=jnp.float32) * top[..., None], axis=-2)
    gate = _param(self, "gate_kernel", (e, c.hidden_size, m), ("expert", "embed", "mlp"))
    up = _param(self, "up_kernel", (e, c.hidden_size, m), ("expert", "embed", "mlp"))
    down = _param(self, "down_kernel", (e, m, c.hidden_size), ("expert", "mlp", "embed"))
    hidden = (jax.nn.silu(jnp.einsum("btd,edm->btem", x, gate.astype(dt)))
              * jnp.einsum("btd,edm->btem", x, up.astype(dt)))
    expert_out = jnp.einsum("btem,emd->bted", hidden, down.astype(dt))
    out = jnp.einsum("bted,bte->btd", expert_out, combine.astype(dt))
    return out, routes.astype(jnp.int32)


class Block(nn.Module):
  """One pre-norm decoder layer; scanned over layers by `Transformer`.

  The scan carries `(x, cache)`, the cache being None or `(k, v, layer)` over all layers
  (see `Attention`); this layer's expert `routes` come in per layer and go out per layer.
  """
  config: ModelConfig

  @nn.compact
  def __call__(self, carry, positions, query_slots, key_mask, routes):
    x, cache = carry
    c = self.config
    attn_out, cache = Attention(c, name="attn")(
        RMSNorm(c, name="attn_norm")(x), positions, query_slots, key_mask, cache)
    x = x + attn_out
    normed = RMSNorm(c, name="mlp_norm")(x)
    if c.is_moe:
      mlp_out, routes = MoE(c, name="moe")(normed, routes)
    else:
      mlp_out, routes = MLP(c, name="mlp")(normed), None
    if cache is not None:
      cache = (cache[0], cache[1], cache[2] + 1, *cache[3:])
    return (x + mlp_out, cache), routes


class Transformer(nn.Module):
  """The language model. See the module docstring for the padding and slot conventions."""
  config: ModelConfig

  def setup(self):
    c = self.config
    self.embedding = _param(self, "embedding", (c.vocab_size, c.hidden_size), ("vocab", "embed"))
    if not c.tie_embeddings:
      self.lm_head = _param(self, "lm_head", (c.hidden_size, c.vocab_size), ("embed", "vocab"))
    block = nn.remat(Block, static_argnums=()) if c.remat else Block
    self.layers = nn.scan(
        block,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        in_axes=(nn.broadcast, nn.broadcast, nn.broadcast, 0),
        length=c.num_layers,
        unroll=min(c.scan_unroll, c.num_layers),
        metadata_params={nn.PARTITION_NAME: "layers"},
    )(c, name="layers")
    self.final_norm = RMSNorm(c, name="final_norm")

  def __call__(self, tokens: Array, mask: Array | None = None, *,
               cache: KVCache | None = None, write_index: Array | None = None,
               routes: Array | None = None, compute_logits: bool = True,
               empty_cache: bool = False) -> ModelOutput:
    """Runs the model over `tokens: i32[B, T]`.

    Args:
      tokens: `i32[B, T]` token ids (values on padded slots are ignored).
      mask: `bool[B, T]` real tokens; defaults to all True.
      cache: a `KVCache`; the new tokens are written at slots `write_index + j` and attend to
        everything real already in it. None: a plain forward over `tokens` alone.
      write_index: `i32[B]` first slot to write per row (required with `cache`).
      routes: `i32[layers, B, T, k]` expert choices to replay (MoE only); -1 routes afresh.
      compute_logits: False returns hidden states only (for the chunked LM head).
      empty_cache: the cache holds nothing and `write_index` is 0 (a prefill): the new tokens
        attend among themselves only, with the kernels of a forward without a cache
        (`ModelConfig.attention`), instead of over the whole buffer.

    Returns:
      A `ModelOutput`.
    """
    c = self.config
    b, t = tokens.shape
    mask = jnp.ones((b, t), bool) if mask is None else mask.astype(bool)
    if routes is not None and not c.is_moe:
      raise ValueError("routes given to a dense model (num_experts == 0)")
    if cache is None:
      positions = positions_from_mask(mask)
      query_slots = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
      key_mask, caches, new_mask = mask, None, None
    else:
      if write_index is None:
        raise ValueError("write_index is required when a cache is given")
      write_index = write_index.astype(jnp.int32)
      positions = positions_from_mask(mask, real_before(cache.mask, write_index))
      query_slots = write_index[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
      rows = jnp.arange(b)[:, None]
      new_mask = cache.mask.at[rows, query_slots].set(mask, mode="drop")
      key_mask, caches = new_mask, (cache.k, cache.v, jnp.int32(0))
      if empty_cache:
        caches = (*caches, mask)

    x = jnp.take(self.embedding, tokens, axis=0).astype(c.jnp_dtype)
    if cache is not None and isinstance(cache.k, tuple):
      x, new_caches, new_routes = self._each_layer(x, caches, positions, query_slots, key_mask,
                                                   routes)
    else:
      (x, new_caches), new_routes = self.layers(
          (x, caches), positions, query_slots, key_mask, routes)
    hidden = self.final_norm(x)
    new_cache = None
    if cache is not None:
      new_cache = KVCache(k=new_caches[0], v=new_caches[1], mask=new_mask)
    return ModelOutput(hidden=hidden, logits=self.unembed(hidden) if compute_logits else None,
                       cache=new_cache, routes=new_routes)

  def _each_layer(self, x, caches, positions, query_slots, key_mask, routes):
    """The layers one after another, over a per-layer cache (`KVCache`): layer `i` runs with
    its slice of the scanned parameters, and its own cache arrays as they are, rank 4 (a
    leading layer axis of 1 would be a reshape around the in-place write of
    `cpu_kernels.write_cache`, and XLA copies the whole array on either side of one)."""
    c = self.config
    stacked = self.variables["params"]["layers"]
    keys, values, layer_routes = [], [], []
    for i in range(c.num_layers):
      params = jax.tree.map(lambda a: a[i], stacked)
      carry = (x, (caches[0][i], caches[1][i], 0, *caches[3:]))
      (x, cache), layer_route = Block(c, parent=None).apply(
          {"params": params}, carry, positions, query_slots, key_mask,
          None if routes is None else routes[i])
      keys.append(cache[0])
      values.append(cache[1])
      layer_routes.append(layer_route)
    new_routes = None if layer_routes[0] is None else jnp.stack(layer_routes)
    return x, (tuple(keys), tuple(values)), new_routes

  def unembed(self, hidden: Array) -> Array:
    """`f32[..., V]` logits of final hidden states `[..., hidden_size]`."""
    dt = self.config.jnp_dtype
    if self.config.tie_embeddings:
      logits = dense(hidden.astype(dt), self.embedding.astype(dt).T)
    else:
      logits = dense(hidden.astype(dt), self.lm_head.astype(dt))
    return logits.astype(jnp.float32)


def _init_boxed(config: ModelConfig, rng: Array):
  return Transformer(config).init(rng, jnp.zeros((1, 1), jnp.int32))["params"]


def init_params(config: ModelConfig, rng: Array, shardings: Any = None) -> Any:
  """Random parameters for `config`: a plain pytree of arrays (`param_dtype`).

  The same distributions as `Transformer.init` (norm scales 1, biases 0, other weights
  N(0, 0.02^2)) drawn on the host with numpy from a seed derived from `rng`: XLA compiles the
  model's own init for seconds on a CPU, which every test and script would pay. With
  `shardings` (a tree like the params, e.g. `sharding.param_shardings`), each device gets only
  its shard of each array (`jax.make_array_from_callback`; every process draws the same
  values), so no device holds a whole parameter it should not.
  """
  shapes = param_shapes(config)
  seed = np.asarray(jax.random.key_data(rng) if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key)
                    else rng).ravel().tolist()
  gen = np.random.default_rng(seed)

  def draw(path, leaf):
    name = str(getattr(path[-1], "key", path[-1]))
    if name == "scale":
      value = np.ones(leaf.shape, np.float32)
    elif name.endswith("_bias"):
      value = np.zeros(leaf.shape, np.float32)
    else:
      value = gen.normal(0.0, 0.02, leaf.shape).astype(np.float32)
    return value.astype(leaf.dtype)

  values = jax.tree_util.tree_map_with_path(draw, shapes)
  if shardings is None:
    return jax.tree.map(jnp.asarray, values)
  return jax.tree.map(lambda v, sh: jax.make_array_from_callback(v.shape, sh, lambda i: v[i]),
                      values, shardings)


def param_shapes(config: ModelConfig) -> Any:
  """`jax.ShapeDtypeStruct` of every parameter of `config` (nothing allocated or compiled).

  Use this, not `jax.eval_shape(init_params)`: `init_params` draws on the host and cannot be
  traced.
  """
  return nn.meta.unbox(jax.eval_shape(lambda r: _init_boxed(config, r), jax.random.key(0)))


def param_axes(config: ModelConfig) -> Any:
  """The logical axis names of every parameter, as a pytree of `PartitionSpec`s."""
  boxed = jax.eval_shape(lambda rng: _init_boxed(config, rng), jax.random.key(0))
  return nn.get_partition_spec(boxed)
