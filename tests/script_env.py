"""The environment of a process a test starts: a script, a notebook kernel, a worker.

Most of the suite's time is XLA compiling programs, anew in each process. The tests compile
them with two XLA:CPU code-generation flags that leave the HLO alone and generate it with less
work: backend optimisation level 0 (without LLVM's optimisation passes) and the elemental
emitters instead of the MLIR fusion emitters (half the compile time of the RL step). Every
process of a test (its worker and the processes it starts) compiles alike, so what a test
compares is compiled alike; against the defaults only the last bits of the floats differ.
`benchmarks/` runs with the defaults.
"""

import os
import subprocess
import sys

CODEGEN_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
# The flags this XLA parses, found once per test session and inherited by its processes.
_KNOWN = "PBSD_TESTS_CODEGEN_FLAGS"


def _xla_parses(flags: str) -> bool:
  """Whether this jaxlib's XLA knows every flag of `flags` (an unknown flag in XLA_FLAGS aborts
  the process, and XLA retires flags)."""
  done = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"],
                        env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags},
                        capture_output=True)
  return done.returncode == 0


def codegen_flags() -> str:
  """CODEGEN_FLAGS, less those this XLA does not know."""
  if _KNOWN not in os.environ:
    flags = " ".join(CODEGEN_FLAGS)
    if not _xla_parses(flags):
      flags = " ".join(f for f in CODEGEN_FLAGS if _xla_parses(f))
    os.environ[_KNOWN] = flags
  return os.environ[_KNOWN]


def xla_flags(devices: int = 1) -> str:
  """XLA_FLAGS for a process that sees `devices` fake CPU devices."""
  count = f"--xla_force_host_platform_device_count={devices} " if devices > 1 else ""
  return count + codegen_flags()


def script_env(devices: int = 1, **extra: str) -> dict:
  """This process's environment for a subprocess that runs JAX on `devices` CPU devices."""
  return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(devices), **extra}
