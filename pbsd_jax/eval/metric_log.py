"""The run's metric log: per-step scalars to `<workdir>/metrics.jsonl`, TensorBoard and,
where configured, Weights & Biases.

One JSON object per line, `{"stage": ..., "step": ..., <metric>: <float>, ...}`, appended as
the run goes (NaN, written as Python's `json` does, for a metric undefined at that step; such
values are left out of TensorBoard); `report.plot_metrics` reads it back. A resumed stage
first drops its rows after the restored step (`drop_after`) -- rows written after the last
checkpoint by a run that was killed -- so the file holds each step once. In a multi-process
run only process 0 writes (every process computes the same replicated metrics).

Weights & Biases (`WandbSpec`, `config.log.wandb`) gets the TensorBoard scalars, each stage
on its own step axis (`<stage>/step`), and the run's configuration. The W&B run's id is kept
in `<workdir>/wandb_run.json`, so a resumed workdir resumes its W&B run; its files are under
`<workdir>/wandb/` (an offline run: `wandb sync <workdir>/wandb/offline-run-*`). W&B's own
step of a row is the row's line in metrics.jsonl: a resumed run asks W&B how many lines it
holds (the server's step online; the run's transaction logs under `<workdir>/wandb` offline,
`offline_history`) and sends the ones it lacks -- the rows a killed process logged but W&B
had not flushed (it writes its log every 15 s), or a workdir's rows from before W&B logging
was turned on. Rows W&B holds are not sent again: the steps a killed run logged after its last
checkpoint keep the values it sent (a resumed run recomputes them bitwise equal,
tests/test_fault_injection.py).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import secrets
import socket
import struct
import time

import numpy as np

from pbsd_jax.data import storage
from pbsd_jax.data.jsonl import iter_jsonl


def stage_rows(path: str, stage: str) -> list[dict]:
  """The rows of `stage` in a metrics file, in the order they were written."""
  return [row for _, row in iter_jsonl(path) if row.get("stage") == stage]


def _row(line: str) -> dict | None:
  """A metrics line's row; None for the partial line a killed write can leave."""
  try:
    return json.loads(line)
  except json.JSONDecodeError:
    return None


def _whole_rows(path: str) -> list[dict]:
  """Every whole row of a metrics file; none where the file does not exist yet."""
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [row for row in map(_row, f) if row is not None]


def _kept(line: str, stage: str, step: int) -> bool:
  """Whether a metrics line stays: a whole row that is not of `stage` after `step`."""
  row = _row(line)
  return row is not None and not (row["stage"] == stage and row["step"] > step)


class MetricLog:
  """Per-step scalars to `<workdir>/metrics.jsonl` and TensorBoard event files.

  Both are appended in the calling thread, whole or not at all (`storage.append`), and no
  file is held open between writes: a write that fails (a full disk, a vanished workdir)
  raises there, as a `storage.StorageError` naming the file, before the step goes on, and no
  background writer thread can die unnoticed.
  """

  def __init__(self, workdir: str, wandb: WandbSpec | None = None, config: dict | None = None):
    """`wandb`: mirror the scalars to this W&B run (with the run's `config`), or None."""
    import jax
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._tb_dir = os.path.join(workdir, "tensorboard")
    self.writes = jax.process_index() == 0
    self._events = None  # this process's event file, made at the first write
    self._wandb = None
    if wandb is not None and self.writes:
      self._lines = len(_whole_rows(self.path))  # rows in metrics.jsonl
      self._wandb = _WandbRun(workdir, wandb, config or {})

  def drop_after(self, stage: str, step: int):
    """Removes `stage`'s rows with a step after `step` (the file is replaced atomically)."""
    if not self.writes or not os.path.exists(self.path):
      return
    with open(self.path) as f:
      lines = f.readlines()
    keep = [line.rstrip("\n") + "\n" for line in lines if _kept(line, stage, step)]
    if self._wandb is not None:
      self._lines = len(keep)
    if keep == lines:
      return
    with storage.replaced(self.path) as f:
      f.writelines(keep)

  def rows(self, stage: str) -> list[dict]:
    """`stage_rows` of this log."""
    return stage_rows(self.path, stage)

  def close(self):
    """Sends W&B the rows it lacks and finishes its run (the files are closed after each
    write): a resumed run that had nothing left to train writes no row, but the process it
    resumed may have been killed before W&B flushed its last rows."""
    if self._wandb is not None:
      self._wandb.catch_up(self.path, self._lines)
      self._wandb.finish()
      self._wandb = None

  def write(self, stage: str, step: int, metrics: dict):
    if not self.writes:
      return
    row = {"stage": stage, "step": int(step),
           **{k: float(np.asarray(v)) for k, v in metrics.items()}}
    storage.append(self.path, (json.dumps(row) + "\n").encode())
    scalars = finite_scalars(row)
    if self._events is None:
      with storage.writing(self._tb_dir):
        os.makedirs(self._tb_dir, exist_ok=True)
      self._events = os.path.join(self._tb_dir, f"events.out.tfevents.{int(time.time())}."
                                  f"{socket.gethostname()}.{os.getpid()}")
      storage.append(self._events, _record(_event(file_version="brain.Event:2")))
    storage.append(self._events, _record(_event(step=int(step), scalars=scalars)))
    if self._wandb is not None:
      self._wandb.send(self._lines, row, self.path)
      self._lines += 1


@dataclasses.dataclass(frozen=True)
class WandbSpec:
  """Weights & Biases logging (`config.log.wandb`): the run goes to `project` under `entity`
  (empty: the account's default), named `name` (empty: the workdir's name), `mode` "online"
  or "offline"."""

  project: str
  entity: str = ""
  name: str = ""
  mode: str = "online"

  def for_run(self, run: str) -> WandbSpec:
    """The spec of run `run` among several of one invocation (scripts/compare.py's methods
    and seeds): named `<name>/<run>`, or by its own directory where `name` is empty."""
    return dataclasses.replace(self, name=f"{self.name}/{run}" if self.name else "")


def finite_scalars(row: dict) -> dict:
  """A metrics row's scalars as TensorBoard and W&B get them, `<stage>/<metric>`: NaN marks
  a metric undefined at that step (an AUC with one class empty) and is left out."""
  return {f"{row['stage']}/{k}": v for k, v in row.items()
          if k not in ("stage", "step") and np.isfinite(v)}


class _WandbRun:
  """The W&B run of a workdir (module docstring); `next` is the first metrics.jsonl line it
  does not hold."""

  def __init__(self, workdir: str, spec: WandbSpec, config: dict):
    import wandb
    state = os.path.join(workdir, "wandb_run.json")
    if os.path.exists(state):
      with open(state) as f:
        run_id = json.load(f)["id"]
    else:
      run_id = secrets.token_hex(6)
      with storage.replaced(state) as f:
        json.dump({"id": run_id}, f)
    self._workdir, self._id, self._offline = workdir, run_id, spec.mode == "offline"
    # An offline run starts its step at 0 on every resume; its earlier logs hold the lines.
    held = self._offline_lines() if self._offline else None
    self.run = wandb.init(project=spec.project, entity=spec.entity or None,
                          name=spec.name or os.path.basename(os.path.abspath(workdir)),
                          id=run_id, resume="allow", mode=spec.mode, dir=workdir,
                          config=config, reinit="create_new")
    self.next = self.run.step if held is None else held
    self.stages: set[str] = set()  # those given their step axis in this process

  def send(self, line: int, row: dict, path: str):
    """Sends metrics.jsonl's `line` (`row`), after the lines before it that W&B lacks."""
    self.catch_up(path, line)
    if line >= self.next:
      self._log(line, row)

  def finish(self):
    """Finishes the run; an offline run once its transaction log holds every line sent (W&B's
    `finish` returns before its service has written them, and a run resumed at once in the
    same process would read too few)."""
    self.run.finish()
    deadline = time.monotonic() + 60
    while self._offline and self._offline_lines() < self.next and time.monotonic() < deadline:
      time.sleep(0.05)

  def _offline_lines(self) -> int:
    return 1 + max((row["_step"] for row in offline_history(self._workdir, self._id)),
                   default=-1)

  def catch_up(self, path: str, lines: int):
    """Sends the lines of metrics.jsonl (at `path`) before `lines` that W&B lacks."""
    if lines > self.next:
      for i, row in enumerate(_whole_rows(path)[self.next:lines], self.next):
        self._log(i, row)

  def _log(self, line: int, row: dict):
    stage = row["stage"]
    if stage not in self.stages:
      self.run.define_metric(f"{stage}/*", step_metric=f"{stage}/step")
      self.stages.add(stage)
    self.run.log({**finite_scalars(row), f"{stage}/step": row["step"]}, step=line)
    self.next = line + 1


def offline_history(workdir: str, run_id: str) -> list[dict]:
  """The history rows an offline W&B run recorded in its transaction logs under
  `<workdir>/wandb` (every resumed segment, in the order they started): `{key: value}` with
  W&B's own `_step`. A log is a LevelDB log (32 KiB blocks of records, each after a 7-byte
  header: CRC, length, type) of `wandb_internal_pb2.Record`s, after a 7-byte file header. A
  log's torn tail (a record still being written, or cut by a kill) ends it."""
  from google.protobuf.message import DecodeError
  from wandb.proto import wandb_internal_pb2

  rows = []
  # `offline-run-<time>-<id>`, then `-1`, `-2`, ... for a segment started in the same second.
  paths = glob.glob(os.path.join(workdir, "wandb", "offline-run-*", f"run-{run_id}.wandb"))
  order = lambda p: re.fullmatch(r"offline-run-(\d+_\d+)-.*?(?:-(\d+))?",
                                 os.path.basename(os.path.dirname(p))).groups(default="0")
  for path in sorted(paths, key=lambda p: (order(p)[0], int(order(p)[1]))):
    with open(path, "rb") as f:
      data = f.read()
    pos, chunks = 7, b""
    while pos + 7 <= len(data):
      if _BLOCK - pos % _BLOCK < 7:  # a block's tail too short for a header is padding
        pos += _BLOCK - pos % _BLOCK
        continue
      _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
      if not length and not kind or pos + 7 + length > len(data):
        break
      chunks, pos = chunks + data[pos + 7:pos + 7 + length], pos + 7 + length
      if kind in (_FULL, _LAST):
        try:
          record = wandb_internal_pb2.Record.FromString(chunks)
        except DecodeError:
          break
        chunks = b""
        if record.HasField("history"):
          rows.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json)
                       for i in record.history.item})
  return rows


_BLOCK, _FULL, _LAST = 32768, 1, 4  # the LevelDB log's block size and record types


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
