"""A run configuration: validate a ConfigDict and build the pieces it names.

With `pbsd_jax.train` (the loop), the only library modules that read a `ml_collections`
ConfigDict (configs/ holds the files); everything they build takes plain values. `validate`
runs at start-up, before anything compiles, and every error names the offending
`config.<field>` in one line.
"""

from __future__ import annotations

from typing import Any

import jax

from pbsd_jax import algorithms
from pbsd_jax.env import protocol
from pbsd_jax.models import ModelConfig
from pbsd_jax.models.sizes import SIZES

RETRIEVERS = ("ingraph", "host", "http")
# GRPO fields whose "off" is None in the algorithm and 0 in the config (command-line typed).
_ZERO_IS_NONE = ("dual_clip", "norm_len", "overlong_max_len")


class ConfigError(ValueError):
  """A configuration value that cannot run; the message names the field."""


def _fail(field: str, value: Any, why: str):
  raise ConfigError(f"config.{field}={value!r}: {why}")


def algorithm_hparams(config) -> dict:
  """The algorithm's hyperparameters: the shared `grpo` section plus its own section."""
  hparams = {k: (None if k in _ZERO_IS_NONE and not v else v)
             for k, v in config.grpo.items()}
  if config.algorithm != "grpo":
    hparams.update(dict(config[config.algorithm]))
  return hparams


def build_algorithm(config) -> algorithms.GRPO:
  """The configured algorithm (`pbsd_jax.algorithms.get`), errors naming the field."""
  if config.algorithm not in algorithms.names():
    _fail("algorithm", config.algorithm, f"unknown; registered: {list(algorithms.names())}")
  try:
    return algorithms.get(config.algorithm, **algorithm_hparams(config))
  except ValueError as err:
    # The algorithm names its field as `Class.field`; point at the config section instead.
    message = str(err)
    for section in (config.algorithm, "grpo"):
      for field in config[section].keys():
        if f".{field} " in message or f".{field}=" in message:
          raise ConfigError(f"config.{section}.{field}: {message}") from None
    raise ConfigError(f"config.{config.algorithm}: {message}") from None


def build_model_config(config, vocab_size: int | None = None) -> ModelConfig:
  """The `ModelConfig` of `config.model.name` (the vocabulary's size for the embedded task),
  or the `model_config.json` of `config.model.init_dir` when the run starts from a checkpoint
  (e.g. `scripts/convert_hf.py` output), whose vocabulary must be the data's."""
  if config.model.init_dir:
    from pbsd_jax import policy_checkpoint
    model = policy_checkpoint.find_model_config(config.model.init_dir)
    if model is None:
      _fail("model.init_dir", config.model.init_dir, "holds no model_config.json")
    if vocab_size is not None and model.vocab_size != vocab_size:
      _fail("model.init_dir", config.model.init_dir,
            f"the model's vocab_size={model.vocab_size} is not the data vocabulary's "
            f"{vocab_size}")
    return model
  name = config.model.name
  if name not in SIZES:
    _fail("model.name", name, f"unknown model size; known: {sorted(SIZES)}")
  kwargs = dict(SIZES[name])
  if "vocab_size" not in kwargs:
    if vocab_size is None:
      _fail("model.name", name, "this size takes vocab_size from the vocabulary; none given")
    kwargs["vocab_size"] = vocab_size
  try:
    return ModelConfig(**kwargs, param_dtype=config.model.param_dtype,
                       dtype=config.model.dtype, remat=config.model.remat)
  except ValueError as err:
    raise ConfigError(f"config.model: {err}") from None


def validate(config, num_devices: int | None = None) -> None:
  """Checks everything that can be checked before data is read or anything compiles.

  Raises:
    ConfigError: naming the first field that cannot run.
  """
  build_algorithm(config)
  if config.model.name not in SIZES:
    _fail("model.name", config.model.name, f"unknown model size; known: {sorted(SIZES)}")
  for field in ("param_dtype", "dtype"):
    if config.model[field] not in ("float32", "bfloat16", "float16"):
      _fail(f"model.{field}", config.model[field], "must be float32, bfloat16 or float16")
  if config.data.prompt_template not in protocol.PROMPT_TEMPLATES:
    _fail("data.prompt_template", config.data.prompt_template,
          f"must be one of {sorted(protocol.PROMPT_TEMPLATES)}")
  if config.env.retriever not in RETRIEVERS:
    _fail("env.retriever", config.env.retriever, f"must be one of {RETRIEVERS}")
  if config.env.retriever == "http" and not config.env.url:
    _fail("env.url", config.env.url, "an http retriever needs a url")
  for field in ("buffer_size", "max_turns", "max_action_tokens", "max_query_tokens", "top_k"):
    if config.env[field] < 1:
      _fail(f"env.{field}", config.env[field], "must be >= 1")
  if config.env.max_observation_tokens < 3:
    _fail("env.max_observation_tokens", config.env.max_observation_tokens,
          "must be >= 3 (two tags and a token)")
  if config.data.prompt_width >= config.env.buffer_size:
    _fail("data.prompt_width", config.data.prompt_width,
          f"leaves no room for a trajectory in env.buffer_size={config.env.buffer_size}")
  if config.rollout.prompts_per_step < 1:
    _fail("rollout.prompts_per_step", config.rollout.prompts_per_step, "must be >= 1")
  if config.rollout.temperature < 0:
    _fail("rollout.temperature", config.rollout.temperature, "must be >= 0")
  for section in ("rollout", "eval"):
    if not 0.0 < config[section].top_p <= 1.0:
      _fail(f"{section}.top_p", config[section].top_p, "must be in (0, 1]")
  if config.optim.lr <= 0:
    _fail("optim.lr", config.optim.lr, "must be > 0")
  if config.optim.warmup_steps < 0:
    _fail("optim.warmup_steps", config.optim.warmup_steps, "must be >= 0")
  if config.optim.weight_decay < 0:
    _fail("optim.weight_decay", config.optim.weight_decay, "must be >= 0")
  for field in ("steps", "epochs", "minibatches"):
    if config.rl[field] < (0 if field == "steps" else 1):
      _fail(f"rl.{field}", config.rl[field], "out of range")
  for field, low in (("steps", 0), ("batch_size", 1), ("max_examples", 0)):
    if config.sft[field] < low:
      _fail(f"sft.{field}", config.sft[field], f"must be >= {low}")
  if config.sft.max_examples and config.sft.max_examples < config.sft.batch_size:
    _fail("sft.max_examples", config.sft.max_examples,
          f"is smaller than sft.batch_size={config.sft.batch_size}")
  batch = config.rollout.prompts_per_step * config.grpo.group_size
  if batch % config.rl.minibatches:
    _fail("rl.minibatches", config.rl.minibatches,
          f"does not divide the batch of {batch} trajectories (prompts_per_step x group_size)")
  mini = batch // config.rl.minibatches
  if config.rl.micro_batch_size and mini % config.rl.micro_batch_size:
    _fail("rl.micro_batch_size", config.rl.micro_batch_size,
          f"does not divide the mini-batch of {mini} trajectories")
  mesh = [config.mesh.data, config.mesh.fsdp, config.mesh.tensor]
  if sum(size == -1 for size in mesh) > 1 or any(size == 0 or size < -1 for size in mesh):
    _fail("mesh", dict(config.mesh), "sizes must be positive, with at most one -1")
  num_devices = jax.device_count() if num_devices is None else num_devices
  fixed = 1
  for size in mesh:
    fixed *= size if size > 0 else 1
  if num_devices % fixed or (-1 not in mesh and fixed != num_devices):
    _fail("mesh", dict(config.mesh), f"does not match the {num_devices} available devices")
  data_shards = (config.mesh.data * (config.mesh.fsdp if config.mesh.fsdp > 0
                                     else num_devices // fixed))
  if batch % data_shards:
    _fail("rollout.prompts_per_step", config.rollout.prompts_per_step,
          f"the batch of {batch} trajectories does not divide over {data_shards} data shards")
  if any(k < 1 for k in config.eval.pass_k):
    _fail("eval.pass_k", config.eval.pass_k, "every k must be >= 1")


def validate_for_script(config) -> None:
  """`validate` at an absl script's start: a bad config ends it with one usage line."""
  from absl import app
  try:
    validate(config)
  except ConfigError as err:
    raise app.UsageError(str(err)) from None
