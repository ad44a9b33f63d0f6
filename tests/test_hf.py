"""Hugging Face interop: exact logits, greedy tokens and round trips against `transformers`.

The torch-backed tests need the `hf` extra (torch, transformers); the rest (round trips of our
own params, config mapping, errors) run without it.
"""

import dataclasses
import functools
import importlib.util
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from safetensors import safe_open

from pbsd_jax.generate.sampling import Sampler
from pbsd_jax.models import hf
from pbsd_jax.models.config import ModelConfig, RopeScaling
from pbsd_jax.models.hf import config as hf_config, safetensors_io
from pbsd_jax.models.transformer import param_axes, param_shapes, rope_frequencies
from pbsd_jax.parallel import sharding

try:
  import hf_fixtures  # needs torch + transformers
  import torch
except ImportError:
  hf_fixtures = None

requires_torch = pytest.mark.skipif(hf_fixtures is None, reason="needs the hf extra")
CASES = sorted(hf_fixtures.CASES) if hf_fixtures else []
SINGLE_FILE_CASES = ("qwen2", "llama_mqa")  # the others are written as several shards
GEN_STEPS = 32


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """case -> (directory written by `save_pretrained`, the torch model)."""
  out = {}
  for i, case in enumerate(CASES):
    path = str(tmp_path_factory.mktemp(case))
    shard = "5GB" if case in SINGLE_FILE_CASES else "20KB"
    out[case] = (path, hf_fixtures.write_checkpoint(case, path, seed=i, max_shard_size=shard))
  return out


@functools.lru_cache(maxsize=None)
def _loaded(path):
  return hf.load(path)


def _tokens_with_left_padding():
  tokens = np.random.RandomState(0).randint(0, 128, (2, 12)).astype(np.int32)
  mask = np.ones((2, 12), bool)
  mask[1, :3] = False
  return tokens, mask


@requires_torch
@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers_including_left_padded_rows(checkpoints, case):
  path, model = checkpoints[case]
  config, params = _loaded(path)
  tokens, mask = _tokens_with_left_padding()
  ours = np.asarray(hf_fixtures.forward_logits(config, params, tokens, mask))
  theirs = hf_fixtures.torch_logits(model, tokens, mask)
  np.testing.assert_allclose(ours[mask], theirs[mask], atol=1e-4, rtol=0)


@requires_torch
@pytest.mark.parametrize("case", CASES)
def test_greedy_generation_of_32_tokens_matches_transformers(checkpoints, case):
  """Prefill + cached one-token decodes through the project's sampler at temperature 0."""
  path, model = checkpoints[case]
  config, params = _loaded(path)
  prompt = np.random.RandomState(1).randint(0, 128, (2, 6)).astype(np.int32)
  state, result = Sampler(config, temperature=0.0).generate(
      params, jnp.asarray(prompt), jnp.ones(prompt.shape, bool), jax.random.key(0), GEN_STEPS)
  np.testing.assert_array_equal(np.asarray(result.num_new), [GEN_STEPS, GEN_STEPS])
  with torch.no_grad():
    theirs = model.generate(torch.as_tensor(prompt, dtype=torch.long),
                            attention_mask=torch.ones(prompt.shape, dtype=torch.long),
                            max_new_tokens=GEN_STEPS, min_new_tokens=GEN_STEPS,
                            do_sample=False, pad_token_id=0)
  np.testing.assert_array_equal(np.asarray(state.tokens[:, prompt.shape[1]:]),
                                theirs[:, prompt.shape[1]:].numpy())


@requires_torch
@pytest.mark.parametrize("case", CASES)
def test_export_reloads_in_transformers_with_identical_tensors_and_logits(
    checkpoints, case, tmp_path):
  path, model = checkpoints[case]
  config, params = _loaded(path)
  hf.save(config, params, str(tmp_path), architecture=model.config.architectures[0],
          max_shard_size="16KB")
  assert os.path.exists(tmp_path / safetensors_io.INDEX_FILE)
  reloaded = hf_fixtures.from_pretrained(str(tmp_path))
  original, exported = model.state_dict(), reloaded.state_dict()
  assert sorted(exported) == sorted(original)
  for name, tensor in original.items():
    assert torch.equal(exported[name], tensor), name
  tokens, mask = _tokens_with_left_padding()
  np.testing.assert_array_equal(hf_fixtures.torch_logits(reloaded, tokens, mask),
                                hf_fixtures.torch_logits(model, tokens, mask))


@requires_torch
@pytest.mark.parametrize("case", CASES)
def test_loaded_params_have_the_structure_shapes_and_dtypes_of_init_params(checkpoints, case):
  config, params = _loaded(checkpoints[case][0])
  expected = param_shapes(config)
  assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(expected)
  for got, want in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(expected)):
    assert (got.shape, got.dtype) == (want.shape, want.dtype)


@requires_torch
def test_config_maps_every_family_switch(checkpoints):
  assert _loaded(checkpoints["qwen2"][0])[0] == ModelConfig(
      vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=64,
      rope_theta=1e6, rms_norm_eps=1e-6, qkv_bias=True)
  assert _loaded(checkpoints["qwen3_moe_unnormed_tied"][0])[0] == ModelConfig(
      vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=64,
      rope_theta=1e4, qk_norm=True, tie_embeddings=True, num_experts=4, num_experts_per_tok=2,
      expert_mlp_dim=16, norm_topk_prob=False)
  assert _loaded(checkpoints["qwen3_wide_heads"][0])[0].head_dim == 16


_CANDIDATES = ("vocab", "mlp", "head_dim")


def _rules_to_fsdp(candidates=_CANDIDATES):
  """A logical-axis table (of `sharding.RULES`' names) mapping only `candidates` to 'fsdp'."""
  return tuple((name, "fsdp" if name in candidates else None) for name, _ in sharding.RULES)


def _first_axis_rule(mesh, candidates=_CANDIDATES):
  """Logical spec -> sharding: the first candidate axis present goes to 'fsdp' (what
  `_rules_to_fsdp(candidates)` gives, written out by hand)."""

  def rule(spec):
    chosen = next((axis for axis in spec if axis in candidates), None)
    return NamedSharding(mesh, P(*("fsdp" if chosen is not None and axis == chosen else None
                                   for axis in spec)))
  return rule


@requires_torch
def test_multi_shard_checkpoint_loads_each_array_with_its_sharding(checkpoints):
  path = checkpoints["qwen3_wide_heads"][0]  # 20KB shards; head_dim 16 split over 8 devices
  index = json.load(open(os.path.join(path, safetensors_io.INDEX_FILE)))
  assert len(set(index["weight_map"].values())) > 1
  config, reference = _loaded(path)
  mesh = jax.make_mesh((8,), ("fsdp",))
  rule = _first_axis_rule(mesh)
  _, params = hf.load(path, mesh=mesh, rules=_rules_to_fsdp())
  flat_specs = jax.tree_util.tree_leaves(param_axes(config),
                                         is_leaf=lambda x: isinstance(x, P))
  flat = zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(reference), flat_specs)
  sharded = 0
  for got, want, spec in flat:
    assert got.sharding == rule(spec)
    if "fsdp" in rule(spec).spec:
      sharded += 1
      assert got.addressable_shards[0].data.size == want.size // 8
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert sharded >= 10  # embedding, lm_head, q/k/v/o kernels, norms over head_dim, MLP
  tree = jax.tree_util.tree_map(rule, param_axes(config), is_leaf=lambda x: isinstance(x, P))
  _, from_tree = hf.load(path, shardings=tree)
  assert jax.tree_util.tree_leaves(jax.tree_util.tree_map(lambda x: x.sharding, from_tree)) == [
      rule(spec) for spec in flat_specs]


@requires_torch
def test_mesh_without_shardings_replicates(checkpoints):
  path = checkpoints["llama_mqa"][0]
  mesh = jax.make_mesh((8,), ("fsdp",))
  _, params = hf.load(path, mesh=mesh)
  embedding = params["embedding"]
  assert embedding.sharding == NamedSharding(mesh, P())
  np.testing.assert_array_equal(np.asarray(embedding), np.asarray(_loaded(path)[1]["embedding"]))


@requires_torch
def test_fused_expert_tensors_load_like_per_expert_tensors(checkpoints, tmp_path):
  """transformers 5 keeps experts fused (`gate_up_proj [E, 2M, D]`); such files load too."""
  from safetensors.torch import save_file
  path, model = checkpoints["qwen3_moe"]
  state = {name: t.contiguous() for name, t in model.state_dict().items()}
  assert "model.layers.0.mlp.experts.gate_up_proj" in state
  save_file(state, str(tmp_path / safetensors_io.SINGLE_FILE), metadata={"format": "pt"})
  config_file = hf_config.CONFIG_FILE
  (tmp_path / config_file).write_text(open(os.path.join(path, config_file)).read())
  mesh = jax.make_mesh((8,), ("fsdp",))
  _, fused = hf.load(str(tmp_path), mesh=mesh, rules=_rules_to_fsdp(("mlp",)))
  _, per_expert = _loaded(path)
  assert fused["layers"]["moe"]["up_kernel"].sharding.spec == P(None, None, None, "fsdp")
  jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(fused),
                         jax.device_get(per_expert))


@requires_torch
def test_attention_bias_loads_the_output_bias_and_exports_as_the_same_family(checkpoints,
                                                                             tmp_path):
  path, model = checkpoints["llama_attention_bias"]
  config, params = _loaded(path)
  assert config.qkv_bias and config.o_bias
  np.testing.assert_array_equal(
      params["layers"]["attn"]["o_bias"][1],
      model.state_dict()["model.layers.1.self_attn.o_proj.bias"].numpy())
  hf.save(config, params, str(tmp_path))
  assert json.load(open(tmp_path / hf_config.CONFIG_FILE))["architectures"] == [hf_config.LLAMA]
  without = config.replace(qkv_bias=True, o_bias=False)  # q/k/v biases only: Qwen2's
  assert hf_config.default_architecture(without) == hf_config.QWEN2
  with pytest.raises(ValueError, match="o_bias=False differ"):
    hf_config.config_to_hf(without, hf_config.LLAMA)


@requires_torch
@pytest.mark.parametrize("case, scaling", [("llama31_rope", "llama3"),
                                           ("qwen3_yarn_bias", "yarn")])
def test_scaled_rope_changes_the_logits_it_matches(checkpoints, case, scaling):
  """The scaled cases are not plain RoPE in disguise: dropping the scaling moves the logits
  by far more than the 1e-4 they match transformers to; so does dropping YaRN's multiplier."""
  config, params = _loaded(checkpoints[case][0])
  assert config.rope_scaling.kind == scaling
  tokens, mask = _tokens_with_left_padding()
  ours = np.asarray(hf_fixtures.forward_logits(config, params, tokens, mask))
  plain = np.asarray(hf_fixtures.forward_logits(config.replace(rope_scaling=None), params,
                                                tokens, mask))
  assert np.abs(ours - plain)[mask].max() > 1e-2
  if scaling == "yarn":
    assert config.rope_scaling.attention_factor == pytest.approx(0.1 * np.log(4.0) + 1.0)
    unscaled = config.replace(rope_scaling=config.rope_scaling.__class__(
        **{**dataclasses.asdict(config.rope_scaling), "attention_factor": 1.0}))
    assert np.abs(ours - np.asarray(hf_fixtures.forward_logits(
        unscaled, params, tokens, mask)))[mask].max() > 1e-2


# Round trips of our own params: no torch needed.

_OWN_CONFIGS = {
    "llama_bf16": ModelConfig(vocab_size=64, hidden_size=32, num_heads=4, num_kv_heads=1,
                              mlp_dim=48, param_dtype="bfloat16", dtype="bfloat16"),
    "qwen2_tied": ModelConfig(vocab_size=64, hidden_size=32, num_heads=4, num_kv_heads=2,
                              mlp_dim=48, qkv_bias=True, tie_embeddings=True, rope_theta=1e6),
    "qwen3_moe": ModelConfig(vocab_size=64, hidden_size=32, num_heads=2, num_kv_heads=2,
                             head_dim=24, mlp_dim=48, qk_norm=True, num_experts=3,
                             num_experts_per_tok=2, expert_mlp_dim=8, norm_topk_prob=False),
    "llama31_bias": ModelConfig(vocab_size=64, hidden_size=32, num_heads=4, num_kv_heads=2,
                                mlp_dim=48, qkv_bias=True, o_bias=True, rope_theta=5e5,
                                rope_scaling=RopeScaling("llama3", 8.0, 8192, 1.0, 4.0)),
    "qwen3_yarn": ModelConfig(vocab_size=64, hidden_size=32, num_heads=4, num_kv_heads=2,
                              head_dim=16, mlp_dim=48, qk_norm=True, rope_theta=1e6,
                              rope_scaling=RopeScaling("yarn", 4.0, 32768, beta_fast=16.0,
                                                       attention_factor=1.2, truncate=False)),
}


def _random_params(config, seed=0):
  """Random params of `config` (numpy, `param_dtype`), without running the model's init."""
  rng = np.random.RandomState(seed)
  shapes = param_shapes(config)
  return jax.tree_util.tree_map(
      lambda s: rng.standard_normal(s.shape).astype(s.dtype), shapes)


@pytest.mark.parametrize("name", sorted(_OWN_CONFIGS))
def test_save_then_load_is_bit_exact(name, tmp_path):
  config = _OWN_CONFIGS[name]
  params = _random_params(config, seed=3)
  hf.save(config, params, str(tmp_path), max_shard_size=4096)
  loaded_config, loaded = hf.load(str(tmp_path))
  assert loaded_config == config
  jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(loaded),
                         jax.device_get(params))


@pytest.mark.parametrize("name", sorted(_OWN_CONFIGS))
def test_config_survives_config_json(name):
  config = _OWN_CONFIGS[name]
  as_json = json.loads(json.dumps(hf_config.config_to_hf(config)))
  assert hf_config.config_from_hf(as_json) == config


def test_single_file_and_sharded_saves_write_the_expected_files(tmp_path):
  config = _OWN_CONFIGS["qwen2_tied"]
  params = _random_params(config)
  hf.save(config, params, str(tmp_path / "one"))
  assert sorted(os.listdir(tmp_path / "one")) == [hf_config.CONFIG_FILE,
                                                  safetensors_io.SINGLE_FILE]
  hf.save(config, params, str(tmp_path / "many"), max_shard_size="10KB")
  index = json.load(open(tmp_path / "many" / safetensors_io.INDEX_FILE))
  shards = sorted(set(index["weight_map"].values()))
  assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
  assert index["metadata"]["total_size"] == sum(x.size * 4 for x in jax.tree.leaves(params))


def _rewrite_single_file(path, change):
  """Applies `change(dict name -> array)` to a single-file checkpoint at `path`."""
  file = os.path.join(path, safetensors_io.SINGLE_FILE)
  with safe_open(file, framework="numpy") as source:
    tensors = {name: source.get_tensor(name) for name in source.keys()}
  change(tensors)
  safetensors_io.write_file(file, tensors)


@pytest.fixture
def own_checkpoint(tmp_path):
  config = _OWN_CONFIGS["qwen2_tied"]
  hf.save(config, _random_params(config), str(tmp_path))
  return str(tmp_path)


def test_missing_tensor_error_names_the_tensor_and_expected_shape(own_checkpoint):
  _rewrite_single_file(own_checkpoint,
                       lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
  with pytest.raises(ValueError, match=r"missing tensor model\.layers\.1\.self_attn\.k_proj"
                     r"\.weight \(expected shape \(16, 32\)\)"):
    hf.load(own_checkpoint)


def test_shape_mismatch_error_names_the_tensor_and_both_shapes(own_checkpoint):
  def widen(tensors):
    tensors["model.layers.0.mlp.up_proj.weight"] = np.zeros((49, 32), np.float32)
  _rewrite_single_file(own_checkpoint, widen)
  with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight has shape "
                     r"\(49, 32\), expected \(48, 32\)"):
    hf.load(own_checkpoint)


def test_shardings_pytree_without_an_entry_names_the_parameter(own_checkpoint):
  mesh = jax.make_mesh((8,), ("fsdp",))
  with pytest.raises(ValueError, match="shardings has no entry for final_norm/scale"):
    hf.load(own_checkpoint, shardings={"embedding": NamedSharding(mesh, P())})


def test_unknown_architecture_error_names_it(own_checkpoint):
  config_path = os.path.join(own_checkpoint, hf_config.CONFIG_FILE)
  config = json.load(open(config_path))
  config["architectures"] = ["GPT2LMHeadModel"]
  json.dump(config, open(config_path, "w"))
  with pytest.raises(ValueError, match="GPT2LMHeadModel.*not supported"):
    hf.load(own_checkpoint)


def test_missing_weights_file_is_an_error(tmp_path):
  config = _OWN_CONFIGS["qwen2_tied"]
  (tmp_path / hf_config.CONFIG_FILE).write_text(json.dumps(hf_config.config_to_hf(config)))
  with pytest.raises(ValueError, match="model.safetensors"):
    hf.load(str(tmp_path))


_LLAMA = hf_config.config_to_hf(_OWN_CONFIGS["llama_bf16"])


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type='dynamic'"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e6}}, "rope_type='longrope'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                       "original_max_position_embeddings": 8192}},
     "rope_scaling.low_freq_factor"),
    ({"rope_scaling": {"rope_type": "yarn"}, "max_position_embeddings": None},
     "original_max_position_embeddings"),
    ({"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1},
     "sliding-window"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "sliding-window"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"num_hidden_layers": None}, "num_hidden_layers"),
])
def test_unsupported_options_are_rejected_by_name(change, message):
  with pytest.raises(ValueError, match=message):
    hf_config.config_from_hf({**_LLAMA, **change})


@pytest.mark.parametrize("change, message", [
    ({"mlp_only_layers": [1]}, "mlp_only_layers"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
])
def test_qwen3_moe_with_dense_layers_is_rejected(change, message):
  moe = hf_config.config_to_hf(_OWN_CONFIGS["qwen3_moe"])
  with pytest.raises(ValueError, match=message):
    hf_config.config_from_hf({**moe, **change})


def test_rope_theta_is_read_from_v5_rope_parameters():
  config = hf_config.config_from_hf({**_LLAMA, "rope_theta": None,
                              "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})
  assert config.rope_theta == 5e5


def test_scaled_rope_reads_the_same_from_v4_and_v5_fields():
  llama31 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 8192}
  v4 = hf_config.config_from_hf({**_LLAMA, "rope_theta": 5e5,
                                 "rope_scaling": {"rope_type": "llama3", **llama31}})
  v5 = hf_config.config_from_hf({**_LLAMA, "rope_theta": None, "rope_parameters": {
      "rope_type": "llama3", "rope_theta": 5e5, **llama31}})
  assert v4 == v5 and v4.rope_theta == 5e5
  assert v4.rope_scaling == RopeScaling("llama3", 8.0, 8192, 1.0, 4.0)
  # YaRN: the factor from the context lengths when absent, the multiplier from mscale.
  yarn = hf_config.config_from_hf({**_LLAMA, "max_position_embeddings": 131072, "rope_scaling": {
      "type": "yarn", "original_max_position_embeddings": 32768, "mscale": 2.0,
      "mscale_all_dim": 1.0}})
  assert yarn.rope_scaling.factor == 4.0
  assert yarn.rope_scaling.attention_factor == pytest.approx(
      (0.2 * np.log(4.0) + 1.0) / (0.1 * np.log(4.0) + 1.0))


@requires_torch
@pytest.mark.parametrize("name", ["llama31_bias", "qwen3_yarn"])
def test_rope_frequencies_equal_transformers_at_a_real_head_dim(name):
  import transformers
  from transformers import modeling_rope_utils
  config = _OWN_CONFIGS[name].replace(head_dim=128)
  hf = hf_config.config_to_hf(config)
  theirs, scale = modeling_rope_utils.ROPE_INIT_FUNCTIONS[config.rope_scaling.kind](
      transformers.AutoConfig.for_model(hf.pop("model_type"), **hf), "cpu")
  ours, our_scale = rope_frequencies(128, config.rope_theta, config.rope_scaling)
  plain, _ = rope_frequencies(128, config.rope_theta)
  # The slowest frequencies are divided by the whole factor (8 and 4), the fastest kept.
  ratio = np.asarray(plain) / theirs.numpy()
  assert ratio[0] == 1.0 and ratio[-1] == pytest.approx(config.rope_scaling.factor)
  np.testing.assert_allclose(np.asarray(ours), theirs.numpy(), rtol=1e-6, atol=0)
  assert our_scale == pytest.approx(scale)


def test_scaled_rope_and_output_bias_survive_model_config_json(tmp_path):
  from pbsd_jax.run import policy_checkpoint
  for config in (_OWN_CONFIGS["llama31_bias"], _OWN_CONFIGS["qwen3_yarn"]):
    path = policy_checkpoint.save_model_config(str(tmp_path), config)
    assert policy_checkpoint.load_model_config(path) == config


def test_save_rejects_an_architecture_that_cannot_hold_the_config(tmp_path):
  config = _OWN_CONFIGS["qwen3_moe"]
  with pytest.raises(ValueError, match="cannot be saved as LlamaForCausalLM"):
    hf.save(config, _random_params(config), str(tmp_path),
            architecture=hf_config.LLAMA)


def test_save_error_names_a_param_with_the_wrong_shape(tmp_path):
  config = _OWN_CONFIGS["qwen2_tied"]
  params = _random_params(config)
  params["embedding"] = params["embedding"][:10]
  with pytest.raises(ValueError, match=r"embedding has shape \(10, 32\), expected \(64, 32\)"):
    hf.save(config, params, str(tmp_path))


def _convert_script():
  spec = importlib.util.spec_from_file_location(
      "convert_hf", os.path.join(os.path.dirname(__file__), "..", "scripts", "convert_hf.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@requires_torch
def test_convert_script_round_trip_reproduces_the_checkpoint(checkpoints, tmp_path):
  path, model = checkpoints["qwen3_wide_heads"]
  convert = _convert_script()
  config = convert.convert_import(path, str(tmp_path / "ckpt"))
  assert convert.load_model_config(str(tmp_path / "ckpt")) == config
  convert.convert_export(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
  assert os.path.exists(tmp_path / "hf" / "generation_config.json")  # assets carried over
  exported = hf_fixtures.from_pretrained(str(tmp_path / "hf"))
  assert exported.config.architectures == [hf_config.QWEN3]
  assert exported.config.max_position_embeddings == model.config.max_position_embeddings
  for name, tensor in model.state_dict().items():
    assert torch.equal(exported.state_dict()[name], tensor), name
