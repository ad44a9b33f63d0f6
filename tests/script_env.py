"""The environment of a process a test starts: a script, a notebook kernel, a worker.

Most of the suite's time is XLA compiling programs, anew in each process. The tests compile
them at XLA:CPU's backend optimisation level 0: the same HLO, generated without LLVM's
optimisation passes, in less time. Every process of a test (its worker and the processes it
starts) compiles alike, so what a test compares is compiled alike; against the default level
only the last bits of the floats differ. `benchmarks/` runs at the default level.
"""

import os

CODEGEN_FLAGS = "--xla_backend_optimization_level=0"


def xla_flags(devices: int = 1) -> str:
  """XLA_FLAGS for a process that sees `devices` fake CPU devices."""
  count = f"--xla_force_host_platform_device_count={devices} " if devices > 1 else ""
  return count + CODEGEN_FLAGS


def script_env(devices: int = 1, **extra: str) -> dict:
  """This process's environment for a subprocess that runs JAX on `devices` CPU devices."""
  return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(devices), **extra}
