"""Hugging Face `config.json` <-> our `ModelConfig`, for Llama / Qwen2 / Qwen3 / Qwen3-MoE.

`config_from_hf` accepts only what our model computes exactly: every option that would change the
logits (RoPE scalings other than llama3 / yarn, sliding windows, other activations, dense layers
in an MoE, ...) is a one-line `ValueError` naming the field. `config_to_hf` is its inverse for
the architecture that can hold the config.
"""

from __future__ import annotations

import math
from typing import Any

from pbsd_jax.models.config import ModelConfig, ROPE_TYPES, RopeScaling

LLAMA, QWEN2, QWEN3, QWEN3_MOE = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                  "Qwen3MoeForCausalLM")
MODEL_TYPES = {LLAMA: "llama", QWEN2: "qwen2", QWEN3: "qwen3", QWEN3_MOE: "qwen3_moe"}
SUPPORTED_ARCHITECTURES = tuple(MODEL_TYPES)

CONFIG_FILE = "config.json"

_FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def _field(hf: dict, name: str, default: Any = None, required: bool = False) -> Any:
  if name not in hf or hf[name] is None:
    if required:
      raise ValueError(f"{CONFIG_FILE}: missing required field '{name}'")
    return default
  return hf[name]


def architecture_of(hf: dict) -> str:
  """The supported architecture named by a `config.json` dict, or a ValueError."""
  names = hf.get("architectures") or []
  if not names:
    by_type = {model_type: arch for arch, model_type in MODEL_TYPES.items()}
    names = [by_type.get(hf.get("model_type"), f"model_type={hf.get('model_type')!r}")]
  if len(names) != 1 or names[0] not in SUPPORTED_ARCHITECTURES:
    raise ValueError(f"{CONFIG_FILE}: architecture {names} is not supported; supported: "
                     f"{list(SUPPORTED_ARCHITECTURES)}")
  return names[0]


def _rope(hf: dict) -> tuple[float, RopeScaling | None]:
  """RoPE base and scaling from either the v4 (`rope_theta` + `rope_scaling`) or the v5
  (`rope_parameters`) form, resolved as transformers' `modeling_rope_utils` does."""
  if hf.get("partial_rotary_factor", 1.0) != 1.0:
    raise ValueError(f"{CONFIG_FILE}: partial_rotary_factor must be 1.0")
  theta = float(_field(hf, "rope_theta", 10_000.0))
  scaling = None
  for key in ("rope_scaling", "rope_parameters"):
    rope = hf.get(key)
    if rope is None:
      continue
    if not isinstance(rope, dict):
      raise ValueError(f"{CONFIG_FILE}: '{key}' must be an object, got {rope!r}")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
      raise ValueError(f"{CONFIG_FILE}: {key}.partial_rotary_factor must be 1.0")
    theta = float(rope.get("rope_theta", theta))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
      continue
    if kind not in ROPE_TYPES:
      raise ValueError(f"{CONFIG_FILE}: {key}.rope_type={kind!r} is not supported (plain RoPE "
                       f"or {list(ROPE_TYPES)}; others would change the logits)")
    original = (hf.get("original_max_position_embeddings")
                or rope.get("original_max_position_embeddings")
                or _field(hf, "max_position_embeddings"))
    if not original:
      raise ValueError(f"{CONFIG_FILE}: {key}.rope_type={kind!r} needs "
                       "original_max_position_embeddings or max_position_embeddings")
    factor = rope.get("factor")
    if factor is None and kind == "yarn":
      factor = _field(hf, "max_position_embeddings", required=True) / original
    if factor is None:
      raise ValueError(f"{CONFIG_FILE}: {key}.factor is required for rope_type={kind!r}")
    if kind == "llama3":
      for name in ("low_freq_factor", "high_freq_factor"):
        if rope.get(name) is None:
          raise ValueError(f"{CONFIG_FILE}: {key}.{name} is required for rope_type='llama3'")
      scaling = RopeScaling(kind, float(factor), int(original),
                            low_freq_factor=float(rope["low_freq_factor"]),
                            high_freq_factor=float(rope["high_freq_factor"]))
    else:
      scaling = RopeScaling(kind, float(factor), int(original),
                            beta_fast=float(rope.get("beta_fast") or 32),
                            beta_slow=float(rope.get("beta_slow") or 1),
                            attention_factor=_yarn_attention_factor(rope, float(factor)),
                            truncate=bool(rope.get("truncate", True)))
  return theta, scaling


def _yarn_attention_factor(rope: dict, factor: float) -> float:
  """YaRN's cos / sin multiplier: `attention_factor`, else from `mscale` / `mscale_all_dim`."""
  if rope.get("attention_factor") is not None:
    return float(rope["attention_factor"])

  def mscale(scale, m=1.0):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

  if rope.get("mscale") and rope.get("mscale_all_dim"):
    return float(mscale(factor, rope["mscale"]) / mscale(factor, rope["mscale_all_dim"]))
  return float(mscale(factor))


def _rope_to_hf(scaling: RopeScaling | None) -> dict | None:
  """The `rope_scaling` object of `scaling` (None: plain RoPE)."""
  if scaling is None:
    return None
  out = {"rope_type": scaling.kind, "factor": scaling.factor,
         "original_max_position_embeddings": scaling.original_max_positions}
  if scaling.kind == "llama3":
    return {**out, "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor}
  return {**out, "beta_fast": scaling.beta_fast, "beta_slow": scaling.beta_slow,
          "attention_factor": scaling.attention_factor, "truncate": scaling.truncate}


def _reject_sliding_window(hf: dict, num_layers: int) -> None:
  layer_types = hf.get("layer_types")
  if layer_types is None:
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    first = hf.get("max_window_layers", 0) or 0
    layer_types = ["sliding_attention" if window is not None and i >= first else
                   "full_attention" for i in range(num_layers)]
  other = sorted(set(layer_types) - {"full_attention"})
  if other:
    raise ValueError(f"{CONFIG_FILE}: layer types {other} (sliding-window attention) are not "
                     "supported; only full attention")


def config_from_hf(hf: dict, param_dtype: str | None = None,
                   dtype: str | None = None) -> ModelConfig:
  """Our `ModelConfig` for a Hugging Face `config.json` dict; unsupported options raise.

  Args:
    hf: the parsed `config.json`.
    param_dtype: storage dtype of our params; None: the checkpoint's `dtype`/`torch_dtype`
      when it is float32/bfloat16/float16, else float32.
    dtype: compute dtype; None: the same as `param_dtype`.
  """
  arch = architecture_of(hf)
  act = _field(hf, "hidden_act", "silu")
  if act != "silu":
    raise ValueError(f"{CONFIG_FILE}: hidden_act={act!r} is not supported (only 'silu')")
  if _field(hf, "mlp_bias", False):
    raise ValueError(f"{CONFIG_FILE}: mlp_bias=true is not supported")
  num_layers = _field(hf, "num_hidden_layers", required=True)
  _reject_sliding_window(hf, num_layers)
  hidden, heads = _field(hf, "hidden_size", required=True), _field(
      hf, "num_attention_heads", required=True)
  head_dim = _field(hf, "head_dim")
  if head_dim == hidden // heads and hidden % heads == 0:
    head_dim = None  # the default; keeps configs from every family comparable
  num_experts = 0
  moe = {}
  if arch == QWEN3_MOE:
    num_experts = _field(hf, "num_experts", _field(hf, "num_local_experts", 0))
    if num_experts and _field(hf, "mlp_only_layers", []):
      raise ValueError(f"{CONFIG_FILE}: mlp_only_layers={hf['mlp_only_layers']} is not "
                       "supported (every layer must be sparse)")
    if num_experts and _field(hf, "decoder_sparse_step", 1) != 1:
      raise ValueError(f"{CONFIG_FILE}: decoder_sparse_step={hf['decoder_sparse_step']} is "
                       "not supported (must be 1)")
    if num_experts:
      moe = dict(num_experts_per_tok=_field(hf, "num_experts_per_tok", required=True),
                 expert_mlp_dim=_field(hf, "moe_intermediate_size", required=True),
                 norm_topk_prob=bool(_field(hf, "norm_topk_prob", False)))
  stored = _field(hf, "dtype", _field(hf, "torch_dtype", "float32"))
  param_dtype = param_dtype or (stored if stored in _FLOAT_DTYPES else "float32")
  theta, scaling = _rope(hf)
  attention_bias = bool(_field(hf, "attention_bias", False))
  return ModelConfig(
      vocab_size=_field(hf, "vocab_size", required=True), hidden_size=hidden,
      num_layers=num_layers, num_heads=heads,
      num_kv_heads=_field(hf, "num_key_value_heads", heads), head_dim=head_dim,
      mlp_dim=_field(hf, "intermediate_size", required=True), rope_theta=theta,
      rope_scaling=scaling,
      rms_norm_eps=float(_field(hf, "rms_norm_eps", 1e-6)),
      qkv_bias=arch == QWEN2 or attention_bias, o_bias=arch != QWEN2 and attention_bias,
      qk_norm=arch in (QWEN3, QWEN3_MOE),
      tie_embeddings=bool(_field(hf, "tie_word_embeddings", False)),
      num_experts=num_experts, param_dtype=param_dtype, dtype=dtype or param_dtype, **moe)


def default_architecture(model: ModelConfig) -> str:
  """The HF architecture that represents `model` most directly."""
  if model.is_moe:
    return QWEN3_MOE
  if model.qk_norm:
    return QWEN3
  return QWEN2 if model.qkv_bias and not model.o_bias else LLAMA


def _check_architecture(model: ModelConfig, arch: str) -> None:
  if arch not in SUPPORTED_ARCHITECTURES:
    raise ValueError(f"architecture {arch!r} is not supported; supported: "
                     f"{list(SUPPORTED_ARCHITECTURES)}")
  problems = []
  if model.is_moe and arch != QWEN3_MOE:
    problems.append("num_experts > 0 needs Qwen3MoeForCausalLM")
  if model.qk_norm != (arch in (QWEN3, QWEN3_MOE)):
    problems.append(f"qk_norm={model.qk_norm} does not match {arch}")
  if arch == QWEN2 and (not model.qkv_bias or model.o_bias):
    problems.append("Qwen2ForCausalLM has q/k/v biases and no output bias; set qkv_bias=True, "
                    "o_bias=False")
  if arch != QWEN2 and model.qkv_bias != model.o_bias:
    problems.append(f"{arch}'s attention_bias biases q/k/v and the output together; "
                    f"qkv_bias={model.qkv_bias} and o_bias={model.o_bias} differ")
  if problems:
    raise ValueError(f"ModelConfig cannot be saved as {arch}: " + "; ".join(problems))


def config_to_hf(model: ModelConfig, architecture: str | None = None) -> dict:
  """The `config.json` dict of `model` as `architecture` (default: `default_architecture`)."""
  arch = architecture or default_architecture(model)
  _check_architecture(model, arch)
  hf = {
      "architectures": [arch], "model_type": MODEL_TYPES[arch],
      "vocab_size": model.vocab_size, "hidden_size": model.hidden_size,
      "intermediate_size": model.mlp_dim, "num_hidden_layers": model.num_layers,
      "num_attention_heads": model.num_heads, "num_key_value_heads": model.num_kv_heads,
      "head_dim": model.resolved_head_dim, "hidden_act": "silu",
      "rms_norm_eps": model.rms_norm_eps, "rope_theta": model.rope_theta,
      "rope_scaling": _rope_to_hf(model.rope_scaling),
      "tie_word_embeddings": model.tie_embeddings, "torch_dtype": model.param_dtype,
      "attention_dropout": 0.0,
  }
  if arch != QWEN2:
    hf["attention_bias"] = model.qkv_bias
  if arch != LLAMA:
    hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=model.num_layers)
  if arch == QWEN3_MOE:
    hf.update(num_experts=model.num_experts, num_experts_per_tok=model.num_experts_per_tok,
              moe_intermediate_size=model.resolved_expert_mlp_dim,
              norm_topk_prob=model.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[])
  return hf
