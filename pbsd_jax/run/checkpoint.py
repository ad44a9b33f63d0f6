"""Checkpoints of a run: the `TrainState` and the data-iterator position, with orbax.

A checkpoint is one step directory under the workdir (orbax `CheckpointManager`) holding four
items: `state` (params, optimiser state, step, PRNG key as raw key data -- tensorstore arrays,
restored straight into the target shardings), `data_state` (a JSON dict: where the data
iterator is), `meta` (JSON: the PRNG implementation, to rebuild the typed key) and
`checksums` (JSON: a checksum of every array of `state`, and the fingerprint of the
configuration that saved it).

Integrity: `restore_latest` verifies a step's checksums against the restored arrays; a step
that orbax cannot read (a truncated file, a missing manifest) or whose checksums differ is
reported in one line and set aside (`<directory>/unusable/`), and the next older step is
tried -- a fresh start only when no step is good. A checksum is computed on the devices by
one jitted reduction over the global array (`checksums`), so every process of a multi-host
run gets the same replicated scalar without gathering arrays to one host.

Atomicity is orbax's: a step is written into `<step>.orbax-checkpoint-tmp-<timestamp>` and
renamed to `<step>` only once complete (on object stores a `commit_success.txt` marks it). A
process killed mid-save leaves only the temporary directory, which every reader ignores (and
the next `Checkpointer` on the workdir deletes), so a resume falls back to the last finished
step.

Storage faults: a save that fails for a full disk, a read-only or vanished directory -- in
`save`, or in the background thread of an asynchronous save, reported by the next `save` or
`wait` -- raises `storage.StorageError`, one line naming the directory and the state's size;
the step it was writing stays a temporary directory, never taken for a checkpoint.

Preemption: `PreemptionGuard` turns SIGTERM into a flag that the training loop polls at step
boundaries, where it force-saves and exits -- never saving from inside a signal handler while a
step runs.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
import time
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from pbsd_jax.data import storage
from pbsd_jax.rl.train_state import TrainState


def _key_data(rng):
  return jax.jit(jax.random.key_data)(rng)


def _bits(x: jax.Array) -> jax.Array:
  """`u32[x.shape]`: each element's bit pattern (8-byte elements fold their two halves)."""
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  size = jnp.dtype(x.dtype).itemsize
  if size == 8:
    halves = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return halves[..., 0] ^ (halves[..., 1] * jnp.uint32(0x9E3779B9))
  unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[size]
  return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _checksum(x: jax.Array) -> jax.Array:
  """`u32[]`: the sum, mod 2**32, of each element's bits times an odd multiplier of its flat
  position. An odd multiplier is invertible mod 2**32, so changing any one element always
  changes the sum. The position comes from iotas in the array's own shape (no reshape), so a
  sharded array reduces shard by shard."""
  bits = _bits(x)
  position = jnp.zeros(x.shape, jnp.uint32)
  for axis in range(x.ndim):
    position = position * jnp.uint32(x.shape[axis]) + jax.lax.broadcasted_iota(
        jnp.uint32, x.shape, axis)
  return jnp.sum(bits * (position * jnp.uint32(2654435761) * 2 + 1), dtype=jnp.uint32)


_checksums = jax.jit(lambda tree: jax.tree.map(_checksum, tree))


def checksums(tree: Any) -> dict[str, int]:
  """`{leaf path: checksum}` of every array leaf of `tree` (replicated on every process)."""
  sums = jax.device_get(_checksums(tree))
  return {jax.tree_util.keystr(path): int(v)
          for path, v in jax.tree_util.tree_flatten_with_path(sums)[0]}


def _is_abandoned_read(unraisable) -> bool:
  """An error report from a read that a failed restore abandoned: orbax's reader coroutine
  collected unfinished, or a tensorstore callback finding orbax's event loop closed."""
  code = getattr(unraisable.object, "cr_code", None)
  return ((code is not None and "orbax" in code.co_filename)
          or (isinstance(unraisable.exc_value, RuntimeError)
              and str(unraisable.exc_value) == "Event loop is closed"))


def _quiet_abandoned_reads() -> None:
  """Drops, for the rest of the process, the tracebacks of reads a failed restore abandoned
  (they come from other threads, at any later time; `restore_latest`'s one line already says
  the step is unusable); every other unraisable error is reported as before."""
  previous = sys.unraisablehook
  if getattr(previous, "quiets_abandoned_reads", False):
    return

  def hook(unraisable):
    if not _is_abandoned_read(unraisable):
      previous(unraisable)

  hook.quiets_abandoned_reads = True
  sys.unraisablehook = hook
  warnings.filterwarnings("ignore", "coroutine '_read_array_index_and_device_put' was never "
                          "awaited", RuntimeWarning)


class ConfigMismatchError(ValueError):
  """A checkpoint saved by a run of a different configuration (fingerprints differ)."""


class CorruptCheckpointError(ValueError):
  """A restored array whose checksum differs from the one recorded when it was saved."""


def _abstract(leaf):
  """A `ShapeDtypeStruct` with the leaf's sharding (default: the first local device)."""
  sharding = getattr(leaf, "sharding", None)
  if sharding is None:
    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)


def check_options(save_interval_steps: int, max_to_keep: int | None) -> None:
  """Raises a `ValueError` naming the `Checkpointer` option that cannot run."""
  if save_interval_steps < 1:
    raise ValueError(f"save_interval_steps must be >= 1, got {save_interval_steps}")
  if max_to_keep is not None and max_to_keep < 1:
    raise ValueError(f"max_to_keep must be >= 1 (or None), got {max_to_keep}")


class Checkpointer:
  """Saves and restores `(TrainState, data_state)` in a workdir.

  Args:
    directory: the checkpoint directory (created if missing).
    save_interval_steps: `save` writes only steps that are multiples of this, besides the
      first save into an empty directory (orbax's initial-save policy) and forced saves.
    max_to_keep: finished checkpoints kept (oldest deleted first); None keeps all.
    async_save: write in a background thread; `save` returns once the arrays are copied off
      the devices. Call `wait` before reading the files or exiting.
    fingerprint: identifies the configuration of the run; recorded with every step, and a
      step recorded with another one is not restored (`ConfigMismatchError`).
  """

  def __init__(self, directory: str, *, save_interval_steps: int = 1,
               max_to_keep: int | None = 3, async_save: bool = True, fingerprint: str = ""):
    check_options(save_interval_steps, max_to_keep)
    self.directory = os.path.abspath(directory)
    self.fingerprint = fingerprint
    self._needed = None  # the bytes of the last state saved, for a full disk's message
    options = ocp.CheckpointManagerOptions(
        save_interval_steps=save_interval_steps, max_to_keep=max_to_keep,
        enable_async_checkpointing=async_save, cleanup_tmp_directories=True, create=True)
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          item_names=("state", "data_state", "meta",
                                                      "checksums"))

  def save(self, state: TrainState, data_state: dict | None = None, *,
           step: int | None = None, force: bool = False) -> bool:
    """Saves `state` and `data_state` as `step` (default `state.step`).

    Args:
      state: the train state (arrays may be sharded; every process must call `save`).
      data_state: JSON-serialisable data-iterator position.
      step: the checkpoint's step number.
      force: save even off the save interval.

    Returns:
      Whether a checkpoint was started: False off the interval, and for a step that is
      already saved (or being saved) -- a step is never rewritten.

    Raises:
      storage.StorageError: this save, or an earlier asynchronous one, failed for a fault of
        the storage.
    """
    step = int(jax.device_get(state.step)) if step is None else int(step)
    self._needed = sum(x.nbytes for x in jax.tree.leaves((state.params, state.opt_state)))
    with self._writing():
      self._manager.check_for_errors()  # a background save that failed since the last call
      if step in self._manager.all_steps() or not (force or self._manager.should_save(step)):
        return False
      tree = state.replace(rng=_key_data(state.rng))
      meta = {"rng_impl": str(jax.random.key_impl(state.rng))}
      sums = {"fingerprint": self.fingerprint, "arrays": checksums(tree)}
      args = ocp.args.Composite(state=ocp.args.StandardSave(tree),
                                data_state=ocp.args.JsonSave(dict(data_state or {})),
                                meta=ocp.args.JsonSave(meta),
                                checksums=ocp.args.JsonSave(sums))
      return self._manager.save(step, args=args, force=force)

  def _writing(self):
    """`storage.writing` of this directory: a failed write, here or in a background save,
    is one line naming the directory and the state's size."""
    return storage.writing(self.directory, self._needed)

  def restore(self, target: TrainState, step: int | None = None, *,
              check_fingerprint: bool = True) -> tuple[TrainState, dict]:
    """The checkpointed `(state, data_state)` of `step` (default: the latest finished one),
    its checksums verified.

    Args:
      target: a `TrainState` of arrays or `jax.ShapeDtypeStruct`s giving the structure,
        shapes, dtypes and shardings to restore into (e.g. a freshly initialised state, or
        `jax.eval_shape` of one with `sharding=` set); the PRNG leaf is a typed key.
      step: which step; None for the latest.
      check_fingerprint: refuse a step saved with another configuration fingerprint.

    Raises:
      FileNotFoundError: no finished checkpoint (or not that step) in the directory.
      ConfigMismatchError: the step was saved with another fingerprint.
      CorruptCheckpointError: an array's checksum differs from the recorded one.
      Exception: whatever orbax raises for files it cannot read.
    """
    step = self.latest_step() if step is None else step
    if step is None or step not in self.all_steps():
      raise FileNotFoundError(f"no finished checkpoint{'' if step is None else f' {step}'} in "
                              f"{self.directory}; steps present: {self.all_steps()}")
    rng_sharding = _abstract(target.rng).sharding
    abstract = jax.tree.map(_abstract, target.replace(rng=jax.eval_shape(
        jax.random.key_data, target.rng)))
    abstract = abstract.replace(rng=jax.ShapeDtypeStruct(abstract.rng.shape,
                                                         abstract.rng.dtype,
                                                         sharding=rng_sharding))
    # Checked here because orbax, missing them, leaves tensorstore callbacks that print
    # tracebacks into its closed event loop.
    state_dir = os.path.join(self.directory, str(step), "state")
    for name in ("manifest.ocdbt", "_METADATA"):
      if not os.path.exists(os.path.join(state_dir, name)):
        raise FileNotFoundError(f"{os.path.join(state_dir, name)} is missing")
    recorded = self._manager.restore(step, args=ocp.args.Composite(
        checksums=ocp.args.JsonRestore())).checksums
    if check_fingerprint and recorded["fingerprint"] != self.fingerprint:
      raise ConfigMismatchError(
          f"checkpoint {step} in {self.directory} was saved by another configuration "
          f"(fingerprint {recorded['fingerprint'] or 'none'}, this run {self.fingerprint})")
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), data_state=ocp.args.JsonRestore(),
        meta=ocp.args.JsonRestore()))
    got = checksums(restored.state)
    bad = sorted(k for k in set(got) | set(recorded["arrays"])
                 if got.get(k) != recorded["arrays"].get(k))
    if bad:
      raise CorruptCheckpointError(f"checksum mismatch in {len(bad)} array(s), first {bad[0]}")
    impl = restored.meta["rng_impl"]
    wrap = jax.jit(lambda data: jax.random.wrap_key_data(data, impl=impl),
                   out_shardings=rng_sharding)
    state = restored.state.replace(rng=wrap(restored.state.rng))
    return state, dict(restored.data_state)

  def restore_latest(self, target: TrainState, *, check_fingerprint: bool = True,
                     report: Callable[[str], None] = print) -> tuple[TrainState, dict] | None:
    """`restore(target)` of the newest good step, or None when no step is good (a fresh run).

    A step that cannot be read or fails its checksums is reported in one line through
    `report` and moved to `<directory>/unusable/` (kept for inspection; its step number is
    then saved anew), and the next older step is tried. A fingerprint mismatch is not
    corruption: it is raised, not skipped.
    """
    steps = self.all_steps()
    # Before the first read: a failing one reports from other threads as soon as it fails.
    _quiet_abandoned_reads()
    for step in reversed(steps):
      try:
        return self.restore(target, step, check_fingerprint=check_fingerprint)
      except ConfigMismatchError:
        raise
      except Exception as err:  # orbax raises many types for unreadable files
        reason = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
        report(f"checkpoint {step} in {self.directory} is unusable "
               f"({type(err).__name__}: {reason}); trying the previous one")
        del err
        gc.collect()  # this restore's abandoned reader coroutines, now (quietly)
        self._set_aside(step)
    if steps:
      report(f"no good checkpoint in {self.directory}; starting this stage afresh")
    return None

  def _set_aside(self, step: int):
    if jax.process_index() == 0:
      aside = os.path.join(self.directory, "unusable")
      os.makedirs(aside, exist_ok=True)
      os.replace(os.path.join(self.directory, str(step)),
                 os.path.join(aside, f"{step}-{time.time_ns()}"))
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      multihost_utils.sync_global_devices(f"checkpoint_set_aside_{step}")
    self._manager.reload()

  def latest_step(self) -> int | None:
    """The newest finished step, or None."""
    self._manager.reload()
    return self._manager.latest_step()

  def all_steps(self) -> Sequence[int]:
    """Finished steps, ascending."""
    self._manager.reload()
    return sorted(self._manager.all_steps())

  def wait(self):
    """Blocks until pending asynchronous saves are finished (renamed into place).

    Raises:
      storage.StorageError: a save failed for a fault of the storage (a full disk, ...).
    """
    with self._writing():
      self._manager.wait_until_finished()
      self._manager.check_for_errors()

  def close(self):
    """Waits for pending saves and releases the manager's resources."""
    # The manager removes stale temporary directories in a thread started at construction,
    # which its `close` does not join: without this wait, deleting the directory right after
    # (a short-lived checkpointer in a temporary directory) makes that thread log a traceback.
    await_cleanup = getattr(self._manager, "_maybe_await_cleanup_tmp_directory", None)
    if await_cleanup is not None:
      await_cleanup()
    with self._writing():
      self._manager.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, exc_type, *exc):
    if exc_type is None:
      self.close()
      return
    # Leaving on an error: the pending save may fail of the same fault, which must not hide
    # the error that ends the run; the step it was writing stays a temporary directory.
    with contextlib.suppress(Exception):
      self.close()


class PreemptionGuard:
  """SIGTERM (and any other given signal) -> a flag polled at step boundaries.

  Use as a context manager around the training loop (in the main thread); the previous
  handlers come back on exit. `save_if_requested` is the one-line final save:

      with PreemptionGuard() as guard:
        for ...:
          state, metrics = step(state, batch)
          if guard.save_if_requested(checkpointer, state, data_state):
            break

  In a multi-process run every process polls, and the flag is the OR over processes, so all
  of them save the same step together.
  """

  def __init__(self, signals: Sequence[int] = (signal.SIGTERM,)):
    self._signals = tuple(signals)
    self._previous: dict[int, Any] = {}
    self._flag = False

  def __enter__(self) -> "PreemptionGuard":
    for sig in self._signals:
      self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous.clear()

  def _handle(self, signum, frame):
    del signum, frame
    self._flag = True

  @property
  def requested(self) -> bool:
    """Whether a signal arrived (in any process)."""
    if jax.process_count() == 1:
      return self._flag
    from jax.experimental import multihost_utils
    flags = multihost_utils.process_allgather(np.array(self._flag))
    return bool(np.any(flags))

  def save_if_requested(self, checkpointer: Checkpointer, state: TrainState,
                        data_state: dict | None = None) -> bool:
    """On a request: force-saves `state`, waits for the write, returns True (then exit)."""
    if not self.requested:
      return False
    checkpointer.save(state, data_state, force=True)
    checkpointer.wait()
    return True
