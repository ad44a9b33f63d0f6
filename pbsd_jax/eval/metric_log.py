"""The run's metric log: per-step scalars to `<workdir>/metrics.jsonl` and TensorBoard.

One JSON object per line, `{"stage": ..., "step": ..., <metric>: <float>, ...}`, appended as
the run goes (NaN, written as Python's `json` does, for a metric undefined at that step; such
values are left out of TensorBoard); `report.plot_metrics` reads it back. A resumed stage
first drops its rows after the restored step (`drop_after`) -- rows written after the last
checkpoint by a run that was killed -- so the file holds each step once. In a multi-process
run only process 0 writes (every process computes the same replicated metrics).
"""

from __future__ import annotations

import json
import os

import numpy as np

from pbsd_jax.data.jsonl import iter_jsonl


def stage_rows(path: str, stage: str) -> list[dict]:
  """The rows of `stage` in a metrics file, in the order they were written."""
  return [row for _, row in iter_jsonl(path) if row.get("stage") == stage]


def _kept(line: str, stage: str, step: int) -> bool:
  """Whether a metrics line stays: a row (not the partial line a killed write can leave)
  that is not of `stage` after `step`."""
  try:
    row = json.loads(line)
  except json.JSONDecodeError:
    return False
  return not (row["stage"] == stage and row["step"] > step)


class MetricLog:
  """Per-step scalars to `<workdir>/metrics.jsonl` and TensorBoard event files."""

  def __init__(self, workdir: str):
    import jax
    from tensorboardX import SummaryWriter
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.writes = jax.process_index() == 0
    self._tb = SummaryWriter(os.path.join(workdir, "tensorboard")) if self.writes else None

  def drop_after(self, stage: str, step: int):
    """Removes `stage`'s rows with a step after `step` (the file is replaced atomically)."""
    if not self.writes or not os.path.exists(self.path):
      return
    with open(self.path) as f:
      lines = f.readlines()
    keep = [line.rstrip("\n") + "\n" for line in lines if _kept(line, stage, step)]
    if keep == lines:
      return
    tmp = f"{self.path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
      f.writelines(keep)
    os.replace(tmp, self.path)

  def rows(self, stage: str) -> list[dict]:
    """`stage_rows` of this log."""
    return stage_rows(self.path, stage)

  def write(self, stage: str, step: int, metrics: dict):
    if not self.writes:
      return
    row = {"stage": stage, "step": int(step),
           **{k: float(np.asarray(v)) for k, v in metrics.items()}}
    with open(self.path, "a") as f:
      f.write(json.dumps(row) + "\n")
    for k, v in row.items():
      # NaN marks a metric undefined at this step (an AUC with one class empty).
      if k not in ("stage", "step") and np.isfinite(v):
        self._tb.add_scalar(f"{stage}/{k}", v, step)
    self._tb.flush()
