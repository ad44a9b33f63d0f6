"""Faults a run must make visible: config errors end scripts/train.py in one line before
anything is read or written; a run whose updates are all skipped stops; failed searches,
retries and retrieval time reach the step's metrics."""

import json
import os
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest

from pbsd_jax.agent.env.http import HttpRetriever, RetrievalServer
from pbsd_jax.agent.rollout import host_rollout
from pbsd_jax.rl import evidence
from pbsd_jax.run import train
from script_env import script_env
from test_rollout import _forced, _prompts, setup  # noqa: F401 (setup: a fixture)
from test_train import SMALL, _final_params

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _train(*args, timeout=120):
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "train.py"), *args]
  proc = subprocess.run(cmd, env=script_env(), capture_output=True, text=True, timeout=timeout,
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


def _diverging_run(kg, workdir: str, *extra, timeout=300):
  """`scripts/train.py` at a learning rate that makes every update after the first
  non-finite."""
  return _train(f"--config={os.path.join(ROOT, 'configs', 'pbsd.py')}", f"--workdir={workdir}",
                f"--config.data.dir={os.path.dirname(kg.paths['spm_model'])}", *SMALL,
                "--config.sft.steps=0", "--config.optim.lr=1e30",
                "--config.optim.warmup_steps=0", "--config.rl.max_skipped_steps=2", *extra,
                timeout=timeout)


@pytest.fixture(scope="module")
def diverging(kg, tmp_path_factory):
  """A diverging run of 8 RL steps, which stops at its second skipped step in a row."""
  workdir = str(tmp_path_factory.mktemp("diverging"))
  code, lines = _diverging_run(kg, workdir, "--config.rl.steps=8")
  return workdir, code, lines


def test_a_run_whose_updates_are_all_skipped_stops_in_one_line(diverging):
  workdir, code, lines = diverging
  assert code != 0
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  skipped = [r["skipped_updates"] for r in rows]
  assert skipped[-2:] == [1.0, 1.0] and len(rows) < 8  # stopped at the second in a row
  assert lines[-1] == (
      f"stopped at RL step {len(rows)}: every update of the last 2 steps was skipped "
      "(non-finite loss or gradient); the checkpoints keep the last finite parameters "
      "(config.rl.max_skipped_steps sets how many steps to allow)")


def test_a_stopped_run_keeps_the_parameters_of_its_last_applied_update(kg, diverging,
                                                                       tmp_path):
  """The stopped run's checkpoint holds exactly the parameters of the same run stopped by its
  step count after its last applied update (the skipped ones leave them as they were)."""
  workdir, _, _ = diverging
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  applied = [r["step"] for r in rows if r["stage"] == "rl" and r["skipped_updates"] == 0
             and r["empty_updates"] == 0]
  assert applied == [1]  # the first update is finite, every later one is not
  code, lines = _diverging_run(kg, str(tmp_path), "--config.rl.steps=1")
  assert code == 0, lines[-5:]
  (_, got), (_, want) = _final_params(workdir), _final_params(str(tmp_path))
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(got))
  jax.tree.map(np.testing.assert_array_equal, got, want)


class _FailingRequests:
  """Serves `retriever`, answering the requests numbered in `fail` (0-based) with HTTP 500."""

  def __init__(self, retriever, fail):
    self.retriever, self.fail, self.requests = retriever, set(fail), 0
    self._lock = threading.Lock()

  def retrieve(self, queries, k):
    with self._lock:
      number, self.requests = self.requests, self.requests + 1
    if number in self.fail:
      raise RuntimeError("injected")
    return self.retriever.retrieve(queries, k)


def test_a_steps_metrics_count_the_injected_retrieval_faults(kg, setup):
  env, sampler, params = setup
  records = kg.records("sft")[:2]
  prompts, prompt_mask = _prompts(kg, records)
  # One search call per turn with a search. Call 1: its first attempt fails, the retry
  # succeeds; call 2: both attempts fail, so its searches fail.
  server_side = _FailingRequests(kg.retriever, fail={0, 2, 3})
  with RetrievalServer(server_side) as server:
    client = HttpRetriever(server.url, timeout_s=5.0, max_retries=1, backoff_s=0.0)
    before = client.metrics()
    rollout = host_rollout(sampler, env, params, prompts, prompt_mask, jax.random.key(0),
                           client, kg.tokenizer, [r["golden_answers"] for r in records],
                           None, *_forced(kg, [r["actions"] for r in records]))
    metrics = {**evidence.rollout_metrics(rollout),
               **train.retrieval_metrics(before, client.metrics())}
  searches = [len(r["actions"]) - 1 for r in records]  # the last action answers
  assert min(searches) >= 1 and max(searches) >= 2
  assert float(metrics["searches"]) == sum(searches)
  assert float(metrics["failed_searches"]) == sum(n >= 2 for n in searches)  # turn 2's rows
  assert metrics["retrieval/calls"] == max(searches)
  assert metrics["retrieval/failed_calls"] == 1 and metrics["retrieval/retries"] == 2
  assert metrics["retrieval/attempts"] == server_side.requests == max(searches) + 2
  assert metrics["retrieval/latency_s"] > 0
