"""Our sampler and our single-turn GRPO and PBSD steps on the reference shape.

One RL step is one `jax.jit` program, as `pbsd_jax.run.train.make_rl_iteration` builds it: rollout
(prefill + `lax.while_loop` decode of exactly `--new-tokens` tokens, temperature 1, no stop)
-> reward -> evidence (`evidence.policy_batch`; with one update per batch the student
log-probs are the update's own forward, so this is PBSD's teacher pass and nothing for GRPO)
-> one PPO update (`learner.on_policy_update`). The
breakdown jits the three parts separately. The reward is a deterministic function of the
sampled tokens (more than half of them even), so groups have non-zero advantages.

The PBSD teacher prompt is the student prompt with its last quarter replaced by other ids:
the same 64-token width, a different conditioning, which is all the cost depends on.

Sampler tokens/s: `--prompts x --group` sequences x `--new-tokens` / wall seconds of
`Sampler.generate` (prefill + decode). Decode bandwidth: parameter bytes + the whole KV cache
(at this shape one block of the decode attention: every slot) per decode step / its time.

Floors, from the matmul peak and the read bandwidth measured in the same run:
- the update: 6 x (the layers' multiplying parameters x every token + the LM head's x the
  trajectory tokens, the only positions it scores) FLOPs at the matmul peak;
- a decode step: the larger of 2 x the multiplying parameters (LM head included) x rows FLOPs
  at the matmul peak and its bytes (above) at the read bandwidth.
PBSD's extra cost is set against its teacher forward measured alone: (PBSD step - GRPO step)
/ PBSD's evidence pass (`pbsd_extra_over_teacher`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import ours_common
from pbsd_jax.agent.rollout import Rollout
from pbsd_jax.generate.sampling import Sampler
from pbsd_jax.rl import algorithms, evidence, learner, train_state


def even_majority_reward(tokens: jax.Array, sampled: jax.Array) -> jax.Array:
  """`f32[B]` 1.0 where more than half of a row's sampled tokens are even ids."""
  even = jnp.sum(sampled & (tokens % 2 == 0), axis=1)
  return (2 * even > jnp.sum(sampled, axis=1)).astype(jnp.float32)


def single_turn_rollout(sampler: Sampler, params, prompts: jax.Array, mask: jax.Array,
                        rng: jax.Array, group: int, new_tokens: int) -> Rollout:
  """One sampled answer per row, in the shared `Rollout` layout (turn 0 = every action)."""
  b, p = prompts.shape
  state = sampler.prefill(params, prompts, mask, p + new_tokens)
  budget = jnp.full((b,), new_tokens, jnp.int32)
  state, _ = sampler.decode(params, state, rng, budget, max_steps=new_tokens)
  ones = jnp.ones((b,), jnp.int32)
  return Rollout(tokens=state.tokens, action_mask=state.sampled,
                 turn_ids=jnp.where(state.sampled, 0, -1), num_turns=ones, length=state.cursor,
                 prompt_length=jnp.sum(mask, axis=1).astype(jnp.int32),
                 finished=ones.astype(bool), truncated=jnp.zeros((b,), bool),
                 group_ids=jnp.arange(b, dtype=jnp.int32) // group,
                 sample_logp=state.sample_logp,
                 reward=even_majority_reward(state.tokens, state.sampled),
                 searches=jnp.zeros((b,), jnp.int32), search_failures=jnp.zeros((b,), jnp.int32),
                 prompt_width=p)


def step_parts(name: str, config, params, prompts, mask, teacher, teacher_mask, args) -> dict:
  """Calls timing one RL step of algorithm `name` and its three parts, by figure name."""
  sampler = Sampler(config, temperature=1.0)
  algo = algorithms.get(name)
  tx = train_state.make_optimizer(1e-6)
  plan = learner.UpdatePlan(chunk_size=args.chunk_size or None)
  rollout_fn = jax.jit(functools.partial(single_turn_rollout, sampler, group=args.group,
                                         new_tokens=args.new_tokens))
  # One update in one pass: the student log-probs come from the update's own forward
  # (`UpdatePlan.on_policy`), so GRPO's evidence part is empty and PBSD's is the teacher pass.
  on_policy = plan.on_policy(prompts.shape[0])
  evidence_fn = jax.jit(functools.partial(
      evidence.policy_batch, model=config, algo=algo, max_turns=1, chunk_size=plan.chunk_size,
      score_student=not on_policy))
  update_fn = jax.jit(functools.partial(
      learner.on_policy_update if on_policy else learner.ppo_update, model=config, tx=tx,
      algo=algo, plan=plan))

  def iteration(state, rng):
    rollout = rollout_fn(state.params, prompts, mask, rng)
    return learner.rl_step(state, rollout, teacher, teacher_mask, model=config, tx=tx,
                           algo=algo, max_turns=1, plan=plan)

  step_fn = jax.jit(iteration, donate_argnums=0)
  holder = {"state": train_state.init_train_state(jax.tree.map(jnp.copy, params), tx,
                                              jax.random.key(0)), "n": 0}

  def step():
    holder["n"] += 1
    holder["state"], metrics = step_fn(holder["state"], jax.random.key(holder["n"]))
    return metrics

  rollout = rollout_fn(params, prompts, mask, jax.random.key(0))
  step0 = jnp.zeros((), jnp.int32)
  batch = evidence_fn(params, rollout, teacher, teacher_mask, step0)
  state = train_state.init_train_state(params, tx, jax.random.key(0))
  return {f"{name}_step_s": step,
          f"{name}_rollout_s": lambda: rollout_fn(params, prompts, mask, jax.random.key(0)),
          f"{name}_evidence_s": lambda: evidence_fn(params, rollout, teacher, teacher_mask,
                                                    step0),
          f"{name}_update_s": lambda: update_fn(state, batch)}


def measure_sampler(config, params, prompts, mask, args) -> dict:
  """Sampler tokens/s (prefill + decode) and the decode step's time and bytes read.

  The sampler gets the parameters in the compute dtype (cast once, as a rollout worker holds
  them), so a bfloat16 decode reads bfloat16 weights.
  """
  sampler = Sampler(config, temperature=1.0)
  params = jax.tree.map(lambda x: x.astype(config.jnp_dtype), params)
  b, p = prompts.shape
  size = p + args.new_tokens
  budget = jnp.full((b,), args.new_tokens, jnp.int32)

  def generate():
    return sampler.generate(params, prompts, mask, jax.random.key(0), args.new_tokens)

  generate_s, _ = ours_common.best_of(generate, args.repeats)
  state = sampler.prefill(params, prompts, mask, size)
  decode = lambda: sampler.decode(params, state, jax.random.key(0), budget,
                                  max_steps=args.new_tokens)
  decode_s, _ = ours_common.best_of(decode, args.repeats)
  step_bytes = ours_common.tree_bytes(params) + ours_common.tree_bytes((state.cache.k,
                                                                        state.cache.v))
  return {"sampler_tok_s": b * args.new_tokens / generate_s, "generate_s": generate_s,
          "decode_step_s": decode_s / args.new_tokens, "decode_bytes_per_step": step_bytes}


def main():
  p = ours_common.parser(__doc__)
  p.add_argument("--group", type=int, default=8, help="generations per prompt (G)")
  p.add_argument("--new-tokens", type=int, default=128)
  # 16 positions x 64 rows: [1024, 8192] f32 logits (32 MB) per LM-head chunk, which a CPU's
  # last-level cache holds; on this 2-core CPU the step is ~8% faster than one unchunked head.
  p.add_argument("--chunk-size", type=int, default=16,
                 help="LM-head chunk in positions (0: the whole sequence at once)")
  p.add_argument("--only", choices=("sampler", "grpo", "pbsd"), action="append",
                 help="measure only these (repeatable; default all)")
  args = p.parse_args()
  config, params = ours_common.load_model(args)
  prompts = np.repeat(ours_common.load_prompts(args, config), args.group, axis=0)
  mask = np.ones(prompts.shape, bool)
  # Privileged prompt: the last quarter of the prompt replaced (same width P).
  teacher = prompts.copy()
  quarter = prompts.shape[1] // 4
  teacher[:, -quarter:] = (prompts[:, -quarter:] + 1) % config.vocab_size
  prompts, mask, teacher = map(jnp.asarray, (prompts, mask, teacher))
  only = set(args.only or ("sampler", "grpo", "pbsd"))
  result = {"batch": int(prompts.shape[0]), "new_tokens": args.new_tokens,
            "dtype": config.dtype, "scan_unroll": config.scan_unroll}
  if "sampler" in only:
    result.update(measure_sampler(config, params, prompts, mask, args))
    peaks = ours_common.chip_peaks()
    if peaks:
      result["decode_bandwidth_util"] = (result["decode_bytes_per_step"]
                                         / result["decode_step_s"] / peaks[1])
  # The algorithms' steps and parts are timed in turn, so PBSD's extra cost (a difference of
  # two steps) is not a drift of the machine between two phases of the run.
  calls = {}
  for name in ("grpo", "pbsd"):
    if name in only:
      calls.update(step_parts(name, config, params, prompts, mask, teacher, mask, args))
  result.update(ours_common.best_of_each(calls, args.repeats))
  if {"grpo", "pbsd"} <= only:
    result["pbsd_over_grpo"] = result["pbsd_step_s"] / result["grpo_step_s"]
    result["pbsd_extra_over_teacher"] = ((result["pbsd_step_s"] - result["grpo_step_s"])
                                         / result["pbsd_evidence_s"])
  result.update(floors(config, prompts.shape, args, result))
  ours_common.emit(result)


def floors(config, shape: tuple[int, int], args, result: dict) -> dict:
  """The update's and the decode step's floors (module docstring), our time over each, and
  the same matrix products alone (`ours_common.products_seconds`) at the shapes we run them:
  the update's over every token (the LM head's over the trajectory tokens, in `--chunk-size`
  chunks, without its rematerialised forward) and a decode step's for `rows` rows, where their
  operands and results fit `products_seconds`'s memory bound."""
  rows, prompt = shape
  peak = ours_common.matmul_peak(config.dtype)
  out = {"matmul_peak_flops": peak, "read_bytes_s": ours_common.read_bandwidth()}
  if "grpo_update_s" in result:
    tokens, scored = rows * (prompt + args.new_tokens), rows * args.new_tokens
    chunk = rows * args.chunk_size if args.chunk_size else scored
    passes = [(tokens, i, o) for i, o in ours_common.matmul_kernels(config, head=False)]
    heads = [chunk] * (scored // chunk) + ([scored % chunk] if scored % chunk else [])
    passes += [(m, config.hidden_size, config.vocab_size) for m in heads]
    # Each kernel's forward, input gradient and weight gradient: the floor's 6 FLOPs per
    # multiplying parameter and token.
    shapes = [s for m, i, o in passes for s in ((m, i, o), (m, o, i), (i, m, o))]
    flops = sum(2 * m * k * n for m, k, n in shapes)
    out.update(update_floor_flops=flops, update_floor_s=flops / peak,
               grpo_update_over_floor=result["grpo_update_s"] * peak / flops)
    products = ours_common.products_seconds(shapes, args.repeats, dtype=config.dtype)
    if products is not None:
      out.update(update_products_s=products, update_products_over_floor=products * peak / flops)
  if "decode_step_s" in result:
    floor = max(2 * ours_common.matmul_params(config) * rows / peak,
                result["decode_bytes_per_step"] / out["read_bytes_s"])
    shapes = [(rows, i, o) for i, o in ours_common.matmul_kernels(config)]
    out.update(decode_floor_s=floor, decode_over_floor=result["decode_step_s"] / floor)
    products = ours_common.products_seconds(shapes, args.repeats, steps=args.new_tokens,
                                            dtype=config.dtype)
    if products is not None:
      out.update(decode_products_s=products, decode_products_over_floor=products / floor)
  return out


if __name__ == "__main__":
  main()
