"""A decode step's cost against the buffer it runs in: does it follow the fill?

  python benchmarks/ours_decode.py --model DIR [--rows 64 --filled 896 --big 32768]

The same decode -- `--rows` rows, each with `--filled` tokens already in its cache, then
`--steps` sampled tokens per call, the state carried from call to call -- runs in a buffer of
`--small` slots and in one of `--big` slots (the extra slots empty), as `Sampler.decode` runs
it (on the CPU, `cpu_kernels.decode_attention` reading the filled slots in place), and once
more in the big buffer with XLA's decode attention (`attention.decode_attention`: blocks of
`DECODE_BLOCK` slots up to the longest filled prefix, each copied out of the cache). The
cache of the big buffer is the small one's, padded, so the runs attend to the same keys.
Prints the step times and their ratios to the small buffer's; the last line is
`RESULT {json}`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import ours_common
from pbsd_jax.generate.sampling import Sampler
from pbsd_jax.models.attention import cpu_kernels


def padded(state, size: int):
  """`state` in a buffer of `size` slots: the same tokens and cache, empty slots after."""
  extra = size - state.buffer_size
  pad = lambda x, axis: jnp.pad(x, [(0, 0)] * axis + [(0, extra)] + [(0, 0)] * (x.ndim - axis - 1))
  # Keys hold the slots last, values second to last (`KVCache`), per layer or stacked.
  cache = state.cache.replace(k=jax.tree.map(lambda x: pad(x, x.ndim - 1), state.cache.k),
                              v=jax.tree.map(lambda x: pad(x, x.ndim - 2), state.cache.v),
                              mask=pad(state.cache.mask, 1))
  return jax.tree.map(jnp.copy, state.replace(  # its own arrays: a decode donates them
      tokens=pad(state.tokens, 1), sampled=pad(state.sampled, 1),
      sample_logp=pad(state.sample_logp, 1), cache=cache))


def step_time(sampler, params, state, steps: int, repeats: int) -> float:
  """Seconds per decode step. The state is donated and carried from call to call (as the
  rollout's program carries its buffer), so no call copies the cache; each call appends
  `steps` tokens."""
  budget = jnp.full((state.tokens.shape[0],), steps, jnp.int32)
  decode = jax.jit(lambda p, s: sampler.decode(p, s, jax.random.key(0), budget,
                                               max_steps=steps)[0], donate_argnums=1)
  carry = [state]

  def call():
    carry[0] = decode(params, carry[0])
    return carry[0]

  seconds, _ = ours_common.best_of(call, repeats)
  return seconds / steps


def main():
  p = ours_common.parser(__doc__)
  p.add_argument("--rows", type=int, default=64)
  p.add_argument("--filled", type=int, default=896,
                 help="tokens in each row's cache before the first call")
  p.add_argument("--steps", type=int, default=32, help="decode steps timed per call")
  p.add_argument("--small", type=int, default=1024, help="the buffer that just fits")
  p.add_argument("--big", type=int, default=32768, help="the long-context buffer")
  args = p.parse_args()
  config, params = ours_common.load_model(args)
  params = jax.tree.map(lambda x: x.astype(config.jnp_dtype), params)
  sampler = Sampler(config, temperature=1.0)
  rng = np.random.default_rng(0)
  prompts = jnp.asarray(rng.integers(10, config.vocab_size, (args.rows, args.filled)), jnp.int32)
  state = sampler.prefill(params, prompts, jnp.ones(prompts.shape, bool), args.small)
  if args.filled + (1 + args.repeats) * args.steps > args.small:
    raise SystemExit("--filled + (1 + --repeats) * --steps must fit in --small")
  small = step_time(sampler, params, padded(state, args.small), args.steps, args.repeats)
  big = step_time(sampler, params, padded(state, args.big), args.steps, args.repeats)
  kernel = cpu_kernels.decode_attention
  cpu_kernels.decode_attention = lambda *args: None  # XLA's decode attention, in blocks
  jax.clear_caches()  # `Sampler.decode` traces again, without the kernel
  try:
    xla = step_time(sampler, params, padded(state, args.big), args.steps, args.repeats)
  finally:
    cpu_kernels.decode_attention = kernel
  result = {"rows": args.rows, "filled": args.filled, "small_slots": args.small,
            "big_slots": args.big, "decode_step_small_s": small, "decode_step_big_s": big,
            "decode_step_big_xla_attention_s": xla, "big_over_small": big / small,
            "xla_attention_over_small": xla / small}
  print(f"decode step, {args.rows} rows, {args.filled} filled: {args.small} slots "
        f"{small * 1e3:.2f} ms; {args.big} slots {big * 1e3:.2f} ms ({big / small:.2f}x); "
        f"{args.big} slots with XLA's decode attention {xla * 1e3:.2f} ms "
        f"({xla / small:.2f}x)")
  ours_common.emit(result)


if __name__ == "__main__":
  main()
