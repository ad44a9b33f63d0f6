"""Which TPU slices hold the paper's recipe: the table of docs/tpu.md, from the memory model.

For each model shape, context buffer and slice, the recipe of `configs/search_r1.py` (32
prompts x 8 trajectories, float32 master weights, bfloat16 compute, remat, an HTTP
retriever: the host turn loop and the update) is tried with meshes (FSDP over the chips, with
tensor parallelism of 1 to 8) and micro-batches (4 down to 1 row per device), in that order;
the first that fits (`memory_model.estimate` of the update and of the turn loop's programs,
within the chip's HBM less a margin) is the cell, with its per-device need and the
step's roofline split (`memory_model.step_seconds`). `--compiled=qwen2.5-3b@8192=a.json,...`
(`scripts/aot_compile.py --json` reports; `qwen3-8b@8192@64=b.json` for a micro-batch of 64
rows, 32 otherwise: the recipe's) marks the cells the compiler checked, and where the compiler
fitted every program of a cell the model refused, the cell is the compiled setting.

  python benchmarks/tpu_plan.py > /tmp/table.md
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "configs"))

from pbsd_jax.run import aot, memory_model, run_config  # noqa: E402

SHAPES = ("qwen2.5-3b", "qwen3-8b")
BUFFERS = (8192, 16384, 32768, 65536)
TOPOLOGIES = ("v5e-16", "v5e-64", "v5e-256", "v5p-32", "v5p-128", "v4-64")
# The share of HBM a program may plan for: XLA's own reservations and fragmentation.
MARGIN = 0.9
# The compiled update's total over the model's figure on the 3B and 8B
# programs of docs/tpu.md: 1.3-1.6; a cell whose update needs it is marked "tight".
UPDATE_LAYOUT = 1.5


def recipe(name: str, buffer: int, **fields):
  import search_r1
  config = search_r1.get_config()
  config.model.name = name
  config.env.buffer_size = buffer
  for path, value in fields.items():
    section, field = path.split(".")
    config[section][field] = value
  return config


def need(spec, mesh) -> tuple[float, float]:
  """The model's need of the worst program, and the update's."""
  parts = {kind: memory_model.estimate(spec, mesh, kind)["total"]
           for kind in ("rl_update", "start", "act", "observe")}
  return max(parts.values()), parts["rl_update"]


def cell(name: str, buffer: int, topology: str, compiled_micro: int | None = None):
  """The first setting that fits by the model, or with `compiled_micro`, the setting the
  compiler fitted (FSDP over every chip, that micro-batch)."""
  devices, chip = aot.topology(topology)
  rows = 32 * 8 // 4  # a mini-batch of the recipe (rl.minibatches = 4)
  # (tensor parallelism, micro-batch rows): 4, 2, then 1 row per device in a micro-batch.
  settings = ([(1, compiled_micro)] if compiled_micro else
              [(tensor, len(devices) // tensor * per_shard) for tensor in (1, 2, 4, 8)
               for per_shard in (4, 2, 1)])
  tried = None
  for tensor, micro in settings:
    if len(devices) % tensor or micro > rows or rows % micro:
      continue
    spec = run_config.validate(recipe(name, buffer, **{
        "mesh.fsdp": -1, "mesh.tensor": tensor, "rl.micro_batch_size": micro}),
                               num_devices=len(devices))
    try:
      mesh = spec.build_mesh(devices)
    except (NotImplementedError, run_config.ConfigError):
      continue  # an axis the physical torus cannot give
    total, update = need(spec, mesh)
    tried = total if tried is None else min(tried, total)
    if total <= MARGIN * chip.hbm or compiled_micro:
      times = memory_model.step_seconds(spec, mesh, chip.peak_flops, chip.bandwidth)
      return dict(fits=True, mesh=f"fsdp {len(devices) // tensor} x tensor {tensor}",
                  micro=micro, need=total, hbm=chip.hbm, times=times,
                  tight=update * UPDATE_LAYOUT > MARGIN * chip.hbm)
  return dict(fits=False, need=tried, hbm=chip.hbm)


def main():
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--compiled", default="",
                 help="MODEL@BUFFER=REPORT,...: scripts/aot_compile.py --json reports of cells")
  args = p.parse_args()
  compiled = {}
  for item in filter(None, args.compiled.split(",")):
    label, path = item.split("=", 1)
    name, buffer, micro = (label.split("@") + ["32"])[:3]
    with open(path) as f:
      report = json.load(f)
    fitted = [q for q in report["programs"] if "memory" in q]
    most = max(q["memory"]["total"] for q in fitted)
    training = [q for q in fitted if not q["name"].startswith("eval")]
    fits = all(q["fits"] for q in training) and not any(
        not r.startswith("eval") for r in report["refused"])
    compiled[report["topology"], f"{name}@{buffer}"] = (
        f" (compiled: {len(fitted)} programs, at most {most / (1 << 30):.1f} GiB"
        + "".join(f"; {r.split(' ')[0]} does not fit" for r in report["refused"]) + ")",
        fits, int(micro))
  print("| model | buffer | slice | fits | mesh | micro-batch (rows) | HBM per chip | "
        "rollout s | evidence s | update s |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  gib = 1 << 30
  for name in SHAPES:
    for buffer in BUFFERS:
      for topology in TOPOLOGIES:
        c = cell(name, buffer, topology)
        mark, fits, micro = compiled.get((topology, f"{name}@{buffer}"), ("", False, 0))
        if fits and not c["fits"]:
          c = cell(name, buffer, topology, compiled_micro=micro)
        if c["fits"]:
          t = c["times"]
          tight = " (tight: the update)" if c["tight"] and not mark else ""
          print(f"| {name} | {buffer // 1024}K | {topology} | yes{tight}{mark} | {c['mesh']} | "
                f"{c['micro']} | {c['need'] / gib:.1f} / {c['hbm'] / gib:.0f} GiB "
                f"| {t['rollout']:.0f} | {t['evidence']:.1f} | {t['update']:.1f} |")
        else:
          print(f"| {name} | {buffer // 1024}K | {topology} | no{mark} | | | "
                f"{c['need'] / gib:.1f} / {c['hbm'] / gib:.0f} GiB | | | |")


if __name__ == "__main__":
  main()
