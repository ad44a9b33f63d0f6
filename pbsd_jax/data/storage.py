"""Writing files so that a fault of the storage loses nothing and is told in one line.

The faults: a full disk (or quota), a read-only file system, a directory this user may not
write, and a directory that vanished (deleted by another process, unmounted) while a run
wrote to it. `writing(path)` turns any of them, raised by the block it guards (Python's
`OSError`, or an error of tensorstore, orbax's writer, whose message carries the errno as
`os_error_code`), into a `StorageError` whose message is one line: the path, the bytes the
write needed and the bytes free where known, and what to do.

Outputs another run reads are never left half-written under their own name: `replaced`
(a file) and `replaced_directory` (a directory of files) write under a temporary name beside
the target and rename it into place once complete; `append` adds a line whole or not at all.

Imports nothing of the package.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from typing import Iterator

FULL = (errno.ENOSPC, errno.EDQUOT)
READ_ONLY = (errno.EROFS,)
DENIED = (errno.EACCES, errno.EPERM)
GONE = (errno.ENOENT, errno.ESTALE, errno.ENOTDIR)
# The faults recognised anywhere; a missing path only inside `writing`, where the path was
# there when the run began writing to it (elsewhere it is a missing input).
FAULTS = FULL + READ_ONLY + DENIED
_TENSORSTORE = re.compile(r"os_error_code='?(\d+)")
# numpy's `tofile` reports a short write without its errno: on a local disk, a full one.
_SHORT_WRITE = re.compile(r"^\d+ requested and \d+ written$")


class StorageError(OSError):
  """A write failed for a reason of the storage; `str` is one line saying what to do."""


def causes(err: BaseException | None) -> Iterator[BaseException]:
  """`err`, then the error it was raised from (or while handling), and so on."""
  seen = set()
  while err is not None and id(err) not in seen:
    seen.add(id(err))
    yield err
    err = err.__cause__ or err.__context__


def fault_errno(err: BaseException, faults: tuple[int, ...] = FAULTS) -> int | None:
  """The errno of the first storage fault among `err` and its causes (an `OSError`'s errno,
  tensorstore's `os_error_code` in a message, numpy's short write), None when there is
  none."""
  for cause in causes(err):
    code = getattr(cause, "errno", None) if isinstance(cause, OSError) else None
    if code is None and (match := _TENSORSTORE.search(str(cause))):
      code = int(match.group(1))
    if code is None and isinstance(cause, OSError) and _SHORT_WRITE.match(str(cause)):
      code = errno.ENOSPC
    if code in faults:
      return code
  return None


def size_text(n: int) -> str:
  """`n` bytes in the largest unit that keeps it >= 1 (one decimal)."""
  for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
    if n >= scale:
      return f"{n / scale:.1f} {unit}"
  return f"{n} bytes"


def _free(path: str) -> int | None:
  """Free bytes on the file system of `path` (its nearest existing ancestor)."""
  path = os.path.abspath(path)
  while not os.path.exists(path) and os.path.dirname(path) != path:
    path = os.path.dirname(path)
  try:
    return shutil.disk_usage(path).free
  except OSError:
    return None


def message(code: int, path: str, needed: int | None = None) -> str:
  """The one line for storage fault `code` while writing `path` (`needed` bytes, if known)."""
  again = "then re-run the same command"
  if code in FULL:
    free = _free(path)
    sizes = ", ".join(s for s in (needed and f"this write needs about {size_text(needed)}",
                                  free is not None and f"{size_text(free)} free") if s)
    return (f"no space left on the device of {path}{f' ({sizes})' if sizes else ''}: free "
            f"space or move the directory to a larger disk, {again}")
  if code in READ_ONLY:
    return (f"{path} is on a read-only file system: remount it read-write or use another "
            f"directory, {again}")
  if code in DENIED:
    return (f"{path} is not writable by this user (permission denied): grant write "
            f"permission or use another directory, {again}")
  return (f"{path} no longer exists (deleted or unmounted while in use): restore it, or its "
          f"copy, {again}")


@contextlib.contextmanager
def writing(path: str, needed: int | None = None,
            faults: tuple[int, ...] = FAULTS + GONE) -> Iterator[None]:
  """Turns a storage fault raised by the block (writing `path`, `needed` bytes) into a
  `StorageError` with `message`'s line; other errors pass unchanged."""
  try:
    yield
  except StorageError:
    raise
  except Exception as err:  # orbax and tensorstore raise ValueError for write errors
    code = fault_errno(err, faults)
    if code is None:
      raise
    raise StorageError(code, message(code, path, needed)) from err


def append(path: str, data: bytes) -> None:
  """Appends `data` to the file `path` whole or not at all: a failed write is cut off again,
  so the file never ends in part of it."""
  with writing(path, len(data)):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
      start = os.fstat(fd).st_size
      try:
        view = memoryview(data)
        while view:
          view = view[os.write(fd, view):]
      except OSError:
        os.ftruncate(fd, start)
        raise
    finally:
      os.close(fd)


def _remove(path: str) -> None:
  if os.path.isdir(path) and not os.path.islink(path):
    shutil.rmtree(path, ignore_errors=True)
  else:
    with contextlib.suppress(OSError):
      os.remove(path)


@contextlib.contextmanager
def replaced(path: str, mode: str = "w", **open_args) -> Iterator:
  """A file to write that appears as `path` only once the block ends without error: it is
  written as `<path>.tmp-<pid>` and renamed over `path` (removed on failure). Creates the
  parent directory."""
  path = os.path.abspath(path)
  tmp = f"{path}.tmp-{os.getpid()}"
  with writing(path):
    try:
      os.makedirs(os.path.dirname(path), exist_ok=True)
      with open(tmp, mode, **open_args) as f:
        yield f
      os.replace(tmp, path)
    except BaseException:
      _remove(tmp)
      raise


@contextlib.contextmanager
def replaced_directory(path: str) -> Iterator[str]:
  """A directory to fill that appears as `path` only once the block ends without error: the
  block writes into the yielded temporary directory beside `path`, which then takes `path`'s
  place (an older `path` is removed); on failure it is removed and `path` is left as it was."""
  path = os.path.abspath(path.rstrip(os.sep))
  tmp, old = f"{path}.tmp-{os.getpid()}", f"{path}.old-{os.getpid()}"
  with writing(path):
    try:
      _remove(tmp)
      os.makedirs(tmp)
      yield tmp
      if os.path.exists(path):
        os.replace(path, old)
      os.replace(tmp, path)
    except BaseException:
      _remove(tmp)
      raise
    _remove(old)
