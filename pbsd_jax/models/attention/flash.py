"""Tiled flash attention over a `KVCache` layout, with its own backward pass.

Layouts (`models.transformer.KVCache`): keys `[layers, B, kv_heads, head_dim, S]`, values
`[layers, B, kv_heads, S, head_dim]`, or one layer's arrays without the `layers` axis (then
`layer` is 0); queries `[B, T, kv_heads, groups, head_dim]`; `key_mask: bool[B, S]` the real
slots, and a query at slot `q` attends to the real slots `s <= q`. Pure XLA: it runs on every
platform.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

Array = jax.Array


# Attention of more than one query per row runs in tiles of this many queries x keys
# (`tiled_attention`).
QUERY_BLOCK = 512
KEY_BLOCK = 512


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
