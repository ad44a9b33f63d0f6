"""Storage faults: a full disk, a read-only workdir, a workdir deleted or unmounted mid-run.

Each through a script run as a subprocess on a real file system: a tmpfs of a few MB (filled
by the test to the byte where it matters), remounted read-only or unmounted under the run,
or a directory another process deletes. The run is frozen (SIGSTOP) while the test changes
its storage, so the fault lands at the step the test names however fast the run goes; every
wait is bounded. A run ends with one line and no traceback, and re-running the same command
once the fault is gone ends bitwise equal to the uninterrupted run (`opsd_run`)."""

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from pbsd_jax.data import storage
from pbsd_jax.eval.metric_log import MetricLog
from script_env import script_env
from test_train import OPSD, ROOT, SMALL, _checkpoint, _metrics, _train
from test_workdir import _assert_trees_equal

MB = 1 << 20


@contextlib.contextmanager
def tmpfs(path, size_mb):
  """A tmpfs of `size_mb` MB mounted at `path` (skips where this host cannot mount one)."""
  os.makedirs(path, exist_ok=True)
  done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)],
                        capture_output=True, text=True)
  if done.returncode:
    pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
  try:
    yield str(path)
  finally:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def remount(path, options):
  subprocess.run(["mount", "-o", f"remount,{options}", str(path)], check=True)


def fill(path, leave=0):
  """Fills the file system of `path` until `leave` bytes are free; returns the filler file."""
  filler = os.path.join(path, "filler")
  with open(filler, "ab") as f:
    with contextlib.suppress(OSError):
      while (free := shutil.disk_usage(path).free) > leave:
        f.write(b"\0" * min(free - leave, MB))
        f.flush()
  return filler


def run_until(proc, marker, timeout=300):
  """Waits for `marker` to exist, then freezes the run (SIGSTOP); fails if it ended first."""
  deadline = time.time() + timeout
  while not os.path.exists(marker) and proc.poll() is None and time.time() < deadline:
    time.sleep(0.005)
  proc.send_signal(signal.SIGSTOP)
  assert os.path.exists(marker), f"the run ended (or hung) before {marker}"


def ended(proc):
  """Resumes a frozen run and returns its output once it ends (it must end by itself)."""
  proc.send_signal(signal.SIGCONT)
  out, _ = proc.communicate(timeout=300)
  return out


def one_line(out, returncode):
  """The line a run ended with, after checking that it failed and printed no traceback."""
  assert returncode == 1, out[-3000:]
  assert "Traceback" not in out and "Exception ignored" not in out, out[-3000:]
  return out.strip().splitlines()[-1]


def assert_resumed_bitwise(workdir, opsd_run, record_property):
  want = _checkpoint(opsd_run)
  _assert_trees_equal(_checkpoint(workdir), want)
  assert _metrics(workdir) == _metrics(opsd_run)  # each step once, with the same values
  leftovers = [os.path.join(d, n) for d, _, names in os.walk(workdir) for n in names + [d]
               if "tmp" in os.path.basename(n)]
  assert not leftovers, leftovers
  record_property("faults_injected", 1)
  record_property("runs_resumed", 1)
  record_property("bytes_compared", sum(np.asarray(x).nbytes for x in jax.tree.leaves(want)))


# (stage whose checkpoint fails, asynchronous saves, bytes left free, extra flags). With 64 KB
# left the step's metrics row and events fit and its checkpoint (~0.9 MB) does not; with none
# left (and no checkpoint until the last step) the step's rollout file fails, or its metrics.
# The re-run goes on in place once space is freed, or (`copy`) from a copy of the workdir on
# another disk. The two checkpoint cases take each stage, each way of saving and each place of
# the re-run once (the stages save through the same code, `run/checkpoint.py`).
FULL = {
    "sft-checkpoint": ("ckpt_sft/1", False, 64 << 10, ()),
    "rl-checkpoint-async-copy": ("ckpt_rl/1", True, 64 << 10, ()),
    "rl-rollouts": ("ckpt_rl/1", False, 0, ("--config.rl.save_rollouts=1",
                                            "--config.checkpoint.save_interval_steps=100")),
}


@pytest.mark.parametrize("case", list(FULL))
def test_a_full_disk_stops_the_run_in_one_line_and_the_rerun_resumes_bitwise_equal(
    kg, opsd_run, tmp_path, case, record_property):
  marker, async_save, leave, extra = FULL[case]
  data_dir = os.path.dirname(kg.paths["spm_model"])
  flags = (*OPSD, f"--config.checkpoint.async_save={async_save}", *extra)
  with tmpfs(tmp_path / "disk", 40) as disk:
    workdir = os.path.join(disk, "run")
    proc = _train(workdir, data_dir, *flags, wait=False)
    run_until(proc, os.path.join(workdir, marker))
    filler = fill(disk, leave)
    line = one_line(ended(proc), proc.returncode)
    assert line.startswith("error: no space left on the device of "
                           f"{workdir}/"), line
    assert "free space or move the directory to a larger disk, then re-run the same command" \
        in line
    if leave:  # the checkpoint failed: it names its directory and the state's size
      state = _checkpoint(opsd_run)
      size = storage.size_text(sum(x.nbytes for x in jax.tree.leaves(
          (state["params"], state["opt_state"]))))
      assert f"{workdir}/{marker.split('/')[0]} (this write needs about {size}, " in line, line
    details = line.split("(traceback: ")[1].split(";")[0]
    assert "No space left on device" in open(details).read()

    os.remove(filler)
    if case.endswith("copy"):
      workdir = shutil.copytree(workdir, tmp_path / "copy")
    _train(workdir, data_dir, *flags)  # the same command resumes
    assert_resumed_bitwise(workdir, opsd_run, record_property)
    if "rollouts" in case:
      for step in (1, 2, 3):
        with np.load(os.path.join(workdir, "rollouts", f"rl_{step}.npz")) as saved:
          assert saved["tokens"].shape[0] == 4  # 2 prompts x 2 samples


def test_a_read_only_workdir_is_refused_in_one_line_before_any_data_is_read(kg, tmp_path):
  with tmpfs(tmp_path / "disk", 4) as disk:
    workdir = os.path.join(disk, "run")
    os.makedirs(workdir)
    remount(disk, "ro")
    data_dir = str(tmp_path / "data")  # made at start-up, were the run to get that far
    proc = _train(workdir, data_dir, *OPSD, wait=False)
    out, _ = proc.communicate(timeout=300)
    line = one_line(out, proc.returncode)
    assert line.startswith(f"error: {workdir} is on a read-only file system: remount it "
                           "read-write or use another directory"), line
    assert not os.path.exists(data_dir)


@pytest.mark.parametrize("how", ["deleted", "unmounted", "read-only"])
def test_a_workdir_that_goes_away_mid_run_stops_it_within_the_step(kg, opsd_run, tmp_path,
                                                                    how, record_property):
  data_dir = os.path.dirname(kg.paths["spm_model"])
  with tmpfs(tmp_path / "disk", 40) as disk:
    workdir = os.path.join(disk, "run")
    proc = _train(workdir, data_dir, *OPSD, wait=False)
    run_until(proc, os.path.join(workdir, "ckpt_sft", "2"))
    if how == "deleted":
      shutil.rmtree(workdir)
    elif how == "unmounted":
      subprocess.run(["umount", "-l", disk], check=True)
    else:
      remount(disk, "ro")
    line = one_line(ended(proc), proc.returncode)
    if how == "read-only":
      assert line.startswith(f"error: {workdir}/"), line
      assert "is on a read-only file system" in line, line
      # The lock went with the process; nothing past step 2 claims to be saved.
      with open(os.path.join(workdir, ".lock")) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
      assert sorted(os.listdir(os.path.join(workdir, "ckpt_sft"))) == ["1", "2"]
      remount(disk, "rw")
      _train(workdir, data_dir, *OPSD)
      assert_resumed_bitwise(workdir, opsd_run, record_property)
      return
    # The step's first write names its file, or `check_claimed` before it the workdir.
    assert line.startswith(f"error: {workdir}"), line
    assert ("no longer exists (deleted or unmounted while in use): restore it, or its copy, "
            "then re-run the same command") in line, line
    assert not os.path.exists(workdir)  # nothing wrote into a directory made anew
    record_property("faults_injected", 1)


def test_metric_rows_are_appended_whole_or_not_at_all_on_a_full_disk(tmp_path):
  with tmpfs(tmp_path / "disk", 1) as disk:
    log = MetricLog(disk)
    log.write("rl", 1, {"loss": 0.5})
    fill(disk)
    written, err = 1, None
    for step in range(2, 200):
      try:
        log.write("rl", step, {"loss": step / 7, **{f"m{i}": i / 3 for i in range(40)}})
      except storage.StorageError as e:
        err = e
        break
      written = step
    assert err is not None, "a full disk never failed a write"
    assert err.strerror.startswith(f"no space left on the device of {disk}/"), err.strerror
    rows = [json.loads(line) for line in open(os.path.join(disk, "metrics.jsonl"))]
    # The failing step's row is absent (its append was cut off again) or whole (it was the
    # events file that failed after it).
    assert [r["step"] for r in rows] in (list(range(1, written + 1)),
                                         list(range(1, written + 2)))
    assert rows[-1]["step"] == 1 or rows[-1]["loss"] == rows[-1]["step"] / 7


def _script(name, *args):
  return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", name), *args],
                        env=script_env(), capture_output=True, text=True, timeout=600)


def test_evaluate_and_build_index_on_a_full_disk_leave_no_partial_output(kg, opsd_run,
                                                                         tmp_path,
                                                                         record_property):
  from pbsd_jax.agent.env.host_bm25 import HostBM25Retriever
  corpus = kg.paths["corpus"]
  with tmpfs(tmp_path / "disk", 2) as disk:
    # An older index is in place: a failed build must leave it as it was.
    old = os.path.join(disk, "index")
    done = _script("build_index.py", f"--corpus={kg.paths['world']}", f"--out={old}")
    assert done.returncode != 0  # not a corpus: nothing written
    HostBM25Retriever.from_texts(["the mill", "the sea"], ["a", "b"]).save(old)
    before = sorted(os.listdir(old))
    filler = fill(disk, 16 << 10)

    done = _script("build_index.py", f"--corpus={corpus}", f"--out={old}")
    line = one_line(done.stdout + done.stderr, done.returncode)
    assert line.startswith(f"error: no space left on the device of {old} "), line
    assert sorted(os.listdir(disk)) == ["filler", "index"]  # no temporary directory left
    assert sorted(os.listdir(old)) == before
    assert HostBM25Retriever.load(old).ids == ["a", "b"]
    verbose = _script("build_index.py", f"--corpus={corpus}", f"--out={old}", "--verbose")
    assert "Traceback" in verbose.stderr and verbose.stderr.strip().splitlines()[-1] == (
        line.split(" (traceback: ")[0])

    fill(disk)
    out = os.path.join(disk, "eval", "result.json")
    done = _script("evaluate.py", f"--ckpt_dir={os.path.join(opsd_run, 'ckpt_rl')}",
                   f"--config={os.path.join(ROOT, 'configs', 'pbsd.py')}", *SMALL,
                   f"--data_dir={os.path.dirname(kg.paths['spm_model'])}",
                   "--splits=rl_validation", "--num_examples=2", "--samples=1",
                   "--batch_size=2", f"--out={out}")
    line = one_line(done.stdout + done.stderr, done.returncode)
    assert line.startswith(f"error: no space left on the device of {out} "), line
    assert not os.path.exists(out) and sorted(os.listdir(disk)) in (["eval", "filler", "index"],
                                                                     ["filler", "index"])
    assert not os.path.exists(os.path.dirname(out)) or not os.listdir(os.path.dirname(out))

    os.remove(filler)
    done = _script("build_index.py", f"--corpus={corpus}", f"--out={old}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(HostBM25Retriever.load(old).ids) == len(kg.corpus)
    assert not [n for n in os.listdir(disk) if "tmp" in n or "old" in n]
  record_property("faults_injected", 2)
