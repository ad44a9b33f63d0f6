"""What every `benchmarks/ours_*.py` script shares: arguments, the model, timing, the result line.

A script measures warm: one call compiles and warms up, then the best of `--repeats` calls
counts (`best_of`). Its last stdout line is `RESULT {json}` (`emit`), which
`benchmarks/run_all.py` parses. The model is either the reference checkpoint (`--model DIR`,
written by `benchmarks/reference.py`, loaded with `pbsd_jax.models.hf.load`) or a named shape
from `pbsd_jax/models/sizes.py` with seeded random weights (`--size`, for `benchmarks/gpu.sh`).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from pbsd_jax.models import ModelConfig, hf, init_params
from pbsd_jax.models.sizes import SIZES
from pbsd_jax.parallel import chips


def parser(doc: str) -> argparse.ArgumentParser:
  """The arguments every script takes; scripts add their own."""
  p = argparse.ArgumentParser(description=doc)
  p.add_argument("--model", help="reference HF checkpoint dir (benchmarks/reference.py)")
  p.add_argument("--size", help="a pbsd_jax/models/sizes.py shape with random weights "
                 "(instead of --model)")
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                 help="compute dtype (parameters stay float32 master weights)")
  p.add_argument("--cache-dtype", default="", choices=("", "float32", "bfloat16"),
                 help="KV cache dtype (ModelConfig.cache_dtype; default: the compute dtype)")
  p.add_argument("--repeats", type=int, default=3, help="timed calls after the warm-up")
  p.add_argument("--scan-unroll", type=int, default=1,
                 help="layers per iteration of the layer scan (ModelConfig.scan_unroll); 0: "
                      "all of them, unrolled as the peers' Python loops over layers are")
  return p


def load_model(args) -> tuple[ModelConfig, Any]:
  """`(config, params)` from `--model` or `--size`: float32 parameters, `--dtype` compute,
  `--cache-dtype` KV cache, `--scan-unroll` layers per scan iteration."""
  if args.model:
    config, params = hf.load(args.model, param_dtype="float32", dtype=args.dtype)
  elif args.size:
    config = ModelConfig(**SIZES[args.size], param_dtype="float32", dtype=args.dtype)
    params = init_params(config, jax.random.key(0))
  else:
    raise SystemExit("pass --model DIR (benchmarks/reference.py --out DIR) or --size NAME")
  return config.replace(scan_unroll=args.scan_unroll or config.num_layers,
                        cache_dtype=args.cache_dtype), params


def load_prompts(args, model: ModelConfig, num: int = 8, width: int = 64) -> np.ndarray:
  """`i32[num, width]` prompts: `DIR/prompts.json`, or seeded random ids without `--model`."""
  if args.model:
    with open(os.path.join(args.model, "prompts.json")) as f:
      return np.asarray(json.load(f)["prompts"], np.int32)
  return np.random.default_rng(0).integers(10, model.vocab_size, (num, width), dtype=np.int32)


def best_of(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
  """`(best wall seconds, last output)` of `repeats` calls after one warm-up call.

  Outputs are waited for (`block_until_ready`), so the time is the computation's, not the
  dispatch's. `fn` may carry state between calls through a closure (donated train states).
  """
  out = jax.block_until_ready(fn())
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - start)
  return best, out


def best_of_each(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
  """Best wall seconds of each of `fns`, calling them in turn: one warm-up round, then
  `repeats` rounds of one call each, so a drift of the machine's speed during the run weighs
  on all of them alike (what a difference of two of them needs)."""
  for fn in fns.values():
    jax.block_until_ready(fn())
  best = dict.fromkeys(fns, float("inf"))
  for _ in range(repeats):
    for name, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn())
      best[name] = min(best[name], time.perf_counter() - start)
  return best


def matmul_peak(dtype: str = "float32", sizes=(1024, 2048, 4096), repeats: int = 3) -> float:
  """Best FLOP/s of a square `jnp.dot` over `sizes` (`2 n^3` FLOPs each), measured now."""
  best = 0.0
  for n in sizes:
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(dtype)
    dot = jax.jit(jnp.dot)
    seconds, _ = best_of(lambda: dot(a, b), repeats)
    best = max(best, 2 * n ** 3 / seconds)
  return best


def read_bandwidth(megabytes: int = 512, repeats: int = 3) -> float:
  """Best bytes/s of a `jnp.sum` over `megabytes` of float32, measured now."""
  x = jnp.ones((megabytes * 2 ** 20 // 4,), jnp.float32)
  seconds, _ = best_of(lambda: jax.jit(jnp.sum)(x), repeats)
  return x.nbytes / seconds


def matmul_kernels(model: ModelConfig, head: bool = True) -> list[tuple[int, int]]:
  """`(in, out)` of every matmul with activations: each layer's q, k, v, o, gate, up and down
  kernels, and (with `head`) the LM head last; not the embedding gather or the norms."""
  d, hd, f = model.hidden_size, model.resolved_head_dim, model.mlp_dim
  q, kv = model.num_heads * hd, model.num_kv_heads * hd
  layer = [(d, q), (d, kv), (d, kv), (q, d), (d, f), (d, f), (f, d)]
  return layer * model.num_layers + ([(d, model.vocab_size)] if head else [])


def matmul_params(model: ModelConfig, head: bool = True) -> int:
  """Parameters of `matmul_kernels`."""
  return sum(i * o for i, o in matmul_kernels(model, head))


def products_seconds(shapes: list[tuple[int, int, int]], repeats: int, steps: int = 1,
                     dtype: str = "float32", max_bytes: int = 4 << 30) -> float | None:
  """Best wall seconds of the products `[m, k] x [k, n]` of `shapes` in `dtype`, each on
  operands of its own (XLA computes every one; independent ones may run side by side, as in a
  model), per round of `steps` rounds; None (not measured) where the operands and results
  would pass `max_bytes`. Over several rounds (a `fori_loop`) each left operand is scaled by a
  carried scalar, so no product is hoisted out of the loop: `m x k` multiplies each."""
  size = jnp.dtype(dtype).itemsize * sum(m * k + k * n + m * n for m, k, n in shapes)
  if size > max_bytes:
    return None
  keys = iter(jax.random.split(jax.random.key(0), 2 * len(shapes)))
  operands = [tuple(jax.random.normal(next(keys), shape).astype(dtype)
                    for shape in ((m, k), (k, n))) for m, k, n in shapes]
  if steps == 1:
    run = jax.jit(lambda operands: [a @ b for a, b in operands])
  else:
    def rounds(operands):
      def one(_, scale):
        return 1.0 + 1e-9 * sum((a * scale.astype(a.dtype) @ b)[0, 0].astype(jnp.float32)
                                for a, b in operands)
      return jax.lax.fori_loop(0, steps, one, jnp.float32(1.0))
    run = jax.jit(rounds)
  seconds, _ = best_of(lambda: run(operands), repeats)
  return seconds / steps


def chip_peaks() -> tuple[float, float] | None:
  """`(bf16 FLOP/s, HBM bytes/s)` of device 0 (`pbsd_jax.parallel.chips`), or None (e.g. a
  CPU)."""
  chip = chips.by_kind(jax.devices()[0].device_kind)
  return None if chip is None else (chip.peak_flops, chip.bandwidth)


def tree_bytes(tree: Any) -> int:
  """Bytes of every array in a pytree."""
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def emit(result: dict) -> None:
  """Prints the result line `run_all.py` parses (the script's last stdout line)."""
  result = {"system": "ours", "device": jax.devices()[0].device_kind,
            "jax": jax.__version__, **result}
  print("RESULT " + json.dumps(result), flush=True)
