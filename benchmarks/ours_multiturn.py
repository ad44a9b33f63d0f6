"""Multi-turn rollout cost: time per trajectory token at 1 turn and at `--turns` turns.

`rollout.ingraph_rollout` (one XLA program: turn loop, decode, in-graph BM25 retrieval,
observation appends) on the reference model, 64 rows (8 prompts x 8), over a synthetic corpus
of random-token documents. Two kinds of actions, each turn the same for every row:

  * `sampled`: the policy decodes `--action-tokens` tokens (a random model rarely closes a tag,
    so nearly every turn is an invalid action followed by the notice observation);
  * `forced`: a search action of a document's first tokens is appended (as `sft_sequences`
    replays oracle trajectories), the top-2 documents come back as the observation.

The buffer is sized to the trajectory (prompt width + turns x tokens per turn), so a longer
episode pays for its longer context. Time per trajectory token = wall seconds of the rollout
(prefill included) / trajectory tokens (actions + observations) summed over the rows.

The long-horizon row: sampled actions over `--long-turns` turns (default 64) and over 1 turn,
both in a buffer of `--long-buffer` slots (default 32,768): what a step costs follows what is
filled (decode reads the cache up to the longest filled prefix, appends skip the empty tiles),
not the buffer. `long_cache_read_s_per_token`: the bytes of KV cache its decode steps read (each
sampled token's step reads every slot up to its own), at the read bandwidth measured in the same
run, per trajectory token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import ours_common
from pbsd_jax.agent.env.agent_env import AgentEnv
from pbsd_jax.agent.env.bm25 import BM25Index
from pbsd_jax.agent.rollout import ingraph_rollout
from pbsd_jax.generate.sampling import Sampler

# Synthetic protocol ids below the prompts' range [10, V): tags, EOS, the notice.
TAGS = dict(search_open=1, search_close=2, answer_open=3, answer_close=4, info_open=5,
            info_close=6, eos_id=7)
NOTICE = (8, 9)
DOCS, DOC_LEN, QUERY_LEN, TOP_K = 512, 24, 4, 2


def corpus(vocab_size: int) -> np.ndarray:
  """`i32[DOCS, DOC_LEN]` seeded random documents of ids in [10, V)."""
  return np.random.default_rng(1).integers(10, vocab_size, (DOCS, DOC_LEN), dtype=np.int32)


def forced_searches(docs: np.ndarray, turns: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
  """`(i32[turns, rows, La], i32[turns, rows])`: `<search> first tokens of a doc </search>`."""
  pick = np.random.default_rng(2).integers(0, len(docs), (turns, rows))
  query = docs[pick][..., :QUERY_LEN]
  ends = np.broadcast_to(np.int32(TAGS["search_open"]), (turns, rows, 1))
  closes = np.broadcast_to(np.int32(TAGS["search_close"]), (turns, rows, 1))
  actions = np.concatenate([ends, query, closes], axis=-1).astype(np.int32)
  return actions, np.full((turns, rows), actions.shape[-1], np.int32)


def time_per_token(config, params, prompts, index, docs, turns: int, kind: str, args,
                   buffer: int = 0) -> dict:
  """Best wall seconds of one rollout of `turns` turns and its seconds per trajectory token,
  in a buffer of `buffer` slots (0: the trajectory's size)."""
  b, p = prompts.shape
  action = args.action_tokens if kind == "sampled" else QUERY_LEN + 2
  observation = len(NOTICE) if kind == "sampled" else TOP_K * DOC_LEN + 2
  env = AgentEnv(buffer_size=buffer or p + turns * (action + observation), max_turns=turns,
                 max_action_tokens=action, max_observation_tokens=TOP_K * DOC_LEN + 2,
                 max_query_tokens=QUERY_LEN, top_k=TOP_K, notice=NOTICE, **TAGS)
  sampler = Sampler(config, temperature=1.0)
  mask = jnp.ones(prompts.shape, bool)
  gold = jnp.full((b, 1, 1), -1, jnp.int32)
  forced = (None, None) if kind == "sampled" else tuple(
      map(jnp.asarray, forced_searches(docs, turns, b)))

  def rollout():
    return ingraph_rollout(sampler, env, params, prompts, mask, jax.random.key(0), index, gold,
                           None, *forced)

  seconds, out = ours_common.best_of(rollout, args.repeats)
  # A sampled row may end early (it drew EOS or closed a tag): count what was written.
  tokens = int(jnp.sum(out.length - p))
  # What the decode steps read of the KV cache: each sampled token's step reads every slot up
  # to its own (all real here), both keys and values of every layer.
  slots_read = int(jnp.sum(jnp.where(out.action_mask, jnp.arange(out.tokens.shape[1]) + 1, 0)))
  slot_bytes = (2 * config.num_layers * config.num_kv_heads * config.resolved_head_dim
                * jnp.dtype(config.jnp_cache_dtype).itemsize)
  return {"seconds": seconds, "tokens": tokens, "s_per_token": seconds / tokens,
          "buffer": env.buffer_size, "cache_bytes_read": slots_read * slot_bytes}


def main():
  p = ours_common.parser(__doc__)
  p.add_argument("--turns", type=int, default=8)
  p.add_argument("--group", type=int, default=8)
  p.add_argument("--action-tokens", type=int, default=32, help="sampled tokens per turn")
  p.add_argument("--long-turns", type=int, default=64)
  p.add_argument("--long-buffer", type=int, default=32_768, help="0: skip the long row")
  args = p.parse_args()
  config, params = ours_common.load_model(args)
  prompts = jnp.asarray(np.repeat(ours_common.load_prompts(args, config), args.group, axis=0))
  docs = corpus(config.vocab_size)
  index = BM25Index.build(list(docs), config.vocab_size, ignore_ids=range(10))
  result = {}
  for kind in ("sampled", "forced"):
    one = time_per_token(config, params, prompts, index, docs, 1, kind, args)
    many = time_per_token(config, params, prompts, index, docs, args.turns, kind, args)
    result[f"multiturn_{kind}"] = {"1": one, str(args.turns): many,
                                   "ratio": many["s_per_token"] / one["s_per_token"]}
  # The headline figures: sampled actions (the decode loop is the rollout's hot path).
  sampled = result["multiturn_sampled"]
  result.update(s_per_token_1turn=sampled["1"]["s_per_token"],
                s_per_token_8turn=sampled[str(args.turns)]["s_per_token"], turns=args.turns)
  if args.long_buffer:
    one, many = (time_per_token(config, params, prompts, index, docs, turns, "sampled", args,
                                args.long_buffer) for turns in (1, args.long_turns))
    result.update(long_multiturn={"1": one, str(args.long_turns): many},
                  long_s_per_token_1turn=one["s_per_token"],
                  long_s_per_token_many=many["s_per_token"], long_turns=args.long_turns,
                  long_buffer=args.long_buffer, long_turns_tokens=many["tokens"],
                  read_bytes_s=ours_common.read_bandwidth())
    # The cache reads alone at the read bandwidth, per trajectory token: a bound under the
    # long episode's time per token that no decode kernel moves.
    result["long_cache_read_s_per_token"] = (many["cache_bytes_read"] / result["read_bytes_s"]
                                             / many["tokens"])
  ours_common.emit(result)


if __name__ == "__main__":
  main()
