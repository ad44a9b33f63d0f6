"""Hugging Face interop: Llama / Qwen2 / Qwen3 / Qwen3-MoE checkpoints in and out, exactly.

A Hugging Face model directory is `config.json` plus one `model.safetensors` or several
`model-0000i-of-0000N.safetensors` shards listed in `model.safetensors.index.json`. `load` turns
it into our `ModelConfig` and params; `save` writes one that
`transformers.AutoModelForCausalLM.from_pretrained` loads. Both directions are pure re-layouts
(reshape + transpose), so a round trip is bit-exact.

Layouts. HF `nn.Linear` weights are `[out, in]`; ours put the input axis first and keep the head
axes apart (`q_kernel [D, H, hd]`, `o_kernel [H, hd, D]`), and stack layers (and experts) on
leading axes. One `_Layout` per parameter states the mapping

    ours[layer, (expert,) ...] = transpose(reshape(hf_tensor(layer, (expert))[window], split), perm)

and is used in both directions, and for slices: with a sharding, each device reads only the
rows of the memory-mapped safetensors files that its shard needs.

The files themselves are read and written through the `safetensors` library by `safetensors_io`,
so `load`/`save` need neither torch nor transformers. Chat templates live in `chat_template`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from pbsd_jax.models import safetensors_io
from pbsd_jax.models.config import ModelConfig
from pbsd_jax.models.transformer import Transformer, param_axes

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


def _rope_theta(hf: dict) -> float:
  """RoPE base from either the v4 (`rope_theta` + `rope_scaling`) or v5 (`rope_parameters`)."""
  for key in ("rope_scaling", "rope_parameters"):
    rope = hf.get(key)
    if rope is None:
      continue
    if not isinstance(rope, dict):
      raise ValueError(f"{CONFIG_FILE}: '{key}' must be an object, got {rope!r}")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
      raise ValueError(f"{CONFIG_FILE}: {key}.rope_type={kind!r} is not supported (only plain "
                       "RoPE; scaled variants would change the logits)")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
      raise ValueError(f"{CONFIG_FILE}: {key}.partial_rotary_factor must be 1.0")
  if hf.get("partial_rotary_factor", 1.0) != 1.0:
    raise ValueError(f"{CONFIG_FILE}: partial_rotary_factor must be 1.0")
  params = hf.get("rope_parameters") or {}
  return float(params.get("rope_theta", _field(hf, "rope_theta", 10_000.0)))


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
  return ModelConfig(
      vocab_size=_field(hf, "vocab_size", required=True), hidden_size=hidden,
      num_layers=num_layers, num_heads=heads,
      num_kv_heads=_field(hf, "num_key_value_heads", heads), head_dim=head_dim,
      mlp_dim=_field(hf, "intermediate_size", required=True), rope_theta=_rope_theta(hf),
      rms_norm_eps=float(_field(hf, "rms_norm_eps", 1e-6)),
      qkv_bias=arch == QWEN2 or bool(_field(hf, "attention_bias", False)),
      qk_norm=arch in (QWEN3, QWEN3_MOE),
      tie_embeddings=bool(_field(hf, "tie_word_embeddings", False)),
      num_experts=num_experts, param_dtype=param_dtype, dtype=dtype or param_dtype, **moe)


def default_architecture(config: ModelConfig) -> str:
  """The HF architecture that represents `config` most directly."""
  if config.is_moe:
    return QWEN3_MOE
  if config.qk_norm:
    return QWEN3
  return QWEN2 if config.qkv_bias else LLAMA


def _check_architecture(config: ModelConfig, arch: str) -> None:
  if arch not in SUPPORTED_ARCHITECTURES:
    raise ValueError(f"architecture {arch!r} is not supported; supported: "
                     f"{list(SUPPORTED_ARCHITECTURES)}")
  problems = []
  if config.is_moe and arch != QWEN3_MOE:
    problems.append("num_experts > 0 needs Qwen3MoeForCausalLM")
  if config.qk_norm != (arch in (QWEN3, QWEN3_MOE)):
    problems.append(f"qk_norm={config.qk_norm} does not match {arch}")
  if arch == QWEN2 and not config.qkv_bias:
    problems.append("Qwen2ForCausalLM always has q/k/v biases; set qkv_bias=True")
  if problems:
    raise ValueError(f"ModelConfig cannot be saved as {arch}: " + "; ".join(problems))


def config_to_hf(config: ModelConfig, architecture: str | None = None) -> dict:
  """The `config.json` dict of `config` as `architecture` (default: `default_architecture`)."""
  arch = architecture or default_architecture(config)
  _check_architecture(config, arch)
  hf = {
      "architectures": [arch], "model_type": MODEL_TYPES[arch],
      "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
      "intermediate_size": config.mlp_dim, "num_hidden_layers": config.num_layers,
      "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
      "head_dim": config.resolved_head_dim, "hidden_act": "silu",
      "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
      "rope_scaling": None, "tie_word_embeddings": config.tie_embeddings,
      "torch_dtype": config.param_dtype, "attention_dropout": 0.0,
  }
  if arch != QWEN2:
    hf["attention_bias"] = config.qkv_bias
  if arch != LLAMA:
    hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=config.num_layers)
  if arch == QWEN3_MOE:
    hf.update(num_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
              moe_intermediate_size=config.resolved_expert_mlp_dim,
              norm_topk_prob=config.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[])
  return hf


@dataclasses.dataclass(frozen=True)
class _Layout:
  """How one of our parameters is cut from Hugging Face tensors.

  Attributes:
    name: HF tensor name, with `{layer}` / `{expert}` fields for stacked parameters.
    stack: sizes of our leading axes that index separate HF tensors: (), (L,) or (L, E).
    split: per HF tensor axis, the sizes that axis is reshaped into (e.g. `[H*hd, D]` ->
      `((H, hd), (D,))`).
    perm: our block axes as a permutation of the flattened split axes.
    window: `(hf_axis, start)` when the HF tensor fuses several parameters along `hf_axis`
      (Qwen3-MoE `gate_up_proj`); the parameter is `split[hf_axis]` wide from `start`.
    hf_shape: the full HF tensor shape (differs from the split sizes only with a window).
  """

  name: str
  stack: tuple[int, ...]
  split: tuple[tuple[int, ...], ...]
  perm: tuple[int, ...]
  window: tuple[int, int] | None = None
  hf_shape: tuple[int, ...] | None = None

  @property
  def expected_hf_shape(self) -> tuple[int, ...]:
    return self.hf_shape or tuple(math.prod(sizes) for sizes in self.split)

  @property
  def block_shape(self) -> tuple[int, ...]:
    flat = [s for sizes in self.split for s in sizes]
    return tuple(flat[p] for p in self.perm)

  @property
  def shape(self) -> tuple[int, ...]:
    return self.stack + self.block_shape

  def hf_name(self, index: tuple[int, ...]) -> str:
    return self.name.format(**dict(zip(("layer", "expert"), index)))

  def read(self, checkpoint: safetensors_io.SafetensorsCheckpoint,
           index: tuple[slice, ...] | None = None) -> np.ndarray:
    """Our parameter, or the slice `index` of it, read from `checkpoint`."""
    index = tuple(index or ()) + (slice(None),) * (len(self.shape) - len(index or ()))
    ranges = [range(*s.indices(n)) for s, n in zip(index, self.shape)]
    if any(r.step != 1 for r in ranges):
      raise ValueError(f"{self.name}: strided reads are not supported")
    stack_ranges, block_ranges = ranges[:len(self.stack)], ranges[len(self.stack):]
    flat_ranges = [None] * len(block_ranges)
    for our_axis, flat_axis in enumerate(self.perm):
      flat_ranges[flat_axis] = block_ranges[our_axis]
    blocks = [self._read_block(checkpoint.tensor(self.hf_name(ids), self.expected_hf_shape),
                               flat_ranges)
              for ids in itertools.product(*stack_ranges)]
    return np.stack(blocks).reshape(tuple(len(r) for r in ranges))

  def _read_block(self, tensor: safetensors_io.LazyTensor,
                  flat_ranges: list[range]) -> np.ndarray:
    # Each HF axis is read as one contiguous run covering its outer split range; the inner
    # split axes are then cut after the reshape.
    hf_index, inner_cuts, grouped = [], [], []
    axis = 0
    for hf_axis, sizes in enumerate(self.split):
      group = flat_ranges[axis:axis + len(sizes)]
      inner = math.prod(sizes[1:])
      start = self.window[1] if self.window and self.window[0] == hf_axis else 0
      hf_index.append(slice(start + group[0].start * inner, start + group[0].stop * inner))
      grouped.append((len(group[0]),) + sizes[1:])
      inner_cuts.extend([slice(None)] + [slice(r.start, r.stop) for r in group[1:]])
      axis += len(sizes)
    block = np.asarray(tensor[tuple(hf_index)])
    block = block.reshape([s for sizes in grouped for s in sizes])[tuple(inner_cuts)]
    return block.transpose(self.perm)

  def to_hf(self, block: np.ndarray) -> np.ndarray:
    """The HF tensor of one stacked entry `block` (our layout); the inverse of `read`."""
    if self.window:
      raise ValueError(f"{self.name}: fused tensors are read-only")
    return np.asarray(block).transpose(np.argsort(self.perm)).reshape(self.expected_hf_shape)


def _layouts(config: ModelConfig, fused_experts: bool = False) -> dict[tuple[str, ...], _Layout]:
  """Our parameter path -> `_Layout`, for every parameter of `config`."""
  c = config
  d, v, l = c.hidden_size, c.vocab_size, c.num_layers
  h, kv, hd, m = c.num_heads, c.num_kv_heads, c.resolved_head_dim, c.mlp_dim
  layer = "model.layers.{layer}."
  out = {
      ("embedding",): _Layout("model.embed_tokens.weight", (), ((v,), (d,)), (0, 1)),
      ("final_norm", "scale"): _Layout("model.norm.weight", (), ((d,),), (0,)),
      ("layers", "attn_norm", "scale"): _Layout(layer + "input_layernorm.weight", (l,),
                                                ((d,),), (0,)),
      ("layers", "mlp_norm", "scale"): _Layout(layer + "post_attention_layernorm.weight", (l,),
                                               ((d,),), (0,)),
      ("layers", "attn", "o_kernel"): _Layout(layer + "self_attn.o_proj.weight", (l,),
                                              ((d,), (h, hd)), (1, 2, 0)),
  }
  if not c.tie_embeddings:
    out[("lm_head",)] = _Layout("lm_head.weight", (), ((v,), (d,)), (1, 0))
  for proj, heads in (("q", h), ("k", kv), ("v", kv)):
    out[("layers", "attn", f"{proj}_kernel")] = _Layout(
        layer + f"self_attn.{proj}_proj.weight", (l,), ((heads, hd), (d,)), (2, 0, 1))
    if c.qkv_bias:
      out[("layers", "attn", f"{proj}_bias")] = _Layout(
          layer + f"self_attn.{proj}_proj.bias", (l,), ((heads, hd),), (0, 1))
  if c.qk_norm:
    for proj in ("q", "k"):
      out[("layers", "attn", f"{proj}_norm", "scale")] = _Layout(
          layer + f"self_attn.{proj}_norm.weight", (l,), ((hd,),), (0,))
  if not c.is_moe:
    for proj in ("gate", "up"):
      out[("layers", "mlp", f"{proj}_kernel")] = _Layout(
          layer + f"mlp.{proj}_proj.weight", (l,), ((m,), (d,)), (1, 0))
    out[("layers", "mlp", "down_kernel")] = _Layout(layer + "mlp.down_proj.weight", (l,),
                                                    ((d,), (m,)), (1, 0))
    return out
  e, me = c.num_experts, c.resolved_expert_mlp_dim
  out[("layers", "moe", "router_kernel")] = _Layout(layer + "mlp.gate.weight", (l,),
                                                    ((e,), (d,)), (1, 0))
  if fused_experts:  # transformers >= 5 in memory: gate and up stacked along the output axis
    for i, proj in enumerate(("gate", "up")):
      out[("layers", "moe", f"{proj}_kernel")] = _Layout(
          layer + "mlp.experts.gate_up_proj", (l,), ((e,), (me,), (d,)), (0, 2, 1),
          window=(1, i * me), hf_shape=(e, 2 * me, d))
    out[("layers", "moe", "down_kernel")] = _Layout(layer + "mlp.experts.down_proj", (l,),
                                                    ((e,), (d,), (me,)), (0, 2, 1))
    return out
  expert = layer + "mlp.experts.{expert}."
  for proj in ("gate", "up"):
    out[("layers", "moe", f"{proj}_kernel")] = _Layout(
        expert + f"{proj}_proj.weight", (l, e), ((me,), (d,)), (1, 0))
  out[("layers", "moe", "down_kernel")] = _Layout(expert + "down_proj.weight", (l, e),
                                                  ((d,), (me,)), (1, 0))
  return out


def _output_bias_names(config: ModelConfig, arch: str) -> list[str]:
  """Llama/Qwen3 `attention_bias` also adds an o_proj bias, which our model does not have."""
  if arch == QWEN2 or not config.qkv_bias:
    return []
  return [f"model.layers.{i}.self_attn.o_proj.bias" for i in range(config.num_layers)]


def _set_path(tree: dict, path: tuple[str, ...], value: Any) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _get_path(tree: Any, path: tuple[str, ...]) -> Any:
  for key in path:
    tree = tree[key]
  return tree


ShardingsLike = Any  # None | pytree of jax.sharding.Sharding | Callable[[PartitionSpec], Sharding]


def _resolve_shardings(config: ModelConfig, mesh: jax.sharding.Mesh | None,
                       shardings: ShardingsLike) -> Any:
  """A pytree (matching params) of `Sharding`, or None for plain single-device arrays."""
  if shardings is None and mesh is not None:
    shardings = NamedSharding(mesh, PartitionSpec())  # replicated
  if shardings is None:
    return None
  if isinstance(shardings, jax.sharding.Sharding):
    single = shardings
    shardings = lambda _: single
  if callable(shardings):
    return jax.tree_util.tree_map(shardings, param_axes(config),
                                  is_leaf=lambda x: isinstance(x, PartitionSpec))
  return shardings


def load(path: str, *, mesh: jax.sharding.Mesh | None = None, shardings: ShardingsLike = None,
         param_dtype: str | None = None, dtype: str | None = None) -> tuple[ModelConfig, Any]:
  """Reads a Hugging Face model directory into our config and params.

  Args:
    path: directory with `config.json` and `model.safetensors` or sharded safetensors plus
      `model.safetensors.index.json`.
    mesh: with no `shardings`, params are replicated over this mesh.
    shardings: where each parameter goes: one `jax.sharding.Sharding` for all, a pytree of
      them matching the params, or a function from a parameter's logical `PartitionSpec` (as in
      `param_axes(config)`, e.g. `P('layers', 'embed', 'heads', 'head_dim')`) to a `Sharding`.
      Each device then reads only its own slice of the files (`jax.make_array_from_callback`),
      so a large model never sits whole in one host's memory.
    param_dtype / dtype: see `config_from_hf`.

  Returns:
    `(config, params)`: params in our layout (see `transformer.py`), in `config.param_dtype`.
  """
  with open(os.path.join(path, CONFIG_FILE)) as f:
    hf = json.load(f)
  arch = architecture_of(hf)
  config = config_from_hf(hf, param_dtype, dtype)
  checkpoint = safetensors_io.SafetensorsCheckpoint(path)
  for name in _output_bias_names(config, arch):
    if np.any(checkpoint.tensor(name, (config.hidden_size,))[:]):
      raise ValueError(f"tensor {name} is nonzero: an output-projection bias is not "
                       "representable in ModelConfig")
  fused = "model.layers.0.mlp.experts.gate_up_proj" in checkpoint
  target = jnp.dtype(config.jnp_param_dtype)
  placement = _resolve_shardings(config, mesh, shardings)
  params: dict = {}
  for path_keys, layout in _layouts(config, fused).items():
    if placement is None:
      array = jnp.asarray(layout.read(checkpoint).astype(target))
    else:
      try:
        sharding = _get_path(placement, path_keys)
      except (KeyError, TypeError):
        raise ValueError(f"shardings has no entry for {'/'.join(path_keys)}") from None
      array = jax.make_array_from_callback(
          layout.shape, sharding,
          lambda index, layout=layout: layout.read(checkpoint, index).astype(target))
    _set_path(params, path_keys, array)
  return config, params


def _to_host(array: Any) -> np.ndarray:
  if isinstance(array, jax.Array) and not array.is_fully_addressable:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    array = multihost_utils.process_allgather(array, tiled=True)
  return np.asarray(array)


def _hf_entries(config: ModelConfig, arch: str) -> list[tuple[str, tuple, tuple, Any]]:
  """(hf_name, shape, stack index, layout or None for a zero o_proj bias), in file order."""
  entries = []
  for path_keys, layout in _layouts(config).items():
    for ids in itertools.product(*(range(n) for n in layout.stack)):
      entries.append((layout.hf_name(ids), layout.expected_hf_shape, ids, path_keys))
  for name in _output_bias_names(config, arch):
    entries.append((name, (config.hidden_size,), (), None))
  return sorted(entries, key=lambda entry: entry[0])


def save(config: ModelConfig, params: Any, path: str, *, architecture: str | None = None,
         max_shard_size: int | str = "5GB", extra_config: dict | None = None) -> None:
  """Writes a Hugging Face model directory that `AutoModelForCausalLM.from_pretrained` loads.

  Args:
    config: the model config.
    params: params in our layout (numpy or jax arrays, possibly sharded; multi-host arrays are
      gathered one tensor at a time and written by process 0).
    path: output directory (created).
    architecture: HF class to write as; default `default_architecture(config)`.
    max_shard_size: bytes per safetensors shard (int or '5GB'); several shards come with a
      `model.safetensors.index.json`.
    extra_config: extra `config.json` fields (e.g. `eos_token_id`, `max_position_embeddings`).
  """
  arch = architecture or default_architecture(config)
  hf = {**config_to_hf(config, arch), **(extra_config or {})}
  layouts = _layouts(config)
  for path_keys, layout in layouts.items():
    try:
      leaf = _get_path(params, path_keys)
    except (KeyError, TypeError):
      raise ValueError(f"params are missing {'/'.join(path_keys)} (expected shape "
                       f"{layout.shape})") from None
    if tuple(leaf.shape) != layout.shape:
      raise ValueError(f"params {'/'.join(path_keys)} has shape {tuple(leaf.shape)}, "
                       f"expected {layout.shape}")
  dtype = np.dtype(config.jnp_param_dtype)
  entries = _hf_entries(config, arch)
  shards = [[entries[i] for i in shard] for shard in safetensors_io.plan_shards(
      [math.prod(shape) * dtype.itemsize for _, shape, _, _ in entries], max_shard_size)]
  writer = jax.process_index() == 0
  if writer:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
      json.dump(hf, f, indent=2)
  weight_map, total = {}, 0
  for file_name, shard in zip(safetensors_io.shard_file_names(len(shards)), shards):
    tensors = {}
    for hf_name, shape, ids, path_keys in shard:
      if path_keys is None:
        tensors[hf_name] = np.zeros(shape, dtype)
      else:
        leaf = _get_path(params, path_keys)
        block = _to_host(leaf[ids] if ids else leaf)
        tensors[hf_name] = layouts[path_keys].to_hf(block).astype(dtype)
      weight_map[hf_name] = file_name
      total += tensors[hf_name].nbytes
    if writer:
      safetensors_io.write_file(os.path.join(path, file_name), tensors)
  if writer and len(shards) > 1:
    safetensors_io.write_index(path, weight_map, total)


@functools.partial(jax.jit, static_argnames=("config",))
def _forward(config: ModelConfig, params: Any, tokens: jax.Array, mask: jax.Array) -> jax.Array:
  return Transformer(config).apply({"params": params}, tokens, mask).logits


def forward_logits(config: ModelConfig, params: Any, tokens: jax.Array,
                   mask: jax.Array | None = None) -> jax.Array:
  """Full-vocabulary logits `f32[B, T, V]` of `tokens: i32[B, T]` (mask `bool[B, T]`).

  Position `t` holds the logits of the token after `tokens[:, t]`; left padding (mask False)
  never shifts positions, so a left-padded row equals the unpadded one on its real tokens.
  """
  tokens = jnp.asarray(tokens, jnp.int32)
  mask = jnp.ones(tokens.shape, bool) if mask is None else jnp.asarray(mask, bool)
  return _forward(config, params, tokens, mask)
