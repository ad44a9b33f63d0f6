"""Every retriever through every script a user runs: `scripts/train.py` on a 2-device mesh with
validation during RL (`eval.every`), then `scripts/evaluate.py` on its checkpoint on one device
(once for the in-graph indexes) and `scripts/stratify.py` for an in-graph and a host
retriever; the HTTP retriever also across 2 processes.

The in-graph dense index, `scripts/build_index.py`'s sparse index and the host loop over the
same token BM25 search the same documents for the same query tokens, so from one seed they
sample the same episodes: their RL rows and evaluation outcomes must agree. (The sparse index
built at start-up, `env.index=sparse`: test_train's routing test runs it through train.py,
test_bm25 checks that it scores and ranks as the dense one.) `bm25s`
ranks with its own tokenizer and the retrieval server receives the query as text, so those
two are checked for having run each path and searched.
"""

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest

from script_env import script_env
from test_train import ROOT, _metrics

# 30 SFT steps at a high learning rate (the micro model then searches), one RL step;
# validation on 4 questions at RL steps 0 and 1.
SMALL = ["--config.model.name=micro", "--config.sft.steps=30", "--config.sft.lr=1e-2",
         "--config.sft.warmup_steps=0", "--config.sft.schedule=constant",
         "--config.sft.batch_size=16", "--config.sft.max_examples=256", "--config.rl.steps=1",
         "--config.rollout.prompts_per_step=2", "--config.grpo.group_size=2",
         "--config.data.prompt_width=64", "--config.env.buffer_size=320",
         "--config.env.max_turns=7", "--config.env.max_action_tokens=48",
         "--config.checkpoint.async_save=False", "--config.eval.every=1",
         "--config.eval.num_examples=4"]
# The retrievers, each as its config overrides ({index_dir}, {url}: the fixture's).
RETRIEVERS = {
    "ingraph_dense": [],
    "ingraph_index_dir": ["--config.env.index_dir={index_dir}"],
    "host": ["--config.env.retriever=host"],
    "bm25s": ["--config.env.retriever=bm25s"],
    "http": ["--config.env.retriever=http", "--config.env.url={url}"],
}
# The runs are made once, for every test here (conftest: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("retrievers")

# Search the same token BM25 (the corpus rendered and encoded as observations are).
SAME_INDEX = ("ingraph_dense", "ingraph_index_dir", "host")
# Not run through evaluate.py and stratify.py: their in-graph evaluation is ingraph_dense's over
# another index, which their validation rows during RL already compare.
TRAIN_ONLY = ("ingraph_index_dir",)
# Run through stratify.py too: one in-graph and one host retriever (stratify.py builds its agent
# as evaluate.py does, which every other retriever runs).
STRATIFIED = ("ingraph_dense", "http")
QUESTIONS = 4


def _script(name, *args, devices=1):
  done = subprocess.run(
      [sys.executable, os.path.join(ROOT, "scripts", name), *args], capture_output=True,
      text=True, timeout=600, env=script_env(devices))
  return done.returncode, done.stdout + done.stderr


@pytest.fixture(scope="module")
def runs(kg, tmp_path_factory):
  """Each retriever's train, evaluate and stratify outputs: `{name: (metrics rows,
  evaluate.py's result, stratify.py's tier sizes, workdir)}`."""
  from pbsd_jax.agent.env.http import RetrievalServer
  from pbsd_jax.data import jsonl

  base = tmp_path_factory.mktemp("retrievers")
  data_dir = os.path.dirname(kg.paths["spm_model"])
  index_dir = str(base / "index")
  code, out = _script("build_index.py", f"--corpus={kg.paths['corpus']}", f"--out={index_dir}",
                      f"--tokenizer={kg.paths['spm_model']}", "--shards=2")
  assert code == 0, out[-2000:]
  questions = str(base / "questions.jsonl")
  jsonl.write_jsonl(questions, kg.records("rl_validation")[:QUESTIONS])
  results, sft = {}, None
  with RetrievalServer(kg.retriever) as server:
    for name, overrides in RETRIEVERS.items():
      workdir = str(base / name)
      config = [f"--config={os.path.join(ROOT, 'configs', 'grpo.py')}",
                f"--config.data.dir={data_dir}", *SMALL,
                *(o.format(index_dir=index_dir, url=server.url) for o in overrides)]
      # SFT reads the oracle trajectories, never the retriever: it runs once, and the other
      # runs resume its checkpoint (saved under another env, hence --force_resume).
      resume = []
      if sft is not None:
        shutil.copytree(sft, os.path.join(workdir, "ckpt_sft"))
        resume = ["--force_resume"]
      code, out = _script("train.py", *config, f"--workdir={workdir}", *resume, devices=2)
      sft = sft or os.path.join(workdir, "ckpt_sft")
      assert code == 0, f"{name}: {out[-3000:]}"
      with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
      if name in TRAIN_ONLY:
        results[name] = rows, None, None, workdir
        continue
      ckpt = ["--ckpt_dir=" + os.path.join(workdir, "ckpt_rl"), "--batch_size=8"]
      evaluated = os.path.join(workdir, "eval.json")
      code, out = _script("evaluate.py", *config, *ckpt, f"--splits={questions}",
                          "--samples=2", f"--out={evaluated}")
      assert code == 0, f"{name}: {out[-3000:]}"
      with open(evaluated) as f:
        evaluation = json.load(f)["splits"][questions]
      tiers = None
      if name in STRATIFIED:
        code, out = _script("stratify.py", *config, *ckpt, f"--split={questions}",
                            "--samples=2", "--per_tier=1", f"--out={base / name}.jsonl")
        tiers = re.findall(r"tier(?:s| sizes) (\{[^}]*\})", out)
        assert tiers, f"{name}: {out[-3000:]}"
        tiers = ast.literal_eval(tiers[-1])
      results[name] = rows, evaluation, tiers, workdir
  return results


def _rl_row(rows):
  (row,) = [r for r in rows if r["stage"] == "rl"]
  return row


def test_every_retriever_trains_on_a_mesh_with_validation(runs):
  for name, (rows, *_) in runs.items():
    assert [r["step"] for r in rows if r["stage"] == "eval"] == [0, 1], name
    row = _rl_row(rows)
    assert row["searches"] > 0, name  # the episodes searched
    assert row["failed_searches"] == 0, name
  http = _rl_row(runs["http"][0])
  assert http["retrieval/calls"] > 0 and http["retrieval/failed_calls"] == 0


def test_retrievers_over_the_same_index_sample_the_same_episodes(runs):
  want_rows, want_eval, want_tiers, _ = runs["ingraph_dense"]
  want = _rl_row(want_rows)
  assert want["mean_action_tokens"] > 0
  for name in SAME_INDEX[1:]:
    rows, evaluation, tiers, _ = runs[name]
    got = _rl_row(rows)
    for key in ("mean_turns", "mean_action_tokens", "searches", "reward_mean"):
      assert got[key] == want[key], (name, key)
    for key in ("mean_turns", "mean_action_tokens"):
      assert [r[key] for r in rows if r["stage"] == "eval"] == [
          r[key] for r in want_rows if r["stage"] == "eval"], (name, key)
    if name in TRAIN_ONLY:
      continue
    for setting in ("greedy", "top_p"):
      for key in ("solve_counts", "mean_turns", "mean_action_tokens", "finished"):
        assert evaluation[setting][key] == want_eval[setting][key], (name, setting, key)
    assert tiers in (None, want_tiers), name


def test_every_kind_of_retriever_evaluates_on_one_device_and_stratifies(runs):
  for name, (_, evaluation, tiers, _) in runs.items():
    if name in TRAIN_ONLY:
      continue
    assert evaluation["top_p"]["num_questions"] == QUESTIONS, name
    assert evaluation["top_p"]["samples_per_question"] == 2, name
    assert evaluation["greedy"]["mean_turns"] >= 1, name
    if name in STRATIFIED:
      # Every question is in one tier, whether stratify could draw per_tier of each (it then
      # writes the subset) or says in one line which tiers are short.
      assert sorted(tiers) == ["easy", "hard", "medium"] and sum(tiers.values()) == QUESTIONS


class _FirstAttemptsFail:
  """`retriever` behind a request log whose every search request's first attempt fails (the
  server answers 500, the client retries; the scripts' start-up probe, never retried, is
  answered): `queries[i]` is request i's, logged at that attempt."""

  def __init__(self, retriever):
    self.retriever, self.queries, self._failed = retriever, [], set()
    self._lock = threading.Lock()

  def retrieve(self, queries, k):
    if list(queries) == ["probe"]:
      return self.retriever.retrieve(queries, k)
    with self._lock:
      retry = tuple(queries) in self._failed
      if retry:
        self._failed.remove(tuple(queries))
      else:
        self._failed.add(tuple(queries))
        self.queries.append(list(queries))
    if not retry:
      raise RuntimeError("the first attempt fails")
    return self.retriever.retrieve(queries, k)


def _turn_queries(kg, rollout, rows):
  """`{turn: sorted queries}` of the searches of rollout rows `rows`, as the server reads
  them (whitespace aside)."""
  from pbsd_jax.agent.env import actions
  out = {}
  for b in rows:
    for k in range(int(rollout["num_turns"][b])):
      action = actions.parse_action(kg.decode(rollout["tokens"][b][rollout["turn_ids"][b] == k]))
      if action.kind == actions.SEARCH:
        out.setdefault(k, []).append(" ".join(action.content.split()))
  return {k: sorted(v) for k, v in out.items()}


def test_two_processes_each_search_their_own_rows_over_http(kg, runs, tmp_path):
  """The HTTP retriever across 2 processes of one device each, data parallel (a mesh of
  several devices a process: test_multihost): the same episodes, evaluation and (within the
  multi-host tolerance) parameters as the 1-process run on 2 devices; each process asks the
  server for its own rows only, one request a turn; faults of either process are counted."""
  from pbsd_jax.agent.env.http import RetrievalServer
  from test_multihost import DATA_PARALLEL, _assert_close_runs, _free_port, _processes, _wait
  data_dir = os.path.dirname(kg.paths["spm_model"])
  workdir, one = str(tmp_path / "http_pair"), runs["http"][3]
  shutil.copytree(os.path.join(one, "ckpt_sft"), os.path.join(workdir, "ckpt_sft"))
  logged = _FirstAttemptsFail(kg.retriever)
  with RetrievalServer(logged) as server:
    port = _free_port()
    config = [f"--config={os.path.join(ROOT, 'configs', 'grpo.py')}",
              f"--config.data.dir={data_dir}", *SMALL, "--config.env.retriever=http",
              f"--config.env.url={server.url}", f"--workdir={workdir}", "--force_resume",
              "--config.rl.save_rollouts=1", *DATA_PARALLEL]
    procs = [subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "scripts", "train.py"), *config,
         *_processes(port, i)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=script_env()) for i in range(2)]
    codes, outs = _wait(procs)
  assert codes == [0, 0], outs[0][-2000:] + outs[1][-2000:]
  _assert_close_runs(workdir, one)  # the RL and evaluation rows' samples, the parameters
  got = _rl_row(_metrics(workdir))
  assert got["searches"] > 0 and got["reward_mean"] == _rl_row(runs["http"][0])["reward_mean"]
  # Each process's requests: its own rows' queries (rows 0-1, 2-3), one request a turn.
  with np.load(os.path.join(workdir, "rollouts", "rl_1.npz")) as f:
    rollout = dict(f)
  requests = [sorted(" ".join(q.split()) for q in r) for r in logged.queries]
  assert max(len(r) for r in requests) <= 2  # never a row of the other process
  blocks = [_turn_queries(kg, rollout, rows) for rows in ((0, 1), (2, 3))]
  for block in blocks:
    for queries in block.values():
      assert queries in requests
  # Every request was retried once, and the step's counters hold both processes'.
  rl_calls = sum(len(block) for block in blocks)
  assert got["retrieval/calls"] == got["retrieval/retries"] == rl_calls
  assert rl_calls > max(len(block) for block in blocks)  # both processes searched
