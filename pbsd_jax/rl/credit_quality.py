"""Credit quality where the world knows its gold chains: whether a credit signal ranks the
turns that helped (`agent.gold_chain.turn_labels`) above the others.

`roc_auc` is the Mann-Whitney AUC of a score for useful vs. labelled-but-not-useful turns
(0.5 for a signal that carries no information, 1 for a perfect ranking; NaN when one class is
empty), computed from ranks on device. `quality_metrics` applies it to PBSD's turn evidence `s`
and to the final turn credit signed by the outcome (`sign(A) * w`: the weight a turn's tokens
get relative to the flat GRPO advantage, so GRPO itself scores `sign(A)`), over all turns and
separately in solved and failed trajectories. With the turns' values
(`gold_chain.turn_values`) it also scores them for PROGRESS vs. CULPRIT turns
(`gold_chain.value_labels`, neutral ones left out): the `_value` metrics.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pbsd_jax.agent.gold_chain import CULPRIT, PROGRESS, UNLABELLED, USEFUL, value_labels
from pbsd_jax.rl import credit

Array = jax.Array


@jax.jit
def roc_auc(score: Array, positive: Array, valid: Array) -> Array:
  """ROC AUC of `score` for `positive` vs. not, over the `valid` entries (any shape).

  `P(score of a positive > score of a negative)`, ties counting one half: the Mann-Whitney U
  statistic from average ranks, `O(N log N)`. NaN when either class is empty.
  """
  s = jnp.where(valid, score, jnp.inf).reshape(-1).astype(jnp.float32)
  pos = (valid & positive).reshape(-1)
  neg = (valid & ~positive).reshape(-1)
  ranked = jnp.sort(s)
  # 1-based average rank among the valid entries (invalid ones sort last, at +inf).
  rank = (jnp.searchsorted(ranked, s, side="left") + jnp.searchsorted(ranked, s, side="right")
          + 1) / 2.0
  n_pos, n_neg = jnp.sum(pos).astype(jnp.float32), jnp.sum(neg).astype(jnp.float32)
  u = jnp.sum(jnp.where(pos, rank, 0.0)) - n_pos * (n_pos + 1) / 2
  return jnp.where((n_pos > 0) & (n_neg > 0), u / jnp.maximum(n_pos * n_neg, 1.0), jnp.nan)


def quality_metrics(turn_label: Array, solved: Array, signed_credit: Array | None = None,
                    credited: Array | None = None, evidence: Array | None = None,
                    turn_value: Array | None = None) -> dict:
  """`credit/` metrics of a batch: AUCs of the credit signals for useful turns.

  Args:
    turn_label: `i32[B, K]` (`turn_labels`).
    solved: `bool[B]` trajectories whose reward is positive.
    signed_credit: `f32[B, K]` each turn's credit relative to the flat outcome advantage,
      `sign(A) * w` (`turn_signed_credit`), or None (no weight AUCs).
    credited: `bool[B]` rows whose outcome advantage is non-zero (where `signed_credit` is
      defined); required with `signed_credit`.
    evidence: `f32[B, K]` turn evidence `s`, or None for an algorithm without one.
    turn_value: `f32[B, K]` the turns' values (`gold_chain.turn_values`), or None.

  Returns:
    `credit/frac_useful` and `credit/labelled_turns`; with `signed_credit`,
    `credit/auc_weight{,_solved,_failed}`; with `evidence`, `credit/auc_evidence{,_solved,
    _failed}` (NaN where a class is empty). With `turn_value`, `credit/frac_progress`,
    `credit/frac_culprit` and the same AUCs for progress vs. culprit turns, named `..._value`.
  """
  labelled, useful = turn_label != UNLABELLED, turn_label == USEFUL
  n = jnp.sum(labelled).astype(jnp.float32)
  metrics = {"credit/labelled_turns": n,
             "credit/frac_useful": jnp.sum(useful) / jnp.maximum(n, 1),
             **_aucs(labelled, useful, solved, signed_credit, credited, evidence, "")}
  if turn_value is not None:
    label = value_labels(turn_value)
    progress, culprit = label == PROGRESS, label == CULPRIT
    n = jnp.maximum(jnp.sum(label != UNLABELLED), 1)
    metrics["credit/frac_progress"] = jnp.sum(progress) / n
    metrics["credit/frac_culprit"] = jnp.sum(culprit) / n
    metrics.update(_aucs(progress | culprit, progress, solved, signed_credit, credited,
                         evidence, "_value"))
  return metrics


def _aucs(labelled: Array, positive: Array, solved: Array, signed_credit: Array | None,
          credited: Array | None, evidence: Array | None, name: str) -> dict:
  """The AUCs of `quality_metrics` for `positive` vs. the other `labelled` turns, over all
  rows and within solved and failed ones, their names ending in `name`."""
  metrics = {}
  rows = {"": jnp.ones_like(solved), "_solved": solved, "_failed": ~solved}
  for suffix, keep in rows.items():
    if signed_credit is not None:
      metrics[f"credit/auc_weight{name}{suffix}"] = roc_auc(
          signed_credit, positive, labelled & (keep & credited)[:, None])
    if evidence is not None:
      metrics[f"credit/auc_evidence{name}{suffix}"] = roc_auc(evidence, positive,
                                                              labelled & keep[:, None])
  return metrics


def batch_metrics(algo, inputs, token_advantages: Array, turn_label: Array,
                  turn_value: Array | None = None) -> dict:
  """`quality_metrics` of a batch as an algorithm credits it: its outcome advantages, turn
  evidence (`algo.turn_credit`, None for GRPO) and final token advantages.

  Args:
    algo: a `pbsd_jax.rl.algorithms` algorithm.
    inputs: its `AdvantageInputs` (student log-probs filled in).
    token_advantages: `f32[B, T]` what `algo.advantages(inputs)` returned.
    turn_label: `i32[B, K]` (`turn_labels`).
    turn_value: `f32[B, K]` (`turn_values`), or None.
  """
  outcome, _ = algo.outcome_advantages(inputs)
  turns = algo.turn_credit(outcome, inputs)
  signed = turn_signed_credit(token_advantages, outcome, inputs.turn_ids, inputs.max_turns)
  return quality_metrics(turn_label, inputs.rewards > 0, signed, outcome != 0,
                         None if turns is None else turns.evidence, turn_value)


def turn_signed_credit(token_advantages: Array, outcome: Array, turn_ids: Array,
                       max_turns: int) -> Array:
  """`f32[B, K]` each turn's credit relative to the flat outcome advantage, signed by it:
  `sign(A)` times the turn's mean of `A_t / A` (`sign(A) * w` for PBSD, `sign(A)` for GRPO);
  0 on rows with `A = 0` and on absent turns. The result is rounded to 1e-5: XLA divides by
  multiplying with a reciprocal, which leaves GRPO's `A / A` (and a mean of ones) an ulp off
  1 on some rows, and that noise must not rank turns that carry the same credit."""
  scale = outcome[:, None]
  ratio = jnp.where(scale != 0, token_advantages / jnp.where(scale != 0, scale, 1.0), 0.0)
  signed = jnp.sign(outcome)[:, None] * credit.turn_evidence(ratio, turn_ids, max_turns)
  return jnp.round(signed * 1e5) / 1e5
