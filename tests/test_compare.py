"""scripts/compare.py and its statistics (pbsd_jax.eval.results)."""

import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from pbsd_jax.eval import results
from script_env import script_env
from test_colabs import execute_notebook
from test_train import ROOT, SMALL

# The compare run is made once, for both tests (conftest: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("compare")


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


def test_curve_mean_is_the_area_over_the_span_of_steps():
  # Trapezoids over steps 0, 2, 3: (0.2 + 0.4) / 2 * 2 + (0.4 + 1.0) / 2 * 1 = 1.3, over 3.
  assert results.curve_mean(np.array([0, 2, 3]), np.array([0.2, 0.4, 1.0])) == pytest.approx(
      1.3 / 3)
  assert results.curve_mean(np.array([5]), np.array([0.7])) == 0.7
  assert np.isnan(results.curve_mean(np.array([]), np.array([])))  # eval.every=0: no rows


def test_first_divergence_is_the_first_rl_step_whose_rollouts_differ(tmp_path):
  def write(name, tokens, accuracy=0.5):
    rows = [{"stage": "sft", "step": 1, "loss": 1.0}] + [
        {"stage": "rl", "step": i + 1, "accuracy": accuracy, "mean_turns": 2.0,
         "mean_action_tokens": t, "searches": 1.0, "loss": float(i)} for i, t in
        enumerate(tokens)]
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)
  base = write("a", [10.0, 11.0, 12.0])
  assert results.first_divergence(base, write("b", [10.0, 11.0, 13.0])) == 3
  # The loss is not a rollout statistic; the accuracy is.
  assert results.first_divergence(base, write("c", [10.0, 11.0, 12.0])) is None
  assert results.first_divergence(base, write("d", [10.0, 11.0], accuracy=0.25)) == 1
  assert results.first_divergence(base, write("e", [10.0, 11.0])) is None  # steps both have


def _compare(workdir, data_dir, ood, results_md, *extra, check=True):
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "compare.py"), f"--workdir={workdir}",
         f"--config.data.dir={data_dir}", *SMALL, "--config.eval.num_examples=6",
         "--config.eval.every=2", "--methods=grpo,pbsd", "--seeds=2", "--samples=2",
         "--batch_size=12", "--ablations=pbsd-sum",
         *([f"--ood={ood}"] if ood else []), f"--results={results_md}", *extra]
  proc = subprocess.run(cmd, env=script_env(), capture_output=True, text=True, timeout=900)
  if check:
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
  return proc


@pytest.fixture(scope="module")
def comparison(kg, tmp_path_factory):
  """One finished compare.py run (GRPO, PBSD and the pbsd-sum ablation x 2 seeds, with OOD
  tiers): `(workdir, results page, ood file, data dir, stdout)`; treat it as read-only."""
  root = tmp_path_factory.mktemp("comparison")
  ood = [r for t in ("easy", "medium", "hard") for r in
         [x for x in kg.records("ood") if x["tier"] == t][:2]]
  ood_path = root / "ood.jsonl"
  ood_path.write_text("".join(json.dumps(r) + "\n" for r in ood))
  workdir, page = str(root / "compare"), str(root / "docs" / "results.md")
  data_dir = os.path.dirname(kg.paths["spm_model"])
  return workdir, page, ood_path, data_dir, _compare(workdir, data_dir, ood_path, page).stdout


def test_compare_trains_every_method_and_seed_from_one_sft_and_tabulates_them(comparison,
                                                                               tmp_path):
  workdir, page, ood_path, data_dir, out = comparison
  runs = [f"{m}_seed{s}" for m in ("grpo", "pbsd", "pbsd-sum") for s in (0, 1)]
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
  # The notebooks read a compare workdir back the same way.
  loaded, metrics = results.load_runs(workdir)
  assert sorted(metrics) == sorted((m, s) for m in ("grpo", "pbsd", "pbsd-sum")
                                   for s in (0, 1))
  assert sorted(loaded) == sorted([("sft", 0), *metrics])
  assert all(loaded[(m, s)] == evals[f"{m}_seed{s}"] for m, s in metrics)
  with pytest.raises(FileNotFoundError, match="no <method>_seed<s> run"):
    results.load_runs(str(tmp_path / "docs"))
  text = open(page).read()
  for method in ("grpo", "pbsd"):
    acc = [100 * evals[f"{method}_seed{s}"]["validation"]["greedy"]["accuracy"] for s in (0, 1)]
    want = f"| {method.upper()} | {np.mean(acc):.1f} ± {np.std(acc, ddof=1):.1f} |"
    assert want in text, want
  # Every method and variant is paired with GRPO (the values: the synthetic test below).
  assert re.search(r"\| PBSD - GRPO \| [+-]\d+\.\d \[", text)
  assert re.search(r"\| PBSD-SUM - GRPO \| [+-]\d+\.\d \[", text)
  # and has a row of its own in the credit table, with its turn weights' range.
  (credit,) = [line for line in text.splitlines()
               if line.startswith("| PBSD-SUM | ") and line.count("|") == 15]
  assert re.fullmatch(r"\d\.\d{3} \.\. \d\.\d{3}", credit.rsplit("|", 2)[1].strip())
  # The ablation ran PBSD with its own setting, and is tabulated against PBSD.
  with open(os.path.join(workdir, "pbsd-sum_seed0", "run_config.json")) as f:
    ablated = json.load(f)
  assert (ablated["algorithm"], ablated["pbsd"]["reduction"]) == ("pbsd", "sum")
  acc = [100 * evals[f"pbsd-sum_seed{s}"]["validation"]["greedy"]["accuracy"] for s in (0, 1)]
  assert re.search(rf"\| pbsd-sum \| turn reduction sum [^|]*\| {np.mean(acc):.1f} ± "
                   rf"{np.std(acc, ddof=1):.1f} \|", text)
  for png in ("results_accuracy_vs_step.png", "results_training_accuracy.png",
              "results_dynamics.png", "results_pass_at_k.png"):
    assert os.path.getsize(os.path.join(os.path.dirname(page), png)) > 0
  # A second invocation trains and evaluates nothing again.
  stamps = {run: os.path.getmtime(os.path.join(workdir, run, "final_eval.json"))
            for run in runs}
  _compare(workdir, data_dir, ood_path, str(tmp_path / "again.md"))
  assert stamps == {run: os.path.getmtime(os.path.join(workdir, run, "final_eval.json"))
                    for run in runs}


@functools.cache
def _compare_module():  # once: the script defines its absl flags when loaded
  spec = importlib.util.spec_from_file_location("compare", os.path.join(ROOT, "scripts",
                                                                        "compare.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_the_results_page_pairs_each_method_with_grpo_by_hand(tmp_path):
  """`write_results` on two methods x 2 seeds made up here: 4 validation questions x 2
  top-p samples, greedy curves over RL steps 0, 2, 4, and rollouts that part at chosen steps."""
  sys.path.insert(0, os.path.join(ROOT, "configs"))
  import demo
  from pbsd_jax.eval import evaluate

  def evaluation(greedy, top_p):  # solve vectors: [4] greedy, [4 x 2] top-p
    out = lambda solved, n: evaluate.summarize(
        {"reward": np.asarray(solved, np.float32), "num_turns": np.full(len(solved), 3),
         "num_action_tokens": np.full(len(solved), 20), "finished": np.ones(len(solved)),
         "truncated": np.zeros(len(solved))}, ["in_domain"] * 4, n, (1, 2))
    return {"validation": {"greedy": out(greedy, 1), "top_p": out(np.ravel(top_p), 2)}}
  evals = {("sft", 0): evaluation([1, 0, 0, 0], [[1, 0], [0, 0], [0, 0], [0, 0]]),
           ("grpo", 0): evaluation([1, 1, 0, 0], [[1, 0], [1, 0], [0, 0], [0, 0]]),
           ("grpo", 1): evaluation([1, 0, 0, 0], [[1, 1], [0, 0], [0, 0], [0, 0]]),
           ("pbsd", 0): evaluation([1, 1, 1, 0], [[1, 1], [1, 0], [1, 0], [0, 0]]),
           ("pbsd", 1): evaluation([1, 0, 0, 0], [[1, 1], [0, 0], [0, 0], [1, 0]])}
  # PBSD's evidence on validation: a key an evaluation lacks (an older evaluation's answer
  # split, GRPO's evidence) is left out of the mean, and "-" where no seed has it.
  evals[("sft", 0)]["validation"]["top_p"]["credit"] = {"auc_evidence": 0.6}
  evals[("pbsd", 0)]["validation"]["top_p"]["credit"] = {
      "auc_evidence": 0.5, "auc_evidence_value_answer_shown": 0.8}
  evals[("pbsd", 1)]["validation"]["top_p"]["credit"] = {"auc_evidence": 0.7}
  curves = {("grpo", 0): [0.0, 0.5, 0.5], ("grpo", 1): [0.0, 0.25, 0.25],
            ("pbsd", 0): [0.0, 0.5, 1.0], ("pbsd", 1): [0.0, 0.25, 0.25]}
  parts = {0: 3, 1: None}  # the step each seed's PBSD rollouts leave GRPO's
  weights = {("pbsd", 0): [(0.95, 1.04), (0.92, 1.0)], ("pbsd", 1): [(1.0, 1.07), (1.0, 1.0)]}
  runs = {}
  for (method, seed), curve in curves.items():
    rows = [{"stage": "eval", "step": 2 * i, "accuracy": a} for i, a in enumerate(curve)]
    for step in range(1, 5):
      tokens = 30.0 + step + (0.5 if method == "pbsd" and parts[seed] and
                              step >= parts[seed] else 0.0)
      row = {"stage": "rl", "step": step, "accuracy": 0.75 if tokens % 1 else 0.25,
             "mean_turns": 3.0, "mean_action_tokens": tokens, "searches": 2.0}
      if method == "pbsd":
        low, high = weights[(method, seed)][step % 2]
        row |= {"credit/weight_min": low, "credit/weight_max": high}
      rows.append(row)
    runs[(method, seed)] = str(tmp_path / f"{method}_{seed}.jsonl")
    with open(runs[(method, seed)], "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)
  page = _compare_module().write_results(str(tmp_path / "page.md"), evals, runs,
                                         ["grpo", "pbsd"], demo.get_config(), minutes=1.0)
  text = open(page).read()
  row = next(line for line in text.splitlines() if line.startswith("| PBSD - GRPO |"))
  cells = [c.strip() for c in row.strip("|").split("|")]
  # Per question, mean over seeds of PBSD - GRPO: greedy (0, 0, +1, 0) and 0 -> +12.5;
  # top-p rates (0.5, 0, 0.5, 0) and (0, 0, 0, 0.5) -> +18.75; pass@2 (0, 0, 1, 0) and
  # (0, 0, 0, 1) -> +25.
  assert [c.split(" [")[0] for c in cells[1:4]] == ["+12.5", "+18.8", "+25.0"]
  # Mean accuracy over steps 0-4: seed 0 (0.25 + 0.5) / 2 vs (0.25 + 0.75) / 2 -> +12.5;
  # seed 1: 0.
  assert cells[4] == "+6.2 (seeds +0.0 .. +12.5)"
  # Training rollouts over steps 1-4: seed 0's PBSD solves 0.75 from step 3 on, GRPO 0.25:
  # (0.25 + 0.5 + 0.75) / 3 - 0.25 -> +25; seed 1: 0.
  assert cells[5] == "+12.5 (seeds +0.0 .. +25.0)"
  assert cells[6] == "3 / never"
  credit = [line for line in text.splitlines() if line.startswith(("| GRPO | ", "| PBSD | "))
            and line.count("|") > 12]
  assert [line.rsplit("|", 2)[1].strip() for line in credit] == ["-", "0.920 .. 1.070"]
  on_validation = [[c.strip() for c in line.strip("|").split("|")]
                   for line in text.splitlines() if line.count("|") == 12]
  assert on_validation[2:] == [["SFT", "0.600"] + ["-"] * 9,
                               ["PBSD", "0.600"] + ["-"] * 6 + ["0.800", "-", "-"]]
  # Runs without validation rows (eval.every=0): that column says so, the others stand.
  for path in runs.values():
    kept = [line for line in open(path) if '"eval"' not in line]
    with open(path, "w") as f:
      f.writelines(kept)
  page = _compare_module().write_results(str(tmp_path / "page.md"), evals, runs,
                                         ["grpo", "pbsd"], demo.get_config(), minutes=1.0)
  row = next(line for line in open(page).read().splitlines()
             if line.startswith("| PBSD - GRPO |"))
  assert [c.strip() for c in row.strip("|").split("|")][4:] == [
      "-", "+12.5 (seeds +0.0 .. +25.0)", "3 / never"]


def test_the_results_notebook_draws_a_compare_workdir(comparison, tmp_path):
  workdir = comparison[0]
  nb, got = execute_notebook(
      "results", f"RUNS_DIR = {workdir!r}; WORKDIR = {str(tmp_path)!r}",
      "dict(methods=methods, seeds=seeds, rows=rows, curve=curve('pbsd', 'eval', "
      "'accuracy')[0].tolist())")
  assert (got["methods"], got["seeds"]) == (["grpo", "pbsd", "pbsd-sum"], [0, 1])
  evals, _ = results.load_runs(workdir)
  for name, runs, greedy, _ in got["rows"]:
    acc = [100 * e["validation"]["greedy"]["accuracy"] for (m, _), e in evals.items()
           if m == name.lower()]
    assert (int(runs), greedy) == (len(acc), f"{np.mean(acc):.1f} ± "
                                   f"{np.std(acc, ddof=1) if len(acc) > 1 else 0:.1f}")
  assert [r[0] for r in got["rows"]] == ["SFT", "GRPO", "PBSD", "PBSD-SUM"]
  assert got["curve"] == [0, 2, 3]  # eval.every=2 over 3 steps: the start, 2 and the end
  images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if "image/png" in o.get("data", {})]
  assert len(images) == 3


def test_an_ablation_the_model_cannot_run_fails_before_the_sft(kg, tmp_path):
  # Replayed routing needs an MoE model; every run's config is checked before anything trains.
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "compare.py"), f"--workdir={tmp_path}",
         f"--config.data.dir={os.path.dirname(kg.paths['spm_model'])}", *SMALL,
         "--methods=pbsd", "--seeds=1", "--ablations=pbsd-replay"]
  proc = subprocess.run(cmd, env=script_env(), capture_output=True, text=True, timeout=300)
  assert proc.returncode != 0
  assert "config.pbsd.replay_routing=True: needs an MoE model" in proc.stdout + proc.stderr
  assert not os.path.exists(tmp_path / "ckpt_sft")


def test_without_ood_file_the_pool_is_stratified_by_the_sft_checkpoint(comparison, kg,
                                                                       tmp_path):
  # The comparison's SFT checkpoint (copied) samples a pool of 6. That small SFT solves none of
  # it, so every question is Hard (0 of 2 samples) and Easy and Medium cannot give one question
  # each: the run ends naming the tier sizes, which counted every pool question, before any
  # RL run. (The demo's SFT: docs/results.md.)
  workdir, _, _, data_dir, _ = comparison
  run = tmp_path / "run"
  shutil.copytree(workdir, run, ignore=lambda d, names: [n for n in names if "_seed" in n])
  (tmp_path / "pool.jsonl").write_text(
      "".join(json.dumps(r) + "\n" for r in kg.records("ood_pool")[::250]))
  proc = _compare(str(run), data_dir, None, str(tmp_path / "page.md"),
                  f"--ood_pool={tmp_path / 'pool.jsonl'}", "--ood_samples=2",
                  "--ood_per_tier=1", check=False)
  assert proc.returncode != 0
  last = (proc.stdout + proc.stderr).strip().splitlines()[-1]
  assert last == ("compare: --ood_pool: tier(s) ['easy', 'medium'] have fewer than per_tier=1 "
                  "questions (tier sizes {'easy': 0, 'medium': 0, 'hard': 6}, n=2 samples "
                  "each)"), last
  assert not [n for n in os.listdir(run) if "_seed" in n]


def test_a_full_disk_under_the_results_page_ends_in_one_line_and_leaves_no_partial_page(
    comparison, tmp_path, record_property):
  # The finished comparison, copied, only draws its page again: onto a full tmpfs first.
  from test_storage_faults import fill, one_line, tmpfs
  workdir, page, ood, data_dir, _ = comparison
  run = str(tmp_path / "run")
  shutil.copytree(workdir, run)
  with tmpfs(tmp_path / "disk", 1) as disk:
    target = os.path.join(disk, "docs", "results.md")
    filler = fill(disk)
    proc = _compare(run, data_dir, ood, target, check=False)
    line = one_line(proc.stdout + proc.stderr, proc.returncode)
    assert line.startswith(f"error: no space left on the device of {disk}/docs/"), line
    leftovers = [n for _, _, names in os.walk(disk) for n in names if n != "filler"]
    assert not leftovers, leftovers  # no page, no plot, no temporary file

    os.remove(filler)
    _compare(run, data_dir, ood, target)
    tables = lambda text: [row for row in text.splitlines() if row.startswith("|")]
    with open(target) as got, open(page) as want:
      assert tables(got.read()) == tables(want.read())
  record_property("faults_injected", 1)
