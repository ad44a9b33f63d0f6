"""Faults a run must make visible, through real subprocesses of scripts/train.py: config
errors end the run in one line before anything is read or written."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _train(*args, timeout=120):
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "train.py"), *args]
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                        cwd=ROOT)
  return proc.returncode, [line for line in proc.stderr.splitlines() if line.strip()]


_HINT = "Pass --helpshort or --helpfull to see help on flags."


@pytest.mark.parametrize("args, message", [
    (["--config.pbsd.delt=0.1"],
     "config.pbsd.delt: the config has no such field; did you mean config.pbsd.delta?"),
    (["--config=configs/nope.py"], "--config=configs/nope.py: no such config file"),
    (["--config=configs/nope.py", "--config.rl.steps=1"],
     "--config=configs/nope.py: no such config file"),
])
def test_a_bad_command_line_is_one_line_naming_the_fix(tmp_path, args, message):
  code, lines = _train(f"--workdir={tmp_path / 'w'}", *args)
  assert code != 0
  assert lines == [f"FATAL Flags parsing error: {message}", _HINT]
  assert not os.path.exists(tmp_path / "w")


@pytest.mark.parametrize("override, field", [
    ("--config.rollout.top_k=-3", "config.rollout.top_k"),
    ("--config.env.timeout_s=0", "config.env.timeout_s"),
    ("--config.env.max_retries=-1", "config.env.max_retries"),
    ("--config.checkpoint.save_interval_steps=0", "config.checkpoint.save_interval_steps"),
])
def test_a_value_a_constructor_rejects_is_one_line_before_data_loading(tmp_path, override,
                                                                       field):
  code, lines = _train(f"--workdir={tmp_path / 'w'}", "--config.data.dir=/nonexistent",
                       override)
  assert code != 0
  assert len(lines) == 1 and lines[0].startswith(f"FATAL config error: {field}:"), lines
  assert not os.path.exists(tmp_path / "w")
