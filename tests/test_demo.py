"""scripts/demo.py (what `make demo` runs) with any registered algorithm, on a tiny config."""

import json
import os
import re
import subprocess
import sys

from test_train import ROOT, SMALL


def test_the_demo_runs_with_grpo_and_reports_what_it_evaluated(kg, tmp_path):
  workdir = str(tmp_path / "demo")
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "demo.py"), f"--workdir={workdir}",
         f"--config.data.dir={os.path.dirname(kg.paths['spm_model'])}", *SMALL,
         "--config.algorithm=grpo", "--config.eval.num_examples=8"]
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
  last = proc.stdout.strip().splitlines()[-1]
  match = re.fullmatch(r"demo: validation accuracy SFT=([\d.]+)% GRPO=([\d.]+)% "
                       r"\(([+-][\d.]+) points\)", last)
  assert match, last
  evaluated = {}
  for name in ("sft", "grpo"):
    with open(os.path.join(workdir, f"eval_{name}.json")) as f:
      evaluated[name] = json.load(f)["accuracy"]
  # The printed figures are the evaluations written beside them (8 questions: multiples of
  # 12.5%).
  assert float(match.group(1)) == round(100 * evaluated["sft"], 1)
  assert float(match.group(2)) == round(100 * evaluated["grpo"], 1)
  assert float(match.group(3)) == round(100 * (evaluated["grpo"] - evaluated["sft"]), 1)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  assert [r["step"] for r in rows if r["stage"] == "rl"] == [1, 2, 3]
  # GRPO computes no evidence: no credit metrics and no credit page.
  assert not any(k.startswith("credit/") for r in rows for k in r)
  assert not os.path.exists(os.path.join(workdir, "credit.html"))
