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
    scalars = {f"{stage}/{k}": v for k, v in row.items()
               if k not in ("stage", "step") and np.isfinite(v)}
    if self._events is None:
      with storage.writing(self._tb_dir):
        os.makedirs(self._tb_dir, exist_ok=True)
      self._events = os.path.join(self._tb_dir, f"events.out.tfevents.{int(time.time())}."
                                  f"{socket.gethostname()}.{os.getpid()}")
      storage.append(self._events, _record(_event(file_version="brain.Event:2")))
    storage.append(self._events, _record(_event(step=int(step), scalars=scalars)))


# TensorBoard's event file, written without TensorBoard (or tensorboardX, which imports
# torch): a TFRecord file of `Event` protocol buffers, each encoded here by hand.

def _crc32c_table() -> list[int]:
  table = []
  for byte in range(256):
    crc = byte
    for _ in range(8):
      crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    table.append(crc)
  return table


_CRC32C = _crc32c_table()


def _masked_crc32c(data: bytes) -> int:
  """CRC-32C (Castagnoli) of `data`, masked as TFRecord files store it."""
  crc = 0xFFFFFFFF
  for byte in data:
    crc = _CRC32C[(crc ^ byte) & 0xFF] ^ (crc >> 8)
  crc ^= 0xFFFFFFFF
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _record(data: bytes) -> bytes:
  """`data` as one TFRecord: its length, the length's masked CRC, data, data's masked CRC."""
  header = struct.pack("<Q", len(data))
  return (header + struct.pack("<I", _masked_crc32c(header)) + data
          + struct.pack("<I", _masked_crc32c(data)))


def _varint(n: int) -> bytes:
  out = bytearray()
  while True:
    out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
    n >>= 7
    if not n:
      return bytes(out)


def _message(number: int, payload: bytes) -> bytes:
  """A length-delimited protobuf field (a string or a nested message)."""
  return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _event(step: int = 0, scalars: dict | None = None, file_version: str = "") -> bytes:
  """An `Event` (wall_time = 1, step = 2, file_version = 3, summary = 5) whose `Summary`
  holds one `Value` (tag = 1, simple_value = 2) per scalar."""
  event = b"\x09" + struct.pack("<d", time.time()) + b"\x10" + _varint(step)
  if file_version:
    event += _message(3, file_version.encode())
  if scalars:
    values = b"".join(_message(1, _message(1, tag.encode()) + b"\x15" + struct.pack("<f", v))
                      for tag, v in scalars.items())
    event += _message(5, values)
  return event
