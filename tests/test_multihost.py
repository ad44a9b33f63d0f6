"""scripts/train.py and scripts/evaluate.py across processes: real subprocesses, two processes
joined over gloo on a loopback coordinator, 2 fake CPU devices each, real orbax checkpoints.

The run: a 2x2x1 mesh over both processes' 4 devices, `data` across the processes and `fsdp`
within each (as on a pod: the tensor axis, which stays within a host too, is compared over a
2x2x2 mesh in one process by test_sharding), evaluating as it trains (`EVAL`: 6 validation
rows, padded to 8 over the 4 devices the batch splits over) and saving every step's rollout;
killed once, after its first RL step, and resumed, so what it is compared on holds across a
resume too. It is compared with the one-device run of the same config (`opsd_run`), with its
evaluations recomputed on one device, and with its last RL step redone on one device from its
checkpoint.

Tolerance: the runs sample the same trajectories (asserted: every per-step metric that counts
tokens, turns or rewards is equal), but a mesh splits each reduction (matmul contractions over
the tensor axis, gradient sums over the data axes) into partial sums added in another order,
and gloo's all-reduce need not add in XLA:CPU's order, so float32 parameters differ in the last
bits, compounded over 7 Adam updates. Measured: a max |diff| of 9e-7 (the pair vs 1 device; 2e-6
for 1 device vs 2x2x2 in one process); asserted: 2e-5. Evaluation and saved rollouts are
compared the same way: what was sampled exactly, floats at the tolerance.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from pbsd_jax.models import param_shapes
from pbsd_jax.parallel import sharding
from pbsd_jax.rl import train_state
from pbsd_jax.run import checkpoint, run_config
from script_env import script_env
from test_configs import load
from test_train import OPSD, ROOT, SMALL, _checkpoint, _metrics, _train

# One worker runs them all, so the runs below are made once (conftest: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("multihost")

MESH = ("--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=1")
# Two processes of one device each, both on `data`: the decode loops hold no collective over
# gloo but the one that ends them.
DATA_PARALLEL = ("--config.mesh.data=2", "--config.mesh.fsdp=1", "--config.mesh.tensor=1")
EVAL = ("--config.eval.every=3", "--config.eval.sft_every=2", "--config.eval.num_examples=6",
        "--config.rl.save_rollouts=1")
ATOL = 2e-5
# Per-step metrics that depend only on what was sampled, not on float rounding.
SAMPLED = ("accuracy", "mean_turns", "mean_action_tokens", "searches", "failed_searches")


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _pair(kg, workdir, port, *extra):
  """Two processes of one run, 2 fake CPU devices each, the 2x2x1 mesh over all 4; the run
  evaluates as it trains and saves its rollouts (`EVAL`)."""
  data_dir = os.path.dirname(kg.paths["spm_model"])
  return [_train(workdir, data_dir, *OPSD, *MESH, *EVAL, *_processes(port, i), *extra,
                 wait=False, devices=2) for i in range(2)]


def _processes(port, i):
  return (f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", f"--process_id={i}")


def _wait(procs, timeout=600):
  outs = []
  try:
    for p in procs:
      outs.append(p.communicate(timeout=timeout)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.communicate()
  return [p.returncode for p in procs], outs


def _assert_close_runs(a, b, atol=ATOL):
  got, want = _checkpoint(a), _checkpoint(b)
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(got["params"]),
                          jax.tree.leaves(want["params"])):
    np.testing.assert_allclose(x, y, rtol=0, atol=atol, err_msg=jax.tree_util.keystr(path))
  np.testing.assert_array_equal(got["rng"], want["rng"])  # the same samples ahead
  # Compared on the stages both logged (a run without `EVAL` has no `eval` rows).
  rows_a, rows_b = _metrics(a), _metrics(b)
  both = {r["stage"] for r in rows_a} & {r["stage"] for r in rows_b}
  rows_a, rows_b = ([r for r in rows if r["stage"] in both] for rows in (rows_a, rows_b))
  assert [(r["stage"], r["step"]) for r in rows_a] == [(r["stage"], r["step"]) for r in rows_b]
  for x, y in zip(rows_a, rows_b):
    assert {k: x[k] for k in SAMPLED if k in x} == {k: y[k] for k in SAMPLED if k in y}


@pytest.fixture(scope="module")
def two_processes(kg, tmp_path_factory):
  """The two-process run, killed once its first RL step is saved (process 1, then its peer,
  which cannot go on alone, as a cluster scheduler ends the job) and resumed by the same
  command: `(workdir, the RL steps saved when it was killed)`."""
  workdir = str(tmp_path_factory.mktemp("two_processes"))
  procs = _pair(kg, workdir, _free_port())
  marker = os.path.join(workdir, "ckpt_rl", "1")
  deadline = time.time() + 300
  while not os.path.exists(marker) and all(p.poll() is None for p in procs) \
      and time.time() < deadline:
    time.sleep(0.05)
  procs[1].send_signal(signal.SIGKILL)
  time.sleep(2.0)
  procs[0].send_signal(signal.SIGKILL)
  codes, _ = _wait(procs, timeout=60)
  assert codes == [-signal.SIGKILL, -signal.SIGKILL], "the run ended before it was killed"
  saved = sorted(int(d) for d in os.listdir(os.path.join(workdir, "ckpt_rl")) if d.isdigit())
  codes, outs = _wait(_pair(kg, workdir, _free_port()))
  assert codes == [0, 0], outs[0][-2000:] + outs[1][-2000:]
  return workdir, saved


def test_a_killed_process_of_two_resumes_with_its_peer_and_ends_where_one_process_does(
    two_processes, opsd_run, record_property):
  workdir, saved = two_processes
  assert 1 in saved and 3 not in saved  # killed between the first RL step and the last
  rl = [r for r in _metrics(opsd_run) if r["stage"] == "rl"]
  assert all(r["grad_norm"] > 0 for r in rl)  # the parameters compared below moved
  # The same samples (every step's counts and the random state, exactly) and parameters
  # within the mesh tolerance, as the uninterrupted run on one device.
  _assert_close_runs(workdir, opsd_run)
  # Only process 0 wrote the metrics: each step once, across the kill.
  logged = [(r["stage"], r["step"]) for r in _metrics(workdir)]
  assert len(logged) == len(set(logged))
  record_property("faults_injected", 1)
  record_property("runs_resumed", 1)


def test_two_processes_evaluate_what_one_device_does(kg, two_processes, opsd_run):
  from pbsd_jax.run import task as task_lib, train
  evals = lambda workdir: {(r["stage"], r["step"]): {k: r[k] for k in SAMPLED if k in r}
                           for r in _metrics(workdir) if r["stage"].startswith("eval")}
  got = evals(two_processes[0])
  assert sorted(got) == [("eval", 0), ("eval", 3), ("eval_sft", 2), ("eval_sft", 4)]
  # One device, from the one-device run's checkpoints (RL step 0 starts from SFT step 4).
  spec = run_config.validate(load("pbsd", *SMALL, *OPSD, *EVAL), num_devices=1)
  task = task_lib.prepare_task(spec, os.path.dirname(kg.paths["spm_model"]))
  spec = spec.for_vocabulary(task.vocab.vocab_size)
  device = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  for (stage, step), row in got.items():
    params = _checkpoint(opsd_run, *(("rl", step) if stage == "eval" and step
                                     else ("sft", step or 4)))["params"]
    result = train.validation_accuracy(spec, task, params, mesh=device)
    assert {k: result[k] for k in row} == row, (stage, step)


def test_the_two_process_run_continues_on_one_device_and_saves_the_rows_it_does(
    kg, two_processes, tmp_path):
  """Its last RL step redone on one device, from its step-2 checkpoint: the same rollout rows
  (every process's, in order), evaluation and parameters."""
  pair = two_processes[0]
  assert sorted(os.listdir(os.path.join(pair, "rollouts"))) == [
      "rl_1.npz", "rl_2.npz", "rl_3.npz"]
  workdir = str(tmp_path / "run")
  shutil.copytree(pair, workdir)
  shutil.rmtree(os.path.join(workdir, "ckpt_rl", "3"))
  os.remove(os.path.join(workdir, "rollouts", "rl_3.npz"))
  _train(workdir, os.path.dirname(kg.paths["spm_model"]), *OPSD, *EVAL)  # 1 device
  _assert_close_runs(workdir, pair)  # its step-3 evaluation included
  name = os.path.join("rollouts", "rl_3.npz")
  with np.load(os.path.join(workdir, name)) as want, np.load(os.path.join(pair, name)) as got:
    assert sorted(got) == sorted(want) and got["tokens"].shape[0] == 4
    for key in want:
      if want[key].dtype.kind == "f":
        np.testing.assert_allclose(got[key], want[key], rtol=0, atol=ATOL, err_msg=key)
      else:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def _evaluate(kg, ckpt_dir, out, *extra, devices=1):
  """scripts/evaluate.py on `ckpt_dir`'s latest step: 4 validation questions, greedy and one
  top-p sample each, in episodes of at most 2 turns of 16 tokens."""
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "evaluate.py"), f"--ckpt_dir={ckpt_dir}",
         f"--config={os.path.join(ROOT, 'configs', 'pbsd.py')}", *SMALL,
         f"--data_dir={os.path.dirname(kg.paths['spm_model'])}", "--splits=rl_validation",
         "--num_examples=4", "--samples=1", "--batch_size=4", "--config.env.max_turns=2",
         "--config.env.max_action_tokens=16", f"--out={out}", *extra]
  return subprocess.Popen(cmd, env=script_env(devices),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _flat(tree, prefix=""):
  """`{"/key/0/...": leaf}` of a JSON tree."""
  items = (tree.items() if isinstance(tree, dict) else enumerate(tree)
           if isinstance(tree, list) else None)
  if items is None:
    return {prefix: tree}
  return {k: v for key, value in items for k, v in _flat(value, f"{prefix}/{key}").items()}


def test_evaluate_on_two_processes_writes_once_what_one_process_computes(kg, two_processes,
                                                                         tmp_path):
  ckpt_dir = os.path.join(two_processes[0], "ckpt_rl")
  port = _free_port()
  pair = [_evaluate(kg, ckpt_dir, tmp_path / "pair" / "eval.json", *DATA_PARALLEL,
                    *_processes(port, i)) for i in range(2)]
  one = _evaluate(kg, ckpt_dir, tmp_path / "one" / "eval.json")
  codes, outs = _wait(pair + [one])
  assert codes == [0, 0, 0], "\n".join(out[-2000:] for out in outs)
  assert "wrote" in outs[0] and "wrote" not in outs[1] and "accuracy" not in outs[1]
  assert os.listdir(tmp_path / "pair") == ["eval.json"]
  got, want = (_flat(json.loads((tmp_path / d / "eval.json").read_text()))
               for d in ("pair", "one"))
  assert sorted(got) == sorted(want)
  assert any(k.endswith("credit/auc_evidence") for k in got)
  for key, value in want.items():
    if isinstance(value, float) and not float(value).is_integer():
      assert got[key] == pytest.approx(value, rel=0, abs=ATOL, nan_ok=True), key
    else:
      assert got[key] == value, key


@pytest.mark.parametrize("sizes", [(1, 1, 1), (4, 2, 1)], ids=["1_device", "4x2x1"])
def test_a_checkpoint_of_two_processes_restores_onto_one_process(kg, two_processes, sizes):
  config = load("pbsd", *SMALL, *OPSD)
  model = run_config.build_model_config(config, kg.vocab.vocab_size)
  tx = run_config.build_optimizer(config, "rl")
  data, fsdp, tensor = sizes
  mesh = sharding.make_mesh(data, fsdp, tensor, devices=jax.devices()[:data * fsdp * tensor])
  abstract = jax.eval_shape(lambda params: train_state.init_train_state(
      params, tx, jax.random.key(0)), param_shapes(model))
  shardings = train_state.train_state_shardings(model, tx, mesh)
  target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract, shardings)
  with checkpoint.Checkpointer(os.path.join(two_processes[0], "ckpt_rl")) as ckpt:
    state, data_state = ckpt.restore(target, 2, check_fingerprint=False)
  assert data_state == {"stage": "rl", "step": 2}
  assert state.params["embedding"].sharding.mesh.shape == mesh.shape
  saved = _checkpoint(two_processes[0], step=2)
  for x, y in zip(jax.tree.leaves(state.params), jax.tree.leaves(saved["params"])):
    np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("override, field", [
    ("--config.mesh.data=3", "config.mesh"),
    ("--config.rollout.prompts_per_step=1", "config.rollout.prompts_per_step"),
    ("--config.sft.batch_size=2", "config.sft.batch_size"),
])
def test_a_mesh_that_does_not_fit_is_one_line_before_compiling(tmp_path, override, field):
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "train.py"),
         f"--workdir={tmp_path / 'w'}", "--config.data.dir=/nonexistent", *SMALL, *MESH,
         override]
  proc = subprocess.run(cmd, env=script_env(4), capture_output=True, text=True, timeout=120,
                        cwd=ROOT)
  lines = [line for line in proc.stderr.splitlines() if line.strip()]
  assert proc.returncode != 0
  assert len(lines) == 1 and lines[0].startswith(f"FATAL config error: {field}"), lines
  assert not os.path.exists(tmp_path / "w")


# A program compiled, or read from the persistent compilation cache (tests/conftest.py).
_compiles = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kw: _compiles.append(event)
    if event == "/jax/core/compile/backend_compile_duration" else None)
jax.monitoring.register_event_listener(
    lambda event, **kw: _compiles.append(event)
    if event == "/jax/compilation_cache/cache_hits" else None)


def test_no_rl_step_after_the_first_compiles_again_on_the_mesh(kg):
  from pbsd_jax.run import task as task_lib, train
  spec = run_config.validate(load("pbsd", *SMALL, "--config.mesh.data=2",
                                  "--config.mesh.fsdp=2", "--config.mesh.tensor=2"))
  task = task_lib.prepare_task(spec, os.path.dirname(kg.paths["spm_model"]))
  spec = spec.for_vocabulary(task.vocab.vocab_size)
  # Two steps whose questions have different numbers of golden answers: a batch shaped by
  # its own rows would recompile the second.
  answers = lambda step: max(len(r["golden_answers"])
                             for r in task_lib.rl_prompts(task, spec, step)[0])
  first = 0
  second = next(s for s in range(1, 200) if answers(s) != answers(first))
  model, tx = spec.model, spec.rl.optimizer
  mesh = sharding.make_mesh(2, 2, 2)
  iteration = train.make_rl_iteration(task.agent(spec.sampler("rollout")), model, tx,
                                      spec.algorithm, spec.rl.plan, mesh)
  state = train.fresh_state(train.initial_params(spec, mesh), tx, model, mesh, 0)
  counts = []
  for step in (first, second, second + 1):
    _, batch, group_ids = train.rl_inputs(task, spec, step, mesh)
    before = len(_compiles)
    state, rollout, metrics = iteration(state, (task.search, task.tokenizer.text), batch,
                                        group_ids)
    jax.block_until_ready(metrics)
    counts.append(len(_compiles) - before)
    assert rollout.tokens.sharding.spec[0] == ("data", "fsdp")  # each device its own rows
  assert counts[0] >= 1 and counts[1:] == [0, 0], counts
