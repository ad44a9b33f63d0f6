"""The turn values checked by Monte Carlo: does a turn the world calls progress raise the
policy's own chance of success, and a culprit lower it?

For each question one rollout is sampled (`scripts/check_labels.py`) and its turns get their
values (`gold_chain.turn_values`). Then, for every turn j of it, the trajectory's first j turns are
replayed and the policy continues from there, `continuations` times (the chance of success
*without* turn j: the policy may take another turn in its place), and likewise after its first
j + 1 turns (*with* turn j). Their difference in solve rate is turn j's Monte Carlo value.
The two agree on a turn when their signs do; a Monte Carlo value of 0 (as many solved with the
turn as without) agrees with a neutral label only.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pbsd_jax.agent import gold_chain
from pbsd_jax.agent.rollout import Agent, ingraph_rollout, rollout_actions


def monte_carlo_values(agent: Agent, params: Any, batch: dict, base: Any, *,
                       continuations: int, rng: jax.Array) -> dict[str, np.ndarray]:
  """The Monte Carlo value of every labelled turn of `base`.

  Args:
    agent: an in-graph agent (`Agent.in_graph`: the continuations are `ingraph_rollout`s).
    params: the policy's parameters.
    batch: `base`'s rows (`batch.question_batch` with their gold chains).
    base: the trajectories, labelled (`label_turns`; `agent.rollout` of `batch` is).
    continuations: rollouts per turn and side (with, without).
    rng: folded per turn and side, the continuations' key.

  Returns:
    `value`, `mc`: `f32[N, K]` the turns' values and Monte Carlo values (NaN where a turn is
    unlabelled); `reward`: `f32[N]` the trajectories' rewards.
  """
  if not agent.in_graph:
    raise ValueError("the Monte Carlo check continues trajectories in the graph: it needs "
                     "config.env.retriever=ingraph")
  env = agent.env
  value = np.asarray(base.turn_value)
  forced, lengths = rollout_actions(base, env.max_turns, env.max_action_tokens)
  rows = np.repeat(np.arange(value.shape[0]), continuations)

  def solve_rate(prefix: int, key: jax.Array) -> np.ndarray:
    out = ingraph_rollout(agent.sampler, env, params, batch["prompts"][rows],
                          batch["prompt_mask"][rows], key, agent.search, batch["gold"][rows],
                          None, jnp.asarray(forced[:, rows]), jnp.asarray(lengths[:, rows]),
                          text=agent.tokenizer.text, prefix_turns=jnp.int32(prefix))
    return np.asarray(out.reward).reshape(-1, continuations).mean(axis=1)

  mc = np.full(value.shape, np.nan, np.float32)
  for j in range(env.max_turns):
    if np.all(np.isnan(value[:, j])):
      continue
    key = jax.random.fold_in(rng, j)
    without, with_turn = (solve_rate(j + i, jax.random.fold_in(key, i)) for i in (0, 1))
    mc[:, j] = np.where(np.isnan(value[:, j]), np.nan, with_turn - without)
  return {"value": value, "mc": mc, "reward": np.asarray(base.reward)}


def agreement(value: np.ndarray, mc: np.ndarray) -> dict[str, float]:
  """How often the labels and the Monte Carlo values agree (module docstring), overall and
  per label, with the two values' correlation over the labelled turns."""
  labelled = ~np.isnan(value)
  label = np.asarray(gold_chain.value_labels(jnp.asarray(value)))
  sign = np.where(label == gold_chain.PROGRESS, 1, np.where(label == gold_chain.CULPRIT, -1, 0))
  agree = labelled & (np.sign(mc) == sign)
  out = {"turns": int(labelled.sum()),
         "agreement": float(agree.sum() / max(labelled.sum(), 1)),
         "correlation": (float(np.corrcoef(value[labelled], mc[labelled])[0, 1])
                         if labelled.sum() > 1 and np.std(mc[labelled]) > 0
                         and np.std(value[labelled]) > 0 else float("nan"))}
  for code, name in gold_chain.VALUE_LABEL_NAMES.items():
    if name:
      keep = label == code
      out[f"{name}_turns"] = int(keep.sum())
      out[f"{name}_agreement"] = float(agree[keep].mean()) if keep.any() else float("nan")
      out[f"{name}_mean_mc"] = float(mc[keep].mean()) if keep.any() else float("nan")
  return out
