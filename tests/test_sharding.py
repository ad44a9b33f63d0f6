"""Mesh, the logical-axis rules, sharding guard, and the RL step under a mesh / two processes.

Runs on the 8 fake CPU devices of conftest.py.
"""

import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import multiprocess_worker as mw
from pbsd_jax.models.transformer import param_axes, param_shapes, param_shardings
from pbsd_jax.parallel import sharding
from pbsd_jax.rl import learner, train_state
from script_env import script_env


def test_make_mesh_names_axes_and_fills_the_free_size():
  mesh = sharding.make_mesh(data=2, fsdp=-1, tensor=2)
  assert mesh.axis_names == ("data", "fsdp", "tensor")
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
  assert all(t == AxisType.Auto for t in mesh.axis_types)


def test_make_mesh_that_does_not_match_device_count_names_the_sizes():
  with pytest.raises(ValueError, match=r"mesh \(data=2, fsdp=2, tensor=3\) has 12 devices "
                                       r"but 8 are available"):
    sharding.make_mesh(2, 2, 3)


def test_make_mesh_rejects_a_zero_size_by_field_name():
  with pytest.raises(ValueError, match="mesh.tensor must be >= 1"):
    sharding.make_mesh(8, 1, 0)


def test_rules_map_logical_axes_to_mesh_axes():
  mesh = sharding.make_mesh(2, 2, 2)
  spec = lambda *names, shape=None: sharding.logical_to_mesh_spec(P(*names), mesh,
                                                                  shape=shape)
  assert spec("embed", "mlp") == P("fsdp", "tensor")
  assert spec("batch", "length") == P(("data", "fsdp"), None)
  assert spec("layers", "heads", "head_dim", "embed") == P(None, "tensor", None, "fsdp")
  # An axis already taken by an earlier dimension is not reused (both want 'tensor').
  assert spec("mlp", "vocab") == P("tensor", None)


def test_size_one_and_non_dividing_mesh_axes_are_dropped():
  mesh = sharding.make_mesh(1, 8, 1)
  spec = sharding.logical_to_mesh_spec(P("vocab", "embed"), mesh)
  assert spec == P(None, "fsdp")  # tensor has size 1
  assert sharding.logical_to_mesh_spec(P("vocab", "embed"), mesh, shape=(64, 12)) == P(None,
                                                                                      None)
  mesh = sharding.make_mesh(2, 2, 2)
  assert sharding.logical_to_mesh_spec(P("batch"), mesh, shape=(6,)) == P("data")


def test_unknown_logical_axis_is_an_error_naming_it():
  with pytest.raises(ValueError, match="logical axis 'experts' has no rule"):
    sharding.logical_to_mesh_spec(P("experts"), sharding.make_mesh(2, 2, 2))


def test_param_and_optimizer_state_shardings_follow_the_rules():
  config, tx = mw.make_config(), mw.make_tx()
  mesh = sharding.make_mesh(2, 2, 2)
  params = param_shardings(config, mesh)
  assert params["embedding"].spec == P("tensor", "fsdp")
  assert params["lm_head"].spec == P("fsdp", "tensor")
  assert params["layers"]["mlp"]["down_kernel"].spec == P(None, "tensor", "fsdp")
  assert params["layers"]["attn"]["k_kernel"].spec == P(None, "fsdp", "tensor", None)
  opt = sharding.opt_state_shardings(tx, param_shapes(config), params, mesh)
  adam = opt.inner_state[1][0]
  assert adam.mu["layers"]["mlp"]["gate_kernel"].spec == P(None, "fsdp", "tensor")
  assert adam.nu["embedding"].spec == P("tensor", "fsdp")
  assert adam.count.spec == P()
  assert opt.hyperparams["learning_rate"].spec == P()


def _sharded_shapes(config, mesh, rules):
  """Abstract parameters carrying the shardings `rules` give them (nothing allocated)."""
  shapes = param_shapes(config)
  shardings = sharding.logical_to_sharding(param_axes(config), mesh, rules, shapes)
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      shapes, shardings)


def test_guard_accepts_the_default_rules():
  mesh = sharding.make_mesh(2, 2, 2)
  sharding.assert_params_sufficiently_sharded(
      _sharded_shapes(mw.make_config(), mesh, sharding.RULES), mesh)


def test_guard_fails_when_rules_silently_replicate_the_mlp():
  mesh = sharding.make_mesh(2, 2, 2)
  rules = tuple((name, None if name == "mlp" else axes) for name, axes in sharding.RULES)
  with pytest.raises(ValueError, match=r"not sharded over every parameter mesh axis.*"
                                       r"\['layers'\]\['mlp'\]\['\w+_kernel'\].*\['tensor'\]"):
    sharding.assert_params_sufficiently_sharded(
        _sharded_shapes(mw.make_config(), mesh, rules), mesh)


def test_batch_sharding_splits_rows_over_data_and_fsdp():
  mesh = sharding.make_mesh(2, 2, 2)
  assert sharding.batch_sharding(mesh).spec == P(("data", "fsdp"))
  assert sharding.num_batch_shards(mesh) == 4
  assert sharding.process_batch_rows(16, mesh) == slice(0, 16)  # one process feeds all rows
  batch = sharding.shard_process_local_batch({"x": np.arange(32).reshape(16, 2)}, mesh, 16)
  assert batch["x"].sharding.spec == P(("data", "fsdp"))
  assert {s.data.shape for s in batch["x"].addressable_shards} == {(4, 2)}
  np.testing.assert_array_equal(np.asarray(batch["x"]), np.arange(32).reshape(16, 2))


def _assert_same_run(params, metrics, ref_params, ref_metrics):
  # The same leaves (zip would silently stop at the shorter run).
  assert jax.tree.structure(params) == jax.tree.structure(ref_params)
  assert len(metrics) == len(ref_metrics) > 0
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params),
                          jax.tree.leaves(ref_params)):
    np.testing.assert_allclose(np.asarray(a), b, rtol=1e-4, atol=1e-5,
                               err_msg=jax.tree_util.keystr(path))
  for m, ref in zip(metrics, ref_metrics):
    assert set(m) == set(ref)
    for k in ref:
      np.testing.assert_allclose(np.asarray(m[k]), ref[k], rtol=1e-4, atol=1e-5, err_msg=k)


def test_rl_step_on_a_2x2x2_mesh_matches_one_device_and_shards_big_params():
  config = mw.make_config()
  tx, _ = mw.reference_step()
  mesh = sharding.make_mesh(2, 2, 2)
  state = mw.initial_state(tx, train_state.train_state_shardings(config, tx, mesh))
  step = learner.make_rl_step(config, tx, mw.make_algo(), mw.MAX_TURNS, mw.make_plan(), mesh)
  metrics = []
  for seed in (10, 11):
    state, m = step(state, *mw.make_rollout(seed))
    metrics.append(m)
  ref_params, ref_metrics = mw.reference_run()
  # The batch really moves: two steps changed the parameters.
  assert np.max(np.abs(ref_params["lm_head"] - np.asarray(
      mw.initial_state(tx).params["lm_head"]))) > 1e-4
  _assert_same_run(state.params, metrics, ref_params, ref_metrics)
  gate = state.params["layers"]["mlp"]["gate_kernel"]  # [L=1, D=32, M=64]
  assert gate.sharding.spec == P(None, "fsdp", "tensor")
  assert {s.data.shape for s in gate.addressable_shards} == {(1, 16, 32)}
  mu = state.opt_state.inner_state[1][0].mu["embedding"]  # [V=64, D=32]
  assert {s.data.shape for s in mu.addressable_shards} == {(32, 16)}
  sharding.assert_params_sufficiently_sharded(state.params, mesh)


def test_on_policy_rl_step_on_a_2x2x2_mesh_matches_one_device():
  """One update in one pass: the old log-probs come from the sharded update's own forward."""
  config, tx, algo = mw.make_config(), mw.make_tx(), mw.make_algo()
  plan = learner.UpdatePlan(chunk_size=8)
  mesh = sharding.make_mesh(2, 2, 2)
  assert plan.on_policy(mw.BATCH, sharding.num_batch_shards(mesh))
  rollout = mw.make_rollout(10)
  state = mw.initial_state(tx, train_state.train_state_shardings(config, tx, mesh))
  state, metrics = learner.make_rl_step(config, tx, algo, mw.MAX_TURNS, plan, mesh)(
      state, *rollout)
  ref, ref_metrics = learner.make_rl_step(config, tx, algo, mw.MAX_TURNS, plan)(
      mw.initial_state(tx), *rollout)
  assert np.max(np.abs(np.asarray(ref.params["lm_head"])
                       - np.asarray(mw.initial_state(tx).params["lm_head"]))) > 1e-4
  _assert_same_run(state.params, [metrics], jax.device_get(ref.params),
                   [jax.device_get(ref_metrics)])


def _free_port():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_two_processes_over_gloo_match_one_process(tmp_path):
  out = tmp_path / "two_process.npz"
  port = _free_port()
  worker = os.path.join(os.path.dirname(__file__), "multiprocess_worker.py")
  procs = [subprocess.Popen([sys.executable, worker, str(i), "2", str(port), str(out)],
                            env=script_env(4), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
           for i in range(2)]
  logs = []
  try:
    ref_params, ref_metrics = mw.reference_run()  # computed while the workers start
    for p in procs:
      logs.append(p.communicate(timeout=420)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log[-3000:]
  saved = np.load(out)
  for path, ref in jax.tree_util.tree_leaves_with_path(ref_params):
    np.testing.assert_allclose(saved[jax.tree_util.keystr(path)], ref, rtol=1e-4, atol=1e-5,
                               err_msg=jax.tree_util.keystr(path))
  for i, ref in enumerate(ref_metrics):
    for k, v in ref.items():
      np.testing.assert_allclose(saved[f"metrics{i}/{k}"], v, rtol=1e-4, atol=1e-5, err_msg=k)


def test_activations_keep_their_rows_on_the_data_axes():
  """`constrain_rows` inside a jitted model: on a (data 2, fsdp 2, tensor 2) mesh the hidden
  states of a forward are split by rows over data x fsdp, so no device holds another's rows
  (without it XLA kept the rows whole and split the embedding axis, all-reducing every
  matmul's partial sums); rows that do not split, and arrays off a mesh, are left alone."""
  import jax.numpy as jnp
  from pbsd_jax.models import ModelConfig, Transformer, init_params
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  model = ModelConfig(vocab_size=64, hidden_size=16, num_layers=2, num_heads=2,
                      num_kv_heads=2, mlp_dim=32)
  params = init_params(model, jax.random.key(0), param_shardings(model, mesh))
  tokens = jax.device_put(np.arange(8 * 5).reshape(8, 5) % 64, sharding.replicated(mesh))
  hidden = jax.jit(lambda p, t: Transformer(model).apply(
      {"params": p}, t, compute_logits=False).hidden)(params, tokens)
  assert hidden.sharding.spec[0] == ("data", "fsdp")
  assert {s.data.shape for s in hidden.addressable_shards} == {(2, 5, 16)}
  odd = jax.device_put(np.zeros((6, 3)), sharding.replicated(mesh))
  assert jax.jit(sharding.constrain_rows)(odd).sharding.spec in (P(), P(None))
  np.testing.assert_array_equal(sharding.constrain_rows(jnp.ones((6, 3))), np.ones((6, 3)))
  # The same numbers as on one device.
  one = Transformer(model).apply({"params": jax.device_get(params)}, np.asarray(tokens),
                                 compute_logits=False).hidden
  np.testing.assert_allclose(hidden, one, rtol=1e-5, atol=1e-6)
