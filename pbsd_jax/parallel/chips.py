"""Accelerator chips: HBM, dense bfloat16 FLOP/s and HBM bandwidth (vendors' figures).

`TPUS` by the generation prefix of a Cloud TPU slice's name (`v5e-16`: one chip is one JAX
device, v4 and v5p as megacores); `by_kind` finds a device's chip from its `device_kind`.
"""

from __future__ import annotations

import dataclasses

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Chip:
  """One accelerator chip: its `device_kind`, HBM bytes, dense bf16 FLOP/s and HBM bytes/s."""

  kind: str
  hbm: float
  peak_flops: float
  bandwidth: float


TPUS = {
    "v4": Chip("TPU v4", 32 * GiB, 275e12, 1.2e12),
    "v5e": Chip("TPU v5 lite", 16 * GiB, 197e12, 0.82e12),
    "v5p": Chip("TPU v5", 95 * GiB, 459e12, 2.76e12),
    "v6e": Chip("TPU v6 lite", 32 * GiB, 918e12, 1.64e12),
}
GPUS = {
    "H200": Chip("H200", 141 * GiB, 989e12, 4.8e12),
    "H100": Chip("H100", 80 * GiB, 989e12, 3.35e12),
    "A100": Chip("A100", 80 * GiB, 312e12, 2.0e12),
    "L4": Chip("L4", 24 * GiB, 121e12, 0.3e12),
}


def by_kind(device_kind: str) -> Chip | None:
  """The chip whose kind `device_kind` names (the longest match: "TPU v5 lite" is not a
  "TPU v5"), or None (a CPU)."""
  found = [c for c in (*TPUS.values(), *GPUS.values()) if c.kind.lower() in device_kind.lower()]
  return max(found, key=lambda c: len(c.kind), default=None)
