"""The embedded demo (`make demo`): synthetic data -> SFT -> evaluation -> PBSD RL ->
evaluation -> report, on 2 CPU cores.

Its last line is `demo: validation accuracy SFT=..% PBSD=..% (+.. points)` (greedy decoding
on the 200 validation questions). Re-running resumes from the workdir's checkpoints. Any
registered algorithm runs with `--config.algorithm=NAME`; the credit page is drawn for those
that compute teacher-student evidence (PBSD, RLSD).
"""

import json
import os
import time

from absl import flags
from absl import logging

from pbsd_jax import cli

_CONFIG = cli.define_config(
    os.path.join(os.path.dirname(__file__), "..", "configs", "demo.py"))
_WORKDIR = flags.DEFINE_string("workdir", "workdir/demo", "Data, checkpoints and the report.")
_FORCE_RESUME = flags.DEFINE_bool(
    "force_resume", False, "Resume a workdir made by another configuration (the fields that "
    "differ are named when it is refused without this flag).")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  import jax
  import tqdm

  from pbsd_jax import evaluate, likelihood, policy_checkpoint, privileged, report
  from pbsd_jax import run_config, task as task_lib, train, workdir as workdir_lib
  from pbsd_jax.metric_log import MetricLog
  from pbsd_jax.sampling import Sampler

  start = time.time()
  config, workdir = _CONFIG.value, _WORKDIR.value
  run_config.validate_for_script(config)
  workdir_lib.claim_for_script(workdir, config, force=_FORCE_RESUME.value)
  task = task_lib.prepare_task(config, workdir)
  model = run_config.build_model_config(config, task.vocab.vocab_size)
  mesh = run_config.mesh_for_script(config, model)
  policy_checkpoint.save_model_config(workdir, model)
  log = MetricLog(workdir)

  def validation_accuracy(params, name):
    result = evaluate.evaluate(
        Sampler(model, temperature=0.0), task.env, params,
        task.splits["rl_validation"][:config.eval.num_examples], task.encode, task.index,
        batch_size=50, rng=jax.random.key(config.seed), prompt_width=config.data.prompt_width,
        gold_width=config.data.gold_width, progress=tqdm.tqdm)
    with open(os.path.join(workdir, f"eval_{name}.json"), "w") as f:
      json.dump(result, f, indent=1, default=float)
    print(f"{name}: greedy validation accuracy {result['accuracy']:.1%}, "
          f"mean turns {result['mean_turns']:.2f}, "
          f"generated tokens {result['mean_action_tokens']:.1f}", flush=True)
    return result["accuracy"]

  sft_state = train.sft_stage(config, task, model, workdir, log, mesh, progress=tqdm.tqdm,
                              force_resume=_FORCE_RESUME.value)
  sft_acc = validation_accuracy(sft_state.params, "sft")
  algo = run_config.build_algorithm(config)

  def credit_page(step, state, rollout, batch):
    """The last RL step's rollout, each turn coloured by its evidence (post-update params)."""
    if step != config.rl.steps or "logp_teacher" not in algo.needs:
      return
    teacher = privileged.teacher_sequence(rollout.tokens, rollout.mask, batch["teacher_prompt"],
                                          batch["teacher_prompt_mask"])
    logp = likelihood.dual_logprobs(state.params, model, rollout.tokens, rollout.mask, *teacher)
    view = report.credit_view(rollout, logp, algo, task.env.max_turns,
                              rows=range(min(8, rollout.tokens.shape[0])), step=step)
    report.credit_html(view, task.decode, os.path.join(workdir, "credit.html"),
                       title=f"{algo.name.upper()} turn-level credit")

  rl_state = train.rl_stage(config, task, model, sft_state.params, workdir, log, mesh,
                            progress=tqdm.tqdm, on_step=credit_page,
                            force_resume=_FORCE_RESUME.value)
  rl_acc = validation_accuracy(rl_state.params, algo.name)
  plots = report.plot_metrics(log.path, workdir)
  page = " and credit.html" if "logp_teacher" in algo.needs else ""
  print(f"demo: finished in {(time.time() - start) / 60:.1f} min; report: {len(plots)} plots"
        f"{page} in {workdir}")
  print(f"demo: validation accuracy SFT={sft_acc:.1%} {algo.name.upper()}={rl_acc:.1%} "
        f"({(rl_acc - sft_acc) * 100:+.1f} points)")


if __name__ == "__main__":
  cli.run(main)
