"""scripts/compare.py and its statistics (pbsd_jax.results)."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from pbsd_jax import results
from test_train import ROOT, SMALL


def test_mean_sd_is_the_sample_spread():
  assert results.mean_sd([0.5, 0.7]) == pytest.approx((0.6, np.std([0.5, 0.7], ddof=1)))
  assert results.mean_sd([0.4]) == (0.4, 0.0)


def test_paired_bootstrap_centres_on_the_paired_difference_and_covers_it():
  a = np.array([[0, 1, 0, 1], [1, 1, 0, 0]])
  b = np.array([[1, 1, 0, 1], [1, 1, 1, 0]])
  d, lo, hi = results.paired_bootstrap(a, b, reps=4000)
  # Per question, averaged over the two seeds: +0.5, 0, +0.5, 0.
  assert d == pytest.approx(0.25)
  assert 0.0 <= lo < d < hi <= 0.5
  assert results.paired_bootstrap(a, a) == (0.0, 0.0, 0.0)
  with pytest.raises(ValueError, match="seeds, questions"):
    results.paired_bootstrap(a, b[:, :3])


def test_smooth_and_means_skip_missing_values():
  np.testing.assert_allclose(results.smooth([1.0, 3.0, np.nan, 5.0], 2), [1.0, 2.0, 3.0, 5.0])
  steps, values = results.mean_over_runs([(np.array([0, 2, 4]), np.array([0.1, 0.3, 0.5])),
                                          (np.array([0, 2]), np.array([0.3, np.nan]))])
  np.testing.assert_array_equal(steps, [0, 2])
  np.testing.assert_allclose(values, [0.2, 0.3])
  assert np.isnan(results.nanmean([np.nan, np.nan]))


def _compare(workdir, data_dir, ood, results_md):
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "compare.py"), f"--workdir={workdir}",
         f"--config.data.dir={data_dir}", *SMALL, "--config.eval.num_examples=6",
         "--config.eval.every=2", "--methods=grpo,pbsd", "--seeds=2", "--samples=2", "--batch_size=12",
         f"--ood={ood}", f"--results={results_md}"]
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
  return proc.stdout


def test_compare_trains_every_method_and_seed_from_one_sft_and_tabulates_them(kg, tmp_path):
  ood = [r for t in ("easy", "medium", "hard") for r in
         [x for x in kg.records("ood") if x["tier"] == t][:2]]
  ood_path = tmp_path / "ood.jsonl"
  ood_path.write_text("".join(json.dumps(r) + "\n" for r in ood))
  workdir, page = str(tmp_path / "compare"), str(tmp_path / "docs" / "results.md")
  data_dir = os.path.dirname(kg.paths["spm_model"])
  out = _compare(workdir, data_dir, ood_path, page)
  runs = [f"{m}_seed{s}" for m in ("grpo", "pbsd") for s in (0, 1)]
  assert sorted(d for d in os.listdir(workdir) if "_seed" in d) == sorted(runs)
  evals = {}
  for run in runs:
    with open(os.path.join(workdir, run, "metrics.jsonl")) as f:
      rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows if r["stage"] == "rl"] == [1, 2, 3]
    assert [r["step"] for r in rows if r["stage"] == "eval"] == [0, 2, 3]
    with open(os.path.join(workdir, run, "final_eval.json")) as f:
      evals[run] = json.load(f)
    assert evals[run]["validation"]["greedy"]["num_questions"] == 6
    assert evals[run]["ood"]["top_p"]["samples_per_question"] == 2
    assert f"compare: {run.replace('_seed', ' seed ')}: greedy validation" in out
  # Seeds differ in their RL prompts: the two seeds' rollouts were not the same.
  first = lambda run: [r for r in map(json.loads, open(os.path.join(workdir, run,
                                                                     "metrics.jsonl")))
                       if r["stage"] == "rl"][0]["mean_action_tokens"]
  assert first("grpo_seed0") != first("grpo_seed1")
  text = open(page).read()
  for method in ("grpo", "pbsd"):
    acc = [100 * evals[f"{method}_seed{s}"]["validation"]["greedy"]["accuracy"] for s in (0, 1)]
    want = f"| {method.upper()} | {np.mean(acc):.1f} ± {np.std(acc, ddof=1):.1f} |"
    assert want in text, want
  assert re.search(r"\| PBSD - GRPO \| [+-]\d+\.\d \[", text)
  for png in ("results_accuracy_vs_step.png", "results_dynamics.png", "results_pass_at_k.png"):
    assert os.path.getsize(os.path.join(os.path.dirname(page), png)) > 0
  # A second invocation trains and evaluates nothing again.
  stamps = {run: os.path.getmtime(os.path.join(workdir, run, "final_eval.json"))
            for run in runs}
  _compare(workdir, data_dir, ood_path, page)
  assert stamps == {run: os.path.getmtime(os.path.join(workdir, run, "final_eval.json"))
                    for run in runs}
