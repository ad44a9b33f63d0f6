"""A run configuration: validate a ConfigDict and build the pieces it names.

With `pbsd_jax.run.train` (the loop) and `pbsd_jax.run.task` (data and environment), the only library
modules that read a `ml_collections` ConfigDict (configs/ holds the files); everything they
build takes plain values. `validate` runs at start-up, before data is read or anything
compiles: it builds the objects the run will build -- algorithm, model config, environment,
retrieval client, samplers, optimisers, update plan, mesh shape -- and runs the checkpointer's
option checks, so the constructors are the one place each rule is written, and turns the first
`ValueError` into a `ConfigError` naming the offending `config.<field>` in one line. What only
the config knows (section choices, cross-section sizes) is checked here.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import jax
from jax.sharding import Mesh

from pbsd_jax import protocol
from pbsd_jax.agent.env.agent_env import AgentEnv
from pbsd_jax.agent.env.http import HttpRetriever
from pbsd_jax.data import splits as splits_lib, world as world_lib
from pbsd_jax.generate.sampling import Sampler
from pbsd_jax.models import ModelConfig, param_shapes, param_shardings
from pbsd_jax.models.sizes import SIZES
from pbsd_jax.parallel import sharding
from pbsd_jax.rl import algorithms, learner, train_state

RETRIEVERS = ("ingraph", "host", "bm25s", "http")
# GRPO fields whose "off" is None in the algorithm and 0 in the config (command-line typed).
_ZERO_IS_NONE = {"dual_clip": 0.0, "norm_len": 0.0, "overlong_max_len": 0}
ENV_FIELDS = ("buffer_size", "max_turns", "max_action_tokens", "max_observation_tokens",
              "max_query_tokens", "top_k")
# Validation builds the environment before the vocabulary exists: distinct stand-in tag ids.
_STAND_IN_IDS = dict(search_open=1, search_close=2, answer_open=3, answer_close=4, info_open=5,
                     info_close=6, eos_id=7, notice=(8,))
_STAND_IN_VOCAB = 1024
# How the layers are computed, and in which precision the weights are held and used: the run's
# choice, for a named size and for an `init_dir` checkpoint alike (which fixes what they compute).
RUN_MODEL_FIELDS = ("param_dtype", "dtype", "cache_dtype", "remat", "scan_unroll", "attention")


class ConfigError(ValueError):
  """A configuration value that cannot run; the message names the field."""


def _fail(field: str, value: Any, why: str):
  raise ConfigError(f"config.{field}={value!r}: {why}")


def algorithm_sections() -> dict[str, dict]:
  """The algorithm sections of a config with their defaults (the algorithms' own fields).

  `grpo` holds the hyperparameters every algorithm shares; each other algorithm's section
  holds its own. None ("off") is written as a 0 of the field's type, so the command line can
  set it (`algorithm_hparams` reads it back as None).
  """
  shared = algorithms.hyperparameters("grpo")
  sections = {"grpo": {k: _ZERO_IS_NONE[k] if v is None else v for k, v in shared.items()}}
  for name in algorithms.names():
    if name != "grpo":
      sections[name] = {k: v for k, v in algorithms.hyperparameters(name).items()
                        if k not in shared}
  return sections


def algorithm_hparams(config) -> dict:
  """The algorithm's hyperparameters: the shared `grpo` section plus its own section."""
  hparams = {k: (None if k in _ZERO_IS_NONE and not v else v)
             for k, v in config.grpo.items()}
  if config.algorithm != "grpo":
    hparams.update(dict(config[config.algorithm]))
  return hparams


@contextlib.contextmanager
def naming_fields(fields: dict[str, str], default: str):
  """Turns a constructor's `ValueError` into a `ConfigError` naming the config field.

  The field is the one of `fields` (constructor argument -> `section.field`) that the message
  names first; `default` when it names none.
  """
  try:
    yield
  except ValueError as err:
    message = str(err)
    found = {m.start(): path for name, path in fields.items()
             if (m := re.search(rf"\b{re.escape(name)}\b", message))}
    raise ConfigError(f"config.{found[min(found)] if found else default}: {message}") from None


def build_algorithm(config) -> algorithms.GRPO:
  """The configured algorithm (`pbsd_jax.rl.algorithms.get`), errors naming the field."""
  if config.algorithm not in algorithms.names():
    _fail("algorithm", config.algorithm, f"unknown; registered: {list(algorithms.names())}")
  fields = {f: f"grpo.{f}" for f in config.grpo}
  if config.algorithm != "grpo":
    fields.update({f: f"{config.algorithm}.{f}" for f in config[config.algorithm]})
  with naming_fields(fields, config.algorithm):
    return algorithms.get(config.algorithm, **algorithm_hparams(config))


def build_model_config(config, vocab_size: int | None = None) -> ModelConfig:
  """The `ModelConfig` of `config.model.name` (the vocabulary's size for the embedded task),
  or the `model_config.json` of `config.model.init_dir` when the run starts from a checkpoint
  (e.g. `scripts/convert_hf.py` output), whose embedding must hold every id of its own
  tokenizer (it may have more rows: HF checkpoints pad it), or be exactly the data vocabulary
  when the directory has no tokenizer (a checkpoint of the embedded task's model)."""
  if config.model.init_dir:
    from pbsd_jax.run import policy_checkpoint
    model = policy_checkpoint.find_model_config(config.model.init_dir)
    if model is None:
      _fail("model.init_dir", config.model.init_dir, "holds no model_config.json")
    if vocab_size is not None and model.vocab_size < vocab_size:
      _fail("model.init_dir", config.model.init_dir,
            f"the model's embedding has {model.vocab_size} rows, fewer than the "
            f"{vocab_size} ids of its vocabulary")
    if (vocab_size is not None and model.vocab_size != vocab_size
        and policy_checkpoint.tokenizer_dir(config.model.init_dir) is None):
      _fail("model.init_dir", config.model.init_dir,
            f"holds no tokenizer, and the model's vocab_size={model.vocab_size} is not the "
            f"data vocabulary's {vocab_size}")
    with naming_fields({f: f"model.{f}" for f in RUN_MODEL_FIELDS}, "model"):
      return model.replace(**{f: config.model[f] for f in RUN_MODEL_FIELDS})
  name = config.model.name
  if name not in SIZES:
    _fail("model.name", name, f"unknown model size; known: {sorted(SIZES)}")
  kwargs = dict(SIZES[name])
  if "vocab_size" not in kwargs:
    if vocab_size is None:
      _fail("model.name", name, "this size takes vocab_size from the vocabulary; none given")
    kwargs["vocab_size"] = vocab_size
  with naming_fields({f: f"model.{f}" for f in RUN_MODEL_FIELDS}, "model"):
    return ModelConfig(**kwargs, **{f: config.model[f] for f in RUN_MODEL_FIELDS})


def build_optimizer(config, stage: str):
  """The AdamW of `stage` (`'sft'`: the `sft` section's lr, warm-up, steps and schedule (empty:
  `optim.schedule`); `'rl'`: `optim`'s lr, warm-up and schedule over `rl.steps`), the rest
  from `optim`."""
  o = config.optim
  if stage == "sft":
    lr, warmup, steps, section = (config.sft.lr, config.sft.warmup_steps, config.sft.steps,
                                  "sft")
    schedule, schedule_field = ((config.sft.schedule, "sft.schedule") if config.sft.schedule
                                else (o.schedule, "optim.schedule"))
  else:
    lr, warmup, steps, section = o.lr, o.warmup_steps, config.rl.steps, "optim"
    schedule, schedule_field = o.schedule, "optim.schedule"
  fields = {f: f"optim.{f}" for f in ("weight_decay", "b1", "b2", "grad_clip")}
  fields.update(lr=f"{section}.lr", warmup_steps=f"{section}.warmup_steps",
                total_steps=f"{stage}.steps", schedule=schedule_field)
  with naming_fields(fields, "optim"):
    return train_state.make_optimizer(lr, warmup, steps, o.weight_decay, o.b1, o.b2,
                                      o.grad_clip, schedule)


def build_plan(config) -> learner.UpdatePlan:
  """The RL stage's `UpdatePlan` (`rl` section; 0 is "off" for the micro-batch and chunk)."""
  fields = {f: f"rl.{f}" for f in ("epochs", "minibatches", "micro_batch_size", "chunk_size")}
  with naming_fields(fields, "rl"):
    return learner.UpdatePlan(config.rl.epochs, config.rl.minibatches,
                              config.rl.micro_batch_size or None, config.rl.chunk_size or None)


def build_sampler(config, model: ModelConfig, section: str = "rollout") -> Sampler:
  """The `rollout` (training) or `eval` (top-p evaluation) sampler; it records MoE routes
  when the evidence replays them (`pbsd.replay_routing`)."""
  c = config[section]
  record = config.algorithm == "pbsd" and bool(config.pbsd.replay_routing)
  if record and not model.is_moe:
    _fail("pbsd.replay_routing", config.pbsd.replay_routing,
          "needs an MoE model (model.num_experts > 0): a dense model has no routes to replay")
  fields = {f: f"{section}.{f}" for f in ("temperature", "top_p", "top_k") if f in c}
  with naming_fields(fields, section):
    return Sampler(model, temperature=c.temperature, top_p=c.top_p, top_k=c.get("top_k", 0),
                   record_routes=record)


def build_mesh(config, devices=None) -> Mesh:
  """The run's `('data', 'fsdp', 'tensor')` mesh from `config.mesh` over `devices` (default:
  every device of every process)."""
  with naming_fields({}, "mesh"):
    return sharding.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor,
                              devices=devices)


def mesh_for_script(config, model: ModelConfig) -> Mesh:
  """The run's mesh at a script's start, checked by `check_param_sharding`."""
  mesh = build_mesh(config)
  check_param_sharding(model, mesh)
  return mesh


def check_param_sharding(model: ModelConfig, mesh: Mesh) -> None:
  """A mesh that would leave `model`'s parameters replicated
  (`sharding.assert_params_sufficiently_sharded`) ends the script with one line naming
  `config.mesh`, before anything is allocated or compiled."""
  abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                          param_shapes(model), param_shardings(model, mesh))
  try:
    sharding.assert_params_sufficiently_sharded(abstract, mesh)
  except ValueError as err:
    raise SystemExit(f"FATAL config error: config.mesh ({_describe_mesh(mesh)}): {err}") from None


def _describe_mesh(mesh: Mesh) -> str:
  return ", ".join(f"{name}={size}" for name, size in mesh.shape.items())


def dataset_args(config) -> dict[str, Any]:
  """The embedded task's generator arguments from the `data` section: the keyword arguments
  of `data.build.make_dataset` after its output directory (seed, world and split sizes,
  detour share)."""
  d = config.data
  if not 0.0 <= d.detour_share <= 1.0:
    _fail("data.detour_share", d.detour_share, "must be in [0, 1]")
  try:
    world_sizes = world_lib.WorldSizes(family_rate=d.family_rate)
  except ValueError as err:
    _fail("data.family_rate", d.family_rate, str(err))
  try:
    split_sizes = splits_lib.SplitSizes(hop_weights=tuple(float(w) for w in d.hop_weights))
  except (TypeError, ValueError) as err:
    _fail("data.hop_weights", d.hop_weights, str(err))
  return dict(seed=d.data_seed, world_sizes=world_sizes, split_sizes=split_sizes,
              detour_share=d.detour_share)


def model_before_data(config) -> ModelConfig:
  """`build_model_config` before the vocabulary is read (a stand-in size for the embedded
  task's): everything but the embedding's rows."""
  return build_model_config(config, None if config.model.init_dir else _STAND_IN_VOCAB)


def validate(config, num_devices: int | None = None) -> None:
  """Checks everything that can be checked before data is read or anything compiles.

  Raises:
    ConfigError: naming the first field that cannot run.
  """
  build_algorithm(config)
  model = model_before_data(config)
  if not config.data.train_files:
    dataset_args(config)
  if config.data.prompt_template not in protocol.PROMPT_TEMPLATES:
    _fail("data.prompt_template", config.data.prompt_template,
          f"must be one of {sorted(protocol.PROMPT_TEMPLATES)}")
  if config.env.retriever not in RETRIEVERS:
    _fail("env.retriever", config.env.retriever, f"must be one of {RETRIEVERS}")
  if config.env.index not in ("dense", "sparse"):
    _fail("env.index", config.env.index, "must be 'dense' or 'sparse'")
  if config.env.retriever != "ingraph" and jax.process_count() > 1:
    _fail("env.retriever", config.env.retriever, "must be 'ingraph' in a multi-process run "
          "(a host retriever's turn loop reads every row of the batch on one host)")
  # The client's settings are checked whatever the retriever: a value no retriever can run
  # with is a mistake even while another retriever is chosen (its URL only when it is used).
  with naming_fields({"url": "env.url", "timeout_s": "env.timeout_s",
                      "max_retries": "env.max_retries"}, "env"):
    HttpRetriever(config.env.url if config.env.retriever == "http" else "http://unused",
                  timeout_s=config.env.timeout_s, max_retries=config.env.max_retries)
  with naming_fields({f: f"env.{f}" for f in ENV_FIELDS}, "env"):
    AgentEnv(**{f: config.env[f] for f in ENV_FIELDS}, **_STAND_IN_IDS)
  if config.data.prompt_width >= config.env.buffer_size:
    _fail("data.prompt_width", config.data.prompt_width,
          f"leaves no room for a trajectory in env.buffer_size={config.env.buffer_size}")
  if config.rollout.prompts_per_step < 1:
    _fail("rollout.prompts_per_step", config.rollout.prompts_per_step, "must be >= 1")
  build_sampler(config, model, "rollout")
  build_sampler(config, model, "eval")
  for stage in ("sft", "rl"):
    if config[stage].steps < 0:
      _fail(f"{stage}.steps", config[stage].steps, "must be >= 0")
    if config[stage].steps:
      build_optimizer(config, stage)
  for field, low in (("batch_size", 1), ("max_examples", 0)):
    if config.sft[field] < low:
      _fail(f"sft.{field}", config.sft[field], f"must be >= {low}")
  if config.sft.schedule and config.sft.schedule not in train_state.SCHEDULES:
    _fail("sft.schedule", config.sft.schedule,
          f"must be empty (optim.schedule) or one of {train_state.SCHEDULES}")
  if not 0.0 <= config.sft.teacher_fraction <= 1.0:
    _fail("sft.teacher_fraction", config.sft.teacher_fraction, "must be in [0, 1]")
  if config.sft.max_examples and config.sft.max_examples < config.sft.batch_size:
    _fail("sft.max_examples", config.sft.max_examples,
          f"is smaller than sft.batch_size={config.sft.batch_size}")
  num_devices = jax.device_count() if num_devices is None else num_devices
  with naming_fields({}, "mesh"):
    mesh = sharding.mesh_shape(config.mesh.data, config.mesh.fsdp, config.mesh.tensor,
                               num_devices=num_devices)
  batch = config.rollout.prompts_per_step * config.grpo.group_size
  rows = "rl.micro_batch_size" if config.rl.micro_batch_size else "rollout.prompts_per_step"
  with naming_fields({"minibatches": "rl.minibatches", "micro_batch_size": "rl.micro_batch_size",
                      "data-parallel": rows}, "rl"):
    build_plan(config).micro_batches(batch, mesh["data"] * mesh["fsdp"])
  if config.sft.steps and config.sft.batch_size % (mesh["data"] * mesh["fsdp"]):
    _fail("sft.batch_size", config.sft.batch_size,
          f"does not split over the {mesh['data'] * mesh['fsdp']} data-parallel devices of "
          f"the mesh (mesh.data * mesh.fsdp)")
  for field in ("every", "sft_every"):
    if config.eval[field] < 0:
      _fail(f"eval.{field}", config.eval[field], "must be >= 0 (0: never)")
    if config.eval[field] and jax.process_count() > 1:
      _fail(f"eval.{field}", config.eval[field], "must be 0 in a multi-process run (the "
            "validation rollout is not sharded over processes; evaluate its checkpoints with "
            "scripts/evaluate.py)")
  if any(k < 1 for k in config.eval.pass_k):
    _fail("eval.pass_k", config.eval.pass_k, "every k must be >= 1")
  if config.rl.save_rollouts < 0:
    _fail("rl.save_rollouts", config.rl.save_rollouts, "must be >= 0 (0: never)")
  if config.rl.save_rollouts and jax.process_count() > 1:
    _fail("rl.save_rollouts", config.rl.save_rollouts, "must be 0 in a multi-process run (a "
          "process holds only its rows of the rollout)")
  if config.rl.max_skipped_steps < 0:
    _fail("rl.max_skipped_steps", config.rl.max_skipped_steps, "must be >= 0 (0: never stop)")
  validate_checkpointer(config)


def validate_checkpointer(config) -> None:
  """The `checkpoint` section against the `Checkpointer`'s own option checks."""
  from pbsd_jax.run import checkpoint
  c = config.checkpoint
  fields = {f: f"checkpoint.{f}" for f in ("save_interval_steps", "max_to_keep")}
  with naming_fields(fields, "checkpoint"):
    checkpoint.check_options(c.save_interval_steps, c.max_to_keep)


def validate_for_script(config) -> None:
  """`validate` at a script's start: a bad config ends it (exit status 1) with one line."""
  try:
    validate(config)
  except ConfigError as err:
    raise SystemExit(f"FATAL config error: {err}") from None
