"""The comparison's results: statistics over seeds and questions, curves, the results page.

`scripts/compare.py` trains several algorithms for several seeds from one SFT checkpoint and
evaluates each run; this module turns what the runs wrote (each run's `metrics.jsonl` and
`final_eval.json`) into `docs/results.md` and its PNGs. The statistics are pure functions of
arrays, tested on hand-made values: `mean_sd` over seeds, `paired_bootstrap` of a difference
between two methods paired by seed with an interval over questions, `smooth` for noisy
per-step curves.
"""

from __future__ import annotations

import json
import os
import re
from typing import Mapping, Sequence

import numpy as np

from pbsd_jax.data import storage
from pbsd_jax.eval.metric_log import stage_rows


def mean_sd(values: Sequence[float]) -> tuple[float, float]:
  """Mean and sample standard deviation (0 for a single value) of `values`."""
  x = np.asarray(values, np.float64)
  return float(x.mean()), float(x.std(ddof=1)) if x.size > 1 else 0.0


def paired_bootstrap(a: np.ndarray, b: np.ndarray, reps: int = 2000, seed: int = 0,
                     level: float = 0.95) -> tuple[float, float, float]:
  """`b - a` paired by seed and question, with a bootstrap interval over questions.

  Args:
    a, b: `[S, Q]` per-seed, per-question scores of two methods (e.g. 0/1 greedy
      correctness, or the top-p solve rate); seed s of `a` pairs with seed s of `b`.
    reps: bootstrap resamples of the Q questions.
    seed: the resampling seed.
    level: the interval's coverage.

  Returns:
    `(difference, low, high)`: the mean over seeds and questions of `b - a`, and the
    percentile interval of that mean over question resamples.
  """
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  if a.shape != b.shape or a.ndim != 2:
    raise ValueError(f"a and b must both be [seeds, questions], got {a.shape} and {b.shape}")
  per_question = (b - a).mean(axis=0)
  idx = np.random.default_rng(seed).integers(0, per_question.size, (reps, per_question.size))
  means = per_question[idx].mean(axis=1)
  tail = (1 - level) / 2 * 100
  low, high = np.percentile(means, [tail, 100 - tail])
  return float(per_question.mean()), float(low), float(high)


def smooth(values: Sequence[float], window: int) -> np.ndarray:
  """Trailing moving average over `window` values (fewer at the start); NaNs are skipped."""
  x = np.asarray(values, np.float64)
  out = np.empty_like(x)
  for i in range(x.size):
    part = x[max(0, i - window + 1):i + 1]
    part = part[~np.isnan(part)]
    out[i] = part.mean() if part.size else np.nan
  return out


def _read_json(path: str):
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    return json.load(f)


RUN_DIR = re.compile(r"^(?P<method>[a-z0-9_.-]+)_seed(?P<seed>[0-9]+)$")


def load_runs(workdir: str) -> tuple[dict, dict]:
  """What a `scripts/compare.py` workdir holds: `(evals, metrics)`, with `evals[(method,
  seed)]` each finished run's `final_eval.json` (and `("sft", 0)`: the shared checkpoint's,
  when evaluated) and `metrics[(method, seed)]` the path of each run's `metrics.jsonl`, both
  in the order of their keys. A run still training has metrics and no evaluation.

  Raises:
    FileNotFoundError: `workdir` holds no `<method>_seed<s>` run.
  """
  evals, metrics = {}, {}
  if (sft := _read_json(os.path.join(workdir, "final_eval.json"))) is not None:
    evals[("sft", 0)] = sft
  for name in sorted(os.listdir(workdir)) if os.path.isdir(workdir) else []:
    match, run = RUN_DIR.match(name), os.path.join(workdir, name)
    if match and os.path.isfile(os.path.join(run, "metrics.jsonl")):
      key = (match["method"], int(match["seed"]))
      metrics[key] = os.path.join(run, "metrics.jsonl")
      if (result := _read_json(os.path.join(run, "final_eval.json"))) is not None:
        evals[key] = result
  if not metrics:
    raise FileNotFoundError(f"{workdir}: no <method>_seed<s> run directory with a "
                            "metrics.jsonl (scripts/compare.py writes them)")
  return dict(sorted(evals.items())), dict(sorted(metrics.items()))


def metric_series(metrics_path: str, stage: str, key: str) -> tuple[np.ndarray, np.ndarray]:
  """`(steps, values)` of `key` in the `stage` rows of a metrics file (NaN where absent)."""
  rows = stage_rows(metrics_path, stage)
  steps = np.asarray([r["step"] for r in rows], np.int64)
  values = np.asarray([float(r.get(key, np.nan)) for r in rows], np.float64)
  return steps, values


def curve_mean(steps: np.ndarray, values: np.ndarray) -> float:
  """The area under a curve divided by its span of steps (trapezoids; a curve of one point
  is its value, one of none NaN): the mean accuracy over a run, comparable between runs of
  equal length."""
  steps, values = np.asarray(steps, np.float64), np.asarray(values, np.float64)
  if steps.size == 0:
    return float("nan")
  if steps.size == 1:
    return float(values[0])
  area = np.sum((values[1:] + values[:-1]) / 2 * np.diff(steps))
  return float(area / (steps[-1] - steps[0]))


# The rollout statistics every RL step logs, whatever the algorithm.
ROLLOUT_KEYS = ("accuracy", "mean_turns", "mean_action_tokens", "searches")


def first_divergence(a_path: str, b_path: str, keys: Sequence[str] = ROLLOUT_KEYS
                     ) -> int | None:
  """The first RL step whose rollouts differ between two runs' metrics files (any of `keys`
  unequal), or None where they never do over the steps both logged. Two runs from one
  checkpoint with one seed sample the same rollouts until their updates part the policies."""
  a, b = ({row["step"]: row for row in stage_rows(path, "rl")} for path in (a_path, b_path))
  return next((step for step in sorted(a.keys() & b.keys())
               if any(a[step].get(k) != b[step].get(k) for k in keys)), None)


def nanmean(values, axis=None):
  """`np.nanmean` that gives NaN for all-NaN input without a warning."""
  x = np.asarray(values, np.float64)
  count = np.sum(~np.isnan(x), axis=axis)
  total = np.nansum(x, axis=axis)
  return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def mean_over_runs(series: Sequence[tuple[np.ndarray, np.ndarray]]
                   ) -> tuple[np.ndarray, np.ndarray]:
  """The mean curve of runs' `(steps, values)` over the steps all of them have."""
  common = sorted(set.intersection(*(set(s.tolist()) for s, _ in series)))
  stacked = np.stack([np.asarray([dict(zip(s.tolist(), v))[t] for t in common])
                      for s, v in series])
  return np.asarray(common), nanmean(stacked, axis=0)


def plot_panels(panels: Mapping[str, Mapping[str, tuple[np.ndarray, np.ndarray]]], path: str,
                xlabel: str = "step", smooth_window: int = 0) -> str | None:
  """One PNG of side-by-side panels `{title: {label: (x, y)}}`; with `smooth_window`, each
  curve is drawn faint and its moving average over it. NaN values (a metric undefined at a
  step) leave gaps; a curve with no value at all is left out, and so is a panel without
  curves. Returns `path`, or None (nothing drawn) when no panel is left."""
  import matplotlib
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt

  panels = {title: kept for title, curves in panels.items()
            if (kept := {label: c for label, c in curves.items()
                         if np.any(np.isfinite(np.asarray(c[1], np.float64)))})}
  if not panels:
    return None

  fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
  for ax, (title, curves) in zip(axes[0], panels.items()):
    for i, (label, (x, y)) in enumerate(curves.items()):
      colour = f"C{i}"
      if smooth_window:
        ax.plot(x, y, color=colour, alpha=0.25)
        ax.plot(x, smooth(y, smooth_window), color=colour, label=label)
      else:
        ax.plot(x, y, color=colour, marker="." if len(x) < 30 else None, label=label)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  with storage.replaced(path, "wb") as f:
    fig.savefig(f, format="png", dpi=80)
  plt.close(fig)
  return path


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
  """A GitHub-flavoured markdown table."""
  lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
  return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
