"""Run configs: the paper's defaults, command-line overrides, start-up errors naming the field."""

import os
import sys

import jax
import numpy as np
import pytest
from absl import flags
from ml_collections import config_flags

from pbsd_jax.models import ModelConfig
from pbsd_jax.models.sizes import SIZES
from pbsd_jax.rl import algorithms
from pbsd_jax.run import run_config as train

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "configs")


def load(name, *overrides):
  """Loads configs/<name>.py exactly as a script does, with `--config.x=y` overrides."""
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", flag_values=values)
  argv = ["prog", f"--config={os.path.join(CONFIGS, name)}.py", *overrides]
  saved, sys.argv = sys.argv, argv  # config_flags reads the overrides from sys.argv
  try:
    values(argv)
  finally:
    sys.argv = saved
  return values.config


def load_spec(name, *overrides, num_devices=1):
  """`load`, validated into the run's `RunSpec` for a mesh over `num_devices` devices."""
  return train.validate(load(name, *overrides), num_devices)


@pytest.mark.parametrize("name", ["grpo", "pbsd", "opsd", "rlsd", "gear", "demo",
                                  "long_horizon"])
def test_every_config_loads_validates_and_names_its_algorithm(name):
  config = load(name)
  train.validate(config, num_devices=1)
  algo = train.build_algorithm(config)
  assert algo.name == (name if name not in ("demo", "long_horizon") else "pbsd")


def test_pbsd_config_holds_the_papers_hyperparameters():
  config = load("pbsd")
  algo = train.build_algorithm(config)
  assert (algo.delta, algo.clip, algo.eps_pos, algo.eps_neg) == (0.1, 0.1, 0.001, 0.003)
  assert (algo.eps_low, algo.eps_high, algo.group_size) == (0.2, 0.28, 8)
  assert algo.reduction == "mean" and algo.form == "tanh"
  assert algo.dual_clip is None and algo.overlong_max_len is None
  assert config.rollout.prompts_per_step == 32 and config.rollout.temperature == 1.0
  assert (config.optim.lr, config.optim.warmup_steps, config.optim.weight_decay) == (
      3e-6, 8, 0.1)
  assert config.eval.top_p == 0.95


def test_baseline_configs_hold_their_constants():
  assert train.build_algorithm(load("rlsd")).lam_decay_steps == 50
  assert train.build_algorithm(load("rlsd")).eps_w == 0.2
  gear = train.build_algorithm(load("gear"))
  assert (gear.kl_threshold, gear.entropy_threshold) == (0.4, 1.5)
  assert train.build_algorithm(load("opsd")).beta == 1.0


def test_command_line_overrides_reach_the_algorithm():
  config = load("pbsd", "--config.pbsd.delta=0.2", "--config.grpo.dual_clip=3.0",
                "--config.pbsd.form=clipped_tanh")
  algo = train.build_algorithm(config)
  assert (algo.delta, algo.dual_clip, algo.form) == (0.2, 3.0, "clipped_tanh")


@pytest.mark.parametrize("override, field", [
    ("--config.pbsd.delta=-0.1", "config.pbsd.delta"),
    ("--config.pbsd.eps_pos=-0.001", "config.pbsd.eps_pos"),
    ("--config.grpo.eps_low=1.5", "config.grpo.eps_low"),
    ("--config.algorithm=ppo", "config.algorithm"),
    ("--config.model.name=gpt5", "config.model.name"),
    ("--config.rl.minibatches=3", "config.rl.minibatches"),
    ("--config.rl.micro_batch_size=5", "config.rl.micro_batch_size"),
    ("--config.env.retriever=google", "config.env.retriever"),
    ("--config.mesh.data=3", "config.mesh"),
    ("--config.rollout.top_p=0.0", "config.rollout.top_p"),
    ("--config.data.prompt_width=4096", "config.data.prompt_width"),
    ("--config.sft.batch_size=0", "config.sft.batch_size"),
    ("--config.sft.teacher_fraction=1.5", "config.sft.teacher_fraction"),
    ("--config.eval.every=-1", "config.eval.every"),
    ("--config.eval.sft_every=-2", "config.eval.sft_every"),
    # Rules that live in the constructors (environment, samplers, optimisers, plan, model).
    ("--config.env.top_k=0", "config.env.top_k"),
    ("--config.env.max_observation_tokens=2", "config.env.max_observation_tokens"),
    ("--config.rollout.top_k=-3", "config.rollout.top_k"),
    ("--config.rollout.temperature=-1.0", "config.rollout.temperature"),
    ("--config.eval.top_p=1.5", "config.eval.top_p"),
    ("--config.optim.lr=0.0", "config.optim.lr"),
    ("--config.optim.b2=1.0", "config.optim.b2"),
    ("--config.optim.schedule=linear", "config.optim.schedule"),
    ("--config.sft.schedule=linear", "config.sft.schedule"),
    ("--config.rl.epochs=0", "config.rl.epochs"),
    ("--config.rl.chunk_size=-1", "config.rl.chunk_size"),
    ("--config.model.dtype=float8", "config.model.dtype"),
    ("--config.model.attention=flash", "config.model.attention"),
    ("--config.checkpoint.save_interval_steps=0", "config.checkpoint.save_interval_steps"),
    ("--config.checkpoint.max_to_keep=0", "config.checkpoint.max_to_keep"),
    ("--config.rl.max_skipped_steps=-1", "config.rl.max_skipped_steps"),
    ("--config.rl.save_rollouts=-1", "config.rl.save_rollouts"),
    ("--config.pbsd.replay_routing=True", "config.pbsd.replay_routing"),  # a dense model
    ("--config.env.index=csr", "config.env.index"),
    ("--config.data.oracle.detour_share=1.5", "config.data.oracle.detour_share"),
    ("--config.data.oracle.slip_rate=1.5", "config.data.oracle.slip_rate"),
    ("--config.data.oracle.max_slips=-1", "config.data.oracle.max_slips"),
    ("--config.data.world.family_rate=-0.1", "config.data.world.family_rate"),
    ("--config.data.world.people=321", "config.data.world.people"),
    ("--config.data.splits.hop_weights=(0.5,-0.1)", "config.data.splits.hop_weights"),
    ("--config.data.splits.ood_hard_hops=4", "config.data.splits.ood_hard_hops"),
    ("--config.data.teacher_prompt=hints", "config.data.teacher_prompt"),
    ("--config.sft.corpus_fraction=1.0", "config.sft.corpus_fraction"),
    ("--config.log.wandb.mode=cloud", "config.log.wandb.mode"),
    ("--config.log.wandb.entity=lab", "config.log.wandb.entity"),  # W&B logging is off
    # The retrieval client's settings, whichever retriever is chosen.
    ("--config.env.timeout_s=0.0", "config.env.timeout_s"),
    ("--config.env.max_retries=-1", "config.env.max_retries"),
])
def test_bad_values_fail_at_start_up_naming_the_field(override, field):
  with pytest.raises(train.ConfigError, match=field.replace(".", r"\.")):
    train.validate(load("pbsd", override), num_devices=8)


def test_sft_optimizer_errors_name_the_sft_section():
  with pytest.raises(train.ConfigError, match=r"config\.sft\.lr"):
    train.validate(load("demo", "--config.sft.lr=-1.0"), num_devices=1)
  with pytest.raises(train.ConfigError, match=r"config\.optim\.schedule.*total_steps=10"):
    train.validate(load("demo", "--config.sft.schedule=", "--config.optim.schedule=cosine",
                        "--config.sft.steps=10"), num_devices=1)


@pytest.mark.parametrize("override, field", [("--config.env.timeout_s=0.0", "env.timeout_s"),
                                             ("--config.env.max_retries=-1", "env.max_retries")])
def test_http_retriever_settings_fail_at_start_up(override, field):
  config = load("pbsd", "--config.env.retriever=http", "--config.env.url=http://localhost:1/x",
                override)
  with pytest.raises(train.ConfigError, match=field.replace(".", r"\.")):
    train.validate(config, num_devices=1)


def test_a_mistyped_field_is_named_with_the_nearest_field():
  from pbsd_jax.run import cli
  config = load("pbsd")
  assert "config.pbsd.delta" in cli.field_paths(config)
  assert cli.unknown_field_message(config, ["prog", "--config.pbsd.delta=0.2"]) is None
  assert cli.unknown_field_message(config, ["prog", "--config.pbsd.delt=0.1"]) == (
      "config.pbsd.delt: the config has no such field; did you mean config.pbsd.delta?")
  assert cli.unknown_field_message(config, ["prog", "--config.zzz=1"]) == (
      "config.zzz: the config has no such field")


def test_algorithm_sections_hold_the_algorithms_defaults():
  """The config's defaults are the algorithms' own, written once (None as a typed 0)."""
  config = load("grpo")
  for name in ("pbsd", "rlsd", "gear", "opsd"):
    algo = algorithms.get(name)
    for field, value in config[name].items():
      assert getattr(algo, field) == value, (name, field)
  assert config.grpo.dual_clip == 0.0 and algorithms.get("grpo").dual_clip is None
  assert config.grpo.group_size == algorithms.get("grpo").group_size == 8


def test_batch_must_divide_over_the_data_shards():
  config = load("pbsd", "--config.rollout.prompts_per_step=1", "--config.grpo.group_size=3",
                "--config.mesh.data=2", "--config.mesh.fsdp=1")
  with pytest.raises(train.ConfigError, match="prompts_per_step"):
    train.validate(config, num_devices=2)


@pytest.mark.parametrize("name, billions", [("qwen2.5-0.5b", 0.494), ("qwen2.5-3b", 3.09),
                                            ("qwen3-0.6b", 0.596),
                                            ("qwen3-8b", 8.19), ("llama3-8b", 8.03)])
def test_model_sizes_have_the_public_checkpoints_parameter_counts(name, billions):
  from pbsd_jax.models import param_shapes
  config = train.build_model_config(load("pbsd", f"--config.model.name={name}"))
  count = sum(np.prod(x.shape) for x in jax.tree.leaves(param_shapes(config)))
  assert abs(count / 1e9 - billions) / billions < 0.01, count


def test_the_attention_switch_reaches_the_model_config():
  config = load("demo", "--config.model.attention=dot_product")
  assert train.build_model_config(config, vocab_size=2048).attention == "dot_product"
  assert train.build_model_config(load("demo"), vocab_size=2048).attention == "ours"


def test_how_the_layers_are_computed_is_the_runs_choice_also_for_an_init_dir_model(tmp_path):
  from pbsd_jax.run import policy_checkpoint
  saved = train.build_model_config(load("demo"), vocab_size=2048)
  policy_checkpoint.save_model_config(str(tmp_path), saved.replace(remat=True, scan_unroll=2))
  flags = (f"--config.model.init_dir={tmp_path}", "--config.model.scan_unroll=3",
           "--config.model.attention=dot_product", "--config.model.cache_dtype=bfloat16")
  for config in (train.build_model_config(load("demo", *flags), vocab_size=2048),
                 train.build_model_config(load("demo", *flags[1:]), vocab_size=2048)):
    assert (config.remat, config.scan_unroll, config.attention, config.cache_dtype) == (
        False, 3, "dot_product", "bfloat16")
    assert config.replace(remat=True, scan_unroll=2, attention="ours",
                          cache_dtype="") == saved.replace(remat=True, scan_unroll=2)
  for flag, field in (("scan_unroll=0", "scan_unroll"), ("cache_dtype=int8", "cache_dtype")):
    with pytest.raises(train.ConfigError, match=rf"^config\.model\.{field}: "):
      train.build_model_config(load("demo", *flags[:1], f"--config.model.{flag}"),
                               vocab_size=2048)


def test_an_init_dir_model_is_read_in_the_runs_precision(tmp_path):
  import jax.numpy as jnp
  from pbsd_jax.models import init_params
  from pbsd_jax.parallel import sharding
  from pbsd_jax.run import policy_checkpoint, train as loop
  saved = train.build_model_config(load("demo"), vocab_size=2048)
  params = init_params(saved, jax.random.key(0))
  policy_checkpoint.save_params(str(tmp_path), saved, params)
  spec = load_spec("demo", f"--config.model.init_dir={tmp_path}",
                   "--config.model.param_dtype=bfloat16",
                   "--config.model.dtype=bfloat16").for_vocabulary(2048)
  assert (spec.model.param_dtype, spec.model.dtype) == ("bfloat16", "bfloat16")
  mesh = sharding.make_mesh(devices=jax.devices()[:1])
  got = loop.initial_params(spec, mesh)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(got)):
    assert b.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a.astype(jnp.bfloat16)))


def test_tiny_size_takes_the_vocabulary_size():
  config = train.build_model_config(load("demo"), vocab_size=2048)
  assert isinstance(config, ModelConfig) and config.vocab_size == 2048
  assert set(SIZES) >= {"tiny", "qwen2.5-0.5b", "qwen3-0.6b", "qwen3-8b", "llama3-8b"}


def test_oracle_credit_needs_the_gold_chains_of_the_embedded_task():
  with pytest.raises(train.ConfigError,
                     match=r"^config\.algorithm='oracle_credit': needs the gold chains"):
    train.validate(load("pbsd", "--config.algorithm=oracle_credit",
                        "--config.data.train_files=/data/nq_train.jsonl"), num_devices=1)
  assert train.build_algorithm(load("long_horizon", "--config.algorithm=oracle_credit",
                                    "--config.oracle_credit.clip=0.5")).clip == 0.5


def test_the_chain_teacher_prompt_needs_the_embedded_task():
  with pytest.raises(train.ConfigError, match=r"^config\.data\.teacher_prompt='chain': states "
                                              r"the gold chain"):
    train.validate(load("pbsd", "--config.data.teacher_prompt=chain",
                        "--config.data.train_files=/data/nq_train.jsonl"), num_devices=1)
