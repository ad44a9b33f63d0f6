"""What every training script does before its first step, as one function."""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh

from pbsd_jax.models import ModelConfig
from pbsd_jax.run import policy_checkpoint, run_config, task as task_lib, workdir as workdir_lib


@dataclasses.dataclass(frozen=True)
class Started:
  """A run ready for its stages: the task, the model config and the mesh."""

  task: task_lib.Task
  model: ModelConfig
  mesh: Mesh


def start_run(config, workdir: str, *, force_resume: bool = False) -> Started:
  """Validates `config` (`run_config.validate`), claims `workdir` (`workdir.claim`: a workdir
  of another configuration is refused unless `force_resume`), prepares the task, builds the
  model config for its vocabulary and the mesh (checked to shard the parameters), and saves
  the model config and the model's tokenizer in `workdir` (the first process), where the
  run's checkpoints find them. Each failure ends the script with one line."""
  run_config.validate_for_script(config)
  workdir_lib.claim_for_script(workdir, config, force=force_resume)
  task = task_lib.prepare_task(config, workdir)
  model = run_config.build_model_config(config, task.vocab.vocab_size)
  mesh = run_config.mesh_for_script(config, model)
  if jax.process_index() == 0:  # the files every process would write alike
    policy_checkpoint.save_model_config(workdir, model)
    task_lib.save_tokenizer(config, workdir)
  return Started(task, model, mesh)
