"""The embedded demo (`make demo`): synthetic data -> SFT -> evaluation -> GRPO and PBSD RL
from the same SFT checkpoint -> evaluation -> report, on 2 CPU cores.

Its last line is `demo: validation accuracy SFT=..% GRPO=..% PBSD=..%` (greedy decoding on
the 200 validation questions). Each RL run has its own directory under the workdir
(`grpo/`, `pbsd/`: checkpoints, metrics, plots, evaluation) and starts from the shared
`ckpt_sft`, with the same seed and RL settings; `accuracy_vs_step.png` and
`credit_auc.png` compare them. Re-running resumes from the workdir's checkpoints. Any
registered algorithm runs beside GRPO with `--config.algorithm=NAME`; the credit page is
drawn for those that compute teacher-student evidence (PBSD, RLSD).
"""

import json
import os
import time

from absl import flags
from absl import logging

from pbsd_jax.data import storage
from pbsd_jax.run import cli

_CONFIG = cli.define_config(
    os.path.join(os.path.dirname(__file__), "..", "configs", "demo.py"))
_WORKDIR = flags.DEFINE_string("workdir", "workdir/demo", "Data, checkpoints and the report.")
_FORCE_RESUME = flags.DEFINE_bool(
    "force_resume", False, "Resume a workdir made by another configuration (the fields that "
    "differ are named when it is refused without this flag).")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  import tqdm

  from pbsd_jax.eval import report, results
  from pbsd_jax.eval.metric_log import MetricLog
  from pbsd_jax.run import (policy_checkpoint, run_config, start as start_lib, train,
                            workdir as workdir_lib)

  start = time.time()
  config, workdir = _CONFIG.value, _WORKDIR.value
  run = start_lib.start_run(config, workdir, force_resume=_FORCE_RESUME.value)
  spec, task, mesh = run.spec, run.task, run.mesh
  log = MetricLog(workdir, spec.wandb, spec.settings)

  def validation_accuracy(params, name, out_dir, settings=spec):
    result = train.validation_accuracy(settings, task, params, progress=tqdm.tqdm, credit=True,
                                       mesh=mesh)
    with storage.replaced(os.path.join(out_dir, f"eval_{name}.json")) as f:
      json.dump(result, f, indent=1, default=float)
    credit = result.get("credit")
    auc = "" if credit is None else (
        f"; evidence AUC useful vs. other searches {credit['auc_evidence']:.2f}, teacher > "
        f"student on {credit['frac_evidence_pos']:.0%} of them, mean |s| "
        f"{credit['mean_abs_evidence']:.2f}")
    print(f"{name}: greedy validation accuracy {result['accuracy']:.1%}, "
          f"mean turns {result['mean_turns']:.2f}, "
          f"generated tokens {result['mean_action_tokens']:.1f}{auc}", flush=True)
    return result["accuracy"]

  sft_state = train.sft_stage(spec, task, workdir, log, mesh, progress=tqdm.tqdm,
                              force_resume=_FORCE_RESUME.value)
  log.close()
  accuracy = {"sft": validation_accuracy(sft_state.params, "sft", workdir)}
  runs = {}
  for name in dict.fromkeys(("grpo", config.algorithm)):
    rl_config = config.copy_and_resolve_references()
    rl_config.algorithm = name
    rl_spec = run_config.validate_for_script(rl_config).with_model(spec.model)
    run_dir = os.path.join(workdir, name)
    workdir_lib.claim_for_script(run_dir, rl_spec.settings, force=_FORCE_RESUME.value)
    policy_checkpoint.save_model_config(run_dir, spec.model)
    run_log = MetricLog(run_dir, rl_spec.wandb and rl_spec.wandb.for_run(name),
                        rl_spec.settings)
    rl_state = train.rl_stage(rl_spec, task, sft_state.params, run_dir, run_log, mesh,
                              progress=tqdm.tqdm, on_step=_credit_page(rl_spec, task, run_dir),
                              force_resume=_FORCE_RESUME.value)
    run_log.close()
    accuracy[name] = validation_accuracy(rl_state.params, name, run_dir, rl_spec)
    report.plot_metrics(run_log.path, run_dir)
    runs[name] = run_log.path
  plots = [results.plot_panels(
      {title: {name.upper(): results.metric_series(path, stage, key)
               for name, path in runs.items()}}, os.path.join(workdir, f"{out}.png"))
      for stage, key, out, title in _COMPARISONS]
  print(f"demo: finished in {(time.time() - start) / 60:.1f} min; report in {workdir}: "
        f"{', '.join(os.path.basename(p) for p in plots if p)}, per-run plots in "
        f"{', '.join(f'{name}/' for name in runs)}")
  print("demo: validation accuracy " + " ".join(f"{name.upper()}={acc:.1%}"
                                                for name, acc in accuracy.items()))


# (stage, metric, file, title) of the plots that put the RL runs side by side.
_COMPARISONS = (
    ("eval", "accuracy", "accuracy_vs_step", "greedy validation accuracy"),
    ("rl", "credit/auc_weight", "credit_auc",
     "ROC AUC of the signed turn credit, useful vs. other searches"),
)


def _credit_page(spec, task, run_dir):
  """An `rl_stage` step hook: two groups of the last step's rollout with mixed outcomes, each
  turn coloured by its evidence (post-update params) and labelled by the gold chain, written
  to `<run_dir>/credit.html` for algorithms with evidence."""
  from pbsd_jax.agent import privileged
  from pbsd_jax.eval import report
  from pbsd_jax.rl import likelihood

  algo = spec.algorithm

  def on_step(step, state, rollout, batch):
    if step != spec.rl.steps or "logp_teacher" not in algo.needs:
      return
    teacher = privileged.teacher_sequence(rollout.tokens, rollout.mask, batch["teacher_prompt"],
                                          batch["teacher_prompt_mask"])
    logp = likelihood.dual_logprobs(state.params, spec.model, rollout.tokens, rollout.mask,
                                    *teacher)
    view = report.credit_view(rollout, logp, algo, task.env.max_turns,
                              rows=report.mixed_group_rows(rollout, 2), step=step,
                              teacher_prompt=batch["teacher_prompt"],
                              teacher_prompt_mask=batch["teacher_prompt_mask"])
    report.credit_html(view, task.tokenizer.decode, os.path.join(run_dir, "credit.html"),
                       title=f"{algo.name.upper()} turn-level credit")
  return on_step


if __name__ == "__main__":
  cli.run(main)
