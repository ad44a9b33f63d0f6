"""The declarative table between our parameters and Hugging Face tensors.

HF `nn.Linear` weights are `[out, in]`; ours put the input axis first and keep the head axes
apart (`q_kernel [D, H, hd]`, `o_kernel [H, hd, D]`), and stack layers (and experts) on leading
axes. One `Layout` per parameter states the mapping

    ours[layer, (expert,) ...] = transpose(reshape(hf_tensor(layer, (expert))[window], split), perm)

and is used in both directions, and for slices: reading the slice one device's shard needs
touches only the rows of the HF tensors that slice covers.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np

from pbsd_jax.models.config import ModelConfig
from pbsd_jax.models.hf import safetensors_io


@dataclasses.dataclass(frozen=True)
class Layout:
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


def layouts(model: ModelConfig, fused_experts: bool = False) -> dict[tuple[str, ...], Layout]:
  """Our parameter path -> `Layout`, for every parameter of `model`."""
  c = model
  d, v, l = c.hidden_size, c.vocab_size, c.num_layers
  h, kv, hd, m = c.num_heads, c.num_kv_heads, c.resolved_head_dim, c.mlp_dim
  layer = "model.layers.{layer}."
  out = {
      ("embedding",): Layout("model.embed_tokens.weight", (), ((v,), (d,)), (0, 1)),
      ("final_norm", "scale"): Layout("model.norm.weight", (), ((d,),), (0,)),
      ("layers", "attn_norm", "scale"): Layout(layer + "input_layernorm.weight", (l,),
                                               ((d,),), (0,)),
      ("layers", "mlp_norm", "scale"): Layout(layer + "post_attention_layernorm.weight", (l,),
                                              ((d,),), (0,)),
      ("layers", "attn", "o_kernel"): Layout(layer + "self_attn.o_proj.weight", (l,),
                                             ((d,), (h, hd)), (1, 2, 0)),
  }
  if not c.tie_embeddings:
    out[("lm_head",)] = Layout("lm_head.weight", (), ((v,), (d,)), (1, 0))
  for proj, heads in (("q", h), ("k", kv), ("v", kv)):
    out[("layers", "attn", f"{proj}_kernel")] = Layout(
        layer + f"self_attn.{proj}_proj.weight", (l,), ((heads, hd), (d,)), (2, 0, 1))
    if c.qkv_bias:
      out[("layers", "attn", f"{proj}_bias")] = Layout(
          layer + f"self_attn.{proj}_proj.bias", (l,), ((heads, hd),), (0, 1))
  if c.o_bias:
    out[("layers", "attn", "o_bias")] = Layout(layer + "self_attn.o_proj.bias", (l,), ((d,),),
                                               (0,))
  if c.qk_norm:
    for proj in ("q", "k"):
      out[("layers", "attn", f"{proj}_norm", "scale")] = Layout(
          layer + f"self_attn.{proj}_norm.weight", (l,), ((hd,),), (0,))
  if not c.is_moe:
    for proj in ("gate", "up"):
      out[("layers", "mlp", f"{proj}_kernel")] = Layout(
          layer + f"mlp.{proj}_proj.weight", (l,), ((m,), (d,)), (1, 0))
    out[("layers", "mlp", "down_kernel")] = Layout(layer + "mlp.down_proj.weight", (l,),
                                                   ((d,), (m,)), (1, 0))
    return out
  e, me = c.num_experts, c.resolved_expert_mlp_dim
  out[("layers", "moe", "router_kernel")] = Layout(layer + "mlp.gate.weight", (l,),
                                                   ((e,), (d,)), (1, 0))
  if fused_experts:  # transformers >= 5 in memory: gate and up stacked along the output axis
    for i, proj in enumerate(("gate", "up")):
      out[("layers", "moe", f"{proj}_kernel")] = Layout(
          layer + "mlp.experts.gate_up_proj", (l,), ((e,), (me,), (d,)), (0, 2, 1),
          window=(1, i * me), hf_shape=(e, 2 * me, d))
    out[("layers", "moe", "down_kernel")] = Layout(layer + "mlp.experts.down_proj", (l,),
                                                   ((e,), (d,), (me,)), (0, 2, 1))
    return out
  expert = layer + "mlp.experts.{expert}."
  for proj in ("gate", "up"):
    out[("layers", "moe", f"{proj}_kernel")] = Layout(
        expert + f"{proj}_proj.weight", (l, e), ((me,), (d,)), (1, 0))
  out[("layers", "moe", "down_kernel")] = Layout(expert + "down_proj.weight", (l, e),
                                                 ((d,), (me,)), (1, 0))
  return out
