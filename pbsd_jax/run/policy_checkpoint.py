"""Reading a policy's parameters (and model config) from a checkpoint, for evaluation.

Two layouts are read:
  * a `checkpoint.Checkpointer` directory (the train loop's `<workdir>/ckpt_sft` or
    `<workdir>/ckpt_rl`): finished steps are integer-named subdirectories, each holding the
    `TrainState` under `state/`; only its `params` are read, so neither the optimiser nor its
    state structure needs to be known;
  * a `scripts/convert_hf.py` directory: `{"params": params}` under `params/`.

The model config is `model_config.json` in the directory or its parent (the workdir), when
there is one. Nothing here writes, so a checkpoint can be read while a run is saving into it
(orbax writes a step under a temporary name and renames it when complete).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from pbsd_jax.data import storage
from pbsd_jax.models import ModelConfig

MODEL_CONFIG_FILE = "model_config.json"
PARAMS_DIR = "params"  # convert_hf.py's layout
STATE_ITEM = "state"  # checkpoint.Checkpointer's item holding the TrainState


# Where a model directory keeps its tokenizer: `scripts/convert_hf.py` copies the HF files to
# `hf_assets/`, a train run copies them to `<workdir>/tokenizer/` (beside its `ckpt_*`).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
# What a run copies with them: special tokens, the chat template, the EOS ids.
TOKENIZER_CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json",
                          "chat_template.jinja", "generation_config.json")
_TOKENIZER_DIRS = ("hf_assets", ".", "../tokenizer")


def tokenizer_dir(model_dir: str) -> str | None:
  """The directory holding a model directory's tokenizer, or None when it has none."""
  for sub in _TOKENIZER_DIRS:
    candidate = os.path.normpath(os.path.join(model_dir, sub))
    if any(os.path.isfile(os.path.join(candidate, f)) for f in TOKENIZER_FILES):
      return candidate
  return None


def finished_steps(directory: str) -> list[int]:
  """Ascending steps of a `Checkpointer` directory (integer-named subdirectories)."""
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"checkpoint directory {directory} does not exist")
  return sorted(int(name) for name in os.listdir(directory)
                if name.isdigit() and os.path.isdir(os.path.join(directory, name, STATE_ITEM)))


def params_path(directory: str, step: int | None = None) -> tuple[str, int | None]:
  """The orbax pytree directory holding the params, and its step (None for convert_hf's).

  Raises:
    FileNotFoundError: naming the directory, when it holds neither layout (or not `step`).
  """
  directory = os.path.abspath(directory)
  if step is None and os.path.isdir(os.path.join(directory, PARAMS_DIR)):
    return os.path.join(directory, PARAMS_DIR), None
  steps = finished_steps(directory)
  if not steps:
    raise FileNotFoundError(f"{directory} holds no finished checkpoint step (<step>/{STATE_ITEM})"
                            f" and no {PARAMS_DIR}/ directory")
  if step is None:
    step = steps[-1]
  if step not in steps:
    raise FileNotFoundError(f"{directory} has no finished step {step}; steps: {steps}")
  return os.path.join(directory, str(step), STATE_ITEM), step


def restore_params(directory: str, step: int | None = None, sharding: Any = None,
                   dtype: Any = None) -> tuple[Any, int | None]:
  """The params of a checkpoint (either layout), and the step they come from.

  Args:
    directory: a `Checkpointer` directory or a `convert_hf.py` output directory.
    step: which `Checkpointer` step (default: the latest finished one).
    sharding: where the parameters go: one `Sharding` for all, or a tree of them like the
      params (e.g. `param_shardings` of a mesh: each array is read straight into
      its shards); default: the first local device.
    dtype: the dtype every parameter is read into (cast while reading); default: as stored.

  Returns:
    `(params, step)`; step is None for a `convert_hf.py` directory.
  """
  path, step = params_path(directory, step)
  sharding = sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  # The handler reads the item's tree metadata alone (the step-level metadata file of a
  # `Checkpointer` step lives one directory up).
  metadata = ocp.PyTreeCheckpointHandler().metadata(epath.Path(path))
  tree = getattr(metadata, "tree", metadata)
  if "params" not in tree:
    raise ValueError(f"{path} holds no 'params' (items: {sorted(tree)})")
  if isinstance(sharding, jax.sharding.Sharding):
    sharding = jax.tree.map(lambda _: sharding, tree["params"])
  target = {"params": jax.tree.map(
      lambda m, s: jax.ShapeDtypeStruct(m.shape, dtype or m.dtype, sharding=s), tree["params"],
      sharding)}
  restored = ocp.PyTreeCheckpointer().restore(path, args=ocp.args.PyTreeRestore(
      item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
      partial_restore=True))
  return restored["params"], step


def save_params(directory: str, model: ModelConfig, params: Any) -> None:
  """Writes the `convert_hf.py` layout: `{"params": params}` with orbax under
  `directory/params`, plus `model_config.json` (what `restore_params` and
  `config.model.init_dir` read)."""
  directory = os.path.abspath(directory)
  os.makedirs(directory, exist_ok=True)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(os.path.join(directory, PARAMS_DIR), {"params": params})
  checkpointer.wait_until_finished()
  save_model_config(directory, model)


def save_model_config(directory: str, model: ModelConfig) -> str:
  """Writes `model` as `directory/model_config.json`; returns the path."""
  path = os.path.join(directory, MODEL_CONFIG_FILE)
  with storage.replaced(path) as f:
    json.dump(dataclasses.asdict(model), f, indent=2)
  return path


def load_model_config(path: str) -> ModelConfig:
  """The `ModelConfig` in a `model_config.json` file.

  Raises:
    ValueError: naming the file, for fields `ModelConfig` does not have.
  """
  with open(path) as f:
    fields = json.load(f)
  unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(ModelConfig)})
  if unknown:
    raise ValueError(f"{path}: unknown ModelConfig fields {unknown}")
  return ModelConfig(**fields)


def find_model_config(directory: str) -> ModelConfig | None:
  """`model_config.json` of `directory` or its parent as a `ModelConfig`; None if neither has one.

  Raises:
    ValueError: naming the file, for fields `ModelConfig` does not have.
  """
  directory = os.path.abspath(directory)
  for folder in (directory, os.path.dirname(directory)):
    path = os.path.join(folder, MODEL_CONFIG_FILE)
    if os.path.exists(path):
      return load_model_config(path)
  return None
