"""scripts/aot_compile.py: a run's programs compiled for a TPU topology on this CPU host.

libtpu (the `tpu` extra, part of `test`) is the TPU compiler; no TPU is needed. The runs are
one xdist group: each loads libtpu in its own process, one at a time.
"""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.xdist_group("aot")
MICRO = ["--config=configs/pbsd.py", "--topology=v5e-4", "--config.model.name=micro",
         "--config.sft.steps=2", "--config.rl.micro_batch_size=32", "--config.rl.chunk_size=128",
         "--config.eval.every=1"]


def _compile(tmp_path, *flags):
  out = tmp_path / "aot.json"
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "aot_compile.py"),
                         f"--workdir={tmp_path / 'work'}", f"--json={out}", *flags],
                        cwd=ROOT, capture_output=True, text=True, timeout=900)
  report = json.loads(out.read_text()) if out.exists() else None
  return proc, report


@pytest.fixture(scope="module")
def micro(tmp_path_factory, kg):
  proc, report = _compile(tmp_path_factory.mktemp("aot"), *MICRO,
                          f"--config.data.dir={os.path.dirname(kg.paths['spm_model'])}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  return report, proc.stdout


def test_every_program_of_the_run_compiles_for_the_topology(micro):
  report, stdout = micro
  programs = {p["name"]: p for p in report["programs"]}
  assert list(programs) == ["sft_step", "rl_step", "eval_rollout"]
  assert report["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}
  for p in programs.values():
    m = p["memory"]
    assert p["fits"] and 0 < m["total"] <= report["hbm"]
    assert m["total"] == m["argument"] + m["output"] - m["alias"] + m["temp"] + m["code"]
    assert m["peak"] > 0 and "compiler's peak" in stdout  # peak_memory_in_bytes, as reported
    # The train state is donated: its outputs live in the arguments' buffers.
    if p["name"] != "eval_rollout":
      assert m["alias"] > 0
    assert f"{p['name']}:" in stdout


def test_no_cpu_kernel_reaches_a_tpu_program(micro):
  from pbsd_jax.models.attention import cpu_kernels
  cpu = {*cpu_kernels.TARGETS.values(), *cpu_kernels.WRITE_TARGETS.values()}
  for p in micro[0]["programs"]:
    assert not cpu & set(p["custom_calls"]), p["name"]
    # "ours" attention is XLA's own ops on every platform: no kernel of any kind.
    assert "tpu_custom_call" not in p["custom_calls"], p["name"]


def test_splash_attention_compiles_to_the_mosaic_kernel(tmp_path, kg):
  # Over the mesh of 4 chips: each chip runs the kernel on its rows (a Mosaic kernel cannot
  # be partitioned by XLA).
  proc, report = _compile(tmp_path, *MICRO, "--programs=sft_step",
                          "--config.model.attention=splash",
                          f"--config.data.dir={os.path.dirname(kg.paths['spm_model'])}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "tpu_custom_call" in report["programs"][0]["custom_calls"]


def test_loops_count_as_they_run_and_match_xla_once_each(micro):
  programs = {p["name"]: p for p in micro[0]["programs"]}
  for p in programs.values():
    unit, cost = p["unit_cost"], p["cost"]
    # Every loop counted once: XLA's own cost analysis.
    assert unit["flops"] == pytest.approx(p["xla_flops"], rel=0.15), p["name"]
    # Bytes are counted per top-level instruction, which XLA's figure is not (docs/tpu.md):
    # the same order, not the same number (a stacked weight read whole per layer would be
    # `layers` times more).
    assert 0.2 < unit["bytes"] / p["xla_bytes"] < 5, p["name"]
    assert cost["flops"] > 2 * unit["flops"], p["name"]
    assert not cost["unknown_loops"], p["name"]
  rl = programs["rl_step"]["cost"]["loops"]
  named = lambda scope: [n for name, n in rl.items() if re.search(rf"{scope}/while$", name)]
  assert named("turn_loop") == [7]  # env.max_turns
  assert named("decode_loop") == [48]  # env.max_action_tokens
  # Each decode step's attention reads the cache's blocks: at most all 3 of 640 slots.
  assert named("decode_blocks") == [3]
  # 256 rows in micro-batches of 32: the gradient scan runs 8 times.
  assert 8 in rl.values()


def test_memory_model_holds_the_state_the_compiler_holds(micro):
  for p in micro[0]["programs"]:
    e, m = p["estimate"], p["memory"]
    state = e["params"] + e.get("optimizer", 0) + e.get("teacher", 0)
    # The arguments are the state plus the batch (and the search index), padded to the
    # TPU's tiles, never less.
    assert state <= m["argument"], p["name"]


def test_a_program_too_large_for_the_chip_fails_in_one_line(tmp_path, kg):
  proc, _ = _compile(tmp_path, *MICRO, "--programs=sft_step", "--config.sft.batch_size=2048",
                     "--config.env.buffer_size=16384", "--config.rl.chunk_size=0",
                     f"--config.data.dir={os.path.dirname(kg.paths['spm_model'])}")
  assert proc.returncode == 1
  last = proc.stderr.strip().splitlines()[-1]
  assert re.match(r"error: sft_step (needs|does not fit)", last), proc.stderr[-2000:]
  assert "sft.batch_size" in last and "TPU v5 lite" in last


def test_topology_names():
  from pbsd_jax.run import aot
  assert aot._parse_topology("v5e-16") == ("v5e", 16, None)
  assert aot._parse_topology("v5p:2x2x4") == ("v5p", 0, "2x2x4")
  with pytest.raises(ValueError, match="no v5e slice of 12 chips"):
    aot.topology("v5e-12")
  with pytest.raises(ValueError, match="unknown TPU generation 'v9'"):
    aot.topology("v9-8")
