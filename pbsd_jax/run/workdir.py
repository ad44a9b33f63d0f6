"""A workdir belongs to one run: the configuration that made it, and one process at a time.

`claim` starts a script's use of a workdir. It takes an exclusive `flock` on `<workdir>/.lock`
for the life of the process -- the operating system drops it when the process ends, however
it ends, so a killed run never leaves the workdir locked -- and compares the run's
configuration with the one recorded in `<workdir>/run_config.json` by the run that made it.
Only the `RESUMABLE` fields may differ on resume: they change how long the run goes on, how
it is evaluated and logged (`log`), where the retriever is, the mesh it runs on (a checkpoint
restores onto any mesh) or how the layers are computed (rematerialisation, the layer scan's
unroll, the attention kernel), never what the checkpoints hold.

A claimed workdir that vanishes mid-run (deleted by another process, unmounted) is caught by
`check_claimed`, which the training loops call before each step's writes.

`fingerprint` is a hash of the configuration without those fields; the checkpoints record it
so that a step saved by another configuration is not restored as this run's.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
from typing import Any

from pbsd_jax.data import storage

# Fields (or whole sections) that may change when a run resumes.
RESUMABLE = ("sft.steps", "rl.steps", "rl.save_rollouts", "eval", "checkpoint.save_interval_steps",
             "checkpoint.max_to_keep", "checkpoint.async_save", "env.url", "env.timeout_s",
             "env.max_retries", "env.index_dir", "env.index", "mesh", "model.remat",
             "model.scan_unroll", "model.attention", "model.cache_dtype", "log")
CONFIG_FILE = "run_config.json"
LOCK_FILE = ".lock"
_held: list = []  # the locks `claim_for_script` keeps for the life of the process
_claimed: dict[str, tuple[int, int]] = {}  # claimed workdir -> (device, inode) when claimed


class WorkdirError(RuntimeError):
  """The workdir cannot be used by this run; the message says why in one line."""


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
  if hasattr(tree, "items"):
    flat = {}
    for key, value in tree.items():
      flat.update(_flat(value, f"{prefix}{key}."))
    return flat
  return {prefix[:-1]: tree}


def _fixed(config: dict) -> dict[str, Any]:
  """The flat fields of a config dict that must not change on resume."""
  return {k: v for k, v in _flat(config).items()
          if not any(k == r or k.startswith(r + ".") for r in RESUMABLE)}


def as_dict(config) -> dict:
  """A ConfigDict (or dict) as plain JSON values."""
  return json.loads(config.to_json() if hasattr(config, "to_json") else json.dumps(config))


def fingerprint(config) -> str:
  """A short hash of `config` without its `RESUMABLE` fields."""
  text = json.dumps(_fixed(as_dict(config)), sort_keys=True)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def differing_fields(recorded: dict, config: dict) -> list[str]:
  """The non-resumable fields whose values differ between two config dicts (sorted)."""
  a, b = _fixed(recorded), _fixed(config)
  return sorted(k for k in set(a) | set(b) if a.get(k, "<absent>") != b.get(k, "<absent>"))


def _lock(workdir: str):
  """The lock file, opened and locked; it is held open for reading only, so that it does not
  keep the file system busy (a read-only remount under a live run must take effect)."""
  path = os.path.join(workdir, LOCK_FILE)
  handle = os.fdopen(os.open(path, os.O_RDONLY | os.O_CREAT, 0o644))
  try:
    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    holder = handle.read().strip() or "unknown"
    handle.close()
    raise WorkdirError(f"workdir {workdir} is in use by another process (pid {holder})"
                       ) from None
  try:
    with open(path, "w") as f:
      f.write(str(os.getpid()))
  except OSError:
    handle.close()
    raise
  return handle


def claim(workdir: str, config, *, force: bool = False, lock: bool = True):
  """Locks `workdir` for this process and checks (or records) the configuration that made it.

  Args:
    workdir: the run's directory (created if missing).
    config: the run's configuration: `RunSpec.settings` (or its ConfigDict).
    force: resume even when non-resumable fields differ; the new config is then recorded.
    lock: take the lock and record the configuration (in a multi-host run only the first
      process does; the others only check the record).

  Returns:
    The open lock file: keep a reference for as long as the run uses the workdir (the lock
    goes when it is closed or the process ends); None without `lock`.

  Raises:
    WorkdirError: another live process holds the lock, or the recorded configuration differs
      in non-resumable fields and `force` is not set.
    storage.StorageError: the workdir cannot be written (a read-only file system, no
      permission, a full disk), before anything else is read or written.
  """
  with storage.writing(os.path.abspath(workdir), faults=storage.FAULTS):
    os.makedirs(workdir, exist_ok=True)
    handle = _lock(workdir) if lock else None
  _claimed[os.path.abspath(workdir)] = _identity(workdir)
  path = os.path.join(workdir, CONFIG_FILE)
  current = as_dict(config)
  if os.path.exists(path):
    with open(path) as f:
      fields = differing_fields(json.load(f), current)
    if fields and not force:
      if handle is not None:
        handle.close()
      raise WorkdirError(f"workdir {workdir} was made by another configuration (differs in "
                         f"{', '.join(fields)}); use another --workdir, or pass --force_resume "
                         f"to resume it anyway")
    if not fields:
      return handle
  if not lock:
    return None
  with storage.replaced(path) as f:
    json.dump(current, f, indent=1, sort_keys=True)
  return handle


def _identity(workdir: str) -> tuple[int, int]:
  stat = os.stat(workdir)
  return stat.st_dev, stat.st_ino


def check_claimed(path: str) -> None:
  """Raises `storage.StorageError` when a workdir this process `claim`ed that holds `path`
  (a stage's directory: the workdir or one inside it) is gone -- deleted, or unmounted so
  that its path names another directory or nothing -- so that a run stops instead of writing
  its next step into a directory that is no longer its own."""
  path = os.path.abspath(path)
  for root, identity in _claimed.items():
    if path != root and not path.startswith(root + os.sep):
      continue
    try:
      same = _identity(root) == identity
    except OSError:
      same = False
    if not same:
      raise storage.StorageError(errno.ENOENT, storage.message(errno.ENOENT, root))


def claim_for_script(workdir: str, config, *, force: bool = False) -> None:
  """`claim` at an absl script's start, the lock held until the process ends (taken by the
  first process of a multi-host run): a workdir that cannot be used ends the script with one
  line."""
  import jax
  try:
    _held.append(claim(workdir, config, force=force, lock=jax.process_index() == 0))
  except WorkdirError as err:
    raise SystemExit(f"error: {err}") from None
