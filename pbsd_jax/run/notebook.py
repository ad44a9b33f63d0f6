"""What the notebooks in colabs/ share: a run configuration by name with dotted overrides, the
task and a policy from a path the user typed, one-line errors for what they typed wrong, and
HTML views of rollouts and of per-token evidence.

Each notebook's first cell calls `one_line_errors()`: from then on a `NotebookError` (a wrong
path, a missing checkpoint, an unknown config field) or a `run_config.ConfigError` shows as
one line in the cell's output, not as a stack of frames.
"""

from __future__ import annotations

import html
import os
from typing import Any, Callable, Mapping, Sequence

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class NotebookError(Exception):
  """Something the user typed cannot be used; the message names it."""


def one_line_errors() -> None:
  """Shows `NotebookError` and `ConfigError` in one line in this IPython kernel (a no-op
  outside IPython)."""
  from IPython import get_ipython
  from pbsd_jax.run.run_config import ConfigError
  shell = get_ipython()
  if shell is not None:
    shell.set_custom_exc((NotebookError, ConfigError),
                         lambda self, etype, value, tb, tb_offset=None: [
                             f"{etype.__name__}: {value}"])


def load_config(name: str = "demo", overrides: Mapping[str, Any] | None = None):
  """`get_config()` of `configs/<name>.py` (or of the file `name`) with `overrides`, a mapping
  of dotted field names to values (`{"sft.steps": 40}`), checked by `run_config.validate`.

  Raises:
    NotebookError: no such config file, or an override names no field.
    ConfigError: a value that cannot run.
  """
  from pbsd_jax.run import cli, run_config
  path = name if name.endswith(".py") else os.path.join(REPO_ROOT, "configs", f"{name}.py")
  if not os.path.isfile(path):
    raise NotebookError(f"{path}: no such config file")
  config = cli.load_config_file(path)
  overrides = dict(overrides or {})
  for field in overrides:
    if message := cli.unknown_field_message(config, [f"--config.{field}=0"]):
      raise NotebookError(message)
  config.update_from_flattened_dict(overrides)
  run_config.validate(config)
  return config


def prepare(config, workdir: str, devices=None):
  """The run's spec, its task (data made under `workdir` when `config.data.dir` is missing)
  and a mesh over `devices` (default: one device): `(spec, task, mesh)`; the spec's model
  config is its vocabulary's (saved in `workdir`)."""
  import jax
  from pbsd_jax.run import policy_checkpoint, run_config, task as task_lib
  spec = run_config.validate(config)
  task = task_lib.prepare_task(spec, workdir)
  spec = spec.for_vocabulary(task.vocab.vocab_size)
  policy_checkpoint.save_model_config(workdir, spec.model)
  return spec, task, spec.build_mesh(devices or jax.devices()[:1])


def load_policy(config, ckpt_dir: str, workdir: str | None = None, step: int | None = None):
  """`task.load_policy` for a path the user typed: `(spec, task, params, step)`, the spec's
  model config the checkpoint's.

  Raises:
    NotebookError: no checkpoint at `ckpt_dir` (or not of this model), in one line.
  """
  from pbsd_jax.run import run_config, task as task_lib
  ckpt_dir = os.path.abspath(os.path.expanduser(ckpt_dir))
  spec = run_config.validate(config)
  try:
    task, model, params, step = task_lib.load_policy(spec, ckpt_dir, step,
                                                     workdir or os.path.dirname(ckpt_dir))
  except (FileNotFoundError, ValueError) as err:
    raise NotebookError(f"{ckpt_dir}: {err}") from None
  return spec.with_model(model), task, params, step


def run_script(name: str, *args: str) -> str:
  """Runs `scripts/<name>` with `args` in a subprocess of this Python and returns its
  standard output.

  Raises:
    NotebookError: the script failed; the message is its own one-line error (the last line
      that says FATAL or error, else its last line).
  """
  import subprocess
  import sys
  done = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "scripts", name), *args],
                        capture_output=True, text=True)
  if done.returncode:
    lines = (done.stderr or done.stdout).strip().splitlines() or [f"exit {done.returncode}"]
    line = next((x for x in reversed(lines) if "FATAL" in x or "rror" in x), lines[-1])
    raise NotebookError(f"{name}: {line.strip()}")
  return done.stdout


_STYLE = ("<style>.pbsd {white-space: pre-wrap; font-family: monospace; font-size: 0.85em; "
          "line-height: 1.6; border: 1px solid #ccc; border-radius: 6px; padding: 0.6em; "
          "margin: 0.6em 0} .pbsd .prompt {color: #888} .pbsd .obs {background: #e8eef8; "
          "color: #345} .pbsd .act {background: #dff3df} .pbsd b {font-family: sans-serif}"
          "</style>")


def rollout_html(rollout, decode: Callable[[Sequence[int]], str],
                 rows: Sequence[int] | None = None) -> str:
  """The trajectories of `rows` (default all) as HTML: the prompt grey, each action turn
  green (labelled with its turn index), each observation blue, with the reward and turns."""
  from pbsd_jax.eval import report
  host = {k: np.asarray(getattr(rollout, k)) for k in (
      "tokens", "turn_ids", "action_mask", "length", "prompt_length", "reward", "num_turns")}
  p = rollout.prompt_width
  esc = lambda ids: html.escape(decode([int(i) for i in ids]))
  parts = [_STYLE]
  for b in range(len(host["tokens"])) if rows is None else rows:
    prompt = host["tokens"][b, p - host["prompt_length"][b]:p]
    parts.append(f"<div class='pbsd'><b>row {b}: reward {host['reward'][b]:g}, "
                 f"{host['num_turns'][b]} turns</b>\n<span class='prompt'>{esc(prompt)}</span>")
    for turn, ids in report.segments(host["tokens"][b], host["turn_ids"][b],
                                     host["action_mask"][b], p, int(host["length"][b])):
      css, title = ("obs", "observation") if turn < 0 else ("act", f"turn {turn}")
      parts.append(f"<span class='{css}' title='{title}'>{esc(ids)}</span>")
    parts.append("</div>")
  return "".join(parts)


def token_evidence_html(tokens: np.ndarray, log_ratio: np.ndarray, action: np.ndarray,
                        decode: Callable[[Sequence[int]], str], scale: float | None = None
                        ) -> str:
  """One trajectory with each action token shaded by its evidence `log_ratio` (teacher minus
  student log-prob: blue positive, red negative, full colour at `scale`, default the largest
  |value|); the other tokens grey. Hovering a token shows its value."""
  from pbsd_jax.eval import report
  tokens, log_ratio, action = np.asarray(tokens), np.asarray(log_ratio), np.asarray(action)
  scale = float(np.max(np.abs(log_ratio[action]), initial=0.0)) if scale is None else scale
  parts = [_STYLE, "<div class='pbsd'>"]
  for t, token in enumerate(tokens):
    text = html.escape(decode([int(token)]))
    if action[t]:
      value = float(log_ratio[t])
      parts.append(f"<span style='background:{report.colour(value, scale)}' "
                   f"title='{value:+.4f}'>{text}</span>")
    else:
      parts.append(f"<span class='prompt'>{text}</span>")
  parts.append("</div>")
  return "".join(parts)
