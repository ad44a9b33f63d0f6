"""Every retriever through every script a user runs: `scripts/train.py` on a 2-device mesh with
validation during RL (`eval.every`), then `scripts/evaluate.py` and `scripts/stratify.py` on
its checkpoint on one device.

The in-graph dense and sparse indexes, `scripts/build_index.py`'s sparse index and the host
loop over the same token BM25 search the same documents for the same query tokens, so from one
seed they sample the same episodes: their RL rows and evaluation outcomes must agree. `bm25s`
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

import pytest

from test_train import ROOT

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
    "ingraph_sparse": ["--config.env.index=sparse"],
    "ingraph_index_dir": ["--config.env.index_dir={index_dir}"],
    "host": ["--config.env.retriever=host"],
    "bm25s": ["--config.env.retriever=bm25s"],
    "http": ["--config.env.retriever=http", "--config.env.url={url}"],
}
# The runs are made once, for every test here (conftest: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("retrievers")

# Search the same token BM25 (the corpus rendered and encoded as observations are).
SAME_INDEX = ("ingraph_dense", "ingraph_sparse", "ingraph_index_dir", "host")
QUESTIONS = 4


def _script(name, *args, devices=1):
  flags = f"--xla_force_host_platform_device_count={devices}" if devices > 1 else ""
  done = subprocess.run(
      [sys.executable, os.path.join(ROOT, "scripts", name), *args], capture_output=True,
      text=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags})
  return done.returncode, done.stdout + done.stderr


@pytest.fixture(scope="module")
def runs(kg, tmp_path_factory):
  """Each retriever's train, evaluate and stratify outputs: `{name: (metrics rows,
  evaluate.py's result, stratify.py's tier sizes)}`."""
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
      ckpt = ["--ckpt_dir=" + os.path.join(workdir, "ckpt_rl"), "--batch_size=8"]
      evaluated = os.path.join(workdir, "eval.json")
      code, out = _script("evaluate.py", *config, *ckpt, f"--splits={questions}",
                          "--samples=2", f"--out={evaluated}")
      assert code == 0, f"{name}: {out[-3000:]}"
      with open(evaluated) as f:
        evaluation = json.load(f)["splits"][questions]
      code, out = _script("stratify.py", *config, *ckpt, f"--split={questions}",
                          "--samples=2", "--per_tier=1", f"--out={base / name}.jsonl")
      tiers = re.findall(r"tier(?:s| sizes) (\{[^}]*\})", out)
      assert tiers, f"{name}: {out[-3000:]}"
      results[name] = rows, evaluation, ast.literal_eval(tiers[-1])
  return results


def _rl_row(rows):
  (row,) = [r for r in rows if r["stage"] == "rl"]
  return row


def test_every_retriever_trains_on_a_mesh_with_validation(runs):
  for name, (rows, _, _) in runs.items():
    assert [r["step"] for r in rows if r["stage"] == "eval"] == [0, 1], name
    row = _rl_row(rows)
    assert row["searches"] > 0, name  # the episodes searched
    assert row["failed_searches"] == 0, name
  http = _rl_row(runs["http"][0])
  assert http["retrieval/calls"] > 0 and http["retrieval/failed_calls"] == 0


def test_retrievers_over_the_same_index_sample_the_same_episodes(runs):
  want_rows, want_eval, want_tiers = runs["ingraph_dense"]
  want = _rl_row(want_rows)
  assert want["mean_action_tokens"] > 0
  for name in SAME_INDEX[1:]:
    rows, evaluation, tiers = runs[name]
    got = _rl_row(rows)
    for key in ("mean_turns", "mean_action_tokens", "searches", "reward_mean"):
      assert got[key] == want[key], (name, key)
    for key in ("mean_turns", "mean_action_tokens"):
      assert [r[key] for r in rows if r["stage"] == "eval"] == [
          r[key] for r in want_rows if r["stage"] == "eval"], (name, key)
    for setting in ("greedy", "top_p"):
      for key in ("solve_counts", "mean_turns", "mean_action_tokens", "finished"):
        assert evaluation[setting][key] == want_eval[setting][key], (name, setting, key)
    assert tiers == want_tiers, name


def test_every_retriever_evaluates_and_stratifies_on_one_device(runs):
  for name, (_, evaluation, tiers) in runs.items():
    assert evaluation["top_p"]["num_questions"] == QUESTIONS, name
    assert evaluation["top_p"]["samples_per_question"] == 2, name
    assert evaluation["greedy"]["mean_turns"] >= 1, name
    # Every question is in one tier, whether stratify could draw per_tier of each (it then
    # writes the subset) or says in one line which tiers are short.
    assert sorted(tiers) == ["easy", "hard", "medium"] and sum(tiers.values()) == QUESTIONS
