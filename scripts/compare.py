r"""Compare RL algorithms from one SFT checkpoint over seeds, and write the results page.

  python scripts/compare.py --workdir=workdir/compare --methods=grpo,pbsd,opsd,rlsd,gear \
      --seeds=3 --samples=16 --ablations=all

The SFT stage runs once (`<workdir>/ckpt_sft`); then every method x seed trains from it in its
own directory (`<workdir>/<method>_seed<s>`: checkpoints, metrics, `final_eval.json`) with
`config.seed = s` (the RL prompts and sampling keys; the SFT checkpoint is shared), logging
greedy validation accuracy every `config.eval.every` steps. Each finished run is evaluated
once: greedy and top-p (`config.eval`, `--samples` per question) on the first
`config.eval.num_examples` validation questions and on out-of-domain tiers: the `--ood`
question file (tiers as `scripts/stratify.py` writes them), or else the paper's BC(300)
procedure on `--ood_pool` (the embedded task's `ood_pool` split by default): the shared SFT
checkpoint samples every pool question `--ood_samples` times (`--ood_sampling`: as it trains,
`config.rollout`, the paper's five runs of its agent; or `config.eval`), and
`--ood_per_tier` questions of each tier (Easy: always solved, Hard: never, Medium: the rest)
become `<workdir>/ood_tiers.jsonl` (`evaluate.stratified_subset`). Everything resumes:
re-running skips finished runs and evaluations (a split added later is evaluated alone).
`--results` (default `docs/results.md`) gets the tables and its PNGs go beside
it: accuracy (mean and spread over seeds); the difference of each method and variant from GRPO
paired by seed (greedy, top-p and pass@k with a bootstrap interval over questions, the mean
accuracy over the RL steps of the validation and of the training rollouts, and the step at
which its rollouts first differ from GRPO's); accuracy against step (greedy validation and
training rollouts), the dynamics of PBSD and GRPO, pass@k, the credit AUCs
(`pbsd_jax.rl.credit_quality`) and the range of the turn weights. `--ablations` adds the
paper's Table 3 as PBSD variants (`ABLATIONS`: delta, the deadband, the turn reduction, the
clip, and on an MoE model replayed routing), each in its own `<variant>_seed<s>` runs,
tabulated against PBSD; `all` is every variant the model can run. Every run's config is
checked before the SFT starts. The PNGs are named after the page (`results.md` ->
`results_*.png`), so pages of two comparisons can share a folder:

  python scripts/compare.py --workdir=workdir/compare_moe --config.model.name=tiny-moe \
      --methods=pbsd --ablations=pbsd-replay --results=docs/results_moe.md
"""

import datetime
import json
import os
import time

from absl import flags
from absl import logging

from pbsd_jax.data import storage
from pbsd_jax.run import cli

_CONFIG = cli.define_config(
    os.path.join(os.path.dirname(__file__), "..", "configs", "demo.py"))
_WORKDIR = flags.DEFINE_string("workdir", "workdir/compare", "The shared SFT and the runs.")
_METHODS = flags.DEFINE_list("methods", ["grpo", "pbsd", "opsd", "rlsd", "gear"],
                             "Algorithms to compare (GRPO, when given, is the baseline of the "
                             "paired differences).")
_SEEDS = flags.DEFINE_integer("seeds", 3, "Seeds per method (0 .. seeds-1).")
_SAMPLES = flags.DEFINE_integer("samples", 16, "Top-p samples per question (pass@k up to it).")
_OOD = flags.DEFINE_string("ood", "", "A question file with tiers (scripts/stratify.py).")
_OOD_POOL = flags.DEFINE_string("ood_pool", "ood_pool", "Without --ood: the split or question "
                                "file to stratify by the SFT checkpoint ('' for no OOD).")
_OOD_SAMPLES = flags.DEFINE_integer("ood_samples", 5, "Samples per pool question.")
_OOD_PER_TIER = flags.DEFINE_integer("ood_per_tier", 100, "Pool questions drawn per tier.")
_OOD_SAMPLING = flags.DEFINE_enum("ood_sampling", "rollout", ["rollout", "eval"],
                                  "The pool's samples: the agent as it trains (config.rollout) "
                                  "or the top-p evaluation (config.eval).")
_RESULTS = flags.DEFINE_string("results", "docs/results.md", "The results page to write.")
_FORCE_RESUME = flags.DEFINE_bool("force_resume", False, "As in scripts/train.py.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 64, "Evaluation rollout rows per call.")
_ABLATIONS = flags.DEFINE_list("ablations", [], "PBSD variants (names of ABLATIONS, or 'all') "
                               "to run for every seed beside the methods.")

# The paper's Table 3 as PBSD variants: name -> (what changes, config overrides). The
# deadband's settings: off, the paper's 0.001 / 0.003 (the default), and thresholds in the
# same 1:3 ratio that zero ~40% of turns. On the demo's SFT checkpoint the paper's zero 47% of
# the turns of training rollouts and 0.0005 / 0.0015 zero 34% (0.00075 / 0.00225: 40%); over
# 50 PBSD steps the paper's zeroed 53% (`credit/frac_deadband`), so the third setting is
# 0.0005 / 0.0015. The results page gives each variant's measured `frac_deadband`.
ABLATIONS = {
    "pbsd-delta0.1": ("delta 0.1 (the demo: 0.01)", {"pbsd.delta": 0.1}),
    "pbsd-delta2": ("delta 2.0", {"pbsd.delta": 2.0}),
    "pbsd-nodeadband": ("deadband off", {"pbsd.eps_pos": 0.0, "pbsd.eps_neg": 0.0}),
    "pbsd-deadband40": ("deadband 0.0005 / 0.0015 (the paper's: 0.001 / 0.003)",
                        {"pbsd.eps_pos": 0.0005, "pbsd.eps_neg": 0.0015}),
    "pbsd-sum": ("turn reduction sum (the demo: mean)", {"pbsd.reduction": "sum"}),
    "pbsd-clip0.5": ("clip 0.5 (the paper's: 0.1)", {"pbsd.clip": 0.5}),
    "pbsd-replay": ("replayed routing (MoE; the method: fresh)", {"pbsd.replay_routing": True}),
}
MOE_ONLY = {"pbsd-replay"}


def _write_json(path, value):
  with storage.replaced(path) as f:
    json.dump(value, f, indent=1, default=float)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  import jax
  import tqdm

  from pbsd_jax.eval import evaluate
  from pbsd_jax.eval.metric_log import MetricLog
  from pbsd_jax.run import (policy_checkpoint, run_config, start as start_lib, train,
                            workdir as workdir_lib)

  start = time.time()
  config, workdir = _CONFIG.value, _WORKDIR.value
  ablations = _ABLATIONS.value
  if unknown := [a for a in ablations if a not in ABLATIONS and a != "all"]:
    raise SystemExit(f"compare: --ablations: {unknown[0]!r} is none of {sorted(ABLATIONS)}")
  if ablations and "pbsd" not in _METHODS.value:
    raise SystemExit("compare: --ablations needs pbsd in --methods (the variants are paired "
                     "with it)")
  run_config.validate_for_script(config)
  if ablations == ["all"]:
    moe = run_config.model_before_data(config).is_moe
    ablations = [a for a in ABLATIONS if moe or a not in MOE_ONLY]
  variants = []  # (run name, settings) for every method and variant, seed-major
  for seed in range(_SEEDS.value):
    for method, algorithm, overrides in [(m, m, {}) for m in _METHODS.value] + [
        (name, "pbsd", ABLATIONS[name][1]) for name in ablations]:
      settings = config.copy_and_resolve_references()
      settings.algorithm, settings.seed = algorithm, seed
      settings.update_from_flattened_dict(overrides)
      variants.append((method, seed, run_config.validate_for_script(settings)))
  run = start_lib.start_run(config, workdir, force_resume=_FORCE_RESUME.value)
  spec, task, mesh = run.spec, run.task, run.mesh
  splits = {"validation": task.splits["rl_validation"][:spec.eval.num_examples]}
  ood_flag, pool = ("--ood", _OOD.value) if _OOD.value else ("--ood_pool", _OOD_POOL.value)
  try:
    pool = task.records(pool) if pool else None
  except (FileNotFoundError, ValueError) as err:
    raise SystemExit(f"compare: {ood_flag}: {err}") from None
  sft_log = MetricLog(workdir, spec.wandb, spec.settings)
  sft = train.sft_stage(spec, task, workdir, sft_log, mesh, progress=tqdm.tqdm,
                        force_resume=_FORCE_RESUME.value)
  sft_log.close()
  if _OOD.value:
    splits["ood"] = pool
  elif pool:
    splits["ood"] = ood_tiers(os.path.join(workdir, "ood_tiers.jsonl"), pool, spec, task,
                              sft.params, mesh)

  def final_eval(run_dir, settings: run_config.RunSpec, params):
    path = os.path.join(run_dir, "final_eval.json")
    result = {}
    if os.path.exists(path):
      with open(path) as f:
        result = json.load(f)
    if all(name in result for name in splits):
      return result
    result |= {name: evaluate.evaluate_policy(
        task.agent(settings.sampler("eval")), params, records, batch_size=_BATCH_SIZE.value,
        rng=jax.random.fold_in(jax.random.key(settings.seed), i),
        prompt_width=settings.data.prompt_width, gold_width=settings.data.gold_width,
        template=settings.data.template, samples_per_question=_SAMPLES.value,
        pass_k=tuple(k for k in settings.eval.pass_k if k <= _SAMPLES.value),
        credit_algo=settings.algorithm, teacher_template=settings.data.teacher_template,
        progress=lambda it, **kw: tqdm.tqdm(it, leave=False, **kw), mesh=mesh)
        for i, (name, records) in enumerate(splits.items()) if name not in result}
    _write_json(path, result)
    return result

  base = config.copy_and_resolve_references()
  base.algorithm = "pbsd"  # the SFT checkpoint is scored with PBSD's evidence
  evals = {("sft", 0): final_eval(workdir, run_config.validate_for_script(base).with_model(
      spec.model), sft.params)}
  runs = {}
  for method, seed, settings in variants:  # seed-major: an interrupted invocation has every
    run_dir = os.path.join(workdir, f"{method}_seed{seed}")  # variant at the seeds it finished
    settings = settings.with_model(spec.model)
    workdir_lib.claim_for_script(run_dir, settings.settings, force=_FORCE_RESUME.value)
    policy_checkpoint.save_model_config(run_dir, spec.model)
    log = MetricLog(run_dir, settings.wandb and settings.wandb.for_run(f"{method}_seed{seed}"),
                    settings.settings)
    state = train.rl_stage(settings, task, sft.params, run_dir, log, mesh, progress=tqdm.tqdm,
                           force_resume=_FORCE_RESUME.value)
    log.close()
    evals[(method, seed)] = final_eval(run_dir, settings, state.params)
    runs[(method, seed)] = log.path
    print(f"compare: {method} seed {seed}: greedy validation "
          f"{evals[(method, seed)]['validation']['greedy']['accuracy']:.1%}", flush=True)
  page = write_results(_RESULTS.value, evals, runs, _METHODS.value, config,
                       minutes=(time.time() - start) / 60, ablations=ablations)
  print(f"compare: wrote {page}")


def ood_tiers(path, pool, spec, task, params, mesh):
  """The stratified OOD tiers of `pool` under the SFT `params` (on `mesh`, module docstring),
  made once and read back from `path` after."""
  import tqdm

  from pbsd_jax.data import jsonl
  from pbsd_jax.data.records import read_records
  from pbsd_jax.eval import evaluate

  if os.path.exists(path):
    return read_records(path)
  sampler = spec.sampler(_OOD_SAMPLING.value)
  try:
    rows, summary = evaluate.stratified_subset(
        task.agent(sampler), params, pool, num_samples=_OOD_SAMPLES.value,
        per_tier=_OOD_PER_TIER.value, seed=0, batch_size=_BATCH_SIZE.value,
        prompt_width=spec.data.prompt_width, gold_width=spec.data.gold_width,
        template=spec.data.template, mesh=mesh,
        progress=lambda it, **kw: tqdm.tqdm(it, leave=False, **kw))
  except ValueError as err:
    raise SystemExit(f"compare: --ood_pool: {err}") from None
  jsonl.write_jsonl(path, rows)
  print(f"compare: the OOD pool ({len(pool)} questions x {_OOD_SAMPLES.value} samples) under "
        f"the SFT checkpoint: accuracy {summary['accuracy']:.1%}, tiers "
        f"{summary['tier_sizes']}; {len(rows)} questions to {path}", flush=True)
  return rows


def write_results(path, evals, runs, methods, config, minutes, ablations=()):
  """The results page from the runs' evaluations and metrics (module docstring); the
  `ablations` (names of ABLATIONS) get a table of their own, paired with PBSD."""
  import jax
  import numpy as np

  from pbsd_jax.eval import evaluate, results

  out_dir = os.path.dirname(os.path.abspath(path))
  stem = os.path.splitext(os.path.basename(path))[0]
  png = lambda name: f"{stem}_{name}.png"
  seeds = sorted({s for (m, s) in runs})
  rows_of = lambda method: ([evals[("sft", 0)]] if method == "sft" else
                            [evals[(method, s)] for s in seeds])
  splits = list(evals[("sft", 0)])
  cell = lambda values: "{:.1f} ± {:.1f}".format(*(100 * x for x in results.mean_sd(values)))

  # Table 1: accuracy per method (mean ± sd over seeds).
  tiers = [t for t in evals[("sft", 0)].get("ood", {}).get("greedy", {}).get(
      "tier_accuracy", {})]
  ks = sorted(int(k) for k in evals[("sft", 0)]["validation"]["top_p"]["pass_at_k"])
  kmax = ks[-1]
  header = ["method", "greedy val", "top-p val", f"pass@{kmax} val"] + [
      f"OOD {t} (greedy)" for t in tiers] + (["OOD top-p"] if tiers else [])
  table = []
  for method in ["sft", *methods]:
    got = rows_of(method)
    row = [method.upper(), cell([r["validation"]["greedy"]["accuracy"] for r in got]),
           cell([r["validation"]["top_p"]["accuracy"] for r in got]),
           cell([r["validation"]["top_p"]["pass_at_k"][str(kmax)] for r in got])]
    row += [cell([r["ood"]["greedy"]["tier_accuracy"][t] for r in got]) for t in tiers]
    row += [cell([r["ood"]["top_p"]["accuracy"] for r in got])] if tiers else []
    table.append(row)

  # Differences from GRPO, paired by seed, with an interval over questions: per question its
  # solve rate (pass@1) or pass@k.
  def scores(method, split, setting, k=1):
    return np.stack([evaluate.pass_at_k_array(r["samples_per_question"], r["solve_counts"], k)
                     for r in (evals[(method, s)][split][setting] for s in seeds)])
  def difference(base, method, split, setting, k=1):
    d, lo, hi = results.paired_bootstrap(scores(base, split, setting, k),
                                         scores(method, split, setting, k))
    return f"{100 * d:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]"
  # The mean accuracy over the RL steps (the area under its curve over its span) of the greedy
  # validation (`eval` rows) and of the training rollouts (`rl` rows: one seed samples the same
  # prompts in every method), paired by seed; and the step at which each seed's rollouts first
  # differ from GRPO's.
  curve_mean = lambda method, s, stage: results.curve_mean(
      *results.metric_series(runs[(method, s)], stage, "accuracy"))
  def curve_difference(method, stage):
    d = 100 * np.asarray([curve_mean(method, s, stage) - curve_mean("grpo", s, stage)
                          for s in seeds])
    if np.isnan(d).any():  # no such rows (e.g. eval.every=0)
      return "-"
    return f"{d.mean():+.1f} (seeds {d.min():+.1f} .. {d.max():+.1f})"
  def leaves_grpo(method):
    steps = [results.first_divergence(runs[("grpo", s)], runs[(method, s)]) for s in seeds]
    return " / ".join("never" if step is None else str(step) for step in steps)
  diffs = [[f"{method.upper()} - GRPO"] + [
      difference("grpo", method, split, setting, k) for split in splits
      for setting, k in (("greedy", 1), ("top_p", 1), ("top_p", kmax))] + [
      curve_difference(method, "eval"), curve_difference(method, "rl"), leaves_grpo(method)]
      for method in [*methods, *ablations] if "grpo" in methods and method != "grpo"]
  diff_header = ["difference"] + [f"{split} {setting}" for split in splits
                                  for setting in ("greedy", "top-p", f"pass@{kmax}")] + [
      "val accuracy over the steps", "training rollouts over the steps",
      "rollouts leave GRPO's at step"]

  # Curves: accuracy vs step, dynamics, pass@k.
  curve = lambda method, stage, key: results.mean_over_runs(
      [results.metric_series(runs[(method, s)], stage, key) for s in seeds])
  results.plot_panels(
      {"greedy validation accuracy (mean over seeds)":
       {m.upper(): curve(m, "eval", "accuracy") for m in methods}},
      os.path.join(out_dir, png("accuracy_vs_step")))
  results.plot_panels(
      {"training rollouts' accuracy (mean over seeds)":
       {m.upper(): curve(m, "rl", "accuracy") for m in [*methods, *ablations]}},
      os.path.join(out_dir, png("training_accuracy")), smooth_window=5)
  pair = [m for m in ("grpo", "pbsd") if m in methods]
  dynamics = {"mean turns": "mean_turns", "generated tokens": "mean_action_tokens",
              "teacher > student (fraction of turns)": "credit/frac_evidence_pos",
              "mean |evidence|": "credit/mean_abs_evidence"}
  results.plot_panels(
      {title: {m.upper(): curve(m, "rl", key) for m in pair} for title, key in dynamics.items()},
      os.path.join(out_dir, png("dynamics")), smooth_window=5)
  results.plot_panels(
      {f"pass@k, {split} (top-p)": {m.upper(): (np.asarray(ks), np.mean(
          [[r[split]["top_p"]["pass_at_k"][str(k)] for k in ks] for r in rows_of(m)], axis=0))
          for m in ["sft", *methods]} for split in splits},
      os.path.join(out_dir, png("pass_at_k")), xlabel="k")

  # Credit quality: AUCs over the RL steps (mean over steps and seeds) and on validation.
  credit_keys = ["credit/auc_weight", "credit/auc_weight_solved", "credit/auc_weight_failed",
                 "credit/auc_evidence", "credit/auc_evidence_solved",
                 "credit/auc_evidence_failed", "credit/frac_useful",
                 "credit/frac_evidence_pos", "credit/mean_abs_evidence",
                 "credit/auc_weight_value", "credit/auc_evidence_value", "credit/frac_progress"]
  three = lambda value: "-" if np.isnan(value) else f"{value:.3f}"  # a mean that no run has
  credit_rows = []
  for method in [*methods, *ablations]:
    row = [method.upper()]
    for key in credit_keys:
      value = results.nanmean([results.nanmean(results.metric_series(runs[(method, s)], "rl",
                                                                      key)[1]) for s in seeds])
      row.append(three(value))
    low, high = (np.concatenate([results.metric_series(runs[(method, s)], "rl",
                                                       f"credit/weight_{key}")[1]
                                 for s in seeds]) for key in ("min", "max"))
    row.append(f"{np.nanmin(low):.3f} .. {np.nanmax(high):.3f}"
               if np.isfinite(low).any() else "-")
    credit_rows.append(row)
  eval_credit = []
  for method in ["sft", *methods, *ablations]:
    got = [r["validation"]["top_p"].get("credit") for r in rows_of(method)]
    if got[0] is not None:
      keys = ("auc_evidence", "auc_evidence_solved", "auc_evidence_failed", "frac_useful",
              "frac_evidence_pos", "mean_abs_evidence", "auc_evidence_value",
              "auc_evidence_value_answer_shown", "auc_evidence_value_answer_hidden",
              "frac_progress")
      eval_credit.append([method.upper()] + [
          three(results.nanmean([g.get(k, np.nan) for g in got])) for k in keys])

  # Table 3: PBSD's variants, each paired with PBSD by seed.
  mean_metric = lambda method, key: results.nanmean([results.nanmean(
      results.metric_series(runs[(method, s)], "rl", key)[1]) for s in seeds])
  ablation_rows = [[name, ABLATIONS[name][0] if name in ABLATIONS else "as configured"] + [
      cell([r["validation"][setting]["accuracy"] for r in rows_of(name)])
      for setting in ("greedy", "top_p")] + [
      difference("pbsd", name, "validation", setting) if name in ABLATIONS else "-"
      for setting in ("greedy", "top_p")] + [
      f"{mean_metric(name, key):.3f}" for key in ("credit/frac_deadband",
                                                  "credit/mean_abs_evidence",
                                                  "credit/auc_weight")]
      for name in ["pbsd", *ablations] if ablations]

  device = jax.devices()[0]
  lines = [
      "# Results: PBSD and the baselines from one SFT checkpoint", "",
      f"Written by `scripts/compare.py` on {datetime.date.today()} ({device.platform}, "
      f"{os.cpu_count()} CPU cores, {minutes:.0f} min for what this invocation ran). "
      f"Config: `{config.model.name}` model, {config.rl.steps} RL steps of "
      f"{config.rollout.prompts_per_step} prompts x {config.grpo.group_size} trajectories, "
      f"SFT {config.sft.steps} steps (teacher_fraction {config.sft.teacher_fraction}), "
      f"seeds {seeds}; evaluation on {evals[('sft', 0)]['validation']['greedy']['num_questions']}"
      f" validation questions, top-p {config.eval.top_p} at temperature "
      f"{config.eval.temperature} with "
      f"{evals[('sft', 0)]['validation']['top_p']['samples_per_question']} samples per "
      "question.", "",
      "## Accuracy (%, mean ± sd over seeds; SFT: the shared checkpoint)", "",
      results.markdown_table(header, table), "",
      *(["## Difference from GRPO (points; paired by seed, 95% bootstrap interval over "
         "questions; over the steps: the mean accuracy over the RL steps, the area under its "
         "curve, of the greedy validation and of the training rollouts, with the seeds' "
         "range; the step of each seed at which the "
         "rollouts first differ from GRPO's)", "", results.markdown_table(diff_header, diffs),
         ""] if diffs else []),
      "## Accuracy against RL step", "", f"![accuracy]({png('accuracy_vs_step')})", "",
      "The training rollouts (sampled as the run trains; raw: faint, moving average of 5 "
      "steps):", "", f"![training accuracy]({png('training_accuracy')})", "",
      "## Dynamics, PBSD vs GRPO (raw: faint; moving average of 5 steps)", "",
      f"![dynamics]({png('dynamics')})", "",
      "## pass@k", "", f"![pass@k]({png('pass_at_k')})", "",
      "## Credit quality (ROC AUC for useful vs. other search turns; 0.5 = chance)", "",
      "During training (mean over RL steps and seeds). `auc_weight` ranks turns by the final "
      "credit relative to the flat outcome advantage, `sign(A) * w` (GRPO: `sign(A)`); "
      "`auc_evidence` by the turn evidence `s`. The `_value` columns rank progress vs. culprit "
      "turns instead, by each turn's change to the chance of success (`gold_chain.turn_values`; "
      "`frac_progress`: their share of labelled turns).", "",
      results.markdown_table(["method"] + [k.split("/")[1] for k in credit_keys]
                             + ["turn weights (min .. max)"], credit_rows), ""]
  if ablation_rows:
    lines += ["## Ablations (the paper's Table 3; PBSD variants, mean ± sd over seeds, "
              "difference from PBSD paired by seed with a 95% bootstrap interval over "
              "questions; credit columns: means over the RL steps)", "",
              results.markdown_table(
                  ["variant", "change", "greedy val", "top-p val", "greedy - PBSD",
                   "top-p - PBSD", "frac_deadband", "mean_abs_evidence", "auc_weight"],
                  ablation_rows), ""]
  if eval_credit:
    lines += ["On validation (top-p rollouts, evidence of each checkpoint on its own "
              "trajectories; the answer columns split `auc_evidence_value` by whether an "
              "earlier search showed the document that names the answer):", "",
              results.markdown_table(["checkpoint", "auc_evidence", "auc_evidence_solved",
                                      "auc_evidence_failed", "frac_useful",
                                      "frac_evidence_pos", "mean_abs_evidence",
                                      "auc_evidence_value", "answer in context",
                                      "answer not in context", "frac_progress"], eval_credit),
              ""]
  with storage.replaced(path) as f:
    f.write("\n".join(lines))
  return path


if __name__ == "__main__":
  cli.run(main)
