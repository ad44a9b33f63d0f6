"""Learner utilisation: model FLOP/s of one RL update against the matmul peak measured now.

The update is `learner.ppo_update` (GRPO loss, one optimiser step) on `--rows x --seq` tokens
of a larger shape (default: 8 layers, hidden 512, 8 query / 4 KV heads of 64, MLP 2048,
vocab 32768, untied head; 32 x 1024 = 32k tokens), micro-batched (`--micro`) so the
attention scores of a micro-batch fit in memory, the LM head chunked (`--chunk`). One warm-up
update, then one timed (`--repeats`, default 1: an update is long next to its noise).

Model FLOPs of the update (forward + backward = 3 forwards, each matmul 2 FLOPs per MAC):

    6 * N * tokens + 6 * layers * 2 * heads * head_dim * seq * tokens

with N the parameters that multiply activations (every layer's q, k, v, o, gate, up, down
kernels plus the LM head; not the embedding gather or the norms). The second term is the
attention scores and the weighted sum (2 matmuls of `seq x head_dim` per query and head),
counted over the full square (the convention of model FLOPs; the attention itself skips the
tiles in the causal future, so at 1,024 tokens in tiles of 512 it computes 3 of 4).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import ours_common
from pbsd_jax.models import ModelConfig, init_params
from pbsd_jax.models.sizes import SIZES
from pbsd_jax.rl import algorithms, evidence, learner, train_state
from pbsd_jax.rl.algorithms import AdvantageInputs

LARGER = dict(vocab_size=32_768, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4,
              head_dim=64, mlp_dim=2048, tie_embeddings=False, rope_theta=1e6)


def update_flops(model: ModelConfig, rows: int, seq: int) -> float:
  """Model FLOPs of one forward + backward over `rows x seq` tokens (module docstring)."""
  tokens = rows * seq
  attention = 6 * model.num_layers * 2 * model.num_heads * model.resolved_head_dim * seq
  return float(6 * ours_common.matmul_params(model) * tokens + attention * tokens)


def policy_batch(model: ModelConfig, rows: int, seq: int) -> evidence.PolicyBatch:
  """A full batch: every token real, the second half of each row trained on, rewards 0 / 1
  alternating (so every GRPO group of 8 has non-zero advantages)."""
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, model.vocab_size, (rows, seq)), jnp.int32)
  mask = jnp.ones((rows, seq), bool)
  action = jnp.broadcast_to(jnp.arange(seq) >= seq // 2, (rows, seq))
  inputs = AdvantageInputs(rewards=jnp.arange(rows) % 2, action_mask=action,
                           turn_ids=jnp.where(action, 0, -1), step=jnp.int32(0), max_turns=1,
                           logp_student=jnp.full((rows, seq), -10.0, jnp.float32))
  return evidence.PolicyBatch(tokens=tokens, mask=mask, teacher_tokens=tokens,
                              teacher_mask=mask, action_mask=action, inputs=inputs)


def main():
  p = ours_common.parser(__doc__)
  p.add_argument("--rows", type=int, default=32)
  p.add_argument("--seq", type=int, default=1024)
  p.add_argument("--micro", type=int, default=4, help="rows per micro-batch")
  p.add_argument("--chunk", type=int, default=256, help="LM-head chunk over the sequence")
  p.add_argument("--remat", action="store_true", help="rematerialise each layer")
  # An update of 32k tokens takes about a minute on a 2-core CPU: one warm-up, one timed.
  p.set_defaults(repeats=1)
  args = p.parse_args()
  algo = algorithms.get("grpo")
  if args.rows % algo.group_size:
    p.error(f"--rows {args.rows} is not a whole number of GRPO groups of {algo.group_size}")
  shape = SIZES[args.size] if args.size else LARGER
  config = ModelConfig(**shape, param_dtype="float32", dtype=args.dtype, remat=args.remat)
  params = init_params(config, jax.random.key(0))
  tx = train_state.make_optimizer(1e-6)
  plan = learner.UpdatePlan(micro_batch_size=args.micro, chunk_size=args.chunk)
  update = jax.jit(lambda state, batch: learner.ppo_update(
      state, batch, model=config, tx=tx, algo=algo, plan=plan),
      donate_argnums=0)
  batch = policy_batch(config, args.rows, args.seq)
  holder = {"state": train_state.init_train_state(params, tx, jax.random.key(0))}

  def step():
    holder["state"], metrics = update(holder["state"], batch)
    return metrics

  update_s, _ = ours_common.best_of(step, args.repeats)
  holder.clear()  # free the state before the matmul peak
  flops = update_flops(config, args.rows, args.seq)
  sizes = (1024, 2048, 4096) if jax.default_backend() == "cpu" else (4096, 8192, 16384)
  peak = ours_common.matmul_peak(args.dtype, sizes)
  result = {"update_s": update_s, "update_model_flops": flops, "matmul_peak_flops": peak,
            "mfu": flops / update_s / peak, "update_tokens": args.rows * args.seq,
            "matmul_params": ours_common.matmul_params(config), "dtype": args.dtype}
  chip = ours_common.chip_peaks()
  if chip:
    result["mfu_vs_chip_peak"] = flops / update_s / chip[0]
  ours_common.emit(result)


if __name__ == "__main__":
  main()
