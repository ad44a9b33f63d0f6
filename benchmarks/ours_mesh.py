"""The loop's RL step on a 2x2x2 mesh of 8 fake CPU devices vs on 1 device, same batch.

Both run in one process (8 fake devices; the 1-device mesh takes the first): the embedded
task, `--size` model with random weights, `--algorithm`, the batch `train.rl_inputs` builds
(rows sharded over the data axes), the one-program step `train.make_rl_iteration` with its
explicit shardings. The fake devices share the same cores, so the ratio shows what sharding
adds (collectives, host round trips, recompiles), not a speed-up. Every backend compilation
is counted (`jax.monitoring`'s backend-compile event): after the first step there must be
none. The rollout alone is also timed on both meshes and on a 2x1x1 mesh (2 devices, one per
core). Prints `RESULT {json}` with the warm median times, the ratio and the counts.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
from jax import monitoring  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from pbsd_jax.run import cli, run_config, task as task_lib, train  # noqa: E402
from pbsd_jax.parallel import sharding

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
compiles = [0]
monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kw: compiles.__setitem__(0, compiles[0] + (event == COMPILE_EVENT)))


def measure(spec, task, mesh, steps: int) -> dict:
  """Median warm step time and the compilations of each step on `mesh`."""
  model, tx = spec.model, spec.rl.optimizer
  iteration = train.make_rl_iteration(task.agent(spec.sampler("rollout")), model, tx,
                                      spec.algorithm, spec.rl.plan, mesh)
  state = train.fresh_state(train.initial_params(spec, mesh), tx, model, mesh, spec.seed)
  times, per_step = [], []
  for step in range(steps):
    _, batch, group_ids = train.rl_inputs(task, spec, step, mesh)
    before, start = compiles[0], time.perf_counter()
    state, _, metrics = iteration(state, (task.search, task.tokenizer.text), batch, group_ids)
    jax.block_until_ready((state, metrics))
    times.append(time.perf_counter() - start)
    per_step.append(compiles[0] - before)
  return {"step_s": statistics.median(times[1:]), "compiles_per_step": per_step}


def measure_rollout(spec, task, mesh, steps: int) -> float:
  """Median warm time of the step's rollout alone (`ingraph_rollout`) on `mesh`."""
  rollout_fn = jax.jit(task.agent(spec.sampler("rollout")).rollout)
  params = train.initial_params(spec, mesh)
  times = []
  for step in range(steps):
    _, batch, group_ids = train.rl_inputs(task, spec, step, mesh)
    start = time.perf_counter()
    jax.block_until_ready(rollout_fn(params, jax.random.key(step), batch, group_ids))
    times.append(time.perf_counter() - start)
  return statistics.median(times[1:])


def main():
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--size", default="tiny")
  p.add_argument("--algorithm", default="pbsd")
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--prompts", type=int, default=8)
  p.add_argument("--group", type=int, default=4)
  p.add_argument("--micro_batch_size", type=int, default=0, help="rl.micro_batch_size")
  args = p.parse_args()
  config = cli.load_config_file(os.path.join(ROOT, "configs", f"{args.algorithm}.py"))
  config.model.name = args.size
  config.rollout.prompts_per_step, config.grpo.group_size = args.prompts, args.group
  config.rl.micro_batch_size = args.micro_batch_size
  spec = run_config.validate(config)
  with tempfile.TemporaryDirectory() as workdir:
    task = task_lib.prepare_task(spec, workdir)
    spec = spec.for_vocabulary(task.vocab.vocab_size)
    one = measure(spec, task, sharding.make_mesh(devices=jax.devices()[:1]), args.steps)
    mesh = sharding.make_mesh(2, 2, 2)
    run_config.check_param_sharding(spec.model, mesh)
    eight = measure(spec, task, mesh, args.steps)
    # The rollout alone, and on 2 devices (one per core): what the 8 fake devices' per-token
    # synchronisation costs when they share 2 cores.
    rollout = {name: measure_rollout(spec, task, m, args.steps) for name, m in [
        ("one_device", sharding.make_mesh(devices=jax.devices()[:1])), ("mesh_2x2x2", mesh),
        ("mesh_2x1x1", sharding.make_mesh(2, 1, 1, devices=jax.devices()[:2]))]}
  result = {"size": args.size, "algorithm": args.algorithm,
            "batch": args.prompts * args.group, "micro_batch_size": args.micro_batch_size,
            "one_device_step_s": one["step_s"],
            "mesh_2x2x2_step_s": eight["step_s"],
            "mesh_over_one_device": eight["step_s"] / one["step_s"],
            "compiles_per_step_one_device": one["compiles_per_step"],
            "compiles_per_step_mesh": eight["compiles_per_step"],
            **{f"rollout_{name}_s": t for name, t in rollout.items()}}
  print("RESULT " + json.dumps(result))


if __name__ == "__main__":
  main()
