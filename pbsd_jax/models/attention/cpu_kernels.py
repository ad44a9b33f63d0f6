"""CPU kernels, compiled on first use: XLA FFI custom calls for what XLA:CPU does poorly.

Both read or write a `KVCache` layer where it lies (`kernels/kv_cache.cc`):

* `decode_attention`: one query per row over a layer's filled slots. XLA:CPU copies each block
  of keys and values out of the cache before it reads it; the kernel reads every filled byte
  once, spread over the intra-op thread pool.
* `write_cache`: new keys and values stored at per-row slots, in place. XLA:CPU scatters into a
  bfloat16 array by converting all of it to float32 and back, so with a bfloat16 cache every
  decode step converted the whole cache, eight times over.

The source is compiled with the system C++ compiler (`$CXX`, else `c++` / `g++` on the PATH)
against JAX's FFI headers (`jax.ffi.include_dir()`) into `$PBSD_JAX_KERNEL_CACHE` (default
`~/.cache/pbsd_jax/kernels`), under a name hashed from the source, the compiler and its flags,
JAX's version and the CPU, so a build is reused until one of them changes and a shared home
directory never serves one CPU's build to another. Without a compiler, where the build fails,
or with `PBSD_JAX_CPU_KERNELS=0`, `load()` warns once (not for the last) and returns None, and
callers run their XLA implementation instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import warnings

import jax
import jax.numpy as jnp

SOURCE = pathlib.Path(__file__).parent / "kernels" / "kv_cache.cc"
# The handlers the source defines, by the cache dtype they read or write.
TARGETS = {jnp.dtype(jnp.float32): "PbsdDecodeAttentionF32",
           jnp.dtype(jnp.bfloat16): "PbsdDecodeAttentionBF16"}
WRITE_TARGETS = {jnp.dtype(jnp.float32): "PbsdWriteCacheF32",
                 jnp.dtype(jnp.bfloat16): "PbsdWriteCacheBF16"}


def flags() -> list[str]:
  arch = "-march=native" if platform.machine().lower() in ("x86_64", "amd64") else "-mcpu=native"
  return ["-O3", arch, "-fno-math-errno", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC"]


def _cpu() -> str:
  """What identifies this CPU's instruction set: its model name and feature flags."""
  try:
    with open("/proc/cpuinfo") as f:
      lines = {l for l in f if l.split(":")[0].strip() in ("model name", "flags", "Features")}
    return "".join(sorted(lines))
  except OSError:
    return platform.processor() or platform.machine()


def build(compiler: str | None = None, cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
  """The compiled library's path, built now unless a build for this source, compiler, JAX and
  CPU is cached. Raises `RuntimeError` naming the compiler and its first error line."""
  compiler = compiler or os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
  if not compiler:
    raise RuntimeError("no C++ compiler: set $CXX or install g++")
  cache_dir = pathlib.Path(cache_dir or os.environ.get("PBSD_JAX_KERNEL_CACHE")
                           or pathlib.Path.home() / ".cache" / "pbsd_jax" / "kernels")
  key = hashlib.sha256("\0".join([SOURCE.read_text(), compiler, *flags(), jax.__version__,
                                  _cpu()]).encode()).hexdigest()[:16]
  path = cache_dir / f"{SOURCE.stem}-{key}.so"
  if path.exists():
    return path
  cache_dir.mkdir(parents=True, exist_ok=True)
  partial = path.with_name(f".{path.name}.{os.getpid()}")  # concurrent builds never collide
  try:
    done = subprocess.run([compiler, *flags(), "-I", jax.ffi.include_dir(), str(SOURCE), "-o",
                           str(partial)], capture_output=True, text=True)
  except OSError as e:
    raise RuntimeError(f"C++ compiler {compiler!r} did not run: {e}") from e
  if done.returncode != 0:
    errors = [l for l in done.stderr.splitlines() if "error" in l] or done.stderr.splitlines()
    raise RuntimeError(f"{compiler} failed on {SOURCE.name}: {(errors or ['no output'])[0]}")
  os.replace(partial, path)
  return path


@functools.cache
def load() -> ctypes.CDLL | None:
  """The kernels, built and registered with XLA for the CPU, or None (see the module doc)."""
  if os.environ.get("PBSD_JAX_CPU_KERNELS", "1") == "0":
    return None
  try:
    library = ctypes.cdll.LoadLibrary(str(build()))
  except (RuntimeError, OSError) as e:
    warnings.warn(f"pbsd_jax CPU kernels not built ({e}); the KV cache is read and written "
                  "by XLA",
                  RuntimeWarning, stacklevel=2)
    return None
  for symbol in (*TARGETS.values(), *WRITE_TARGETS.values()):
    jax.ffi.register_ffi_target(symbol, jax.ffi.pycapsule(getattr(library, symbol)),
                                platform="cpu")
  return library


def decode_attention(query: jax.Array, keys: jax.Array, values: jax.Array, layer, key_mask,
                     last) -> jax.Array | None:
  """`f32[B, kv_heads, groups, head_dim]`: each row's queries (`f32`, already scaled by
  `1/sqrt(head_dim)`) over layer `layer` of `keys: [layers, B, kv_heads, head_dim, S]` and
  `values: [layers, B, kv_heads, S, head_dim]` (`KVCache`, f32 or bf16; or one layer's arrays
  without the `layers` axis, and layer 0), at the slots
  `s <= last[b]` where `key_mask: bool[B, S]` holds; zeros for a row with none. None where the
  kernel is not available (not built, or another cache dtype): the caller runs XLA's.

  The call is not differentiable (decode steps are not), and under a mesh XLA gathers its
  operands onto each device (it is a single-device kernel: for CPU test meshes)."""
  target = TARGETS.get(jnp.dtype(keys.dtype))
  if target is None or load() is None:
    return None
  return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(query.shape, jnp.float32),
                          vmap_method="sequential")(
      query.astype(jnp.float32), keys, values, key_mask.astype(bool),
      jnp.asarray(last, jnp.int32), jnp.asarray(layer, jnp.int32))


def write_cache(keys: jax.Array, values: jax.Array, layer, new_keys: jax.Array,
                new_values: jax.Array, slots: jax.Array) -> tuple[jax.Array, jax.Array] | None:
  """`(keys, values)` with layer `layer` holding `new_keys[b, h, j]` and `new_values[b, h, j]`
  (`[B, kv_heads, N, head_dim]`) at slot `slots[b, j]`, a slot outside the buffer dropped:
  `KVCache` arrays as in `decode_attention`, updated in place (the results alias them). None
  where the kernel is not available: the caller scatters in XLA.

  Not differentiable in the new keys and values; under a mesh XLA gathers the cache onto each
  device, as for `decode_attention`."""
  target = WRITE_TARGETS.get(jnp.dtype(keys.dtype))
  if target is None or values.dtype != keys.dtype or load() is None:
    return None
  return jax.ffi.ffi_call(target, (jax.ShapeDtypeStruct(keys.shape, keys.dtype),
                                   jax.ShapeDtypeStruct(values.shape, values.dtype)),
                          input_output_aliases={0: 0, 1: 1}, vmap_method="sequential")(
      keys, values, new_keys.astype(keys.dtype), new_values.astype(keys.dtype),
      jnp.asarray(slots, jnp.int32), jnp.asarray(layer, jnp.int32))
