r"""Converts Hugging Face checkpoints to our orbax checkpoints and back.

Import (HF -> orbax):

  python scripts/convert_hf.py --hf_dir /models/Qwen3-0.6B --out /ckpt/qwen3

writes `/ckpt/qwen3/params` (orbax `StandardCheckpointer`, state `{"params": params}`),
`/ckpt/qwen3/model_config.json` (our `ModelConfig`) and `/ckpt/qwen3/hf_assets/` (the
tokenizer files and the original `config.json`, so an export can restore them).

Export (orbax -> HF):

  python scripts/convert_hf.py --direction=export --ckpt_dir /ckpt/qwen3 --out /models/out

writes a directory that `transformers.AutoModelForCausalLM.from_pretrained` loads.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

from absl import app, flags
import jax
import orbax.checkpoint as ocp

from pbsd_jax.models import hf
from pbsd_jax.models.config import ModelConfig
from pbsd_jax.models.hf import config as hf_config, safetensors_io
from pbsd_jax.models.transformer import param_shapes
from pbsd_jax.run import cli, policy_checkpoint

MODEL_CONFIG_FILE = policy_checkpoint.MODEL_CONFIG_FILE
PARAMS_DIR = policy_checkpoint.PARAMS_DIR
ASSETS_DIR = "hf_assets"
# Fields of the original config.json that an export carries over (token ids, context length).
_CARRIED_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings")
_WEIGHT_FILES = (safetensors_io.SINGLE_FILE, safetensors_io.INDEX_FILE)


save_params_checkpoint = policy_checkpoint.save_params


def load_model_config(directory: str) -> ModelConfig:
  """The `ModelConfig` stored in `directory/model_config.json`; unknown fields are an error."""
  return policy_checkpoint.load_model_config(os.path.join(directory, MODEL_CONFIG_FILE))


def restore_params_checkpoint(directory: str, shardings: Any = None) -> tuple[ModelConfig, Any]:
  """Reads what `save_params_checkpoint` wrote: `(model config, params)`.

  Args:
    directory: the checkpoint directory.
    shardings: optional pytree of `jax.sharding.Sharding` matching the params; default: the
      first local device.
  """
  directory = os.path.abspath(directory)
  model = load_model_config(directory)
  shapes = param_shapes(model)
  if shardings is None:
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    shardings = jax.tree_util.tree_map(lambda _: device, shapes)
  target = jax.tree_util.tree_map(
      lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
      shapes, shardings)
  restored = ocp.StandardCheckpointer().restore(os.path.join(directory, PARAMS_DIR),
                                                {"params": target})
  return model, restored["params"]


def convert_import(hf_dir: str, out: str, param_dtype: str | None = None) -> ModelConfig:
  """HF directory -> orbax checkpoint directory (params, model config, HF assets)."""
  model, params = hf.load(hf_dir, param_dtype=param_dtype)
  save_params_checkpoint(out, model, params)
  assets = os.path.join(out, ASSETS_DIR)
  os.makedirs(assets, exist_ok=True)
  for name in sorted(os.listdir(hf_dir)):
    source = os.path.join(hf_dir, name)
    if os.path.isfile(source) and name not in _WEIGHT_FILES and not name.endswith(
        ".safetensors"):
      shutil.copy2(source, os.path.join(assets, name))
  return model


def convert_export(ckpt_dir: str, out: str, architecture: str | None = None,
                   max_shard_size: str = "5GB") -> ModelConfig:
  """Orbax checkpoint directory -> HF directory (with the assets saved at import, if any)."""
  model, params = restore_params_checkpoint(ckpt_dir)
  assets = os.path.join(ckpt_dir, ASSETS_DIR)
  extra, original_arch = {}, None
  if os.path.exists(os.path.join(assets, hf_config.CONFIG_FILE)):
    with open(os.path.join(assets, hf_config.CONFIG_FILE)) as f:
      original = json.load(f)
    extra = {key: original[key] for key in _CARRIED_FIELDS if key in original}
    original_arch = (original.get("architectures") or [None])[0]
  if architecture is None and original_arch in hf_config.SUPPORTED_ARCHITECTURES:
    try:
      hf_config.config_to_hf(model, original_arch)
      architecture = original_arch
    except ValueError:
      architecture = None  # the model changed shape since import; use the default class
  hf.save(model, params, out, architecture=architecture, max_shard_size=max_shard_size,
          extra_config=extra)
  if os.path.isdir(assets):
    for name in sorted(os.listdir(assets)):
      if name != hf_config.CONFIG_FILE:
        shutil.copy2(os.path.join(assets, name), os.path.join(out, name))
  return model


_DIRECTION = flags.DEFINE_enum("direction", "import", ["import", "export"],
                               "import: HF -> orbax; export: orbax -> HF.")
_HF_DIR = flags.DEFINE_string("hf_dir", None, "Hugging Face model directory to import.")
_CKPT_DIR = flags.DEFINE_string("ckpt_dir", None, "Checkpoint directory to export.")
_OUT = flags.DEFINE_string("out", None, "Output directory.", required=True)
_ARCHITECTURE = flags.DEFINE_enum("architecture", None, list(hf_config.SUPPORTED_ARCHITECTURES),
                                  "Export as this HF class (default: as imported, else "
                                  "inferred from the config).")
_MAX_SHARD_SIZE = flags.DEFINE_string("max_shard_size", "5GB", "Export shard size.")
_PARAM_DTYPE = flags.DEFINE_enum("param_dtype", None, ["float32", "bfloat16", "float16"],
                                 "Import: parameter dtype (default: the checkpoint's).")


def main(argv):
  del argv
  if _DIRECTION.value == "import":
    if not _HF_DIR.value:
      raise app.UsageError("--direction=import needs --hf_dir")
    model = convert_import(_HF_DIR.value, _OUT.value, _PARAM_DTYPE.value)
  else:
    if not _CKPT_DIR.value:
      raise app.UsageError("--direction=export needs --ckpt_dir")
    model = convert_export(_CKPT_DIR.value, _OUT.value, _ARCHITECTURE.value,
                           _MAX_SHARD_SIZE.value)
  print(f"wrote {_OUT.value}: {model}")


if __name__ == "__main__":
  cli.run(main)
