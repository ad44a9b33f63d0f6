"""The run report: PNG plots of the logged metrics and an HTML page of per-turn credit.

`plot_metrics` reads the train loop's `metrics.jsonl` (one JSON object per line with `stage`,
`step` and scalar metrics) and draws one PNG per metric against step, one line per stage.

`credit_view` turns a rollout and its student/teacher log-probs into what the page shows -- per
turn the evidence `s`, the deadbanded `s~` and the modulation weight `w` of docs/design.md §2, as
the algorithm computes them (`turn_credit`) -- and `credit_html` writes the page: each
action turn coloured by its evidence (blue: the teacher finds the turn likelier, red: less
likely) and annotated with its weight; prompts and observations in grey. All text is escaped
(documents may contain `<`).
"""

from __future__ import annotations

import dataclasses
import html
import logging
import os
import re
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pbsd_jax.agent import gold_chain
from pbsd_jax.agent.rollout import Rollout
from pbsd_jax.data import storage
from pbsd_jax.data.jsonl import iter_jsonl
from pbsd_jax.rl import algorithms
from pbsd_jax.rl.algorithms import AdvantageInputs

DEFAULT_PLOT_KEYS = {
    "accuracy": "accuracy",
    "mean_turns": "mean interaction turns",
    "mean_action_tokens": "generated (action) tokens per trajectory",
    "credit/frac_evidence_pos": "fraction of turns with teacher > student",
    "credit/mean_abs_evidence": "mean |evidence| (teacher-student gap)",
}

_log = logging.getLogger(__name__)


def plot_file_name(key: str) -> str:
  """The PNG name of a metric: `credit/mean_abs_evidence` -> `credit_mean_abs_evidence.png`."""
  return re.sub(r"[^A-Za-z0-9_.-]+", "_", key) + ".png"


def plot_metrics(metrics_jsonl_path: str, out_dir: str,
                 keys: Mapping[str, str] | Sequence[str] = DEFAULT_PLOT_KEYS,
                 stages: Sequence[str] | None = None) -> list[str]:
  """One PNG per metric against step; returns the paths written, in the order of `keys`.

  Args:
    metrics_jsonl_path: the metrics file (rows with `stage`, `step` and metrics).
    out_dir: where the PNGs go (created if missing), named by `plot_file_name`.
    keys: metric names, or `{name: plot title}`. A metric no row has is skipped with a
      logged note.
    stages: plot only rows of these stages (default: every stage, one line each).

  Raises:
    ValueError: naming the file and line of a row without an integer `step`.
  """
  import matplotlib
  matplotlib.use("Agg")  # files only, no display
  from matplotlib import pyplot as plt

  titles = dict(keys) if isinstance(keys, Mapping) else {k: k for k in keys}
  series: dict[str, dict[str, tuple[list[int], list[float]]]] = {k: {} for k in titles}
  for line, row in iter_jsonl(metrics_jsonl_path):
    if not isinstance(row, dict) or not isinstance(row.get("step"), int):
      raise ValueError(f"{metrics_jsonl_path}, line {line}: expected an object with an "
                       f"integer 'step'")
    stage = str(row.get("stage", ""))
    if stages is not None and stage not in stages:
      continue
    for key in titles:
      if isinstance(row.get(key), (int, float)):
        steps, values = series[key].setdefault(stage, ([], []))
        steps.append(row["step"])
        values.append(float(row[key]))
  os.makedirs(out_dir, exist_ok=True)
  paths = []
  for key, title in titles.items():
    if not series[key]:
      _log.warning("plot_metrics: no row of %s has %r; no plot for it", metrics_jsonl_path, key)
      continue
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for stage, (steps, values) in series[key].items():
      ax.plot(steps, values, marker="." if len(steps) < 50 else None, label=stage or None)
    ax.set_xlabel("step")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if len(series[key]) > 1:
      ax.legend()
    fig.tight_layout()
    path = os.path.join(out_dir, plot_file_name(key))
    with storage.replaced(path, "wb") as f:
      fig.savefig(f, format="png", dpi=100)
    plt.close(fig)
    paths.append(path)
  return paths


@dataclasses.dataclass(frozen=True)
class TrajectoryCredit:
  """One trajectory as the credit page shows it.

  Attributes:
    prompt: `i32[p]` the real prompt tokens.
    segments: the trajectory in order as `(turn, ids)`: `turn` = k >= 0 for the action tokens
      of turn k, -1 for an observation.
    evidence: `f32[K]` turn evidence `s` (0 for turns that do not exist).
    filtered: `f32[K]` deadbanded evidence `s~`.
    weights: `f32[K]` modulation weights `w`.
    reward: the outcome reward.
    advantage: the group-normalised outcome advantage `A`.
    labels: `K` names of each turn's gold-chain label (`gold_chain.LABEL_NAMES`: useful,
      off-chain, repeat, invalid, "" when unlabelled); empty when the rollout has none.
    teacher_prompt: the teacher's real prompt tokens (with the privileged block), or None.
  """

  prompt: np.ndarray
  segments: tuple[tuple[int, np.ndarray], ...]
  evidence: np.ndarray
  filtered: np.ndarray
  weights: np.ndarray
  reward: float
  advantage: float
  labels: tuple[str, ...] = ()
  teacher_prompt: np.ndarray | None = None


def segments(tokens: np.ndarray, turn_ids: np.ndarray, action: np.ndarray, start: int,
              end: int) -> tuple[tuple[int, np.ndarray], ...]:
  """Maximal runs of `[start, end)` with one label: the turn id on actions, -1 elsewhere."""
  labels = np.where(action[start:end], turn_ids[start:end], -1)
  if labels.size == 0:
    return ()
  cuts = np.flatnonzero(np.diff(labels)) + 1
  bounds = zip(np.concatenate([[0], cuts]), np.concatenate([cuts, [labels.size]]))
  return tuple((int(labels[a]), tokens[start + a:start + b]) for a, b in bounds)


def mixed_group_rows(rollout: Rollout, num_groups: int) -> list[int]:
  """The rows of the first `num_groups` groups whose rewards differ (the groups where the
  outcome advantage is non-zero, so credit has something to assign), then of other groups
  when there are fewer."""
  group_ids, reward = np.asarray(rollout.group_ids), np.asarray(rollout.reward)
  groups = list(dict.fromkeys(group_ids.tolist()))
  mixed = [g for g in groups if np.ptp(reward[group_ids == g]) > 0]
  chosen = (mixed + [g for g in groups if g not in mixed])[:num_groups]
  return [int(b) for g in chosen for b in np.flatnonzero(group_ids == g)]


def credit_view(rollout: Rollout, logp: jax.Array, algo: algorithms.GRPO, max_turns: int, *,
                rows: Sequence[int] | None = None, step: int = 0,
                teacher_prompt: jax.Array | None = None,
                teacher_prompt_mask: jax.Array | None = None) -> list[TrajectoryCredit]:
  """Per-turn evidence, deadband and weights of a rollout's trajectories, for the page.

  The numbers are the algorithm's own (`algo.outcome_advantages` and `algo.turn_credit` on the
  rollout's rewards and `logp`), so the page shows what training computed.

  Args:
    rollout: B trajectories.
    logp: `f32[2, B, T]` student (index 0) and teacher (index 1) log-probs, as
      `likelihood.dual_logprobs` returns them.
    algo: an algorithm that computes turn evidence (`'logp_teacher'` in `algo.needs`: PBSD,
      RLSD).
    max_turns: K, the turn slots.
    rows: which trajectories (default all).
    step: the train step (the algorithm's schedules).
    teacher_prompt, teacher_prompt_mask: `[B, P]` the privileged prompt regions, shown once
      per question on the page.

  Returns:
    One `TrajectoryCredit` per row.
  """
  logp = jnp.asarray(logp)
  if logp.ndim != 3 or logp.shape[0] != 2 or logp.shape[1:] != rollout.tokens.shape:
    raise ValueError(f"logp must be [2, B, T] = [2, {', '.join(map(str, rollout.tokens.shape))}]"
                     f", got {list(logp.shape)}")
  if int(jnp.max(rollout.turn_ids)) >= max_turns:
    raise ValueError(f"the rollout has turn ids up to {int(jnp.max(rollout.turn_ids))}, beyond "
                     f"max_turns={max_turns}")
  if "logp_teacher" not in algo.needs:
    raise ValueError(f"{algo.name} computes no teacher-student evidence to show")
  inputs = AdvantageInputs(rewards=rollout.reward, action_mask=rollout.action_mask,
                           turn_ids=rollout.turn_ids, step=jnp.asarray(step), max_turns=max_turns,
                           logp_student=logp[0], logp_teacher=logp[1])
  advantages, _ = algo.outcome_advantages(inputs)
  turns = algo.turn_credit(advantages, inputs)
  evidence, filtered, weights = turns.evidence, turns.filtered, turns.weights
  host = jax.device_get(dict(tokens=rollout.tokens, turn_ids=rollout.turn_ids,
                             action=rollout.action_mask, length=rollout.length,
                             prompt_length=rollout.prompt_length, reward=rollout.reward,
                             advantages=advantages, evidence=evidence, filtered=filtered,
                             weights=weights))
  p = rollout.prompt_width
  rows = range(host["tokens"].shape[0]) if rows is None else rows
  names = lambda b: (() if rollout.turn_label is None else tuple(
      gold_chain.LABEL_NAMES[int(x)] for x in np.asarray(rollout.turn_label[b])))
  teacher = lambda b: (None if teacher_prompt is None else
                       np.asarray(teacher_prompt[b])[np.asarray(teacher_prompt_mask[b])])
  return [TrajectoryCredit(
      prompt=host["tokens"][b, p - int(host["prompt_length"][b]):p],
      segments=segments(host["tokens"][b], host["turn_ids"][b], host["action"][b], p,
                         int(host["length"][b])),
      evidence=np.asarray(host["evidence"][b]), filtered=np.asarray(host["filtered"][b]),
      weights=np.asarray(host["weights"][b]), reward=float(host["reward"][b]),
      advantage=float(np.asarray(host["advantages"])[b]), labels=names(b),
      teacher_prompt=teacher(b)) for b in rows]


_STYLE = """
body { font-family: sans-serif; margin: 2em; max-width: 70em; }
.trajectory { border: 1px solid #ccc; border-radius: 6px; padding: 0.8em; margin: 1.2em 0; }
.text { white-space: pre-wrap; font-family: monospace; font-size: 0.9em; line-height: 1.6; }
.context { color: #999; }
.turn { border-radius: 3px; padding: 0 2px; }
.note { font-family: sans-serif; font-size: 0.75em; color: #333; background: #eee;
        border-radius: 3px; padding: 0 4px; margin: 0 4px; white-space: nowrap; }
.legend span { padding: 0 6px; margin-right: 6px; border-radius: 3px; }
"""


def colour(value: float, scale: float) -> str:
  """Diverging background: blue for positive evidence, red for negative, alpha by size."""
  alpha = 0.0 if scale <= 0 else min(abs(value) / scale, 1.0) * 0.6
  rgb = "40, 100, 220" if value > 0 else "220, 50, 40"
  return f"rgba({rgb}, {alpha:.3f})"


def credit_html(trajectories: Sequence[TrajectoryCredit], decode: Callable[[Sequence[int]], str],
                path: str, title: str = "PBSD turn-level credit") -> str:
  """Writes `credit_page(trajectories, decode, title)` to `path` (its directory is created if
  missing) and returns `path`."""
  with storage.replaced(path, encoding="utf-8") as f:
    f.write(credit_page(trajectories, decode, title))
  return path


def credit_page(trajectories: Sequence[TrajectoryCredit], decode: Callable[[Sequence[int]], str],
                title: str = "PBSD turn-level credit") -> str:
  """The credit page of `trajectories` as one HTML document.

  Each action turn is shaded by its evidence `s` (colour scale: the largest |s| shown) and
  followed by a note `turn k: s=..., w=...` (`s~=0` marks a deadbanded turn) with its
  gold-chain label when there is one; the prompt and observations are grey. A teacher prompt
  is shown once, before the first trajectory of its question. Every decoded text is
  HTML-escaped.

  Args:
    trajectories: from `credit_view`.
    decode: token ids -> text.
    title: the page title.
  """
  shown = [abs(float(t.evidence[k])) for t in trajectories
           for k, _ in t.segments if k >= 0]
  scale = max(shown, default=0.0)
  esc = lambda ids: html.escape(decode([int(i) for i in ids]))
  parts = [f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}"
           f"</title><style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>",
           "<p class='legend'>Action turns are shaded by their evidence <i>s</i>, the "
           "teacher-minus-student log-likelihood of the turn's tokens (reduced over the turn "
           "as in training): "
           f"<span style='background:{colour(1, 1)}'>teacher higher</span>"
           f"<span style='background:{colour(-1, 1)}'>teacher lower</span>"
           f"(full colour at |s| = {scale:.4g}); <i>w</i> is the weight on the outcome "
           "advantage. Prompt and observations are grey.</p>"]
  shown_teacher = None
  for i, traj in enumerate(trajectories):
    if traj.teacher_prompt is not None and (
        shown_teacher is None or not np.array_equal(traj.teacher_prompt, shown_teacher)):
      shown_teacher = traj.teacher_prompt
      parts.append("<h2>Teacher prompt (privileged)</h2><div class='text context'>"
                   f"{esc(traj.teacher_prompt)}</div>")
    parts.append(f"<div class='trajectory'><h3>trajectory {i}: reward {traj.reward:g}, "
                 f"advantage {traj.advantage:+.4f}</h3><div class='text'>")
    parts.append(f"<span class='context'>{esc(traj.prompt)}</span>")
    for turn, ids in traj.segments:
      if turn < 0:
        parts.append(f"<span class='context'>{esc(ids)}</span>")
        continue
      s, s_kept, w = (float(traj.evidence[turn]), float(traj.filtered[turn]),
                      float(traj.weights[turn]))
      band = " (s~=0)" if s_kept == 0.0 else ""
      label = traj.labels[turn] if turn < len(traj.labels) else ""
      label = f", {label}" if label else ""
      parts.append(f"<span class='turn' style='background:{colour(s, scale)}' "
                   f"title='turn {turn}: s={s:+.5f}, w={w:.4f}'>{esc(ids)}</span>"
                   f"<span class='note'>turn {turn}: s={s:+.4f}{band}, w={w:.4f}{label}"
                   "</span>")
    parts.append("</div></div>")
  parts.append("</body></html>\n")
  return "".join(parts)
