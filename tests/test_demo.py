"""scripts/demo.py (what `make demo` runs): GRPO and PBSD from one SFT checkpoint, tiny config."""

import json
import os
import re
import subprocess
import sys

import numpy as np

from script_env import script_env
from test_train import ROOT, SMALL


def _rows(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


def test_the_demo_trains_grpo_and_pbsd_from_one_sft_checkpoint_and_reports_both(kg, tmp_path):
  workdir = str(tmp_path / "demo")
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "demo.py"), f"--workdir={workdir}",
         f"--config.data.dir={os.path.dirname(kg.paths['spm_model'])}", *SMALL,
         "--config.eval.num_examples=8", "--config.eval.every=2", "--config.eval.sft_every=3",
         "--config.sft.schedule=cosine", "--config.sft.warmup_steps=1"]
  proc = subprocess.run(cmd, env=script_env(), capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
  last = proc.stdout.strip().splitlines()[-1]
  match = re.fullmatch(r"demo: validation accuracy SFT=([\d.]+)% GRPO=([\d.]+)% "
                       r"PBSD=([\d.]+)%", last)
  assert match, last
  paths = {"sft": os.path.join(workdir, "eval_sft.json"),
           "grpo": os.path.join(workdir, "grpo", "eval_grpo.json"),
           "pbsd": os.path.join(workdir, "pbsd", "eval_pbsd.json")}
  # The printed figures are the evaluations written beside them (8 questions: multiples of
  # 12.5%).
  for group, name in enumerate(paths, start=1):
    with open(paths[name]) as f:
      assert float(match.group(group)) == round(100 * json.load(f)["accuracy"], 1), name
  sft_rows = _rows(os.path.join(workdir, "metrics.jsonl"))
  assert {r["stage"] for r in sft_rows} == {"sft", "eval_sft"}
  # sft.schedule=cosine over the 4 SFT steps (1 warm-up step; demo sft.lr 3e-3): updates 0..3
  # at lr * (1 + cos(pi * p)) / 2, p = 0, 0, 1/3, 2/3; the RL stage keeps optim's constant
  # schedule (2 warm-up steps to 1e-3).
  np.testing.assert_allclose([r["learning_rate"] for r in sft_rows if r["stage"] == "sft"],
                             [3e-3, 3e-3, 2.25e-3, 0.75e-3], rtol=1e-5)
  # eval.sft_every=3 over 4 steps: step 3 and the last, which is the SFT evaluation.
  sft_evals = {r["step"]: r["accuracy"] for r in sft_rows if r["stage"] == "eval_sft"}
  assert sorted(sft_evals) == [3, 4]
  with open(paths["sft"]) as f:
    assert sft_evals[4] == json.load(f)["accuracy"]
  for name in ("grpo", "pbsd"):
    rows = _rows(os.path.join(workdir, name, "metrics.jsonl"))
    assert [r["step"] for r in rows if r["stage"] == "rl"] == [1, 2, 3]
    np.testing.assert_allclose([r["learning_rate"] for r in rows if r["stage"] == "rl"],
                               [0.5e-3, 1e-3, 1e-3], rtol=1e-5)
    # eval.every=2: step 0 (the SFT policy), 2, and the last step; the last is the final
    # evaluation, and step 0 is the SFT one (the same greedy evaluation of the same params).
    evals = {r["step"]: r["accuracy"] for r in rows if r["stage"] == "eval"}
    assert sorted(evals) == [0, 2, 3]
    with open(paths[name]) as f:
      assert evals[3] == json.load(f)["accuracy"]
    with open(paths["sft"]) as f:
      assert evals[0] == json.load(f)["accuracy"]
    rl_keys = {k for r in rows if r["stage"] == "rl" for k in r}
    assert "credit/auc_weight" in rl_keys
    # Only PBSD computes evidence: its AUC, its credit page.
    assert ("credit/auc_evidence" in rl_keys) == (name == "pbsd")
    assert os.path.exists(os.path.join(workdir, name, "credit.html")) == (name == "pbsd")
  assert os.path.exists(os.path.join(workdir, "accuracy_vs_step.png"))
