"""A small RL problem shared by the learner tests, and the worker of the two-process test.

As a library (`import multiprocess_worker`): `make_config`, `make_tx`, `make_algo`, `make_plan`,
`make_rollout` and `initial_state` define one deterministic RL problem on a tiny model;
`reference_step` / `reference_run` are its single-device step and two-step result, compiled
and computed once per test process.

As a script: `python multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT OUT.npz` joins a
`jax.distributed` job over gloo on localhost (4 CPU devices per process), feeds only this
process's rows of the batch (`jax.make_array_from_process_local_data`), runs two RL steps under
a (2, 2, 2) mesh, and (process 0) writes the final parameters and metrics to OUT.npz.
"""

from __future__ import annotations

import functools
import os
import sys

import numpy as np

BATCH, PROMPT_WIDTH, LENGTH, GROUP_SIZE, MAX_TURNS = 16, 6, 20, 4, 2


def make_config():
  from pbsd_jax.models import ModelConfig
  return ModelConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                     mlp_dim=64)


def make_tx():
  from pbsd_jax.rl import train_state
  return train_state.make_optimizer(lr=1e-3, warmup_steps=2, weight_decay=0.1, grad_clip=1.0)


def make_algo():
  from pbsd_jax.rl import algorithms
  # A wide delta and a zero deadband, so the tiny model's evidence visibly shapes credit.
  return algorithms.get("pbsd", group_size=GROUP_SIZE, delta=0.05, eps_pos=0.0, eps_neg=0.0)


def make_plan():
  from pbsd_jax.rl import learner
  return learner.UpdatePlan(epochs=2, minibatches=2, micro_batch_size=4, chunk_size=8)


def make_rollout(seed: int, batch: int = BATCH):
  """A `Rollout` in the shared token layout plus left-padded teacher prompts (numpy).

  Row b: a prompt of 3-6 tokens right-aligned in `[0, P)`, then turn 0 (3-4 action tokens),
  an observation (2-3 tokens), turn 1 (2-3 action tokens), then right padding; rewards vary
  inside every group of `GROUP_SIZE` rows.

  Returns:
    `(rollout, teacher_prompt i32[B, P], teacher_prompt_mask bool[B, P])`.
  """
  from pbsd_jax.agent.rollout import Rollout
  rs = np.random.RandomState(seed)
  tokens = rs.randint(1, 64, size=(batch, LENGTH)).astype(np.int32)
  action = np.zeros((batch, LENGTH), bool)
  turns = np.full((batch, LENGTH), -1, np.int32)
  prompt_length = rs.randint(3, PROMPT_WIDTH + 1, size=batch).astype(np.int32)
  length = np.zeros(batch, np.int32)
  teacher = np.zeros((batch, PROMPT_WIDTH), np.int32)
  teacher_mask = np.zeros((batch, PROMPT_WIDTH), bool)
  for b in range(batch):
    tokens[b, :PROMPT_WIDTH - prompt_length[b]] = 0
    col = PROMPT_WIDTH
    for turn, (n_act, n_obs) in enumerate([(rs.randint(3, 5), rs.randint(2, 4)),
                                           (rs.randint(2, 4), 0)]):
      action[b, col:col + n_act] = True
      turns[b, col:col + n_act] = turn
      col += n_act + n_obs
    length[b] = col
    tokens[b, col:] = 0
    n_teacher = min(prompt_length[b] + 2, PROMPT_WIDTH)
    teacher[b, PROMPT_WIDTH - n_teacher:] = rs.randint(1, 64, size=n_teacher)
    teacher_mask[b, PROMPT_WIDTH - n_teacher:] = True
  reward = np.tile(np.array([1.0, 0.0, 0.0, 1.0], np.float32), batch // 4)
  reward[4:8] = [0.0, 1.0, 1.0, 1.0]
  zeros = np.zeros(batch, np.int32)
  rollout = Rollout(tokens=tokens, action_mask=action, turn_ids=turns,
                    num_turns=np.full(batch, 2, np.int32), length=length,
                    prompt_length=prompt_length, finished=np.ones(batch, bool),
                    truncated=np.zeros(batch, bool),
                    group_ids=np.repeat(np.arange(batch // GROUP_SIZE), GROUP_SIZE).astype(
                        np.int32),
                    sample_logp=np.zeros((batch, LENGTH), np.float32), reward=reward,
                    searches=zeros, search_failures=zeros, prompt_width=PROMPT_WIDTH)
  return rollout, teacher, teacher_mask


@functools.lru_cache(maxsize=None)
def _initial_params_host():
  import jax
  from pbsd_jax.models import init_params
  return jax.device_get(init_params(make_config(), jax.random.key(0)))


def initial_params():
  """The problem's seeded initial parameters, as fresh device arrays (safe to donate)."""
  import jax
  import jax.numpy as jnp
  return jax.tree.map(jnp.array, _initial_params_host())


def initial_state(tx, shardings=None):
  """The train state every run of the problem starts from (seeded)."""
  import jax
  from pbsd_jax.rl import train_state
  params = _initial_params_host() if shardings is not None else initial_params()
  return train_state.init_train_state(params, tx, jax.random.key(1), shardings)


@functools.lru_cache(maxsize=None)
def reference_step():
  """`(tx, jitted single-device rl step)` of the problem; one compile per process."""
  from pbsd_jax.rl import learner
  tx = make_tx()
  return tx, learner.make_rl_step(make_config(), tx, make_algo(), MAX_TURNS, make_plan())


@functools.lru_cache(maxsize=None)
def reference_run():
  """Two single-device RL steps (rollout seeds 10, 11): `(params, [metrics, metrics])` numpy."""
  import jax
  tx, step = reference_step()
  state = initial_state(tx)
  metrics = []
  for seed in (10, 11):
    state, m = step(state, *make_rollout(seed))
    metrics.append(jax.device_get(m))
  return jax.device_get(state.params), metrics


def _main(process_id: int, num_processes: int, port: int, out: str):
  import jax  # on 4 CPU devices (the test's `script_env(4)`)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=f"localhost:{port}",
                             num_processes=num_processes, process_id=process_id)
  from jax.experimental import multihost_utils

  from pbsd_jax.parallel import sharding
  from pbsd_jax.rl import learner, train_state

  mesh = sharding.make_mesh(2, 2, 2)
  config, tx = make_config(), make_tx()
  state = initial_state(tx, train_state.train_state_shardings(config, tx, mesh))
  step = learner.make_rl_step(config, tx, make_algo(), MAX_TURNS, make_plan(), mesh)
  metrics = []
  for seed in (10, 11):
    rollout, teacher, teacher_mask = make_rollout(seed)
    rows = sharding.process_batch_rows(BATCH, mesh)
    local = jax.tree.map(lambda x: x[rows], (rollout, teacher, teacher_mask))
    global_batch = sharding.shard_process_local_batch(local, mesh, BATCH)
    state, m = step(state, *global_batch)
    metrics.append(m)
  params = multihost_utils.process_allgather(state.params, tiled=True)
  if process_id == 0:
    flat = {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_leaves_with_path(params)}
    for i, m in enumerate(metrics):
      flat.update({f"metrics{i}/{k}": np.asarray(v) for k, v in m.items()})
    np.savez(out, **flat)
  jax.distributed.shutdown()


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  _main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
