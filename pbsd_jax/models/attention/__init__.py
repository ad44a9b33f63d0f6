"""Attention kernels, chosen by the platform a program is compiled for.

The model (`models.transformer.Attention`) asks for three things; this package decides how:

  write_cache   store new keys and values at per-row slots of a `KVCache` layer
  decode_step   one query per row over its filled slots (a decode step)
  causal        queries over keys at or before their slots (training, prefill, scoring)

Every choice that depends on the hardware goes through `jax.lax.platform_dependent`, which JAX
resolves when it lowers the program for its devices, not when it traces: a program traced on
a CPU host and compiled for a TPU or GPU mesh holds that platform's path only, never a CPU
custom call. Modules: `flash` (tiled flash attention, its own backward pass; every platform),
`decode` (XLA decode attention), `splash` (the Pallas TPU kernel), `cpu_kernels` (XLA FFI
calls for the CPU, built on first use).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pbsd_jax.models.attention import cpu_kernels
from pbsd_jax.models.attention.decode import decode_attention
from pbsd_jax.models.attention.flash import layer_window, tiled_attention
from pbsd_jax.models.attention.splash import splash_attention

Array = jax.Array


def write_cache(keys: Array, values: Array, layer: Array | int, new_keys: Array,
                new_values: Array, slots: Array) -> tuple[Array, Array]:
  """`(keys, values)` of a `KVCache` layer with `new_keys[b, h, j]`, `new_values[b, h, j]`
  (`[B, kv_heads, N, head_dim]`) stored at slot `slots[b, j]`; a slot past the buffer is
  dropped, not clamped. On the CPU in place by `cpu_kernels.write_cache` (where it is built),
  elsewhere by XLA's scatter."""
  def scatter(keys, values, layer, new_keys, new_values, slots):
    lead = () if keys.ndim == 4 else (layer,)  # one layer's arrays, or all layers'
    rows = jnp.arange(new_keys.shape[0])[:, None, None]
    heads = jnp.arange(new_keys.shape[1])[None, :, None]
    at = slots[:, None, :]
    return (keys.at[(*lead, rows, heads, slice(None), at)].set(
                new_keys.astype(keys.dtype), mode="drop"),
            values.at[(*lead, rows, heads, at)].set(new_values.astype(values.dtype),
                                                    mode="drop"))

  def on_cpu(*args):
    return cpu_kernels.write_cache(*args) or scatter(*args)

  return jax.lax.platform_dependent(keys, values, layer, new_keys, new_values, slots,
                                    cpu=on_cpu, default=scatter)


def decode_step(query: Array, keys: Array, values: Array, layer: Array | int, key_mask: Array,
           last: Array) -> Array:
  """`f32[B, kv_heads, groups, head_dim]`: `decode_attention` (its docstring has the shapes);
  on the CPU by `cpu_kernels.decode_attention`, which reads the cache in place."""
  def on_cpu(*args):
    out = cpu_kernels.decode_attention(*args)
    return decode_attention(*args) if out is None else out

  return jax.lax.platform_dependent(query, keys, values, layer, key_mask, last, cpu=on_cpu,
                                    default=decode_attention)


def causal(kind: str, q: Array, keys: Array, values: Array, layer: Array | int,
           query_slots: Array, key_mask: Array, local: bool) -> Array:
  """Attention of `q: [B, T, kv_heads, groups, head_dim]` over layer `layer` of `keys, values`
  (`KVCache` layout), a query at slot `query_slots[b, t]` attending to the real slots
  (`key_mask: bool[B, S]`) at or before it; `local` when the keys are the queries' own tokens
  (no cache, or a prefill), where the splash kernel applies.

  `kind` (`ModelConfig.attention`): "ours" is `flash.tiled_attention` everywhere;
  "dot_product" is `jax.nn.dot_product_attention` (cuDNN's fused kernel on GPU in 16-bit
  floats), the splash kernel on TPU where `local`; "splash" is the splash kernel where `local`
  (interpreted off TPU), else as "dot_product".
  """
  if kind == "ours":
    return tiled_attention(q, keys, values, layer, query_slots, key_mask)
  library = lambda q, implementation="xla": _library(q, keys, values, layer, query_slots,
                                                     key_mask, implementation)
  if kind == "dot_product" and q.dtype in (jnp.bfloat16, jnp.float16) and _has_gpu():
    xla_or_cudnn = lambda q: jax.lax.platform_dependent(
        q, cuda=lambda q: library(q, "cudnn"), default=library)
  else:
    xla_or_cudnn = library
  if not local:
    return xla_or_cudnn(q)
  own_keys, own_values = jnp.swapaxes(keys[0], 2, 3), values[0]  # [B, kv_heads, T, head_dim]
  tpu = lambda q: splash_attention(q, own_keys, own_values, key_mask)
  elsewhere = ((lambda q: splash_attention(q, own_keys, own_values, key_mask, interpret=True))
               if kind == "splash" else xla_or_cudnn)
  return jax.lax.platform_dependent(q, tpu=tpu, default=elsewhere)


@functools.cache
def _has_gpu() -> bool:
  """Whether this process has GPU devices: JAX traces cuDNN's attention against the cuDNN
  library it loaded, so that branch can only be offered where there is one."""
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


def _library(q, keys, values, layer, query_slots, key_mask, implementation):
  """`jax.nn.dot_product_attention` over the whole buffer, masked to the allowed slots."""
  b, t, kvh, groups, hd = q.shape
  size = key_mask.shape[1]
  keys = layer_window(keys, layer, 0, size, q.dtype, axis=4)  # [B, kvh, hd, S]
  values = layer_window(values, layer, 0, size, q.dtype)  # [B, kvh, S, hd]
  allowed = key_mask[:, None, :] & (jnp.arange(size)[None, None, :] <= query_slots[:, :, None])
  out = jax.nn.dot_product_attention(
      q.reshape(b, t, kvh * groups, hd), jnp.moveaxis(keys, 3, 1), jnp.swapaxes(values, 1, 2),
      mask=allowed[:, None], implementation=implementation)
  return out.reshape(q.shape)
