"""Checkpoints of a run: the `TrainState` and the data-iterator position, with orbax.

A checkpoint is one step directory under the workdir (orbax `CheckpointManager`) holding three
items: `state` (params, optimiser state, step, PRNG key as raw key data -- tensorstore arrays,
restored straight into the target shardings), `data_state` (a JSON dict: where the data
iterator is) and `meta` (JSON: the PRNG implementation, to rebuild the typed key).

Atomicity is orbax's: a step is written into `<step>.orbax-checkpoint-tmp-<timestamp>` and
renamed to `<step>` only once complete (on object stores a `commit_success.txt` marks it). A
process killed mid-save leaves only the temporary directory, which every reader ignores (and
the next `Checkpointer` on the workdir deletes), so a resume falls back to the last finished
step.

Preemption: `PreemptionGuard` turns SIGTERM into a flag that the training loop polls at step
boundaries, where it force-saves and exits -- never saving from inside a signal handler while a
step runs.
"""

from __future__ import annotations

import os
import signal
from typing import Any, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp

from pbsd_jax.train_state import TrainState


def _key_data(rng):
  return jax.jit(jax.random.key_data)(rng)


def _abstract(leaf):
  """A `ShapeDtypeStruct` with the leaf's sharding (default: the first local device)."""
  sharding = getattr(leaf, "sharding", None)
  if sharding is None:
    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)


class Checkpointer:
  """Saves and restores `(TrainState, data_state)` in a workdir.

  Args:
    directory: the checkpoint directory (created if missing).
    save_interval_steps: `save` writes only steps that are multiples of this, besides the
      first save into an empty directory (orbax's initial-save policy) and forced saves.
    max_to_keep: finished checkpoints kept (oldest deleted first); None keeps all.
    async_save: write in a background thread; `save` returns once the arrays are copied off
      the devices. Call `wait` before reading the files or exiting.
  """

  def __init__(self, directory: str, *, save_interval_steps: int = 1,
               max_to_keep: int | None = 3, async_save: bool = True):
    if save_interval_steps < 1:
      raise ValueError(f"save_interval_steps must be >= 1, got {save_interval_steps}")
    if max_to_keep is not None and max_to_keep < 1:
      raise ValueError(f"max_to_keep must be >= 1 (or None), got {max_to_keep}")
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(
        save_interval_steps=save_interval_steps, max_to_keep=max_to_keep,
        enable_async_checkpointing=async_save, cleanup_tmp_directories=True, create=True)
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          item_names=("state", "data_state", "meta"))

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
    """
    step = int(jax.device_get(state.step)) if step is None else int(step)
    if step in self._manager.all_steps():
      return False
    tree = state.replace(rng=_key_data(state.rng))
    meta = {"rng_impl": str(jax.random.key_impl(state.rng))}
    args = ocp.args.Composite(state=ocp.args.StandardSave(tree),
                              data_state=ocp.args.JsonSave(dict(data_state or {})),
                              meta=ocp.args.JsonSave(meta))
    return self._manager.save(step, args=args, force=force)

  def restore(self, target: TrainState, step: int | None = None) -> tuple[TrainState, dict]:
    """The checkpointed `(state, data_state)` of `step` (default: the latest finished one).

    Args:
      target: a `TrainState` of arrays or `jax.ShapeDtypeStruct`s giving the structure,
        shapes, dtypes and shardings to restore into (e.g. a freshly initialised state, or
        `jax.eval_shape` of one with `sharding=` set); the PRNG leaf is a typed key.
      step: which step; None for the latest.

    Raises:
      FileNotFoundError: no finished checkpoint (or not that step) in the directory.
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
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), data_state=ocp.args.JsonRestore(),
        meta=ocp.args.JsonRestore()))
    impl = restored.meta["rng_impl"]
    wrap = jax.jit(lambda data: jax.random.wrap_key_data(data, impl=impl),
                   out_shardings=rng_sharding)
    state = restored.state.replace(rng=wrap(restored.state.rng))
    return state, dict(restored.data_state)

  def restore_or_none(self, target: TrainState) -> tuple[TrainState, dict] | None:
    """`restore(target)` of the latest checkpoint, or None when there is none (a fresh run)."""
    return None if self.latest_step() is None else self.restore(target)

  def latest_step(self) -> int | None:
    """The newest finished step, or None."""
    self._manager.reload()
    return self._manager.latest_step()

  def all_steps(self) -> Sequence[int]:
    """Finished steps, ascending."""
    self._manager.reload()
    return sorted(self._manager.all_steps())

  def wait(self):
    """Blocks until pending asynchronous saves are finished (renamed into place)."""
    self._manager.wait_until_finished()

  def close(self):
    """Waits for pending saves and releases the manager's resources."""
    self._manager.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc):
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
