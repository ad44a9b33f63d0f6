"""Compile a run's programs for a TPU slice from this host, and say whether they fit.

  pip install -e .[tpu]      # libtpu: the TPU compiler, no TPU needed
  python scripts/aot_compile.py --config=configs/search_r1.py --topology=v5e-16 \
      --config.model.name=qwen2.5-3b

Takes every override the run takes. For each program the run executes (the SFT step, the
one-program RL step or the host turn loop's programs and the update, evaluation's rollout
where the run evaluates: `eval.every`, `eval.sft_every`) it
prints the TPU compiler's per-device memory against the chip's HBM, the memory model's
estimate, XLA's cost analysis, the FLOPs and bytes with every loop counted as often as it
runs (a rollout's loops at their budgets: every turn, every action token), and the roofline
time and MFU on the chip. A program that does not fit ends the command (exit status 1) with
one line naming it, its need, the chip's capacity and the fields that change it.
`--topology` is a Cloud TPU slice (`v5e-16`, `v6e-64` in chips; `v4-64`, `v5p-128` in
TensorCores) or a libtpu topology (`v5e:4x4`); `--num_slices` joins slices (multi-slice).
The embedded task's data is made in `--workdir` when the config uses it.
"""

import json
import os

# Compiling needs no accelerator of this host: JAX runs on the CPU here.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import flags  # noqa: E402

from pbsd_jax.run import cli  # noqa: E402

_CONFIG = cli.define_config("configs/pbsd.py")
_TOPOLOGY = flags.DEFINE_string("topology", "v5e-4", "TPU slice to compile for, e.g. v5e-16.")
_NUM_SLICES = flags.DEFINE_integer("num_slices", 1, "Slices of --topology (multi-slice).")
_WORKDIR = flags.DEFINE_string("workdir", "workdir/aot", "Where the embedded task's data is "
                               "made (when the config reads it).")
_ONLY = flags.DEFINE_list("programs", [], "Compile only these programs (default: all).")
_JSON = flags.DEFINE_string("json", "", "Also write the reports to this JSON file.")


def main(argv):
  del argv
  from pbsd_jax.run import aot  # sets libtpu's environment before JAX starts a backend
  try:
    devices, chip = aot.topology(_TOPOLOGY.value, _NUM_SLICES.value)
  except ValueError as err:
    raise SystemExit(f"error: {err}") from None
  from pbsd_jax.data import storage
  from pbsd_jax.run import run_config, task as task_lib

  try:
    spec = run_config.validate(_CONFIG.value, num_devices=len(devices))
  except run_config.ConfigError as err:
    raise SystemExit(f"FATAL config error: {err}") from None
  try:
    mesh = spec.build_mesh(devices)
  except NotImplementedError as err:  # a logical axis the physical torus cannot give
    raise SystemExit(f"FATAL config error: config.mesh on {_TOPOLOGY.value}: "
                     f"{str(err).splitlines()[0]}") from None
  task = task_lib.prepare_task(spec, _WORKDIR.value, mesh=mesh, connect=False)
  spec = spec.for_vocabulary(task.vocab.vocab_size)
  run_config.check_param_sharding(spec.model, mesh)
  print(f"{_TOPOLOGY.value} x{_NUM_SLICES.value}: {len(devices)} {chip.kind} chips, mesh "
        + ", ".join(f"{k}={v}" for k, v in mesh.shape.items()), flush=True)
  refused, reports = [], []
  for program in aot.run_programs(spec, task, mesh):
    if _ONLY.value and program.name.split(" ")[0] not in _ONLY.value:
      continue
    try:
      report = aot.analyse(program, chip)
    except MemoryError as err:
      print(f"{program.name}: the TPU compiler refuses it: {err}; the memory model: "
            f"{storage.size_text(program.estimate['total'])}", flush=True)
      reports.append({"name": program.name, "refused": str(err),
                      "estimate": program.estimate, "fields": program.fields})
      refused.append(aot.too_large(program, chip, str(err)))
      continue
    print(aot.describe(report, chip), flush=True)
    reports.append(report.summary())
    if not report.fits:
      refused.append(aot.too_large(program, chip,
                                   f"it needs {storage.size_text(report.memory['total'])}"))
  if _JSON.value:
    with storage.replaced(_JSON.value, "w") as f:
      json.dump({"topology": _TOPOLOGY.value, "num_slices": _NUM_SLICES.value,
                 "chip": chip.kind, "hbm": chip.hbm, "mesh": dict(mesh.shape),
                 "programs": reports, "refused": refused}, f, indent=1)
  if refused:
    raise SystemExit(f"error: {refused[0]}")


if __name__ == "__main__":
  cli.run(main)
