"""The run's metric log: per-step scalars to `<workdir>/metrics.jsonl` and TensorBoard.

One JSON object per line, `{"stage": ..., "step": ..., <metric>: <float>, ...}`, appended as
the run goes (a resumed run appends to the same file); `report.plot_metrics` reads it back.
"""

from __future__ import annotations

import json
import os

import numpy as np


class MetricLog:
  """Per-step scalars to `<workdir>/metrics.jsonl` and TensorBoard event files."""

  def __init__(self, workdir: str):
    from tensorboardX import SummaryWriter
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

  def write(self, stage: str, step: int, metrics: dict):
    row = {"stage": stage, "step": int(step),
           **{k: float(np.asarray(v)) for k, v in metrics.items()}}
    with open(self.path, "a") as f:
      f.write(json.dumps(row) + "\n")
    for k, v in row.items():
      if k not in ("stage", "step"):
        self._tb.add_scalar(f"{stage}/{k}", v, step)
    self._tb.flush()
