"""Hugging Face model directories in and out: Llama / Qwen2 / Qwen3 / Qwen3-MoE, exactly.

A Hugging Face model directory is `config.json` plus its safetensors weights (one file or
several shards; `safetensors_io`). `load` turns it into our `ModelConfig` and params; `save`
writes one that `transformers.AutoModelForCausalLM.from_pretrained` loads. The config is
translated by `hf_config`, and each tensor is re-laid out (reshape + transpose) by the table in
`hf_layout`, so a round trip is bit-exact. Neither direction needs torch or transformers.

Placed on a mesh, each parameter takes its sharding from `pbsd_jax.parallel.sharding`, and each device
reads only the slice of the memory-mapped files that its shard needs. Chat templates live in
`chat_template`.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pbsd_jax.models.config import ModelConfig
from pbsd_jax.models.hf import config as hf_config, layout as hf_layout, safetensors_io
from pbsd_jax.models.transformer import param_shapes, param_shardings
from pbsd_jax.parallel import sharding


def _set_path(tree: dict, path: tuple[str, ...], value: Any) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _get_path(tree: Any, path: tuple[str, ...]) -> Any:
  for key in path:
    tree = tree[key]
  return tree


def _placement(model: ModelConfig, mesh: jax.sharding.Mesh | None, rules: Any,
               shardings: Any) -> Any:
  """A pytree (matching params) of `Sharding`, or None for plain single-device arrays."""
  if rules is not None and mesh is None:
    raise ValueError("rules need a mesh to shard over")
  if shardings is not None or mesh is None:
    return shardings
  if rules is None:
    return jax.tree.map(lambda _: sharding.replicated(mesh), param_shapes(model))
  return param_shardings(model, mesh, rules)


def load(path: str, *, mesh: jax.sharding.Mesh | None = None, rules: Any = None,
         shardings: Any = None, param_dtype: str | None = None,
         dtype: str | None = None) -> tuple[ModelConfig, Any]:
  """Reads a Hugging Face model directory into our model config and params.

  Args:
    path: directory with `config.json` and `model.safetensors` or sharded safetensors plus
      `model.safetensors.index.json`.
    mesh: the device mesh; with no `rules`, every parameter is replicated over it.
    rules: a logical-axis table (`sharding.RULES` or one of its form): each parameter is
      sharded over `mesh` as `param_shardings(model, mesh, rules)` says.
    shardings: instead of `mesh`, a pytree of `jax.sharding.Sharding` matching the params.
      Placed on devices by any of these, each device reads only its own slice of the files
      (`jax.make_array_from_callback`), so a large model never sits whole in one host's memory.
    param_dtype / dtype: see `hf_config.config_from_hf`.

  Returns:
    `(model, params)`: params in our layout (see `transformer.py`), in `model.param_dtype`.
  """
  with open(os.path.join(path, hf_config.CONFIG_FILE)) as f:
    hf = json.load(f)
  model = hf_config.config_from_hf(hf, param_dtype, dtype)
  checkpoint = safetensors_io.SafetensorsCheckpoint(path)
  fused = "model.layers.0.mlp.experts.gate_up_proj" in checkpoint
  target = jnp.dtype(model.jnp_param_dtype)
  placement = _placement(model, mesh, rules, shardings)
  params: dict = {}
  for path_keys, layout in hf_layout.layouts(model, fused).items():
    if placement is None:
      array = jnp.asarray(layout.read(checkpoint).astype(target))
    else:
      try:
        where = _get_path(placement, path_keys)
      except (KeyError, TypeError):
        raise ValueError(f"shardings has no entry for {'/'.join(path_keys)}") from None
      array = jax.make_array_from_callback(
          layout.shape, where,
          lambda index, layout=layout: layout.read(checkpoint, index).astype(target))
    _set_path(params, path_keys, array)
  return model, params


def _to_host(array: Any) -> np.ndarray:
  if isinstance(array, jax.Array) and not array.is_fully_addressable:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    array = multihost_utils.process_allgather(array, tiled=True)
  return np.asarray(array)


def _hf_entries(model: ModelConfig) -> list[tuple[str, tuple, tuple, Any]]:
  """(hf_name, shape, stack index, our parameter path), in file order."""
  entries = []
  for path_keys, layout in hf_layout.layouts(model).items():
    for ids in itertools.product(*(range(n) for n in layout.stack)):
      entries.append((layout.hf_name(ids), layout.expected_hf_shape, ids, path_keys))
  return sorted(entries, key=lambda entry: entry[0])


def save(model: ModelConfig, params: Any, path: str, *, architecture: str | None = None,
         max_shard_size: int | str = "5GB", extra_config: dict | None = None) -> None:
  """Writes a Hugging Face model directory that `AutoModelForCausalLM.from_pretrained` loads.

  Args:
    model: the model config.
    params: params in our layout (numpy or jax arrays, possibly sharded; multi-host arrays are
      gathered one tensor at a time and written by process 0).
    path: output directory (created).
    architecture: HF class to write as; default `hf_config.default_architecture(config)`.
    max_shard_size: bytes per safetensors shard (int or '5GB'); several shards come with a
      `model.safetensors.index.json`.
    extra_config: extra `config.json` fields (e.g. `eos_token_id`, `max_position_embeddings`).
  """
  arch = architecture or hf_config.default_architecture(model)
  hf = {**hf_config.config_to_hf(model, arch), **(extra_config or {})}
  layouts = hf_layout.layouts(model)
  for path_keys, layout in layouts.items():
    try:
      leaf = _get_path(params, path_keys)
    except (KeyError, TypeError):
      raise ValueError(f"params are missing {'/'.join(path_keys)} (expected shape "
                       f"{layout.shape})") from None
    if tuple(leaf.shape) != layout.shape:
      raise ValueError(f"params {'/'.join(path_keys)} has shape {tuple(leaf.shape)}, "
                       f"expected {layout.shape}")
  dtype = np.dtype(model.jnp_param_dtype)
  entries = _hf_entries(model)
  shards = [[entries[i] for i in shard] for shard in safetensors_io.plan_shards(
      [math.prod(shape) * dtype.itemsize for _, shape, _, _ in entries], max_shard_size)]
  writer = jax.process_index() == 0
  if writer:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, hf_config.CONFIG_FILE), "w") as f:
      json.dump(hf, f, indent=2)
  weight_map, total = {}, 0
  for file_name, shard in zip(safetensors_io.shard_file_names(len(shards)), shards):
    tensors = {}
    for hf_name, shape, ids, path_keys in shard:
      leaf = _get_path(params, path_keys)
      block = _to_host(leaf[ids] if ids else leaf)
      tensors[hf_name] = layouts[path_keys].to_hf(block).astype(dtype)
      weight_map[hf_name] = file_name
      total += tensors[hf_name].nbytes
    if writer:
      safetensors_io.write_file(os.path.join(path, file_name), tensors)
  if writer and len(shards) > 1:
    safetensors_io.write_index(path, weight_map, total)

