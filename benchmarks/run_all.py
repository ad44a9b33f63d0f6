"""Runs our benchmarks and the peers' on one machine, in one invocation, and reports ratios.

    .venv/bin/python benchmarks/run_all.py

1. writes the reference checkpoint and prompts (`benchmarks/reference.py --out DIR`);
2. runs each of our scripts (`benchmarks/ours_*.py`, this interpreter) and each peer script
   (`benchmarks/peers/*.py`, `--peers-python`), one process each, one after the other;
3. reads the `RESULT {json}` line each prints last, and prints one markdown table of the
   benchmark targets (measured ratio, target, met or not) with the raw figures beneath;
4. writes it, with the machine and the exact command, into `docs/benchmarks.md` between the
   `<!-- results -->` markers (the prose around them is kept).

Without the peers' virtualenv the peers are skipped (their ratios read "not run") and the
command that makes it is printed. A script that fails is reported with the end of its stderr;
the others still run.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PEERS_VENV_COMMAND = ("python3 -m venv benchmarks/.venv-peers && benchmarks/.venv-peers/bin/pip "
                      "install -r benchmarks/requirements-peers.txt")
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"

OURS = ("ours_rl.py", "ours_mfu.py", "ours_memory.py", "ours_long.py", "ours_multiturn.py",
        "ours_decode.py")
# The RL step with the reference shape's 2 layers unrolled, as the peers loop over layers.
OURS_ARGS = {"ours_rl.py": ["--scan-unroll", "0"]}
# (script, arguments): Tunix twice, at its defaults and at beta 0 (our GRPO's setting).
PEERS = (("tunix_grpo.py", []), ("tunix_grpo.py", ["--beta", "0", "--no-sampler"]),
         ("trl_grpo.py", []), ("hf_generate.py", []))
# --quick: one timed call or step each and a 4k-token learner update (a smoke run only).
ONE = ["--repeats", "1"]
QUICK = {"ours_rl.py": ONE, "ours_mfu.py": ["--rows", "8", *ONE], "ours_memory.py": [],
         "ours_long.py": ["--seq", "4096", "--base", "1024", *ONE],
         "ours_multiturn.py": ["--long-turns", "8", "--long-buffer", "4096", *ONE],
         "ours_decode.py": ["--big", "4096", *ONE],
         "tunix_grpo.py": ["--steps", "1", *ONE],
         "trl_grpo.py": ["--steps", "1"], "hf_generate.py": ONE}

# (target, numerator, denominator, bound, "<=" or ">="); figures are "system.key".
TARGETS = (
    ("GRPO step, ours / Tunix at beta 0 (no reference log-probs)", "ours.grpo_step_s",
     "tunix_beta0.grpo_step_s", 0.5, "<="),
    ("(PBSD step - GRPO step) / PBSD's teacher forward alone", "ours.pbsd_extra_over_teacher",
     None, 1.1, "<="),
    ("GRPO update / its FLOP floor", "ours.grpo_update_over_floor", None, 1.5, "<="),
    ("decode step / its floor (matmul or read)", "ours.decode_over_floor", None, 2.0, "<="),
    ("decode step at 896 filled, 32K-slot buffer / 1K-slot buffer", "ours.decode_step_big_s",
     "ours.decode_step_small_s", 1.25, "<="),
    ("sampler new tok/s, ours / HF generate", "ours.sampler_tok_s", "hf.generate_tok_s", 2.0,
     ">="),
    ("sampler new tok/s, ours / Tunix sampler", "ours.sampler_tok_s", "tunix.sampler_tok_s",
     1.3, ">="),
    ("learner MFU: update model FLOP/s / matmul peak", "ours.mfu", None, 0.40, ">="),
    ("dual log-lik. peak memory, chunked / unchunked", "ours.dual_chunked_bytes",
     "ours.dual_unchunked_bytes", 0.25, "<="),
    ("time per trajectory token, 8 turns / 1 turn", "ours.s_per_token_8turn",
     "ours.s_per_token_1turn", 1.3, "<="),
    ("time per trajectory token, 64 turns in a 32K buffer / 1 turn in its own",
     "ours.long_s_per_token_many", "ours.s_per_token_1turn", 1.3, "<="),
)
# Context, no target.
EXTRA = (("GRPO step, ours / Tunix at its defaults (beta 0.04)", "ours.grpo_step_s",
          "tunix.grpo_step_s"),
         ("PBSD step / GRPO step (ours)", "ours.pbsd_step_s", "ours.grpo_step_s"),
         ("time per trajectory token, 64 turns / 1 turn, both in a 32K buffer",
          "ours.long_s_per_token_many", "ours.long_s_per_token_1turn"),
         ("64 turns: the KV cache reads alone at the read bandwidth, per trajectory token / "
          "1 turn in its own buffer", "ours.long_cache_read_s_per_token", "ours.s_per_token_1turn"),
         ("GRPO update: its matrix products alone / its FLOP floor",
          "ours.update_products_over_floor", None),
         ("decode step: its matrix products alone / its floor", "ours.decode_products_over_floor",
          None),
         ("GRPO step, ours / TRL", "ours.grpo_step_s", "trl.grpo_step_s"))


def run_script(python: str, script: str, args: list[str], timeout: int) -> dict:
  """Runs one benchmark process; its parsed `RESULT` dict, or `{"error": ...}`."""
  command = [python, script, *args]
  print(f"$ {shlex.join(command)}", file=sys.stderr, flush=True)
  try:
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    return {"error": f"timed out after {timeout} s"}
  lines = [l for l in proc.stdout.splitlines() if l.strip()]
  if proc.returncode == 0 and lines and lines[-1].startswith("RESULT "):
    result = json.loads(lines[-1][len("RESULT "):])
    print(f"  {json.dumps(result)}", file=sys.stderr, flush=True)
    return result
  tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
  print(f"  failed (exit {proc.returncode}):\n    " + "\n    ".join(tail), file=sys.stderr)
  return {"error": f"exit {proc.returncode}: {tail[-1] if tail else 'no output'}"}


def figure(results: dict, name: str | None) -> float | None:
  if name is None:
    return 1.0
  system, key = name.split(".", 1)
  value = results.get(system, {}).get(key)
  return float(value) if isinstance(value, (int, float)) else None


def target_table(results: dict) -> str:
  """The markdown table of targets: ratio, target, met."""
  rows = ["| target | measured | required | met |", "|---|---|---|---|"]
  for label, num, den, bound, sense in TARGETS:
    a, b = figure(results, num), figure(results, den)
    if a is None or b is None:
      rows.append(f"| {label} | not run | {sense} {bound:g} | – |")
      continue
    ratio = a / b
    met = ratio <= bound if sense == "<=" else ratio >= bound
    rows.append(f"| {label} | {ratio:.3f} | {sense} {bound:g} | {'yes' if met else 'no'} |")
  for label, num, den in EXTRA:
    a, b = figure(results, num), figure(results, den)
    rows.append(f"| {label} | {'not run' if a is None or b is None else f'{a / b:.3f}'} "
                "| (context) | |")
  return "\n".join(rows)


def raw_table(results: dict) -> str:
  """Every scalar each system reported."""
  rows = ["| system | figure | value |", "|---|---|---|"]
  for system, result in results.items():
    for key, value in result.items():
      if key in ("system",) or isinstance(value, (dict, list)):
        continue
      shown = f"{value:.4g}" if isinstance(value, float) else str(value)
      rows.append(f"| {system} | {key} | {shown} |")
  return "\n".join(rows)


def machine() -> str:
  """CPU model, cores, memory and library versions."""
  cpu = platform.processor() or "unknown"
  try:
    with open("/proc/cpuinfo") as f:
      cpu = re.search(r"model name\s*:\s*(.*)", f.read()).group(1)
    with open("/proc/meminfo") as f:
      ram = int(re.search(r"MemTotal:\s*(\d+)", f.read()).group(1)) / 2 ** 20
  except (OSError, AttributeError):
    ram = float("nan")
  versions = []
  for package in ("jax", "jaxlib", "flax", "optax", "torch", "transformers"):
    try:
      versions.append(f"{package} {importlib.metadata.version(package)}")
    except importlib.metadata.PackageNotFoundError:
      pass
  return (f"{cpu}, {os.cpu_count()} cores, {ram:.0f} GiB RAM, {platform.system()} "
          f"{platform.release()}, Python {platform.python_version()}; ours: "
          f"{', '.join(versions)}")


def peer_versions(results: dict) -> str:
  found = [f"{s}: {r['version']}" for s, r in results.items() if s != "ours" and "version" in r]
  return "; ".join(found) if found else "peers not run"


def report(results: dict, command: str, errors: list[str]) -> str:
  when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
  parts = [f"Measured {when} with `{command}`.", "",
           f"Machine: {machine()}. Peers: {peer_versions(results)}.", "",
           target_table(results), "", "Raw figures (seconds, tokens/s, bytes, FLOP/s):", "",
           raw_table(results)]
  if errors:
    parts += ["", "Not measured:", ""] + [f"- {e}" for e in errors]
  return "\n".join(parts)


def write_doc(path: str, text: str) -> None:
  """Replaces the text between the markers of `path` (or writes them, if absent)."""
  block = f"{BEGIN}\n{text}\n{END}"
  old = open(path).read() if os.path.exists(path) else ""
  if BEGIN in old and END in old:
    new = old[:old.index(BEGIN)] + block + old[old.index(END) + len(END):]
  else:
    new = (old.rstrip() + "\n\n" if old else "# Benchmarks\n\n") + block + "\n"
  with open(path, "w") as f:
    f.write(new)


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--peers-python", default=os.path.join(HERE, ".venv-peers", "bin", "python"))
  p.add_argument("--only", choices=("all", "ours", "peers"), default="all")
  p.add_argument("--quick", action="store_true", help="one timed call, small learner update")
  p.add_argument("--model-dir", help="where the reference checkpoint goes (default: a temp dir)")
  p.add_argument("--doc", default=os.path.join(ROOT, "docs", "benchmarks.md"))
  p.add_argument("--timeout", type=int, default=3600, help="seconds per script")
  args = p.parse_args()
  command = shlex.join(["benchmarks/run_all.py", *sys.argv[1:]])
  if args.model_dir:
    results, errors = run_everything(args, args.model_dir)
  else:
    with tempfile.TemporaryDirectory(prefix="pbsd_bench_") as model_dir:
      results, errors = run_everything(args, model_dir)
  text = report(results, command, errors)
  print(text)
  write_doc(args.doc, text)
  print(f"\nwritten to {os.path.relpath(args.doc, ROOT)}", file=sys.stderr)


def run_everything(args, model_dir: str) -> tuple[dict, list[str]]:
  """Writes the reference into `model_dir` and runs the scripts: `(results by system, errors)`."""
  subprocess.run([sys.executable, os.path.join(HERE, "reference.py"), "--out", model_dir],
                 cwd=ROOT, check=True)
  common = ["--model", model_dir]
  results, errors = {}, []

  def record(system_default, result, script):
    if "error" in result:
      errors.append(f"`{script}`: {result['error']}")
      return
    system = result.get("system", system_default)
    results.setdefault(system, {}).update(result)

  if args.only in ("all", "ours"):
    for script in OURS:
      extra = OURS_ARGS.get(script, []) + (QUICK.get(script, []) if args.quick else [])
      record("ours", run_script(sys.executable, os.path.join(HERE, script), common + extra,
                                args.timeout), script)
  if args.only in ("all", "peers"):
    if not os.path.exists(args.peers_python):
      message = (f"peers skipped: {args.peers_python} is missing; make it with: "
                 f"{PEERS_VENV_COMMAND}")
      print(message, file=sys.stderr)
      errors.append(message)
    else:
      for script, script_args in PEERS:
        extra = QUICK.get(script, []) if args.quick else []
        record(script.split("_")[0], run_script(args.peers_python,
                                                os.path.join(HERE, "peers", script),
                                                common + script_args + extra, args.timeout),
               script)
  return results, errors


if __name__ == "__main__":
  main()
