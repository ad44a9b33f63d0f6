"""Train a search agent: SFT on oracle trajectories, then RL with the configured algorithm.

  python scripts/train.py --config=configs/pbsd.py --workdir=workdir/pbsd \
      --config.rl.steps=50 --config.pbsd.delta=0.2

Re-running the same command resumes from the last checkpoint of the unfinished stage.
Multi-host: the same command on every host, with `--coordinator_address=HOST0:PORT
--num_processes=N --process_id=I` (or nothing on a TPU pod / in a SLURM job); docs/cluster.md.
"""

from absl import flags
from absl import logging

from pbsd_jax.run import cli

_CONFIG = cli.define_config("configs/pbsd.py")
_WORKDIR = flags.DEFINE_string("workdir", "workdir/run", "Checkpoints, metrics, data.")
_DISTRIBUTED = cli.define_distributed()
_FORCE_RESUME = flags.DEFINE_bool(
    "force_resume", False, "Resume a workdir made by another configuration (the fields that "
    "differ are named when it is refused without this flag).")


def main(argv):
  del argv
  cli.initialize_distributed(_DISTRIBUTED)  # before anything touches a device
  from pbsd_jax.eval.metric_log import MetricLog
  from pbsd_jax.run import start, train

  logging.set_verbosity(logging.WARNING)  # orbax logs every file it renames at INFO
  config, workdir, force = _CONFIG.value, _WORKDIR.value, _FORCE_RESUME.value
  run = start.start_run(config, workdir, force_resume=force)
  log = MetricLog(workdir, run.spec.wandb, run.spec.settings)
  progress = cli.progress_bar()
  state = train.sft_stage(run.spec, run.task, workdir, log, run.mesh, progress=progress,
                          force_resume=force)
  train.rl_stage(run.spec, run.task, state.params, workdir, log, run.mesh, progress=progress,
                 force_resume=force)
  log.close()


if __name__ == "__main__":
  cli.run(main)
