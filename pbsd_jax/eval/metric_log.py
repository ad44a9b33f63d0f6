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
import socket
import struct
import time

import numpy as np
from tensorboardX import summary
from tensorboardX.proto import event_pb2, summary_pb2
from tensorboardX.record_writer import masked_crc32c

from pbsd_jax.data import storage
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
  """Per-step scalars to `<workdir>/metrics.jsonl` and TensorBoard event files.

  Both are appended in the calling thread, whole or not at all (`storage.append`), and no
  file is held open between writes: a write that fails (a full disk, a vanished workdir)
  raises there, as a `storage.StorageError` naming the file, before the step goes on, and no
  background writer thread can die unnoticed.
  """

  def __init__(self, workdir: str):
    import jax
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._tb_dir = os.path.join(workdir, "tensorboard")
    self.writes = jax.process_index() == 0
    self._events = None  # this process's event file, made at the first write

  def drop_after(self, stage: str, step: int):
    """Removes `stage`'s rows with a step after `step` (the file is replaced atomically)."""
    if not self.writes or not os.path.exists(self.path):
      return
    with open(self.path) as f:
      lines = f.readlines()
    keep = [line.rstrip("\n") + "\n" for line in lines if _kept(line, stage, step)]
    if keep == lines:
      return
    with storage.replaced(self.path) as f:
      f.writelines(keep)

  def rows(self, stage: str) -> list[dict]:
    """`stage_rows` of this log."""
    return stage_rows(self.path, stage)

  def write(self, stage: str, step: int, metrics: dict):
    if not self.writes:
      return
    row = {"stage": stage, "step": int(step),
           **{k: float(np.asarray(v)) for k, v in metrics.items()}}
    storage.append(self.path, (json.dumps(row) + "\n").encode())
    # NaN marks a metric undefined at this step (an AUC with one class empty).
    values = [value for k, v in row.items() if k not in ("stage", "step") and np.isfinite(v)
              for value in summary.scalar(f"{stage}/{k}", v).value]
    event = event_pb2.Event(wall_time=time.time(), step=int(step),
                            summary=summary_pb2.Summary(value=values))
    if self._events is None:
      with storage.writing(self._tb_dir):
        os.makedirs(self._tb_dir, exist_ok=True)
      self._events = os.path.join(self._tb_dir, f"events.out.tfevents.{int(time.time())}."
                                  f"{socket.gethostname()}.{os.getpid()}")
      storage.append(self._events, _record(event_pb2.Event(
          wall_time=time.time(), file_version="brain.Event:2").SerializeToString()))
    storage.append(self._events, _record(event.SerializeToString()))


def _record(data: bytes) -> bytes:
  """`data` as one TFRecord (length, its masked CRC-32C, data, its masked CRC-32C): the
  format of TensorBoard's event files."""
  header = struct.pack("<Q", len(data))
  return (header + struct.pack("<I", masked_crc32c(header)) + data
          + struct.pack("<I", masked_crc32c(data)))
