"""What every training script does before its first step, as one function."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import Mesh

from pbsd_jax.run import policy_checkpoint, run_config, task as task_lib, workdir as workdir_lib


@dataclasses.dataclass(frozen=True)
class Started:
  """A run ready for its stages: its spec (the model config of its vocabulary), the task and
  the mesh."""

  spec: run_config.RunSpec
  task: task_lib.Task
  mesh: Mesh


def start_run(config, workdir: str, *, force_resume: bool = False) -> Started:
  """Validates `config` into its `RunSpec`, claims `workdir` (`workdir.claim`: a workdir of
  another configuration is refused unless `force_resume`), prepares the task, completes the
  model config for its vocabulary, builds the mesh (checked to shard the parameters), and
  saves the model config and the model's tokenizer in `workdir` (the first process), where
  the run's checkpoints find them. Each failure ends the script with one line."""
  spec = run_config.validate_for_script(config)
  workdir_lib.claim_for_script(workdir, spec.settings, force=force_resume)
  task = task_lib.prepare_task(spec, workdir)
  spec = spec.for_vocabulary(task.vocab.vocab_size)
  mesh = run_config.mesh_for_script(spec)
  if jax.process_index() == 0:  # the files every process would write alike
    policy_checkpoint.save_model_config(workdir, spec.model)
    task_lib.save_tokenizer(spec, workdir)
  return Started(spec, task, mesh)


@dataclasses.dataclass(frozen=True)
class Loaded(Started):
  """A checkpoint's policy ready for evaluation: `Started`'s fields (the spec's model the
  checkpoint's), its parameters on the mesh and their step (None: a converted checkpoint)."""

  params: Any
  step: int | None


def start_evaluation(config, ckpt_dir: str, step: int | None, workdir: str) -> Loaded:
  """What the evaluation scripts do first: validate `config` (a bad one ends the script with
  one line), prepare the task and read the policy of `ckpt_dir` (`task.load_policy`; the
  latest step unless `step`), onto the run's mesh (`spec.build_mesh()`).

  Raises:
    FileNotFoundError, ValueError: no such checkpoint, or data that cannot be used.
  """
  spec = run_config.validate_for_script(config)
  mesh = spec.build_mesh()
  task, model, params, step = task_lib.load_policy(spec, ckpt_dir, step, workdir, mesh)
  return Loaded(spec.with_model(model), task, mesh, params, step)
