"""Model configuration: one frozen dataclass for the Llama / Qwen2 / Qwen3 (-MoE) shapes.

The config is hashable, so it can be a static argument of `jax.jit`. Inconsistent sizes fail
here, at construction, with a `ValueError` naming the field -- never as a shape error in XLA.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

ROPE_TYPES = ("llama3", "yarn")
ATTENTION = ("ours", "dot_product", "splash")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Scaled RoPE frequencies, as Hugging Face's `rope_scaling` / `rope_parameters`.

  `llama3` (Llama 3.1 / 3.2): wavelengths longer than `original_max_positions /
  low_freq_factor` are divided by `factor`, shorter than `original_max_positions /
  high_freq_factor` kept, and the ones between interpolated. `yarn` (Qwen3 long context):
  frequencies ramp from kept (faster than `beta_fast` rotations over the original context) to
  divided by `factor` (slower than `beta_slow`), and cos / sin are multiplied by
  `attention_factor` (resolved from `factor` / `mscale` when the checkpoint is read).
  """

  kind: str
  factor: float
  original_max_positions: int
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  attention_factor: float = 1.0
  truncate: bool = True

  def __post_init__(self):
    if self.kind not in ROPE_TYPES:
      raise ValueError(f"RopeScaling.kind must be one of {ROPE_TYPES}, got {self.kind!r}")
    if self.factor <= 0 or self.original_max_positions <= 0:
      raise ValueError(f"RopeScaling.factor and original_max_positions must be positive, got "
                       f"{self.factor} and {self.original_max_positions}")
    if self.kind == "llama3" and self.high_freq_factor <= self.low_freq_factor:
      raise ValueError(f"RopeScaling.high_freq_factor={self.high_freq_factor} must exceed "
                       f"low_freq_factor={self.low_freq_factor}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Sizes and switches of the decoder-only transformer.

  Family switches: Llama = defaults (`attention_bias`: `qkv_bias` and `o_bias`); Qwen2 =
  `qkv_bias=True`; Qwen3 = `qk_norm=True` with an explicit `head_dim` (may differ from
  `hidden_size // num_heads`); Qwen3-MoE = Qwen3 plus `num_experts > 0`.
  """

  vocab_size: int = 256
  hidden_size: int = 64
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int | None = None  # None: hidden_size // num_heads.
  mlp_dim: int = 128
  rope_theta: float = 10_000.0
  rope_scaling: RopeScaling | None = None
  rms_norm_eps: float = 1e-6
  qkv_bias: bool = False
  o_bias: bool = False  # Llama / Qwen3 `attention_bias` also biases the output projection.
  qk_norm: bool = False
  tie_embeddings: bool = False
  # Mixture of experts (Qwen3-MoE style); num_experts == 0 means a dense SwiGLU MLP.
  num_experts: int = 0
  num_experts_per_tok: int = 2
  expert_mlp_dim: int | None = None  # None: mlp_dim.
  norm_topk_prob: bool = True
  # dtype policy: parameters are stored in `param_dtype` and cast to `dtype` for compute;
  # logits and log-probs are always float32.
  param_dtype: str = "float32"
  dtype: str = "float32"
  # The KV cache's dtype ("": the compute dtype). "bfloat16" under float32 compute halves the
  # cache's memory and what a decode step reads from it; keys and values are rounded to it
  # when written and widened to the compute dtype when read.
  cache_dtype: str = ""
  remat: bool = False
  # Layers per iteration of the layer scan (`lax.scan`'s `unroll`); `num_layers` or more
  # unrolls it fully. The parameters keep their stacked layout either way. On XLA:CPU a
  # fully unrolled shallow model trains faster (the backward pass no longer writes every
  # layer's activations into stacked buffers and reads them back: benchmarks/ours_rl.py);
  # compile time grows with the layers unrolled.
  scan_unroll: int = 1
  # Attention over several queries per row (the training forward, prefill, appends): "ours"
  # (`Attention`'s einsums, queries in blocks) or the accelerators' kernels, "dot_product":
  # on GPU `jax.nn.dot_product_attention` (cuDNN flash attention in bfloat16 / float16), on
  # TPU the Pallas splash-attention kernel for the forward without a cache (training,
  # evidence, SFT) and the prefill into an empty one, elsewhere XLA's
  # `dot_product_attention`. "splash" runs the splash kernel on any backend (interpreted off
  # TPU: slow, for tests). Decode steps (one query per row) always use ours (on the CPU the
  # kernel of `cpu_kernels.decode_attention`).
  attention: str = "ours"

  def __post_init__(self):
    if isinstance(self.rope_scaling, dict):  # as read back from JSON
      object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
    positive = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                "mlp_dim", "scan_unroll")
    for name in positive:
      if getattr(self, name) <= 0:
        raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
    if self.head_dim is not None and self.head_dim <= 0:
      raise ValueError(f"ModelConfig.head_dim must be positive, got {self.head_dim}")
    if self.head_dim is None and self.hidden_size % self.num_heads:
      raise ValueError(
          f"ModelConfig.num_heads={self.num_heads} does not divide "
          f"hidden_size={self.hidden_size}; set head_dim explicitly")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"ModelConfig.num_kv_heads={self.num_kv_heads} does not divide "
          f"num_heads={self.num_heads}")
    if self.resolved_head_dim % 2:
      raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got "
                       f"{self.resolved_head_dim}")
    if self.num_experts < 0:
      raise ValueError(f"ModelConfig.num_experts must be >= 0, got {self.num_experts}")
    if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
      raise ValueError(
          f"ModelConfig.num_experts_per_tok={self.num_experts_per_tok} must be in "
          f"[1, num_experts={self.num_experts}]")
    for name in ("param_dtype", "dtype", "cache_dtype"):
      allowed = sorted(_DTYPES) + ([""] if name == "cache_dtype" else [])
      if getattr(self, name) not in allowed:
        raise ValueError(f"ModelConfig.{name} must be one of {allowed}, got "
                         f"{getattr(self, name)!r}")
    if self.attention not in ATTENTION:
      raise ValueError(f"ModelConfig.attention must be one of {ATTENTION}, got "
                       f"{self.attention!r}")
    if self.rope_theta <= 0:
      raise ValueError(f"ModelConfig.rope_theta must be positive, got {self.rope_theta}")

  @property
  def resolved_head_dim(self) -> int:
    return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

  @property
  def resolved_expert_mlp_dim(self) -> int:
    return self.expert_mlp_dim if self.expert_mlp_dim is not None else self.mlp_dim

  @property
  def is_moe(self) -> bool:
    return self.num_experts > 0

  @property
  def jnp_dtype(self):
    return _DTYPES[self.dtype]

  @property
  def jnp_cache_dtype(self):
    return _DTYPES[self.cache_dtype or self.dtype]

  @property
  def jnp_param_dtype(self):
    return _DTYPES[self.param_dtype]

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)
