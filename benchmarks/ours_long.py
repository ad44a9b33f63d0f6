"""Long rows in the learner: forward + backward of the policy loss on one trajectory.

The loss is `learner.policy_loss` (GRPO's clipped surrogate, the LM head chunked by
`--chunk`) on one row of `--seq` tokens (default 16,384) and, for the per-token comparison,
one of `--base` tokens (default 2,048): every token real, the first `--prompt` tokens the
prompt, the rest trained on with advantages of alternating sign. Memory is XLA's account of
the compiled program (`memory_analysis()`: arguments + outputs + temporaries); time the best
of `--repeats` warm calls. The same loss with the whole row in one attention tile
(`flash.QUERY_BLOCK = KEY_BLOCK = seq`: the full score matrix, nothing skipped) is
compiled, not run, for its memory.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import ours_common
from pbsd_jax.models.attention import flash
from pbsd_jax.rl import algorithms, evidence, learner
from pbsd_jax.rl.algorithms import AdvantageInputs


def row(config, seq: int, prompt: int) -> tuple[evidence.PolicyBatch, learner.Targets]:
  """One trajectory of `seq` tokens and its targets (advantages +1 / -1 by token)."""
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (1, seq)),
                       jnp.int32)
  mask = jnp.ones((1, seq), bool)
  action = jnp.arange(seq)[None] >= prompt
  inputs = AdvantageInputs(rewards=jnp.ones(1), action_mask=action,
                           turn_ids=jnp.where(action, 0, -1), step=jnp.int32(0), max_turns=1,
                           logp_student=jnp.zeros((1, seq), jnp.float32))
  batch = evidence.PolicyBatch(tokens=tokens, mask=mask, teacher_tokens=tokens,
                               teacher_mask=mask, action_mask=action, inputs=inputs,
                               score_from=prompt)
  sign = jnp.where(jnp.arange(seq) % 2 == 0, 1.0, -1.0)[None]
  targets = learner.Targets(old_logp=jnp.full((1, seq), -9.0), advantages=sign * action,
                            loss_mask=action)
  return batch, targets


def loss_and_grad(config, chunk: int):
  loss = functools.partial(learner.policy_loss, model=config, algo=algorithms.get("grpo"),
                           chunk_size=chunk)
  return jax.jit(jax.value_and_grad(lambda p, b, t: loss(p, b, t)[0]))


def compiled_bytes(fn, *args) -> int:
  mem = fn.lower(*args).compile().memory_analysis()
  return mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes


def main():
  p = ours_common.parser(__doc__)
  p.add_argument("--seq", type=int, default=16_384)
  p.add_argument("--base", type=int, default=2_048)
  p.add_argument("--prompt", type=int, default=64)
  p.add_argument("--chunk", type=int, default=256, help="LM-head chunk over the sequence")
  p.set_defaults(repeats=2)
  args = p.parse_args()
  config, params = ours_common.load_model(args)
  result = {}
  for name, seq in (("base", args.base), ("long", args.seq)):
    fn = loss_and_grad(config, args.chunk)
    batch, targets = row(config, seq, args.prompt)
    seconds, (loss, grads) = ours_common.best_of(lambda: fn(params, batch, targets),
                                                 args.repeats)
    norm = float(jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads))))
    if not np.isfinite(norm) or norm == 0:
      raise SystemExit(f"the {seq}-token gradient is {norm}")
    result.update({f"{name}_tokens": seq, f"{name}_s": seconds,
                   f"{name}_s_per_token": seconds / seq,
                   f"{name}_bytes": compiled_bytes(fn, params, batch, targets)})
  blocks = flash.QUERY_BLOCK, flash.KEY_BLOCK
  flash.QUERY_BLOCK = flash.KEY_BLOCK = args.seq
  try:
    result["long_one_tile_bytes"] = compiled_bytes(loss_and_grad(config, args.chunk), params,
                                                   *row(config, args.seq, args.prompt))
  finally:
    flash.QUERY_BLOCK, flash.KEY_BLOCK = blocks
  result["per_token_ratio"] = result["long_s_per_token"] / result["base_s_per_token"]
  ours_common.emit(result)


if __name__ == "__main__":
  main()
