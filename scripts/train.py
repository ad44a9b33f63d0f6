"""Train a search agent: SFT on oracle trajectories, then RL with the configured algorithm.

  python scripts/train.py --config=configs/pbsd.py --workdir=workdir/pbsd \
      --config.rl.steps=50 --config.pbsd.delta=0.2

Re-running the same command resumes from the last checkpoint of the unfinished stage.
"""

from absl import flags
from absl import logging

from pbsd_jax import cli

_CONFIG = cli.define_config("configs/pbsd.py")
_WORKDIR = flags.DEFINE_string("workdir", "workdir/run", "Checkpoints, metrics, data.")
_FORCE_RESUME = flags.DEFINE_bool(
    "force_resume", False, "Resume a workdir made by another configuration (the fields that "
    "differ are named when it is refused without this flag).")


def main(argv):
  del argv
  import tqdm

  from pbsd_jax import policy_checkpoint, run_config, task as task_lib, train
  from pbsd_jax import workdir as workdir_lib
  from pbsd_jax.metric_log import MetricLog

  logging.set_verbosity(logging.WARNING)  # orbax logs every file it renames at INFO
  config = _CONFIG.value
  run_config.validate_for_script(config)
  workdir_lib.claim_for_script(_WORKDIR.value, config, force=_FORCE_RESUME.value)
  task = task_lib.prepare_task(config, _WORKDIR.value)
  model = run_config.build_model_config(config, task.vocab.vocab_size)
  policy_checkpoint.save_model_config(_WORKDIR.value, model)
  log = MetricLog(_WORKDIR.value)
  force = _FORCE_RESUME.value
  state = train.sft_stage(config, task, model, _WORKDIR.value, log, progress=tqdm.tqdm,
                          force_resume=force)
  train.rl_stage(config, task, model, state.params, _WORKDIR.value, log, progress=tqdm.tqdm,
                 force_resume=force)


if __name__ == "__main__":
  cli.run(main)
