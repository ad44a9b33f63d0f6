#!/usr/bin/env bash
# Our benchmark suite on an accelerator, on a Qwen2.5-0.5B-shaped model in bfloat16:
#
#   bash benchmarks/gpu.sh                 # from anywhere; SIZE=qwen3-0.6b etc. to change shape
#   ALLOW_CPU=1 SIZE=micro MFU_ARGS="--rows 8 --seq 64 --micro 1 --chunk 32" bash benchmarks/gpu.sh
#                                          # smoke test of the same steps on a CPU
#
# Makes the virtualenv if it has no accelerator backend (the package + jax[cuda12]), runs
# benchmarks/ours_{rl,mfu,memory,multiturn}.py with --size/--dtype (random weights of the named
# pbsd_jax/models/sizes.py shape), saves each RESULT line under $OUT and prints a summary:
# learner MFU against the chip's dense bf16 peak (pbsd_jax/parallel/chips.py, by device
# kind) and against the matmul peak measured in the same run, and decode bandwidth utilisation
# (parameter + KV-cache bytes read per decode step / decode step time / the chip's HBM bandwidth).
# Then the training loop itself, scripts/train.py on the demo config for a few steps.
set -euo pipefail

cd "$(dirname "$0")/.."
SIZE="${SIZE:-qwen2.5-0.5b}"
DTYPE="${DTYPE:-bfloat16}"
VENV="${VENV:-.venv}"
OUT="${OUT:-workdir/bench-gpu}"
PY="$VENV/bin/python"

has_accelerator() {
  "$PY" -c 'import jax, sys; sys.exit(jax.default_backend() == "cpu")' 2>/dev/null
}

if [ ! -x "$PY" ]; then
  python3 -m venv "$VENV"
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q -e .
fi
if [ "${ALLOW_CPU:-0}" = 1 ]; then
  echo "gpu.sh: ALLOW_CPU=1, running on whatever backend jax has (a smoke test)" >&2
elif ! has_accelerator; then
  # The CUDA plugin matching the installed jax (a TPU VM wants "jax[tpu]" instead).
  JAX_VERSION="$("$PY" -c 'import jax; print(jax.__version__)')"
  "$PY" -m pip install -q "jax[cuda12]==$JAX_VERSION"
fi
[ "${ALLOW_CPU:-0}" = 1 ] || has_accelerator || {
  echo "gpu.sh: jax sees no accelerator in $VENV" >&2; exit 1; }
"$PY" -c 'import jax; print("devices:", jax.devices())'

mkdir -p "$OUT"
run() {  # run NAME SCRIPT ARGS...: one process, its RESULT line kept in $OUT/NAME.json
  local name="$1"; shift
  echo "== $name: $*" >&2
  "$PY" "$@" | tee "$OUT/$name.log" | tail -n 1 | sed 's/^RESULT //' > "$OUT/$name.json"
}
COMMON=(--size "$SIZE" --dtype "$DTYPE")
run rl benchmarks/ours_rl.py "${COMMON[@]}" --chunk-size 64  # 16 suits a CPU cache, not a GPU
read -r -a MFU_ARGS <<< "${MFU_ARGS:---rows 32 --seq 1024 --micro 8 --chunk 512}"
run mfu benchmarks/ours_mfu.py "${COMMON[@]}" "${MFU_ARGS[@]}"
read -r -a MEMORY_ARGS <<< "${MEMORY_ARGS:-}"
run memory benchmarks/ours_memory.py --dtype "$DTYPE" "${MEMORY_ARGS[@]}"
run multiturn benchmarks/ours_multiturn.py "${COMMON[@]}"
# The training loop itself (scripts/train.py: data, SFT, RL under the config's mesh, here all
# of this machine's accelerators) on the demo's task and model, a few steps of each stage,
# computing in $DTYPE with the library attention (cuDNN flash attention on a GPU in 16 bits).
echo "== loop: scripts/train.py" >&2
rm -rf "$OUT/loop"
"$PY" scripts/train.py --config=configs/demo.py --workdir="$OUT/loop" \
    --config.sft.steps="${LOOP_SFT_STEPS:-40}" --config.rl.steps="${LOOP_RL_STEPS:-4}" \
    --config.model.attention="${ATTENTION:-dot_product}" --config.model.dtype="$DTYPE" \
    2>&1 | tail -n 3 > "$OUT/loop.log"
"$PY" - "$OUT/loop/metrics.jsonl" <<'EOF2' | tee -a "$OUT/loop.log"
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
rl = [r for r in rows if r["stage"] == "rl"]
print(f"loop: {len(rows) - len(rl)} SFT + {len(rl)} RL steps written; last RL accuracy "
      f"{rl[-1]['accuracy']:.3f}, grad_norm {rl[-1]['grad_norm']:.3g}")
EOF2

"$PY" - "$OUT" <<'EOF'
import json, os, sys
out = sys.argv[1]
r = {}
for name in ("rl", "mfu", "memory", "multiturn"):
  with open(os.path.join(out, f"{name}.json")) as f:
    r.update(json.load(f))
print(f"device {r['device']}, dtype {r['dtype']}")
print(f"learner MFU vs chip bf16 peak: {r.get('mfu_vs_chip_peak', float('nan')):.1%}  "
      f"(vs measured matmul peak {r['matmul_peak_flops'] / 1e12:.0f} TFLOP/s: {r['mfu']:.1%}; "
      f"{r['update_model_flops'] / r['update_s'] / 1e12:.0f} TFLOP/s)")
print(f"decode bandwidth utilisation: {r.get('decode_bandwidth_util', float('nan')):.1%}  "
      f"({r['decode_bytes_per_step'] / r['decode_step_s'] / 1e12:.2f} TB/s over "
      f"{r['decode_step_s'] * 1e3:.2f} ms steps)")
print(f"sampler {r['sampler_tok_s']:.0f} new tok/s; GRPO step {r['grpo_step_s']:.3f} s, "
      f"PBSD/GRPO {r['pbsd_over_grpo']:.3f}; dual memory chunked/unchunked "
      f"{r['dual_memory_ratio']:.3f}; per-token 8/1 turns "
      f"{r['s_per_token_8turn'] / r['s_per_token_1turn']:.3f}")
EOF
