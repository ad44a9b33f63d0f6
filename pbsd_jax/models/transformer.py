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
expert, layers`); `pbsd_jax.parallel.sharding` maps them to mesh axes. The model knows nothing of RL.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import math

import numpy as np
from flax import struct

from pbsd_jax.models import attention
from pbsd_jax.models.attention.flash import tiling
from pbsd_jax.models.config import ModelConfig, RopeScaling
from pbsd_jax.parallel import sharding

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
  def init(cls, model: ModelConfig, batch: int, size: int) -> "KVCache":
    """An empty cache of `size` slots per row, in `model.cache_dtype`."""
    v = jnp.zeros((batch, model.num_kv_heads, size, model.resolved_head_dim),
                  model.jnp_cache_dtype)
    k, mask = jnp.swapaxes(v, 2, 3), jnp.zeros((batch, size), bool)
    if model.scan_unroll >= model.num_layers:
      return cls(k=(k,) * model.num_layers, v=(v,) * model.num_layers, mask=mask)
    stack = lambda x: jnp.broadcast_to(x, (model.num_layers, *x.shape))
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


def dense(x: Array, kernel: Array, axes: int = 1) -> Array:
  """Contracts the last `axes` axes of `x` with the first `axes` of `kernel`, as one 2-D matmul.

  `x: [..., *in]`, `kernel: [*in, *out]` -> `[..., *out]`. Folding the leading axes into one
  row axis is the same product as `einsum("btd,dhk->bthk")`, but XLA:CPU runs the backward
  of a dot with several batch-like axes about twice as slow as the folded one.
  """
  lead, fan_in = x.shape[:x.ndim - axes], kernel.shape[:axes]
  size = int(np.prod(fan_in))
  y = _matmul(x.reshape(-1, size), kernel.reshape(size, -1))
  return y.reshape(*lead, *kernel.shape[axes:])


@jax.custom_vjp
def _matmul(x: Array, w: Array) -> Array:
  """`x @ w` for `x: [N, K]`, `w: [K, M]`, whose weight gradient runs in YNNPACK on XLA:CPU.

  The weight gradient `x.T @ dy` contracts both operands over their leading axis. XLA:CPU
  folds a transpose into the dot's dimensions, and YNNPACK takes no dot whose left operand
  contracts over its leading axis, so the product falls back to Eigen at about 60 % of
  YNNPACK's speed (the update's weight gradients are a third of its FLOPs). On the CPU the
  backward transposes the smaller operand into a row-major copy behind an optimisation
  barrier (which keeps it from being folded back), so the product is a plain row-major matmul;
  on other platforms it is autodiff's.
  """
  return x @ w


def _matmul_fwd(x, w):
  return x @ w, (x, w)


def _weight_gradient_on_cpu(x, dy):
  kept = jax.lax.optimization_barrier
  if x.shape[1] <= dy.shape[1]:
    return kept(kept(x.T) @ dy)
  return kept(kept(dy.T) @ x).T


def _matmul_bwd(residuals, dy):
  x, w = residuals
  dw = jax.lax.platform_dependent(x, dy, cpu=_weight_gradient_on_cpu,
                                  default=lambda x, dy: x.T @ dy)
  return (dy @ w.T).astype(x.dtype), dw.astype(w.dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def _param(module: nn.Module, name: str, shape, axes, init=_INIT):
  """A parameter in `param_dtype` with logical axis names."""
  return module.param(name, nn.with_logical_partitioning(init, axes), shape,
                      module.model.jnp_param_dtype)


class RMSNorm(nn.Module):
  """x * rsqrt(mean(x^2) + eps) * scale, computed in float32."""
  model: ModelConfig
  axis_name: str = "embed"

  @nn.compact
  def __call__(self, x: Array) -> Array:
    scale = _param(self, "scale", (x.shape[-1],), (self.axis_name,), nn.initializers.ones)
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True)
                                 + self.model.rms_norm_eps)
    return (normed * scale.astype(jnp.float32)).astype(x.dtype)


class Attention(nn.Module):
  """Grouped-query attention with RoPE, optional QKV bias (Qwen2) and q/k norm (Qwen3)."""
  model: ModelConfig

  @nn.compact
  def __call__(self, x, positions, query_slots, key_mask, cache):
    """`cache`: None, or `(k, v, layer)`: every layer's keys and values and this layer's index
    (or this layer's own arrays, rank 4, and 0), or `(k, v, layer, mask)` for an empty cache
    filled from slot 0 (a prefill): the new tokens, real where `mask: bool[B, T]`, then
    attend among themselves only, through the same kernels as a forward without a cache.

    The new keys and values are written straight into the all-layer arrays (which the
    layer scan carries), so a decode step updates the cache in place instead of slicing
    it out and stacking it back (a copy of the whole cache per step); `models.attention`
    chooses the kernels by the platform the program is compiled for.
    """
    c = self.model
    dt, hd, h, kvh = c.jnp_dtype, c.resolved_head_dim, c.num_heads, c.num_kv_heads

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
    new_cache = None
    if cache is not None:
      cache_k, cache_v, layer = cache[:3]
      new_cache = (*attention.write_cache(cache_k, cache_v, layer, k, v, query_slots), layer,
                   *cache[3:])
    local = cache is None or len(cache) == 4  # the new tokens attend among themselves only
    if not local:
      all_keys, all_values, layer = new_cache[:3]  # read in place: never copied out
    else:
      all_keys, all_values, layer = jnp.swapaxes(k, 2, 3)[None], v[None], 0
      if cache is not None:
        key_mask = cache[3]
        query_slots = jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32), key_mask.shape)
    b, t = q.shape[:2]
    q = q.reshape(b, t, kvh, h // kvh, hd)
    if t == 1:
      query = q[:, 0].astype(jnp.float32) / jnp.sqrt(jnp.float32(hd))
      last = query_slots[:, 0]  # each row attends to the slots up to its own
      out = attention.decode_step(query, all_keys, all_values, layer, key_mask, last)[:, None]
    else:
      out = attention.causal(c.attention, q, all_keys, all_values, layer, query_slots,
                             key_mask, local)
    out = out.astype(dt)
    out = out.reshape(b, t, h, hd)
    o_kernel = _param(self, "o_kernel", (h, hd, c.hidden_size), ("heads", "head_dim", "embed"))
    out = dense(out, o_kernel.astype(dt), axes=2)
    if c.o_bias:
      out = out + _param(self, "o_bias", (c.hidden_size,), ("embed",),
                         nn.initializers.zeros).astype(dt)
    return out, new_cache


class MLP(nn.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""
  model: ModelConfig

  @nn.compact
  def __call__(self, x):
    c, dt = self.model, self.model.jnp_dtype
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
  model: ModelConfig

  @nn.compact
  def __call__(self, x, routes=None):
    c, dt = self.model, self.model.jnp_dtype
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
  model: ModelConfig

  @nn.compact
  def __call__(self, carry, positions, query_slots, key_mask, routes):
    x, cache = carry
    x = sharding.constrain_rows(x)
    c = self.model
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
    return (sharding.constrain_rows(x + mlp_out), cache), routes


class Transformer(nn.Module):
  """The language model. See the module docstring for the padding and slot conventions."""
  model: ModelConfig

  def setup(self):
    c = self.model
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
    c = self.model
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

    x = sharding.constrain_rows(jnp.take(self.embedding, tokens, axis=0).astype(c.jnp_dtype))
    if cache is not None and isinstance(cache.k, tuple):
      x, new_caches, new_routes = self._each_layer(x, caches, positions, query_slots, key_mask,
                                                   routes)
    else:
      (x, new_caches), new_routes = self.layers(
          (x, caches), positions, query_slots, key_mask, routes)
    hidden = sharding.constrain_rows(self.final_norm(x))
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
    c = self.model
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
    dt = self.model.jnp_dtype
    if self.model.tie_embeddings:
      logits = dense(hidden.astype(dt), self.embedding.astype(dt).T)
    else:
      logits = dense(hidden.astype(dt), self.lm_head.astype(dt))
    return logits.astype(jnp.float32)


def _init_boxed(model: ModelConfig, rng: Array):
  return Transformer(model).init(rng, jnp.zeros((1, 1), jnp.int32))["params"]


def init_params(model: ModelConfig, rng: Array, shardings: Any = None) -> Any:
  """Random parameters for `model`: a plain pytree of arrays (`param_dtype`).

  The same distributions as `Transformer.init` (norm scales 1, biases 0, other weights
  N(0, 0.02^2)) drawn on the host with numpy from a seed derived from `rng`: XLA compiles the
  model's own init for seconds on a CPU, which every test and script would pay. With
  `shardings` (a tree like the params, e.g. `param_shardings`), each device gets only
  its shard of each array (`jax.make_array_from_callback`; every process draws the same
  values), so no device holds a whole parameter it should not.
  """
  shapes = param_shapes(model)
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


def param_shapes(model: ModelConfig) -> Any:
  """`jax.ShapeDtypeStruct` of every parameter of `model` (nothing allocated or compiled).

  Use this, not `jax.eval_shape(init_params)`: `init_params` draws on the host and cannot be
  traced.
  """
  return nn.meta.unbox(jax.eval_shape(lambda r: _init_boxed(model, r), jax.random.key(0)))


def param_axes(model: ModelConfig) -> Any:
  """The logical axis names of every parameter, as a pytree of `PartitionSpec`s."""
  boxed = jax.eval_shape(lambda rng: _init_boxed(model, rng), jax.random.key(0))
  return nn.get_partition_spec(boxed)


def param_shardings(model: ModelConfig, mesh: jax.sharding.Mesh, rules=sharding.RULES) -> Any:
  """`NamedSharding` of every parameter of `model`, from `param_axes` and the rules."""
  return sharding.logical_to_sharding(param_axes(model), mesh, rules, param_shapes(model))
