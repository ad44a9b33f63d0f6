"""What the attention and the draw cost inside the GRPO update and a decode step, by ablation.

Each program of `ours_rl.py` (the on-policy update of one GRPO batch; `Sampler.decode` of
`--new-tokens` steps) is compiled again with one part replaced by a trivial function of its
input, and the variants are timed in turn (`ours_common.best_of_each`), so what a part costs
is the full program's time minus the variant's (`*_cost_s`; seconds, the decode's per step):

  * `no_attention`: the update's `tiled_attention` returns its queries; the decode's
    attention (`cpu_kernels.decode_attention`) its query;
  * `no_draw`: the decode's `sample_token` takes a token from the sign of the first logit,
    with no softmax and no random numbers.

The variants compute wrong values; they exist only to be timed. Run with the layers unrolled
(`--scan-unroll 0`), as `run_all.py` runs `ours_rl.py`.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np

import ours_common
import ours_rl
from pbsd_jax.generate import sampling
from pbsd_jax.generate.sampling import Sampler
from pbsd_jax.models import transformer
from pbsd_jax.models.attention import cpu_kernels
from pbsd_jax.rl import algorithms, evidence, learner, train_state


@contextlib.contextmanager
def replaced(module, name: str, value):
  old = getattr(module, name)
  setattr(module, name, value)
  try:
    yield
  finally:
    setattr(module, name, old)


ABLATIONS = {
    "update": {"full": (), "no_attention": (
        (transformer, "tiled_attention", lambda q, *args, **kwargs: q * 1.0),)},
    "decode": {"full": (), "no_attention": (
        (cpu_kernels, "decode_attention", lambda query, *args: query * 1.0),), "no_draw": (
        (sampling, "sample_token",
         lambda rng, logits, *args, **kwargs: ((logits[:, 0] > 0).astype(jnp.int32),
                                               logits[:, 1])),)}}


def compiled(fn, args, patches):
  """`fn` compiled for `args` with `patches` in place (the executable keeps them)."""
  with contextlib.ExitStack() as stack:
    for patch in patches:
      stack.enter_context(replaced(*patch))
    return jax.jit(fn).lower(*args).compile()


def main():
  p = ours_common.parser(__doc__)
  p.add_argument("--group", type=int, default=8)
  p.add_argument("--new-tokens", type=int, default=128)
  p.add_argument("--chunk-size", type=int, default=16)
  args = p.parse_args()
  config, params = ours_common.load_model(args)
  prompts = jnp.asarray(np.repeat(ours_common.load_prompts(args, config), args.group, axis=0))
  mask = jnp.ones(prompts.shape, bool)
  sampler = Sampler(config, temperature=1.0)
  algo, tx = algorithms.get("grpo"), train_state.make_optimizer(1e-6)
  plan = learner.UpdatePlan(chunk_size=args.chunk_size or None)
  rollout = jax.jit(functools.partial(ours_rl.single_turn_rollout, sampler, group=args.group,
                                      new_tokens=args.new_tokens))(params, prompts, mask,
                                                                   jax.random.key(0))
  batch = jax.jit(functools.partial(
      evidence.policy_batch, model=config, algo=algo, max_turns=1, chunk_size=plan.chunk_size,
      score_student=False))(params, rollout, prompts, mask, jnp.zeros((), jnp.int32))
  state = train_state.init_train_state(params, tx, jax.random.key(0))
  update = functools.partial(learner.on_policy_update, model=config, tx=tx, algo=algo,
                             plan=plan)
  decode_state = sampler.prefill(params, prompts, mask, prompts.shape[1] + args.new_tokens)
  budget = jnp.full((prompts.shape[0],), args.new_tokens, jnp.int32)
  # `Sampler.decode` is jitted with the sampler static: a new sampler object traces it anew.
  decode = lambda params, st, rng: Sampler(config, temperature=1.0).decode(
      params, st, rng, budget, max_steps=args.new_tokens)
  programs = {"update": (update, (state, batch)),
              "decode": (decode, (params, decode_state, jax.random.key(0)))}
  result = {}
  for program, (fn, fn_args) in programs.items():
    calls = {}
    for variant, patches in ABLATIONS[program].items():
      jax.clear_caches()  # no trace of another variant is reused
      executable = compiled(fn, fn_args, patches)
      calls[f"{program}_{variant}_s"] = functools.partial(executable, *fn_args)
    times = ours_common.best_of_each(calls, args.repeats)
    per = args.new_tokens if program == "decode" else 1  # the decode's per step
    full = times[f"{program}_full_s"] / per
    for variant in ABLATIONS[program]:
      seconds = times[f"{program}_{variant}_s"] / per
      result[f"{program}_{variant}_s"] = seconds
      if variant != "full":
        result[f"{program}_{variant.removeprefix('no_')}_cost_s"] = full - seconds
  ours_common.emit(result)


if __name__ == "__main__":
  main()
