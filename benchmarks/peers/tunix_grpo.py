"""Tunix GRPO step time (with its breakdown) and Tunix sampler throughput on the reference shape.

    benchmarks/.venv-peers/bin/python benchmarks/peers/tunix_grpo.py --model DIR

The reference checkpoint is loaded with Tunix's own Qwen3 safetensors loader
(`tunix.models.qwen3.params.create_model_from_safe_tensors`, f32) on a 1-device mesh; the
reference model is a second copy of it.

Sampler: `tunix.generate.sampler.Sampler` samples 128 new tokens for 64 sequences (the 8 prompts,
each repeated 8 times) at temperature 1 (top_p 1.0, no top-k: plain categorical sampling); one
warm-up call, then the best of 3.

GRPO: `GRPOLearner` with the vanilla rollout engine, 8 prompts x 8 generations, 64-token prompts,
128 new tokens, temperature 1, Tunix's defaults for the loss (beta 0.04, so reference log-probs
are computed; `--beta 0` turns them off, as our GRPO has none, and reports as system
`tunix_beta0`; epsilon 0.2; one iteration per batch), AdamW, and a trivial reward (the fraction of
even token ids in a completion). It runs 1 warm-up step + `--steps` steps. A step is the time
between the ends of consecutive actor updates (it holds the rollout, reference log-probs,
rewards, advantages, update and Tunix's bookkeeping); the breakdown times
`RLCluster.generate` (rollout), `RLCluster.get_ref_per_token_logps` and `RLCluster.update_actor`
(each waited on with `block_until_ready`). Every figure is the best over the timed steps.

Tunix needs a tokenizer; `IdTokenizer` is a real one over the ids themselves (text is the ids in
decimal, space-separated), so prompts go in as exactly the reference ids, with no BOS added.
Last stdout line: `RESULT {json}`.
"""

import argparse
import importlib.metadata
import json
import os
import sys
import time

from flax import nnx
import jax
import numpy as np
import optax
from tunix.generate import sampler as sampler_lib
from tunix.models.qwen3 import model as qwen3_model
from tunix.models.qwen3 import params as qwen3_params
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner
from tunix.rl.rollout import base_rollout

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import reference  # noqa: E402  (benchmarks/reference.py)


class IdTokenizer:
  """Text <-> token ids, where the text is the ids in decimal separated by spaces."""

  def encode(self, text: str, **_) -> list[int]:
    return [int(word) for word in text.split()]

  def decode(self, ids, **_) -> str:
    return " ".join(str(int(i)) for i in ids)

  def bos_id(self):
    return None  # the sampler then prepends nothing

  def eos_id(self) -> int:
    return reference.EOS_ID

  def pad_id(self) -> int:
    return reference.PAD_ID


def tunix_config(model_dir: str) -> qwen3_model.ModelConfig:
  """Tunix's Qwen3 config for the `config.json` in `model_dir`."""
  with open(os.path.join(model_dir, "config.json")) as f:
    hf = json.load(f)
  return qwen3_model.ModelConfig(
      num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"],
      embed_dim=hf["hidden_size"], hidden_dim=hf["intermediate_size"],
      num_heads=hf["num_attention_heads"], head_dim=hf["head_dim"],
      num_kv_heads=hf["num_key_value_heads"], rope_theta=int(reference.SHAPE["rope_theta"]),
      norm_eps=hf["rms_norm_eps"], use_tied_embedding=hf["tie_word_embeddings"])


def load_model(model_dir: str, mesh) -> nnx.Module:
  return qwen3_params.create_model_from_safe_tensors(model_dir, tunix_config(model_dir), mesh)


def prompt_texts(model_dir: str) -> list[str]:
  return [IdTokenizer().decode(p) for p in reference.load_prompts(model_dir)]


def time_sampler(model: nnx.Module, texts: list[str], repeats: int) -> float:
  """Best-of-`repeats` wall seconds of one warm 64 x 128-token sampler call."""
  config = model.config
  sampler = sampler_lib.Sampler(model, IdTokenizer(), sampler_lib.CacheConfig(
      cache_size=reference.PROMPT_LEN + reference.NEW_TOKENS, num_layers=config.num_layers,
      num_kv_heads=config.num_kv_heads, head_dim=config.head_dim))
  batch = [t for t in texts for _ in range(reference.NUM_GENERATIONS)]

  def once() -> float:
    start = time.perf_counter()
    out = sampler(batch, max_generation_steps=reference.NEW_TOKENS,
                  max_prompt_length=reference.PROMPT_LEN, temperature=reference.TEMPERATURE,
                  top_p=1.0, top_k=None, seed=0)
    seconds = time.perf_counter() - start
    assert len(out.tokens) == len(batch)
    return seconds

  once()  # warm-up (compiles)
  return min(once() for _ in range(repeats))


def even_fraction(prompts, completions, **_) -> list[float]:
  """The trivial reward: the fraction of even token ids in each completion."""
  rewards = []
  for text in completions:
    ids = IdTokenizer().encode(text)
    rewards.append(sum(i % 2 == 0 for i in ids) / max(len(ids), 1))
  return rewards


class Timings:
  """Wraps methods of an object so each call's wall time (waited on) is recorded by name."""

  def __init__(self):
    self.seconds: dict[str, list[float]] = {}
    self.ends: list[float] = []

  def wrap(self, obj, method: str, name: str, wait=lambda result: result):
    inner = getattr(obj, method)

    def timed(*args, **kwargs):
      start = time.perf_counter()
      result = inner(*args, **kwargs)
      jax.block_until_ready(wait(result))
      end = time.perf_counter()
      self.seconds.setdefault(name, []).append(end - start)
      if name == "update":
        self.ends.append(end)
      return result

    setattr(obj, method, timed)


def time_grpo(model_dir: str, mesh, texts: list[str], steps: int, beta: float) -> dict:
  """Runs 1 + `steps` GRPO steps; returns the best step time and breakdown in seconds."""
  batch = reference.NUM_PROMPTS  # Tunix counts prompts; each is sampled num_generations times
  rollout_config = base_rollout.RolloutConfig(
      max_tokens_to_generate=reference.NEW_TOKENS, max_prompt_length=reference.PROMPT_LEN,
      kv_cache_size=reference.PROMPT_LEN + reference.NEW_TOKENS,
      temperature=reference.TEMPERATURE, top_p=1.0, top_k=None)
  training_config = rl_cluster_lib.RLTrainingConfig(
      actor_optimizer=optax.adamw(1e-5), eval_every_n_steps=10**6, max_steps=steps + 1,
      mini_batch_size=batch, train_micro_batch_size=batch,
      rollout_micro_batch_size=batch, compute_logps_micro_batch_size=batch)
  roles = (rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE,
           rl_cluster_lib.Role.ROLLOUT)
  cluster = rl_cluster_lib.RLCluster(
      actor=load_model(model_dir, mesh), reference=load_model(model_dir, mesh),
      tokenizer=IdTokenizer(),
      cluster_config=rl_cluster_lib.ClusterConfig(
          role_to_mesh={role: mesh for role in roles}, rollout_engine="vanilla",
          offload_to_cpu=False, training_config=training_config,
          rollout_config=rollout_config))
  learner = grpo_learner.GRPOLearner(
      rl_cluster=cluster, reward_fns=even_fraction,
      algo_config=grpo_learner.GRPOConfig(num_generations=reference.NUM_GENERATIONS,
                                          beta=beta))

  timings = Timings()
  timings.wrap(cluster, "generate", "rollout", wait=lambda out: out.tokens)
  timings.wrap(cluster, "get_ref_per_token_logps", "ref_logprobs")
  timings.wrap(cluster, "update_actor", "update",
               wait=lambda _: nnx.state(cluster.actor_trainer.model))
  learner.train([{"prompts": np.array(texts)}] * (steps + 1))

  step_s = np.diff(timings.ends)  # step i = end of update i - end of update i-1 (i >= 1)
  assert len(step_s) == steps, timings.seconds
  best = lambda name: min(timings.seconds[name][1:])  # the first call compiles
  return {"grpo_step_s": float(step_s.min()), "rollout_s": best("rollout"),
          "ref_logprobs_s": best("ref_logprobs") if "ref_logprobs" in timings.seconds else 0.0,
          "update_s": best("update"), "beta": beta}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", required=True, help="reference dir (benchmarks/reference.py)")
  parser.add_argument("--steps", type=int, default=3, help="timed GRPO steps after the warm-up")
  parser.add_argument("--repeats", type=int, default=3, help="timed sampler calls")
  parser.add_argument("--beta", type=float, default=0.04,
                      help="KL coefficient (Tunix's default 0.04; 0: no reference log-probs)")
  parser.add_argument("--no-sampler", action="store_true", help="time the GRPO step only")
  args = parser.parse_args()

  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  texts = prompt_texts(args.model)
  new_tokens = reference.NUM_PROMPTS * reference.NUM_GENERATIONS * reference.NEW_TOKENS
  sampled = {}
  if not args.no_sampler:
    with jax.set_mesh(mesh):
      sampler_s = time_sampler(load_model(args.model, mesh), texts, args.repeats)
    sampled = {"sampler_tok_s": new_tokens / sampler_s}
  grpo = time_grpo(args.model, mesh, texts, args.steps, args.beta)
  result = {"system": "tunix" if args.beta else "tunix_beta0", **grpo, **sampled,
            "version": importlib.metadata.version("google-tunix")}
  print(f"tunix (beta {args.beta}): GRPO step {grpo['grpo_step_s']:.3f} s (rollout "
        f"{grpo['rollout_s']:.3f}, reference log-probs {grpo['ref_logprobs_s']:.3f}, update "
        f"{grpo['update_s']:.3f})"
        + (f"; sampler {new_tokens} new tokens in {sampler_s:.3f} s" if sampled else ""))
  print("RESULT " + json.dumps(result))


if __name__ == "__main__":
  main()
