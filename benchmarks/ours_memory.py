"""Peak memory of the dual log-likelihood, chunked LM head against unchunked.

`likelihood.dual_logprobs` (student and teacher conditions, vmapped) at a large vocabulary and
long rows (default: vocab 151,936, batch 8 x 4,096 tokens) with a small body (1 layer, hidden
256, 4 query / 2 KV heads of 64, MLP 1024): the body barely matters, the `[2, B, T, V]` logits
do. Memory is XLA's own account of the compiled program (`memory_analysis()`: arguments +
outputs + temporaries), compiled from abstract shapes (`jax.ShapeDtypeStruct`), so the
unchunked program (about 40 GB of logits) is measured without being run.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import ours_common
from pbsd_jax.models import ModelConfig, param_shapes
from pbsd_jax.rl import likelihood


def peak_bytes(model: ModelConfig, rows: int, seq: int, chunk_size: int | None) -> dict:
  """Compiled memory of `dual_logprobs` on `rows x seq` tokens: argument, output, temp, total."""
  tokens = jax.ShapeDtypeStruct((rows, seq), jnp.int32)
  mask = jax.ShapeDtypeStruct((rows, seq), jnp.bool_)
  fn = functools.partial(likelihood.dual_logprobs, model=model, chunk_size=chunk_size)
  compiled = jax.jit(lambda p, t, m, tt, tm: fn(p, student_tokens=t, student_mask=m,
                                                teacher_tokens=tt, teacher_mask=tm)
                     ).lower(param_shapes(model), tokens, mask, tokens, mask).compile()
  mem = compiled.memory_analysis()
  parts = {"argument": mem.argument_size_in_bytes, "output": mem.output_size_in_bytes,
           "temp": mem.temp_size_in_bytes}
  return {**parts, "total": sum(parts.values())}


def main():
  p = ours_common.parser(__doc__)
  p.add_argument("--vocab", type=int, default=151_936)
  p.add_argument("--rows", type=int, default=8)
  p.add_argument("--seq", type=int, default=4096)
  p.add_argument("--chunk", type=int, default=256, help="LM-head chunk over the sequence")
  args = p.parse_args()
  config = ModelConfig(vocab_size=args.vocab, hidden_size=256, num_layers=1, num_heads=4,
                       num_kv_heads=2, head_dim=64, mlp_dim=1024, tie_embeddings=True,
                       param_dtype="float32", dtype=args.dtype)
  chunked = peak_bytes(config, args.rows, args.seq, args.chunk)
  unchunked = peak_bytes(config, args.rows, args.seq, None)
  ours_common.emit({"dual_chunked_bytes": chunked["total"],
                    "dual_unchunked_bytes": unchunked["total"],
                    "dual_memory_ratio": chunked["total"] / unchunked["total"],
                    "dual_chunked": chunked, "dual_unchunked": unchunked,
                    "dual_shape": [args.rows, args.seq, args.vocab], "dual_chunk": args.chunk})


if __name__ == "__main__":
  main()
