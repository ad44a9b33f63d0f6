"""Causal attention through the Pallas splash-attention kernel (TPU; elsewhere interpreted)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pbsd_jax.parallel import sharding

Array = jax.Array


def splash_attention(q: Array, keys: Array, values: Array, mask: Array,
                     interpret: bool = False) -> Array:
  """Causal attention of a forward without a cache through the Pallas splash-attention kernel.

  `q: [B, T, kv_heads, groups, head_dim]`, `keys, values: [B, kv_heads, T, head_dim]`,
  `mask: bool[B, T]` real tokens (contiguous in each row). Rows are padded to a multiple of
  128 slots; a row's real tokens are segment 1 of the kernel's segment ids and every other slot
  segment 0, so a real query attends to the real keys at or before it, as in
  `tiled_attention`, and a padded query's output is set to zero. `interpret` runs the kernel
  in Pallas's interpreter (any backend; slow).

  XLA cannot partition a Mosaic kernel, so on a mesh (the one the arrays are traced on) each
  device runs it on its own block (`jax.shard_map`): its rows over the data axes and its KV
  heads over `tensor`, where they divide; an axis that does not divide runs replicated.
  """
  mesh = jax.typeof(q).sharding.mesh
  if mesh.empty or mesh.size == 1:
    return _splash_block(q, keys, values, mask, interpret)
  rows = sharding.row_axes(mesh, q.shape[0])
  heads = "tensor" if (mesh.shape.get("tensor", 1) > 1
                       and q.shape[2] % mesh.shape["tensor"] == 0) else None
  spec_q, spec_kv = P(rows, None, heads), P(rows, heads)
  return jax.shard_map(functools.partial(_splash_block, interpret=interpret), mesh=mesh,
                       in_specs=(spec_q, spec_kv, spec_kv, P(rows)), out_specs=spec_q,
                       check_vma=False)(q, keys, values, mask)


def _splash_block(q: Array, keys: Array, values: Array, mask: Array, interpret: bool
                  ) -> Array:
  """`splash_attention` on one device's block."""
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
