"""A guarded workdir: the configuration that made it, one process at a time, each metric step
once, and a resume that falls back past a corrupt checkpoint to exactly the uninterrupted
run's parameters (real subprocesses of scripts/train.py, real orbax checkpoints)."""

import json
import os
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from pbsd_jax.eval.metric_log import MetricLog
from pbsd_jax.run import workdir as workdir_lib
from test_checkpoint import delete_manifest, flip_bytes, largest_file, truncate
from test_configs import load
from test_train import OPSD, SMALL, _checkpoint, _final_params, _metrics, _train


def _assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)


def _run(kg, workdir, *extra):
  """scripts/train.py with test_train's small OPSD config; returns (return code, output)."""
  proc = _train(workdir, os.path.dirname(kg.paths["spm_model"]), *OPSD, *extra, wait=False)
  out, _ = proc.communicate(timeout=300)
  return proc.returncode, out


def test_only_non_resumable_fields_count_as_a_different_configuration():
  base = workdir_lib.as_dict(load("pbsd"))
  resumed = workdir_lib.as_dict(load("pbsd", "--config.rl.steps=99", "--config.sft.steps=7",
                                     "--config.eval.num_examples=3",
                                     "--config.env.url=http://elsewhere:1"))
  assert workdir_lib.differing_fields(base, resumed) == []
  assert workdir_lib.fingerprint(load("pbsd")) == workdir_lib.fingerprint(
      load("pbsd", "--config.rl.steps=99"))
  other = workdir_lib.as_dict(load("pbsd", "--config.optim.lr=0.5", "--config.seed=3"))
  assert workdir_lib.differing_fields(base, other) == ["optim.lr", "seed"]
  assert workdir_lib.fingerprint(load("pbsd")) != workdir_lib.fingerprint(
      load("pbsd", "--config.seed=3"))


def test_a_workdir_of_another_configuration_is_refused_unless_forced(tmp_path):
  workdir = str(tmp_path)
  workdir_lib.claim(workdir, load("grpo")).close()
  with pytest.raises(workdir_lib.WorkdirError, match=r"differs in algorithm\b.*--force_resume"):
    workdir_lib.claim(workdir, load("pbsd"))
  workdir_lib.claim(workdir, load("pbsd"), force=True).close()  # records the new config
  workdir_lib.claim(workdir, load("pbsd", "--config.rl.steps=9")).close()
  with open(os.path.join(workdir, workdir_lib.CONFIG_FILE)) as f:
    assert json.load(f)["algorithm"] == "pbsd"


_HOLD = """
import sys, time
from pbsd_jax.run import workdir
from test_configs import load
lock = workdir.claim(sys.argv[1], load("pbsd"))
print("held", flush=True)
time.sleep(600)
"""


def test_a_killed_holder_does_not_leave_the_workdir_locked(tmp_path):
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
  holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path)], env=env,
                            stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(workdir_lib.WorkdirError, match=f"in use by another process "
                                                       rf"\(pid {holder.pid}\)"):
      workdir_lib.claim(str(tmp_path), load("pbsd"))
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
  workdir_lib.claim(str(tmp_path), load("pbsd")).close()


def test_a_resumed_stage_drops_its_rows_after_the_restored_step(tmp_path):
  log = MetricLog(str(tmp_path))
  for stage, step in [("sft", 1), ("sft", 2), ("rl", 1), ("rl", 2), ("rl", 3)]:
    log.write(stage, step, {"loss": float(step)})
  with open(log.path, "a") as f:
    f.write('{"stage": "rl", "st')  # what a kill in the middle of a write leaves
  log.drop_after("rl", 1)
  assert [(r["stage"], r["step"]) for r in _metrics(str(tmp_path))] == [
      ("sft", 1), ("sft", 2), ("rl", 1)]


def test_train_refuses_a_workdir_of_another_configuration_in_one_line(kg, opsd_run):
  before = sorted(os.listdir(os.path.join(opsd_run, "ckpt_rl")))
  code, out = _run(kg, opsd_run, "--config.seed=5", "--config.optim.lr=0.01")
  assert code != 0
  assert out.strip().splitlines()[-1] == (
      f"error: workdir {opsd_run} was made by another configuration (differs in optim.lr, "
      f"seed); use another --workdir, or pass --force_resume to resume it anyway")
  assert "Traceback" not in out
  assert sorted(os.listdir(os.path.join(opsd_run, "ckpt_rl"))) == before


def test_train_refuses_a_workdir_another_process_is_using(kg, opsd_run):
  config = load("pbsd", f"--config.data.dir={os.path.dirname(kg.paths['spm_model'])}", *SMALL,
                *OPSD)
  handle = workdir_lib.claim(opsd_run, config)
  try:
    code, out = _run(kg, opsd_run)
  finally:
    handle.close()
  assert code != 0
  assert out.strip().splitlines()[-1] == (
      f"error: workdir {opsd_run} is in use by another process (pid {os.getpid()})"), out[-3000:]


@pytest.mark.parametrize("corrupt", [
    lambda step_dir: flip_bytes(largest_file(os.path.join(step_dir, "state"))),
    lambda step_dir: truncate(largest_file(os.path.join(step_dir, "state"))),
    delete_manifest,
], ids=["flipped_bytes", "truncated", "deleted_manifest"])
def test_a_corrupt_latest_checkpoint_resumes_to_the_uninterrupted_parameters(
    kg, opsd_run, tmp_path, corrupt, record_property):
  workdir = str(tmp_path / "run")
  shutil.copytree(opsd_run, workdir)
  step, want = _final_params(opsd_run)
  assert step == 3
  rl = [r for r in _metrics(opsd_run) if r["stage"] == "rl"]
  assert all(r["grad_norm"] > 0 for r in rl)  # the replayed step really changes parameters
  with pytest.raises(AssertionError):
    _assert_trees_equal(_checkpoint(opsd_run, step=2)["params"], want)
  corrupt(os.path.join(workdir, "ckpt_rl", "3"))
  code, out = _run(kg, workdir)
  assert code == 0, out[-3000:]
  warnings = [line for line in out.splitlines() if "is unusable" in line]
  assert len(warnings) == 1 and "checkpoint 3 in" in warnings[0], out[-3000:]
  assert "Event loop is closed" not in out and "is missing" not in out.replace(warnings[0], "")
  step, resumed = _final_params(workdir)
  assert step == 3
  _assert_trees_equal(resumed, want)
  assert [r["step"] for r in _metrics(workdir) if r["stage"] == "rl"] == [1, 2, 3]
  record_property("faults_injected", 1)
  record_property("runs_resumed", 1)
  record_property("bytes_compared", sum(x.nbytes for x in jax.tree.leaves(want)))


def test_tensorboard_reads_every_finite_metric_of_every_step(tmp_path):
  import tensorflow as tf  # an independent reader of the event file (it checks the CRCs)
  log = MetricLog(str(tmp_path))
  log.write("rl", 1, {"loss": 0.25, "auc": float("nan")})
  log.write("rl", 2, {"loss": 0.125, "auc": 0.75})
  log.write("eval", 2, {"accuracy": 0.5})
  [path] = [os.path.join(tmp_path, "tensorboard", n)
            for n in os.listdir(tmp_path / "tensorboard")]
  got = [(e.step, v.tag, v.simple_value) for e in tf.compat.v1.train.summary_iterator(path)
         for v in e.summary.value]
  assert got == [(1, "rl/loss", 0.25), (2, "rl/loss", 0.125), (2, "rl/auc", 0.75),
                 (2, "eval/accuracy", 0.5)]


def test_a_claimed_workdir_replaced_at_its_path_is_caught_and_no_other(tmp_path):
  from pbsd_jax.data import storage
  a, b = str(tmp_path / "a"), str(tmp_path / "b")
  handles = [workdir_lib.claim(a, {"x": 1}), workdir_lib.claim(b, {"x": 1})]
  workdir_lib.check_claimed(os.path.join(a, "ckpt_rl"))  # both there: nothing to say
  os.rename(b, b + "-moved")
  os.makedirs(b)  # another directory at the same path, as after an unmount
  workdir_lib.check_claimed(a)
  workdir_lib.check_claimed(str(tmp_path / "unclaimed"))
  for path in (b, os.path.join(b, "run")):
    with pytest.raises(storage.StorageError, match=f"^.*{b} no longer exists"):
      workdir_lib.check_claimed(path)
  for handle in handles:
    handle.close()
