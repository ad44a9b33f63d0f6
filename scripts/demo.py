"""The embedded demo (`make demo`).

Until the training stage lands (issue "Training: ... the end-to-end demo"), this runs the part
of the pipeline that exists, end to end, and says so: it generates the synthetic knowledge
graph and its vocabulary, builds the in-graph BM25 retriever, replays oracle trajectories
through the environment (checking they score), and samples multi-turn rollouts from a random
tiny transformer in one jitted program.
"""

import json
import os
import time

from absl import app
from absl import flags

_WORKDIR = flags.DEFINE_string("workdir", "workdir/demo", "Where data and reports go.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the world, the model and the sampler.")


def main(argv):
  del argv
  import jax
  import jax.numpy as jnp

  from pbsd_jax import vocab as vocab_lib
  from pbsd_jax.batch import forced_batch, gold_batch, prompt_batch
  from pbsd_jax.data.build import make_dataset
  from pbsd_jax.env.token_retriever import TokenBM25Retriever
  from pbsd_jax.models import ModelConfig, init_params
  from pbsd_jax.rollout import AgentEnv, host_rollout, ingraph_rollout
  from pbsd_jax.sampling import Sampler

  start = time.time()
  paths = make_dataset(os.path.join(_WORKDIR.value, "data"), seed=_SEED.value)
  vocab = vocab_lib.sentencepiece_vocabulary(paths["spm_model"])
  encode = lambda s: list(vocab.encode(s))
  decode = lambda ids: vocab.decode([int(i) for i in ids])
  with open(paths["corpus"]) as f:
    corpus = [json.loads(line) for line in f]
  retriever = TokenBM25Retriever.from_texts(
      [d["contents"] for d in corpus], encode, vocab.vocab_size, ids=[d["id"] for d in corpus],
      ignore_ids=vocab_lib.non_term_ids(vocab))
  print(f"data: {len(corpus)} documents, vocabulary {vocab.vocab_size} "
        f"({time.time() - start:.1f}s) in {paths['corpus']}")

  with open(paths["sft"]) as f:
    sft = [json.loads(line) for line in f][:16]
  env = AgentEnv.from_vocab(vocab, buffer_size=720, max_turns=6, max_action_tokens=40,
                            max_observation_tokens=160, max_query_tokens=16, top_k=3,
                            ignore_ids=vocab_lib.whitespace_ids(vocab))
  config = ModelConfig(vocab_size=vocab.vocab_size, hidden_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, mlp_dim=128)
  params = init_params(config, jax.random.key(_SEED.value))
  sampler = Sampler(config, eos_id=vocab.eos_id)
  tokens, mask = prompt_batch([r["question"] for r in sft], encode, 40)
  forced, lengths = forced_batch([r["actions"] for r in sft], encode, env.max_turns,
                                 env.max_action_tokens)
  golds = [r["golden_answers"] for r in sft]
  oracle = host_rollout(sampler, env, params, tokens, mask, jax.random.key(0), retriever,
                        encode, decode, golds, None, jnp.asarray(forced), jnp.asarray(lengths))
  print(f"oracle replay through the environment: accuracy {float(oracle.reward.mean()):.0%}, "
        f"mean turns {float(oracle.num_turns.mean()):.1f}")

  gold = gold_batch(golds, encode, 12)
  t = time.time()
  out = jax.block_until_ready(ingraph_rollout(sampler, env, params, tokens, mask,
                                              jax.random.key(1), retriever.index,
                                              jnp.asarray(gold)))
  print(f"random tiny model, in-graph rollout (one jit, compile included, {time.time() - t:.1f}s):"
        f" accuracy {float(out.reward.mean()):.0%}, mean turns {float(out.num_turns.mean()):.1f},"
        f" mean action tokens {float(out.num_action_tokens.mean()):.0f}")
  print("demo: SFT and PBSD RL stages are not built yet (training issue); ran data + "
        "environment + sampler only.")


if __name__ == "__main__":
  app.run(main)
