"""The scripts' `--config` flag: a config file with `--config.<field>=<value>` overrides.

`define_config` defines the flag and `run` starts the script. A config file that does not
exist, or an override of a field the config does not have, ends the script with one line
(naming the nearest field of the config for a typo) instead of ml_collections' traceback.

`define_distributed` adds the multi-host flags and `initialize_distributed` joins the job
(`jax.distributed.initialize`) before anything touches a device: with `--coordinator_address`,
`--num_processes` and `--process_id`, or with nothing on a TPU pod or in a SLURM job of
several tasks, whose environment JAX reads itself.

`run` also ends a script in one line when the storage it writes to fails (a full disk, a
read-only or vanished directory), with the tracebacks in a file (`--verbose`: on the terminal).
"""

from __future__ import annotations

import difflib
import importlib.util
import logging
import os
import re
import sys
import tempfile
import traceback
from typing import Callable

from absl import app
from absl import flags
from absl import logging as absl_logging
from ml_collections import config_flags

from pbsd_jax.data import storage

# The `--config` default of this process's script (set by `define_config`). ml_collections
# parses a flag default at definition, before any error can be reported in one line, so the
# flag itself has no default and `run` adds `--config=<default>` when the command has none.
_default_config: str | None = None


def define_config(default: str, help_string: str = "Run configuration."):
  """Defines `--config` (a config file, `default` when not given); returns its FlagHolder."""
  global _default_config
  _default_config = default
  return config_flags.DEFINE_config_file("config", None,
                                         f"{help_string} (default: {default!r})")


def define_distributed() -> dict:
  """Defines the multi-host flags; returns their FlagHolders by name."""
  return {
      "coordinator_address": flags.DEFINE_string(
          "coordinator_address", None, "host:port of process 0 in a multi-process run "
          "(default: what a TPU pod or SLURM job provides)."),
      "num_processes": flags.DEFINE_integer("num_processes", None,
                                            "Processes in a multi-process run."),
      "process_id": flags.DEFINE_integer("process_id", None, "This process's index (0 .. "
                                         "num_processes - 1)."),
  }


# Environment variables that say this process is one of several JAX can join by itself
# (SLURM, a TPU pod, Open MPI).
_CLUSTERS = ("SLURM_NTASKS", "TPU_WORKER_HOSTNAMES", "OMPI_COMM_WORLD_SIZE")


def _cluster_size(name: str, value: str) -> int:
  return len(value.split(",")) if name == "TPU_WORKER_HOSTNAMES" else int(value or 1)


def initialize_distributed(holders: dict) -> None:
  """Joins the multi-process job the flags (or the cluster's environment) describe; a single
  process does nothing. CPU processes talk over gloo."""
  given = {name: holder.value for name, holder in holders.items() if holder.value is not None}
  clustered = any(_cluster_size(k, os.environ[k]) > 1 for k in _CLUSTERS if k in os.environ)
  if not given and not clustered:
    return
  if given and len(given) != len(holders):
    missing = sorted(set(holders) - set(given))
    raise SystemExit(f"FATAL Flags parsing error: a multi-process run needs "
                     f"--{' and --'.join(sorted(holders))}; missing --{', --'.join(missing)}")
  import jax
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(**given)


def progress_bar(leave: bool = True) -> Callable:
  """`tqdm.tqdm` (bars left on screen when done, or not) on the first process, and no bar on
  the others, whose bars would repeat it."""
  import jax
  import tqdm
  if jax.process_index() != 0:
    return lambda it, **kw: it
  return lambda it, **kw: tqdm.tqdm(it, leave=leave, **kw)


def field_paths(config, prefix: str = "config") -> list[str]:
  """Every leaf field of a ConfigDict as `config.<section>.<field>`."""
  paths = []
  for key, value in config.items():
    path = f"{prefix}.{key}"
    paths += field_paths(value, path) if hasattr(value, "items") else [path]
  return paths


def _config_path(argv: list[str]) -> str | None:
  for i, arg in enumerate(argv):
    if arg in ("--config", "-config") and i + 1 < len(argv):
      return argv[i + 1]
    if m := re.match(r"^--?config=(.*)$", arg):
      return m.group(1)
  return None


def load_config_file(path: str):
  """`get_config()` of the config file `path` (`file.py[:argument]`)."""
  file, *args = path.split(":", 1)
  spec = importlib.util.spec_from_file_location("config_for_field_names", file)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(*args)


def unknown_field_message(config, argv: list[str]) -> str | None:
  """One line for the first `--config.<field>` override in `argv` that `config` lacks, with
  the nearest field's name; None when every override names a field."""
  paths = field_paths(config)
  for arg in argv:
    if m := re.match(r"^--?(?:no)?(config\.[^=]+)", arg):
      field = m.group(1)
      if field not in paths and not any(p.startswith(field + ".") for p in paths):
        # Compared without the common `config.` prefix, which would make any name look near.
        near = difflib.get_close_matches(field[len("config."):],
                                         [p[len("config."):] for p in paths], n=1)
        hint = f"; did you mean config.{near[0]}?" if near else ""
        return f"{field}: the config has no such field{hint}"
  return None


def _usage_error(message: str):
  """Ends the script the way absl ends it for a bad flag value: one line and the help hint."""
  sys.stderr.write(f"FATAL Flags parsing error: {message}\n"
                   "Pass --helpshort or --helpfull to see help on flags.\n")
  sys.exit(1)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing with the `--config` default and one-line config errors."""
  path = _config_path(argv[1:])
  if path is None and _default_config is not None:
    path = _default_config
    argv = [argv[0], f"--config={path}", *argv[1:]]
  if path is not None and not os.path.isfile(path.split(":", 1)[0]):
    _usage_error(f"--config={path}: no such config file")
  try:
    return app.parse_flags_with_usage(argv)
  except (KeyError, AttributeError):
    message = unknown_field_message(load_config_file(path), argv) if path is not None else None
    if message is None:
      raise
    _usage_error(message)


def _storage_line(err: BaseException) -> str | None:
  """The one line for a storage fault that ended a script: a `storage.StorageError`'s own
  (it names the path), else a full disk's or read-only file system's anywhere in `err`'s
  causes, naming the file of the error; None for any other error."""
  for cause in storage.causes(err):
    if isinstance(cause, storage.StorageError):
      return cause.strerror
  code = storage.fault_errno(err)
  if code is None:
    return None
  path = next((e.filename for e in storage.causes(err)
               if isinstance(e, OSError) and e.filename), "the script's output")
  return storage.message(code, str(path))


class _HeldBack(logging.Filter):
  """Holds back log records of storage faults: orbax's writer threads log each write that
  failed, with its traceback, before the script's own error says the same in one line."""

  def __init__(self):
    super().__init__()
    self.records: list[logging.LogRecord] = []

  def filter(self, record: logging.LogRecord) -> bool:
    try:
      text = record.getMessage()
    except Exception:  # a record whose arguments do not fit its format
      text = str(record.msg)
    faults = storage.FAULTS + storage.GONE
    if all(storage.fault_errno(e, faults) is None
           for e in (record.exc_info and record.exc_info[1], ValueError(text)) if e):
      return True
    self.records.append(record)
    return False


def _write_details(held: _HeldBack) -> str:
  """Writes the traceback of the error being handled and the held-back records to a file in
  the temporary directory; returns its path ('' when that cannot be written either)."""
  path = os.path.join(tempfile.gettempdir(), f"pbsd_jax-{os.getpid()}.log")
  formatter = logging.Formatter("%(asctime)s %(threadName)s %(message)s")
  try:
    with open(path, "w") as f:
      f.writelines(formatter.format(r) + "\n" for r in held.records)
      f.write(traceback.format_exc())
  except OSError:
    return ""
  return path


def run(main: Callable[[list[str]], None]) -> None:
  """`absl.app.run(main)` with `parse_flags`, ending the script in one line for:
  - a `run_config.ConfigError` that `main` raises (e.g. from `task.prepare_task`);
  - a fault of the storage it writes to (a full disk, a read-only or vanished directory):
    the path, the bytes needed where known, and what to do. The tracebacks (the script's and
    those orbax's writer threads log) go to a file the line names, or with `--verbose` to
    the terminal."""
  verbose = flags.DEFINE_bool("verbose", False, "Print the tracebacks of a storage fault "
                              "(a full disk, ...) instead of writing them to a file.")

  def guarded(argv):
    held = _HeldBack()
    if not verbose.value:
      absl_logging.get_absl_handler().addFilter(held)
    try:
      return main(argv)
    except Exception as err:
      if (line := _storage_line(err)) is not None:
        if verbose.value:
          traceback.print_exc()
        elif details := _write_details(held):
          line += f" (traceback: {details}; --verbose prints it)"
        raise SystemExit(f"error: {line}") from None
      from pbsd_jax.run.run_config import ConfigError  # imports JAX: only once main has run
      if isinstance(err, ConfigError):
        raise SystemExit(f"FATAL config error: {err}") from None
      raise

  app.run(guarded, flags_parser=parse_flags)
