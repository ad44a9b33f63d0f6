"""The edge between a ConfigDict and the run: validate it once, into a typed `RunSpec`.

`validate` runs at start-up, before data is read or anything compiles. It builds what the
run will use -- algorithm, model config, samplers, optimisers, update plan, mesh shape --
through their own constructors (so each rule is written once, where the object is), runs the
checkpointer's option checks, turns the first `ValueError` into a `ConfigError` naming the
offending `config.<field>` in one line, and returns them as a frozen `RunSpec`. This module
(with the CLI and notebook override parsing) is the only one that reads a ConfigDict
(configs/ holds the files); the scripts, the loop and the task take the spec.

The model's embedding size of the embedded task comes from its vocabulary, which is read with
the data: until then the spec's `model` is None, and `RunSpec.for_vocabulary` completes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from typing import Any

import jax
from jax.sharding import Mesh

from pbsd_jax import protocol
from pbsd_jax.agent import privileged
from pbsd_jax.agent.env import dense_retriever
from pbsd_jax.agent.env.agent_env import AgentEnv
from pbsd_jax.agent.env.http import HttpRetriever
from pbsd_jax.data import oracle as oracle_lib, splits as splits_lib, world as world_lib
from pbsd_jax.eval.metric_log import WandbSpec
from pbsd_jax.generate.sampling import Sampler
from pbsd_jax.models import ModelConfig, param_shapes, param_shardings
from pbsd_jax.models.sizes import SIZES
from pbsd_jax.parallel import sharding
from pbsd_jax.rl import algorithms, learner, train_state
from pbsd_jax.run import workdir as workdir_lib

RETRIEVERS = ("ingraph", "host", "bm25s", "dense", "http")
# GRPO fields whose "off" is None in the algorithm and 0 in the config (command-line typed).
_ZERO_IS_NONE = {"dual_clip": 0.0, "norm_len": 0.0, "overlong_max_len": 0}
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


@dataclasses.dataclass(frozen=True)
class ModelSource:
  """Where the run's model config comes from: a named size (`name`) or the checkpoint
  directory `init_dir`, with the run's choice of how the layers are computed (`run_fields`:
  `RUN_MODEL_FIELDS` and their values)."""

  name: str
  init_dir: str
  run_fields: tuple[tuple[str, Any], ...]


def model_config(source: ModelSource, vocab_size: int | None = None) -> ModelConfig:
  """The `ModelConfig` of `source.name` (the vocabulary's size for the embedded task), or the
  `model_config.json` of `source.init_dir` when the run starts from a checkpoint (e.g.
  `scripts/convert_hf.py` output), whose embedding must hold every id of its own tokenizer
  (it may have more rows: HF checkpoints pad it), or be exactly the data vocabulary when the
  directory has no tokenizer (a checkpoint of the embedded task's model)."""
  run = dict(source.run_fields)
  if source.init_dir:
    from pbsd_jax.run import policy_checkpoint
    model = policy_checkpoint.find_model_config(source.init_dir)
    if model is None:
      _fail("model.init_dir", source.init_dir, "holds no model_config.json")
    if vocab_size is not None and model.vocab_size < vocab_size:
      _fail("model.init_dir", source.init_dir,
            f"the model's embedding has {model.vocab_size} rows, fewer than the "
            f"{vocab_size} ids of its vocabulary")
    if (vocab_size is not None and model.vocab_size != vocab_size
        and policy_checkpoint.tokenizer_dir(source.init_dir) is None):
      _fail("model.init_dir", source.init_dir,
            f"holds no tokenizer, and the model's vocab_size={model.vocab_size} is not the "
            f"data vocabulary's {vocab_size}")
    with naming_fields({f: f"model.{f}" for f in RUN_MODEL_FIELDS}, "model"):
      return model.replace(**run)
  if source.name not in SIZES:
    _fail("model.name", source.name, f"unknown model size; known: {sorted(SIZES)}")
  kwargs = dict(SIZES[source.name])
  if "vocab_size" not in kwargs:
    if vocab_size is None:
      _fail("model.name", source.name,
            "this size takes vocab_size from the vocabulary; none given")
    kwargs["vocab_size"] = vocab_size
  with naming_fields({f: f"model.{f}" for f in RUN_MODEL_FIELDS}, "model"):
    return ModelConfig(**kwargs, **run)


def _model_source(config) -> ModelSource:
  return ModelSource(config.model.name, config.model.init_dir,
                     tuple((f, config.model[f]) for f in RUN_MODEL_FIELDS))


def build_model_config(config, vocab_size: int | None = None) -> ModelConfig:
  """`model_config` of `config.model`."""
  return model_config(_model_source(config), vocab_size)


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
  settings = _sampler_settings(config, section)
  if settings["record_routes"] and not model.is_moe:
    _fail("pbsd.replay_routing", config.pbsd.replay_routing,
          "needs an MoE model (model.num_experts > 0): a dense model has no routes to replay")
  fields = {f: f"{section}.{f}" for f in ("temperature", "top_p", "top_k")
            if f in config[section]}
  with naming_fields(fields, section):
    return Sampler(model, **settings)


def build_mesh(config, devices=None) -> Mesh:
  """The run's `('data', 'fsdp', 'tensor')` mesh from `config.mesh` over `devices` (default:
  every device of every process)."""
  with naming_fields({}, "mesh"):
    return sharding.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor,
                              devices=devices)


def mesh_for_script(spec: "RunSpec") -> Mesh:
  """The run's mesh at a script's start, checked by `check_param_sharding`."""
  mesh = spec.build_mesh()
  check_param_sharding(spec.model, mesh)
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
  of `data.build.make_dataset` after its output directory (seed, world and split sizes, the
  oracle's detours and slips)."""
  d = config.data

  def build(section: str, cls, **fields):
    try:
      return cls(**fields)
    except (TypeError, ValueError) as err:
      field = re.search(rf"{cls.__name__}\.(\w+)", str(err))  # the field it names
      name = f"data.{section}.{field.group(1)}" if field else f"data.{section}"
      _fail(name, fields.get(field.group(1)) if field else fields, str(err))

  world_sizes = build("world", world_lib.WorldSizes, **d.world)
  split_sizes = build("splits", splits_lib.SplitSizes,
                      **{**d.splits, "hop_weights": tuple(d.splits.hop_weights)})
  oracle = dict(d.oracle)
  if not 0.0 <= oracle["detour_share"] <= 1.0:
    _fail("data.oracle.detour_share", oracle["detour_share"], "must be in [0, 1]")
  slips = build("oracle", oracle_lib.Slips,
                **{k: v for k, v in oracle.items() if k != "detour_share"})
  return dict(seed=d.data_seed, world_sizes=world_sizes, split_sizes=split_sizes,
              detour_share=oracle["detour_share"], slips=slips)


def model_before_data(config) -> ModelConfig:
  """`build_model_config` before the vocabulary is read (a stand-in size for the embedded
  task's): everything but the embedding's rows."""
  return build_model_config(config, None if config.model.init_dir else _STAND_IN_VOCAB)


def _sampler_settings(config, section: str) -> dict:
  c = config[section]
  return dict(temperature=c.temperature, top_p=c.top_p, top_k=c.get("top_k", 0),
              record_routes=config.algorithm == "pbsd" and bool(config.pbsd.replay_routing))


@dataclasses.dataclass(frozen=True)
class SamplerSettings:
  """A sampler's settings (`config.rollout` or `config.eval`); `sampler` binds a model."""

  temperature: float
  top_p: float
  top_k: int
  record_routes: bool

  def sampler(self, model: ModelConfig) -> Sampler:
    return Sampler(model, **dataclasses.asdict(self))


@dataclasses.dataclass(frozen=True)
class DataSpec:
  """The questions, the corpus and the prompts (`config.data`).

  Attributes:
    dir: the embedded task's dataset directory ("": `<workdir>/data`), made there when missing
      and `make_if_missing`.
    train_files, eval_files, sft_files: user files (Search-R1 questions; SFT trajectories).
    corpus: the corpus JSONL ("": the embedded task's).
    template: the student prompt template's text (`protocol.PROMPT_TEMPLATES`).
    teacher_template: the teacher's privileged block (`privileged.TEMPLATES`).
    prompt_width: P, the prompt region's width.
    gold_width: tokens per gold answer.
    chat_template: render prompts with the `init_dir` model's chat template.
    generator: the embedded task's generator arguments (`data.build.make_dataset`'s keyword
      arguments: seed, world and split sizes, detour share), None with user files.
  """

  dir: str
  make_if_missing: bool
  train_files: tuple[str, ...]
  eval_files: tuple[str, ...]
  sft_files: tuple[str, ...]
  corpus: str
  template: str
  teacher_template: str
  prompt_width: int
  gold_width: int
  chat_template: bool
  generator: dict | None


@dataclasses.dataclass(frozen=True)
class EnvSpec:
  """The environment's sizes (`config.env`; `AgentEnv.from_vocab` adds the vocabulary's)."""

  buffer_size: int
  max_turns: int
  max_action_tokens: int
  max_observation_tokens: int
  max_query_tokens: int
  top_k: int


@dataclasses.dataclass(frozen=True)
class RetrievalSpec:
  """What the rollouts search (`config.env`): `retriever` (`RETRIEVERS`), the device index
  kind (`index`: dense or sparse) or a saved one (`index_dir`), the server's `url` with its
  client's `timeout_s` and `max_retries`."""

  retriever: str
  index: str
  index_dir: str
  url: str
  timeout_s: float
  max_retries: int


@dataclasses.dataclass(frozen=True, eq=False)
class SFTSpec:
  """The SFT stage (`config.sft`): `steps` updates of `batch_size` rows drawn from the first
  `max_examples` SFT records (0: all), `teacher_fraction` of them on the teacher's prompt,
  `corpus_fraction` of the rows corpus documents instead; its `optimizer` and `plan` (the LM
  head's chunk)."""

  steps: int
  batch_size: int
  max_examples: int
  teacher_fraction: float
  corpus_fraction: float
  optimizer: Any
  plan: learner.UpdatePlan


@dataclasses.dataclass(frozen=True, eq=False)
class RLSpec:
  """The RL stage (`config.rl`, `config.rollout`, `config.grpo.group_size`): `steps` steps of
  `prompts_per_step` questions x `group_size` trajectories, learnt by `plan` with `optimizer`;
  every `save_rollouts` steps the rollout is saved (0: never); the run
  stops after `max_skipped_steps` steps in a row whose updates were all skipped (0: never)."""

  steps: int
  prompts_per_step: int
  group_size: int
  plan: learner.UpdatePlan
  optimizer: Any
  save_rollouts: int
  max_skipped_steps: int


@dataclasses.dataclass(frozen=True)
class EvalSpec:
  """Evaluation (`config.eval`): greedy validation on `num_examples` questions every `every`
  RL steps and every `sft_every` SFT steps (0: never), and the k of pass@k."""

  every: int
  sft_every: int
  num_examples: int
  pass_k: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class CheckpointSpec:
  """The checkpointer's options (`config.checkpoint`)."""

  save_interval_steps: int
  max_to_keep: int
  async_save: bool


@dataclasses.dataclass(frozen=True, eq=False)
class RunSpec:
  """A validated run: everything the scripts, the task and the loop read.

  Attributes:
    algorithm: the configured algorithm (`rl.algorithms`).
    model_source: where the model config comes from.
    model: the model config; None until the vocabulary is known (`for_vocabulary`) for a
      named size that takes its embedding from the data.
    data, env, retrieval, sft, rl, eval, checkpoint: the sections.
    rollout_sampling, eval_sampling: the training and top-p evaluation sampler settings.
    mesh: `(data, fsdp, tensor)` as configured (-1: the remaining devices).
    seed: the run's seed.
    wandb: where the metrics also go (`config.log.wandb`), None while its project is empty.
    settings: the configuration as plain JSON values: what the workdir records and the
      checkpoints fingerprint (`workdir.claim`, `workdir.fingerprint`).
  """

  algorithm: Any
  model_source: ModelSource
  model: ModelConfig | None
  data: DataSpec
  env: EnvSpec
  retrieval: RetrievalSpec
  sft: SFTSpec
  rl: RLSpec
  eval: EvalSpec
  checkpoint: CheckpointSpec
  rollout_sampling: SamplerSettings
  eval_sampling: SamplerSettings
  mesh: tuple[int, int, int]
  seed: int
  settings: dict
  wandb: WandbSpec | None = None

  def for_vocabulary(self, vocab_size: int) -> "RunSpec":
    """The spec with the model config of a vocabulary of `vocab_size` ids (`model_config`).

    Raises:
      ConfigError: the `init_dir` model's embedding cannot hold the vocabulary.
    """
    return self.with_model(model_config(self.model_source, vocab_size))

  def with_model(self, model: ModelConfig) -> "RunSpec":
    """The spec of another model config (e.g. a checkpoint's own)."""
    return dataclasses.replace(self, model=model)

  def sampler(self, section: str = "rollout") -> Sampler:
    """The `rollout` (training) or `eval` (top-p evaluation) sampler of the model."""
    settings = self.rollout_sampling if section == "rollout" else self.eval_sampling
    return settings.sampler(self.model)

  def build_mesh(self, devices=None) -> Mesh:
    """The run's `('data', 'fsdp', 'tensor')` mesh over `devices` (default: every device of
    every process)."""
    with naming_fields({}, "mesh"):
      return sharding.make_mesh(*self.mesh, devices=devices)


def _files(value: str) -> tuple[str, ...]:
  return tuple(f.strip() for f in value.split(",") if f.strip())


def _stage_optimizer(config, stage: str):
  """`build_optimizer` of a stage that runs; a stage of no steps gets an AdamW of the same
  state (what a checkpoint of it restores into), whose schedule needs no steps."""
  if config[stage].steps:
    return build_optimizer(config, stage)
  return train_state.make_optimizer(1.0)


def _spec(config, model: ModelConfig, algorithm: Any, env: EnvSpec, optimizers: dict,
          plan: learner.UpdatePlan) -> RunSpec:
  """The `RunSpec` of a validated `config`, with what `validate` built: `model` (its model
  config before the data), the algorithm, the environment's sizes, each stage's optimiser
  and the RL update plan."""
  d, e, c = config.data, config.env, config.checkpoint
  sampling = {s: SamplerSettings(**_sampler_settings(config, s)) for s in ("rollout", "eval")}
  return RunSpec(
      algorithm=algorithm, model_source=_model_source(config),
      model=model if config.model.init_dir or "vocab_size" in SIZES[config.model.name] else None,
      data=DataSpec(dir=d.dir, make_if_missing=d.make_if_missing,
                    train_files=_files(d.train_files), eval_files=_files(d.eval_files),
                    sft_files=_files(d.sft_files), corpus=d.corpus,
                    template=protocol.PROMPT_TEMPLATES[d.prompt_template],
                    teacher_template=privileged.TEMPLATES[d.teacher_prompt],
                    prompt_width=d.prompt_width, gold_width=d.gold_width,
                    chat_template=d.chat_template,
                    generator=None if d.train_files else dataset_args(config)),
      env=env,
      retrieval=RetrievalSpec(e.retriever, e.index, e.index_dir, e.url, e.timeout_s,
                              e.max_retries),
      sft=SFTSpec(config.sft.steps, config.sft.batch_size, config.sft.max_examples,
                  config.sft.teacher_fraction, config.sft.corpus_fraction, optimizers["sft"],
                  learner.UpdatePlan(chunk_size=config.rl.chunk_size or None)),
      rl=RLSpec(config.rl.steps, config.rollout.prompts_per_step, config.grpo.group_size,
                plan, optimizers["rl"],
                config.rl.save_rollouts, config.rl.max_skipped_steps),
      eval=EvalSpec(config.eval.every, config.eval.sft_every, config.eval.num_examples,
                    tuple(config.eval.pass_k)),
      checkpoint=CheckpointSpec(c.save_interval_steps, c.max_to_keep, c.async_save),
      rollout_sampling=sampling["rollout"], eval_sampling=sampling["eval"],
      mesh=(config.mesh.data, config.mesh.fsdp, config.mesh.tensor), seed=config.seed,
      settings=workdir_lib.as_dict(config),
      wandb=WandbSpec(**config.log.wandb) if config.log.wandb.project else None)


def validate(config, num_devices: int | None = None) -> RunSpec:
  """Checks everything that can be checked before data is read or anything compiles, and
  returns the run's `RunSpec`.

  Raises:
    ConfigError: naming the first field that cannot run.
  """
  algorithm = build_algorithm(config)
  model = model_before_data(config)
  if not config.data.train_files:
    dataset_args(config)
  elif "turn_value" in algorithm.needs:
    _fail("algorithm", config.algorithm, "needs the gold chains of the embedded task's "
          "questions (its turn values); config.data.train_files has none")
  if config.data.prompt_template not in protocol.PROMPT_TEMPLATES:
    _fail("data.prompt_template", config.data.prompt_template,
          f"must be one of {sorted(protocol.PROMPT_TEMPLATES)}")
  if config.data.teacher_prompt not in privileged.TEMPLATES:
    _fail("data.teacher_prompt", config.data.teacher_prompt,
          f"must be one of {sorted(privileged.TEMPLATES)}")
  if "{chain}" in privileged.TEMPLATES[config.data.teacher_prompt] and config.data.train_files:
    _fail("data.teacher_prompt", config.data.teacher_prompt, "states the gold chain, which "
          "only the embedded task's questions have")
  if config.env.retriever not in RETRIEVERS:
    _fail("env.retriever", config.env.retriever, f"must be one of {RETRIEVERS}")
  if config.env.index not in ("dense", "sparse"):
    _fail("env.index", config.env.index, "must be 'dense' or 'sparse'")
  if config.env.retriever == "dense":
    if not config.env.index_dir:
      _fail("env.index_dir", config.env.index_dir, "env.retriever='dense' needs the directory "
            "of a dense index (scripts/build_index.py --encoder)")
    with naming_fields({}, "env.index_dir"):
      dense_retriever.read_settings(config.env.index_dir)
  # The client's settings are checked whatever the retriever: a value no retriever can run
  # with is a mistake even while another retriever is chosen (its URL only when it is used).
  with naming_fields({"url": "env.url", "timeout_s": "env.timeout_s",
                      "max_retries": "env.max_retries"}, "env"):
    HttpRetriever(config.env.url if config.env.retriever == "http" else "http://unused",
                  timeout_s=config.env.timeout_s, max_retries=config.env.max_retries)
  env = EnvSpec(**{f.name: config.env[f.name] for f in dataclasses.fields(EnvSpec)})
  with naming_fields({f: f"env.{f}" for f in dataclasses.asdict(env)}, "env"):
    AgentEnv(**dataclasses.asdict(env), **_STAND_IN_IDS)
  if config.data.prompt_width >= config.env.buffer_size:
    _fail("data.prompt_width", config.data.prompt_width,
          f"leaves no room for a trajectory in env.buffer_size={config.env.buffer_size}")
  if config.rollout.prompts_per_step < 1:
    _fail("rollout.prompts_per_step", config.rollout.prompts_per_step, "must be >= 1")
  build_sampler(config, model, "rollout")
  build_sampler(config, model, "eval")
  optimizers = {}
  for stage in ("sft", "rl"):
    if config[stage].steps < 0:
      _fail(f"{stage}.steps", config[stage].steps, "must be >= 0")
    optimizers[stage] = _stage_optimizer(config, stage)
  for field, low in (("batch_size", 1), ("max_examples", 0)):
    if config.sft[field] < low:
      _fail(f"sft.{field}", config.sft[field], f"must be >= {low}")
  if config.sft.schedule and config.sft.schedule not in train_state.SCHEDULES:
    _fail("sft.schedule", config.sft.schedule,
          f"must be empty (optim.schedule) or one of {train_state.SCHEDULES}")
  if not 0.0 <= config.sft.teacher_fraction <= 1.0:
    _fail("sft.teacher_fraction", config.sft.teacher_fraction, "must be in [0, 1]")
  if not 0.0 <= config.sft.corpus_fraction < 1.0:
    _fail("sft.corpus_fraction", config.sft.corpus_fraction, "must be in [0, 1)")
  if config.sft.max_examples and config.sft.max_examples < config.sft.batch_size:
    _fail("sft.max_examples", config.sft.max_examples,
          f"is smaller than sft.batch_size={config.sft.batch_size}")
  num_devices = jax.device_count() if num_devices is None else num_devices
  with naming_fields({}, "mesh"):
    mesh = sharding.mesh_shape(config.mesh.data, config.mesh.fsdp, config.mesh.tensor,
                               num_devices=num_devices)
  batch = config.rollout.prompts_per_step * config.grpo.group_size
  rows = "rl.micro_batch_size" if config.rl.micro_batch_size else "rollout.prompts_per_step"
  plan = build_plan(config)
  with naming_fields({"minibatches": "rl.minibatches", "micro_batch_size": "rl.micro_batch_size",
                      "data-parallel": rows}, "rl"):
    plan.micro_batches(batch, mesh["data"] * mesh["fsdp"])
  if config.sft.steps and config.sft.batch_size % (mesh["data"] * mesh["fsdp"]):
    _fail("sft.batch_size", config.sft.batch_size,
          f"does not split over the {mesh['data'] * mesh['fsdp']} data-parallel devices of "
          f"the mesh (mesh.data * mesh.fsdp)")
  for field in ("every", "sft_every"):
    if config.eval[field] < 0:
      _fail(f"eval.{field}", config.eval[field], "must be >= 0 (0: never)")
  if any(k < 1 for k in config.eval.pass_k):
    _fail("eval.pass_k", config.eval.pass_k, "every k must be >= 1")
  if config.rl.save_rollouts < 0:
    _fail("rl.save_rollouts", config.rl.save_rollouts, "must be >= 0 (0: never)")
  if config.rl.max_skipped_steps < 0:
    _fail("rl.max_skipped_steps", config.rl.max_skipped_steps, "must be >= 0 (0: never stop)")
  validate_checkpointer(config)
  validate_wandb(config.log.wandb)
  return _spec(config, model, algorithm, env, optimizers, plan)


def validate_wandb(w) -> None:
  """`config.log.wandb`: a known mode, no run settings without a project, and the package
  installed where it is used."""
  if w.mode not in ("online", "offline"):
    _fail("log.wandb.mode", w.mode, "must be 'online' or 'offline'")
  if not w.project:
    for field in ("entity", "name"):
      if w[field]:
        _fail(f"log.wandb.{field}", w[field], "is set but log.wandb.project is empty (W&B "
              "logging is off)")
    return
  try:
    import wandb  # noqa: F401
  except ImportError:
    _fail("log.wandb.project", w.project, "needs the wandb package: pip install wandb")


def validate_checkpointer(config) -> None:
  """The `checkpoint` section against the `Checkpointer`'s own option checks."""
  from pbsd_jax.run import checkpoint
  c = config.checkpoint
  fields = {f: f"checkpoint.{f}" for f in ("save_interval_steps", "max_to_keep")}
  with naming_fields(fields, "checkpoint"):
    checkpoint.check_options(c.save_interval_steps, c.max_to_keep)


def validate_for_script(config) -> RunSpec:
  """`validate` at a script's start: a bad config ends it (exit status 1) with one line."""
  try:
    return validate(config)
  except ConfigError as err:
    raise SystemExit(f"FATAL config error: {err}") from None
