"""Weights & Biases logging (`config.log.wandb`): what W&B recorded, read back from the
offline run's own transaction log, equals metrics.jsonl, across a resume and from a workdir
that had metrics before W&B was on. test_fault_injection checks it through a killed run."""

import glob
import json
import os
import signal
import struct
import subprocess
import sys

import numpy as np

from pbsd_jax.eval.metric_log import MetricLog, WandbSpec, offline_history

OFFLINE = WandbSpec(project="pbsd-tests", mode="offline")


def wandb_records(workdir):
  """`(run ids, config, history rows)` of the offline W&B run of `workdir`: each `run` record
  (one per segment: the first and each resume) and the rows without W&B's own keys."""
  run_id, ids, config = _run_id(workdir), [], {}
  for path in sorted(glob.glob(os.path.join(workdir, "wandb", "offline-run-*", "*.wandb"))):
    with open(path, "rb") as f:
      data = f.read()
    for _, _, record in _records(data):
      if record.HasField("run"):
        ids.append(record.run.run_id)
        config |= {u.key: json.loads(u.value_json) for u in record.run.config.update}
  history = offline_history(workdir, run_id)
  assert [row["_step"] for row in history] == list(range(len(history)))  # W&B's own step
  return ids, config, [{k: v for k, v in row.items() if not k.startswith("_")}
                       for row in history]


def _records(data):
  """`(start, end, Record)` of each FULL record of a transaction log whose records each fit in
  one block (the run records read here do); `start` is its header's offset."""
  from wandb.proto import wandb_internal_pb2
  pos = 7
  while pos + 7 <= len(data):
    _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
    if kind == 1:  # FULL
      yield pos, pos + 7 + length, wandb_internal_pb2.Record.FromString(
          data[pos + 7:pos + 7 + length])
    if not length:
      return
    pos += 7 + length


def as_logged(rows):
  """metrics.jsonl rows as W&B gets them: `<stage>/<metric>` of the finite values and the
  stage's step."""
  return [{**{f"{r['stage']}/{k}": v for k, v in r.items()
              if k not in ("stage", "step") and np.isfinite(v)},
           f"{r['stage']}/step": r["step"]} for r in rows]


def by_step(history):
  """W&B history rows by `(stage, step)`; a row sent twice fails."""
  out = {}
  for h in history:
    (key,) = [k for k in h if k.endswith("/step")]
    assert (key, h[key]) not in out, f"{key} {h[key]} sent twice"
    out[(key, h[key])] = h
  return out


def _run_id(workdir):
  with open(os.path.join(workdir, "wandb_run.json")) as f:
    return json.load(f)["id"]


def _rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def test_the_offline_run_records_what_metrics_jsonl_holds_once_across_a_resume(tmp_path):
  workdir = str(tmp_path)
  config = {"algorithm": "pbsd", "optim": {"lr": 1e-4}}
  log = MetricLog(workdir, OFFLINE, config)
  log.write("sft", 1, {"loss": 2.5, "auc": float("nan")})
  log.write("eval_sft", 1, {"accuracy": 0.25})
  log.write("sft", 2, {"loss": 1.25, "auc": 0.75})
  log.close()
  # Resumed from the checkpoint of step 1: step 2 again (W&B holds it), then steps 3 and 4.
  log = MetricLog(workdir, OFFLINE, config)
  log.drop_after("sft", 1)
  for step, loss in ((2, 1.25), (3, 0.5), (4, 0.25)):
    log.write("sft", step, {"loss": loss, "auc": 0.75})
  log.close()
  ids, recorded, history = wandb_records(workdir)
  assert len(ids) == 2 and ids[0] == ids[1]  # one W&B run, resumed
  assert {k: recorded[k] for k in config} == config
  assert by_step(history) == by_step(as_logged(_rows(workdir)))
  assert history[0] == {"sft/loss": 2.5, "sft/step": 1}  # NaN left out, as in TensorBoard
  assert history[2] == {"sft/loss": 1.25, "sft/auc": 0.75, "sft/step": 2}  # as first sent
  assert [h.get("sft/step") for h in history] == [1, None, 2, 3, 4]


def test_turning_wandb_on_for_a_workdir_with_metrics_sends_those_first(tmp_path):
  workdir = str(tmp_path)
  log = MetricLog(workdir)
  log.write("sft", 1, {"loss": 3.0})
  log.write("eval_sft", 1, {"accuracy": 0.25})
  log = MetricLog(workdir, OFFLINE, {})
  log.write("sft", 2, {"loss": 2.0})
  log.close()
  assert wandb_records(workdir)[2] == as_logged(_rows(workdir))  # in the order written
  assert not os.path.exists(os.path.join(workdir, "wandb_run.json.tmp"))


def test_a_resumed_run_with_nothing_left_to_write_sends_what_a_killed_one_did_not(tmp_path):
  # The killed process logged every row, but W&B had flushed none of them.
  killed = subprocess.run([sys.executable, "-c", f"""
import os, signal
from pbsd_jax.eval.metric_log import MetricLog, WandbSpec
log = MetricLog({str(tmp_path)!r}, WandbSpec(project="pbsd-tests", mode="offline"), {{}})
for step in (1, 2, 3):
  log.write("sft", step, {{"loss": 1.0 / step}})
os.kill(os.getpid(), signal.SIGKILL)
"""])
  assert killed.returncode == -signal.SIGKILL
  assert offline_history(str(tmp_path), _run_id(tmp_path)) == []
  log = MetricLog(str(tmp_path), OFFLINE, {})
  log.drop_after("sft", 3)  # resumed from the last checkpoint: no step is left to run
  log.close()
  ids, _, history = wandb_records(str(tmp_path))
  assert set(ids) == {_run_id(tmp_path)}
  assert history == as_logged(_rows(str(tmp_path))) and len(history) == 3


def test_a_transaction_log_cut_inside_a_record_reads_as_the_records_before_it(tmp_path):
  # A log read while W&B writes it, or left by a kill, ends inside a record.
  workdir = str(tmp_path)
  log = MetricLog(workdir, OFFLINE, {})
  for step in (1, 2, 3):
    log.write("sft", step, {"loss": 1.0 / step})
  log.close()
  (path,) = glob.glob(os.path.join(workdir, "wandb", "offline-run-*", "*.wandb"))
  with open(path, "rb") as f:
    data = f.read()
  full = offline_history(workdir, _run_id(workdir))
  assert [row["sft/step"] for row in full] == [1, 2, 3]
  # Each record (those of a log this short each fit in its first block) cut inside: in its
  # header and in its payload.
  assert len(data) < 32768
  records = list(_records(data))
  ends = [end for _, end, record in records if record.HasField("history")]
  assert len(ends) == 3
  # Every record of the file is one of them (all FULL, end to end).
  assert [start for start, _, _ in records] == [7] + [end for _, end, _ in records[:-1]]
  assert records[-1][1] == len(data)
  for start, end, _ in records:
    for cut in (start + 3, (start + 7 + end) // 2):
      with open(path, "wb") as f:
        f.write(data[:cut])
      assert offline_history(workdir, _run_id(workdir)) == full[:sum(e <= cut for e in ends)]


def test_a_run_without_wandb_makes_no_wandb_files(tmp_path):
  log = MetricLog(str(tmp_path))
  log.write("sft", 1, {"loss": 3.0})
  log.close()
  assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl", "tensorboard"]
