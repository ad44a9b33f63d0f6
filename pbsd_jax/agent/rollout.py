"""The multi-turn search agent rollout: the `Rollout` layout and its two compositions.

Token layout (docs/design.md §3, the contract every stage shares): `tokens: i32[B, T]` holds the
prompt region, left-padded to a fixed width P, then the trajectory written contiguously from
column P by a per-row cursor (actions and observations alternating), then right padding.
`action_mask` is True exactly on the tokens the policy sampled (including the tag that ended a
turn and EOS); `turn_ids` is k on the action tokens of turn k and -1 elsewhere.

One turn: decode until `</search>`, `</answer>`, EOS or the per-turn budget; classify the action
from its tokens; a search retrieves top-k documents whose tokens are appended as one
`<information>...</information>` observation in a single batched prefill; an answer or EOS
ends the episode; anything else gets a short notice. After `max_turns`, or when the buffer is
full, the episode ends as truncated. The rules on tokens (`AgentEnv`, `classify_turn`,
`assemble_observation`) are the environment's, in `pbsd_jax.agent.env.agent_env`; this module
drives the sampler through them.

Two compositions of the same jitted pieces (`_act`, `_observe`), one per kind of search
(`pbsd_jax.agent.env.retriever`), and `Agent.rollout`, the one place that picks between them:
  * `ingraph_rollout`: the search is a `DeviceIndex`, so the whole episode, turn loop
    included, is one XLA program;
  * `host_rollout`: a Python turn loop that calls any `Retriever` between the jitted pieces.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding

from pbsd_jax.agent import gold_chain
from pbsd_jax.agent.env import actions, observations, rewards
from pbsd_jax.agent.env.agent_env import (AgentEnv, KIND_ANSWER, KIND_EOS, KIND_SEARCH,
                                          assemble_observation, classify_turn)
from pbsd_jax.agent.env.retriever import DeviceIndex, Document, RetrievalError, Retriever
from pbsd_jax.agent.env.token_text import TokenText, answer_match, classify_bytes, turn_bytes
from pbsd_jax.agent.tokenizer import Tokenizer
from pbsd_jax.generate.sampling import DecodeState, STOP_BUFFER_FULL, Sampler
from pbsd_jax.parallel import sharding

Array = jax.Array


@struct.dataclass
class Rollout:
  """A batch of finished episodes in the shared token layout (see the module docstring).

  Attributes:
    tokens: `i32[B, T]` prompt region `[0, P)`, trajectory from column P, right padding 0.
    action_mask: `bool[B, T]` tokens the policy sampled (or that were forced as its actions).
    turn_ids: `i32[B, T]` turn index on action tokens, -1 elsewhere.
    num_turns: `i32[B]` turns taken.
    length: `i32[B]` end column of each row (its cursor): the trajectory is `[P, length)`.
    prompt_length: `i32[B]` real prompt tokens (the prompt is `[P - prompt_length, P)`).
    finished: `bool[B]` the policy ended the episode (answer or EOS).
    truncated: `bool[B]` ended by `max_turns` or by the context budget.
    group_ids: `i32[B]` which prompt each row samples (rows of a group are consecutive).
    sample_logp: `f32[B, T]` the sampler's log-probs of action tokens (diagnostics only).
    reward: `f32[B]` outcome reward (exact match of the last answer in action tokens).
    searches: `i32[B]` search turns (each one retrieval).
    search_failures: `i32[B]` searches whose retrieval failed (host retrievers only).
    prompt_width: P (static).
    turn_kind: `i32[B, K]` each turn's `agent_env.KIND_*`, -1 for a turn not taken.
    turn_doc: `i32[B, K, top_k]` the documents each search turn showed, best first (corpus
      rows, or a host retriever's numeric document ids), -1 where there is none (a failed
      retrieval, a non-numeric id, a document the observation had no room for).
    turn_label: `i32[B, K]` each turn's `gold_chain.turn_labels` once `label_turns` gave it
      the gold chains, else None.
    turn_value: `f32[B, K]` each turn's `gold_chain.turn_values` (NaN where unlabelled),
      given with `turn_label`.
    routes: `i32[B, T, layers, k]` each token's MoE routes in the sampler (-1 on padding)
      when it recorded them (`Sampler.record_routes`), else None.
  """

  tokens: Array
  action_mask: Array
  turn_ids: Array
  num_turns: Array
  length: Array
  prompt_length: Array
  finished: Array
  truncated: Array
  group_ids: Array
  sample_logp: Array
  reward: Array
  searches: Array
  search_failures: Array
  prompt_width: int = struct.field(pytree_node=False)
  turn_kind: Array | None = None
  turn_doc: Array | None = None
  turn_label: Array | None = None
  turn_value: Array | None = None
  routes: Array | None = None

  @property
  def mask(self) -> Array:
    """`bool[B, T]` real tokens: the prompt's and the trajectory's."""
    return _real_tokens(self)

  @property
  def observation_mask(self) -> Array:
    """`bool[B, T]` environment-written trajectory tokens (never trained on)."""
    return _observation_tokens(self)

  @property
  def num_action_tokens(self) -> Array:
    """`i32[B]` tokens the policy generated."""
    return jnp.sum(self.action_mask, axis=1)


# The masks as one program each: host code (saving, evaluation) reads them outside a jitted step.
@jax.jit
def _real_tokens(rollout: Rollout) -> Array:
  cols = jnp.arange(rollout.tokens.shape[1])[None, :]
  return ((cols >= rollout.prompt_width - rollout.prompt_length[:, None])
          & (cols < rollout.length[:, None]))


@jax.jit
def _observation_tokens(rollout: Rollout) -> Array:
  cols = jnp.arange(rollout.tokens.shape[1])[None, :]
  return _real_tokens(rollout) & (cols >= rollout.prompt_width) & ~rollout.action_mask


@struct.dataclass
class Episode:
  """The turn loop's state.

  Attributes:
    decode: the sampler state (buffer, cache, cursors, next-token logits).
    turn_ids: `i32[B, T]` as in `Rollout`.
    num_turns: `i32[B]` turns taken so far.
    finished: `bool[B]` ended by an answer or EOS.
    truncated: `bool[B]` ended by max_turns or the context budget.
    searches: `i32[B]` search turns so far.
    search_failures: `i32[B]` failed retrievals so far.
    turn_kind, turn_doc: as in `Rollout`.
    reward: `f32[B]` with text tags in-graph, the exact match of the last turn that held an
      answer span so far (`token_text.answer_match`); zeros otherwise.
  """

  decode: DecodeState
  turn_ids: Array
  num_turns: Array
  finished: Array
  truncated: Array
  searches: Array
  search_failures: Array
  turn_kind: Array
  turn_doc: Array
  reward: Array

  @property
  def done(self) -> Array:
    return self.finished | self.truncated


@functools.partial(jax.jit, static_argnums=(0, 1))
def _start(sampler: Sampler, env: AgentEnv, params, prompts: Array, prompt_mask: Array
           ) -> Episode:
  b = prompts.shape[0]
  state = sampler.prefill(params, prompts, prompt_mask, env.buffer_size)
  zeros = jnp.zeros((b,), jnp.int32)
  no_turns = jnp.full((b, env.max_turns), -1, jnp.int32)
  return Episode(decode=state, turn_ids=jnp.full(state.tokens.shape, -1, jnp.int32),
                 num_turns=zeros, finished=zeros.astype(bool),
                 truncated=(state.cursor >= env.buffer_size), searches=zeros,
                 search_failures=zeros, turn_kind=no_turns,
                 turn_doc=jnp.full((b, env.max_turns, env.top_k), -1, jnp.int32),
                 reward=jnp.zeros((b,), jnp.float32))


def _check_text(env: AgentEnv, text: TokenText | None) -> None:
  if env.text_tags and text is None:
    raise ValueError("the protocol tags are several tokens in this vocabulary: pass the "
                     "vocabulary's TokenText (token_text.build) as text=")


def _sample_action(sampler: Sampler, env: AgentEnv, params, ep: Episode, rng: Array,
                   text: TokenText | None) -> tuple[DecodeState, Array]:
  """Each live row's action, decoded until a closing tag, EOS or the turn's budget:
  `(decode state, bool[B] the buffer ran out)`."""
  room = env.buffer_size - ep.decode.cursor
  budget = jnp.minimum(env.max_action_tokens, room)
  stops = (None, text.stops) if env.text_tags else (env.stop_sequences, None)
  state, result = sampler.decode(params, ep.decode, rng, budget, stops[0], ~ep.done, stops[1],
                                 max_steps=env.max_action_tokens, eos_id=env.eos_id)
  return state, result.stop_reason == STOP_BUFFER_FULL


def _replay_action(sampler: Sampler, env: AgentEnv, params, ep: Episode, forced: Array,
                   forced_length: Array) -> tuple[DecodeState, Array]:
  """Each live row's given action (`i32[B, La]` with lengths; an oracle's), written as if
  sampled: `(decode state, bool[B] it did not fit)`."""
  room = env.buffer_size - ep.decode.cursor
  lengths = jnp.where(~ep.done, jnp.minimum(forced_length, room), 0)
  state = sampler.append(params, ep.decode, forced, lengths, as_actions=True)
  return state, forced_length > room


def _read_turn(env: AgentEnv, tokens: Array, start: Array, end: Array,
               text: TokenText | None, gold: Array | None
               ) -> tuple[Array, Array, tuple[Array, Array] | None]:
  """The action in `tokens[:, start:end]`: its kind, its query tokens and, with text tags and
  `gold`, whether it holds an answer span and whether that matches (else None). Single-token
  tags are read on ids (`classify_turn`), multi-token tags on the turn's bytes."""
  if not env.text_tags:
    return (*classify_turn(tokens, start, end, env), None)
  s, n, owner = turn_bytes(tokens, start, end, env.max_action_tokens, text)
  kind, query = classify_bytes(tokens, start, end, env, s, n, owner)
  return kind, query, None if gold is None else answer_match(s, n, gold)


# The host loop's per-turn programs take the episode (its KV cache) as donated: the new
# one is written where the old one was, so a call holds one cache, not two.
@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=3)
def _act(sampler: Sampler, env: AgentEnv, params, ep: Episode, rng: Array, turn: Array,
         forced: Array | None = None, forced_length: Array | None = None,
         text: TokenText | None = None, gold: Array | None = None
         ) -> tuple[Episode, Array, Array]:
  """One turn's action per live row, sampled (`_sample_action`) or replayed
  (`_replay_action`), then read (`_read_turn`) and recorded; with text tags an answer is
  judged against `gold` (`batch.gold_text_batch`) when it is given."""
  live = ~ep.done
  start = ep.decode.cursor
  if forced is None:
    state, out_of_room = _sample_action(sampler, env, params, ep, rng, text)
  else:
    state, out_of_room = _replay_action(sampler, env, params, ep, forced, forced_length)
  end = state.cursor
  kind, query, answer = _read_turn(env, state.tokens, start, end, text, gold)
  reward = ep.reward
  if answer is not None:
    has, correct = answer
    reward = jnp.where(live & has, correct.astype(jnp.float32), reward)
  cols = jnp.arange(env.buffer_size)[None, :]
  this_turn = live[:, None] & (cols >= start[:, None]) & (cols < end[:, None])
  ends_episode = live & ((kind == KIND_ANSWER) | (kind == KIND_EOS))
  ep = ep.replace(reward=reward,
      decode=state, turn_ids=jnp.where(this_turn, turn, ep.turn_ids),
      num_turns=ep.num_turns + live, finished=ep.finished | ends_episode,
      turn_kind=ep.turn_kind.at[:, turn].set(jnp.where(live, kind, -1)),
      truncated=ep.truncated | (live & ~ends_episode & (out_of_room | (end >= env.buffer_size))))
  return ep, jnp.where(live, kind, KIND_EOS), query


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=3)
def _observe(sampler: Sampler, env: AgentEnv, params, ep: Episode, kind: Array, turn: Array,
             doc_tokens: Array, doc_lengths: Array, failed: Array, doc_ids: Array) -> Episode:
  """Appends each live row's observation (documents or the notice) in one batched prefill;
  `doc_ids: i32[B, k]` (-1 for none) are recorded for search turns, each where the
  observation showed at least one of its tokens."""
  live = ~ep.done
  room = env.buffer_size - ep.decode.cursor
  budget = jnp.minimum(env.max_observation_tokens, room)
  info_open, info_close = env.tag_tokens("info_open"), env.tag_tokens("info_close")
  obs, obs_len = assemble_observation(doc_tokens, doc_lengths, budget, info_open, info_close)
  notice = jnp.broadcast_to(jnp.array(env.notice, jnp.int32), (obs.shape[0], len(env.notice)))
  width = max(obs.shape[1], len(env.notice))
  pad = lambda x: jnp.pad(x, [(0, 0), (0, width - x.shape[1])])
  search = kind == KIND_SEARCH
  tokens = jnp.where(search[:, None], pad(obs), pad(notice))
  lengths = jnp.where(search, obs_len, jnp.minimum(len(env.notice), room))
  lengths = jnp.where(live, lengths, 0)
  state = sampler.append(params, ep.decode, tokens, lengths)
  too_small = budget < len(info_open) + len(info_close) + 1
  out_of_room = live & ((state.cursor >= env.buffer_size) | (search & too_small))
  last_turn = live & (turn + 1 >= env.max_turns)
  body = obs_len - len(info_open) - len(info_close)
  first = jnp.cumsum(doc_lengths, axis=1) - doc_lengths  # each document's first body column
  shown = (live & search & ~failed)[:, None] & (doc_lengths > 0) & (first < body[:, None])
  return ep.replace(decode=state, truncated=ep.truncated | out_of_room | last_turn,
                    turn_doc=ep.turn_doc.at[:, turn].set(jnp.where(shown, doc_ids, -1)),
                    searches=ep.searches + (live & search),
                    search_failures=ep.search_failures + (live & search & failed))


def _finish(ep: Episode, prompt_mask: Array, group_ids: Array, reward: Array) -> Rollout:
  state = ep.decode
  return Rollout(tokens=state.tokens, action_mask=state.sampled, turn_ids=ep.turn_ids,
                 num_turns=ep.num_turns, length=state.cursor,
                 prompt_length=jnp.sum(prompt_mask, axis=1).astype(jnp.int32),
                 finished=ep.finished, truncated=ep.truncated & ~ep.finished,
                 group_ids=group_ids, sample_logp=state.sample_logp, reward=reward,
                 searches=ep.searches, search_failures=ep.search_failures,
                 prompt_width=prompt_mask.shape[1], turn_kind=ep.turn_kind,
                 turn_doc=ep.turn_doc, routes=state.routes)


def _group_ids(b: int, group_ids: Array | None) -> Array:
  return jnp.arange(b, dtype=jnp.int32) if group_ids is None else jnp.asarray(group_ids,
                                                                              jnp.int32)


@functools.partial(jax.jit, static_argnums=(0, 1))
def ingraph_rollout(sampler: Sampler, env: AgentEnv, params, prompts: Array,
                    prompt_mask: Array, rng: Array, index: DeviceIndex, gold: Array,
                    group_ids: Array | None = None, forced: Array | None = None,
                    forced_length: Array | None = None, text: TokenText | None = None,
                    prefix_turns: Array | None = None) -> Rollout:
  """The whole multi-turn rollout as one XLA program, retrieving from a device index.

  Args:
    sampler: sampling settings (static).
    env: environment settings (static).
    params: policy parameters.
    prompts: `i32[B, P]` left-padded prompts; `prompt_mask: bool[B, P]`.
    rng: PRNG key (turn k uses `fold_in(rng, k)`).
    index: the `DeviceIndex` searched (`BM25Index` or `SparseBM25Index`).
    gold: `i32[B, G, L]` tokenised gold answers (-1 padded) for the token-level reward;
      with text tags their normalised bytes (`batch.gold_text_batch`) for the text-level one.
    group_ids: `i32[B]` (default: each row its own group).
    forced: optional `i32[max_turns, B, La]` actions to force instead of sampling, with
      `forced_length: i32[max_turns, B]` (for replaying oracle trajectories).
    text: the vocabulary's `TokenText`, needed where the tags are several tokens: turns end
      and are classified on their text, queries are the tokens holding the query's bytes,
      and the reward is the exact match of the last answer span (as `host_rollout`'s).
    prefix_turns: with `forced`, `i32[]`: force only the first `prefix_turns` turns and
      sample the rest (a trajectory's prefix replayed, then continued; `rollout_actions`
      reads a rollout's actions back); None: force every turn.

  Returns:
    A `Rollout`.
  """
  _check_text(env, text)
  ep = _start(sampler, env, params, prompts, prompt_mask)

  def body(carry):
    ep, turn = carry
    act = functools.partial(_act, sampler, env, params, ep, jax.random.fold_in(rng, turn),
                            turn, text=text, gold=gold)
    if forced is None:
      ep, kind, query = act()
    elif prefix_turns is None:
      ep, kind, query = act(forced[turn], forced_length[turn])
    else:
      ep, kind, query = jax.lax.cond(turn < prefix_turns,
                                     lambda: act(forced[turn], forced_length[turn]), act)
    _, doc_ids = index.search(query, env.top_k)
    docs, lengths = index.documents(doc_ids)  # [B, k, L], [B, k]
    ep = _observe(sampler, env, params, ep, kind, turn, docs, lengths,
                  jnp.zeros(kind.shape, bool), doc_ids)
    return ep, turn + 1

  with jax.named_scope("turn_loop"):  # its trip count's name (`hlo_cost`)
    ep, _ = jax.lax.while_loop(lambda c: jnp.any(~c[0].done) & (c[1] < env.max_turns),
                               body, (ep, jnp.int32(0)))
  reward = ep.reward if env.text_tags else rewards.token_answer_reward(
      ep.decode.tokens, ep.decode.sampled, env.answer_open, env.answer_close, gold,
      env.ignore_ids)
  return _finish(ep, prompt_mask, _group_ids(prompts.shape[0], group_ids), reward)


def _document_tokens(doc: Document, encode: Callable[[str], list[int]], limit: int
                     ) -> list[int]:
  """The first `limit` tokens of `doc`'s observation text, without encoding all of a long one.

  Only `limit` tokens of a document can be shown, so a prefix of the text is encoded, doubled
  until it gives more than `limit` tokens (the token at the cut, which a longer text could
  merge differently, is never kept) or is the whole text.
  """
  text = observations.format_document(doc)
  chars = 16 * limit
  while True:
    tokens = encode(text[:chars])
    if len(tokens) > limit or chars >= len(text):
      return tokens[:limit]
    chars *= 2


def _host_retrieve(retriever: Any, queries: list[list[int]], texts: list[str], k: int,
                   limit: int, encode: Callable[[str], list[int]]
                   ) -> tuple[list[list[list[int]]], np.ndarray, bool]:
  """Documents' observation tokens per query (at most `limit` each), their ids
  (`i32[queries, k]`, -1 where an id is not a number or none came back) and whether retrieval
  failed.
  The query is its token ids for a retriever with `retrieve_ids`, else its text."""
  try:
    if hasattr(retriever, "retrieve_ids"):
      results = retriever.retrieve_ids(queries, k)
    else:
      results = retriever.retrieve(texts, k)
  except RetrievalError as err:
    notice = Document(id="", contents=f"Search failed: {err.reason}.", score=0.0)
    failure = [_document_tokens(notice, encode, limit)]
    return [failure for _ in queries], np.full((len(queries), k), -1, np.int32), True
  ids = np.full((len(queries), k), -1, np.int32)
  for q, docs in enumerate(results):
    for i, d in enumerate(docs[:k]):
      ids[q, i] = int(d.id) if str(d.id).isdigit() else -1
  return ([[_document_tokens(d, encode, limit) for d in docs] for docs in results], ids, False)


def _query_text(action_tokens: np.ndarray, decoded_query: str,
                decode: Callable[[Sequence[int]], str]) -> str:
  """The query of a search turn, as `actions.parse_action` reads it from the turn's text
  (the decoded query tokens where it does not read a search: a Unicode space the device rules
  do not count as whitespace)."""
  action = actions.parse_action(decode(action_tokens), max_query_chars=sys.maxsize)
  return action.content if action.kind == actions.SEARCH else decoded_query.strip()


def _pad_docs(docs: list[list[list[int]]], k: int, width: int) -> tuple[np.ndarray, np.ndarray]:
  """`(tokens i32[B, k, width], lengths i32[B, k])`; one width for every turn, so the
  observation program compiles once."""
  tokens = np.full((len(docs), k, width), -1, np.int32)
  lengths = np.zeros((len(docs), k), np.int32)
  for b, row in enumerate(docs):
    for i, d in enumerate(row[:k]):
      tokens[b, i, :len(d)] = d
      lengths[b, i] = len(d)
  return tokens, lengths


@dataclasses.dataclass(frozen=True)
class _OwnRows:
  """The rows of a batch that this process's host turn loop serves: of host arrays, all of
  them; of global arrays whose rows are split over the processes (`sharding.batch_sharding`,
  a multi-process run), its own block (`sharding.process_batch_rows`), read from its own
  shards, of which it builds its part of each array it gives the programs."""

  rows: slice
  mesh: Mesh | None

  @classmethod
  def of(cls, prompts: Array) -> _OwnRows:
    layout = getattr(prompts, "sharding", None)
    if isinstance(layout, NamedSharding):
      return cls(sharding.process_batch_rows(prompts.shape[0], layout.mesh), layout.mesh)
    return cls(slice(0, prompts.shape[0]), None)

  def read(self, tree: Any) -> Any:
    """This process's rows of each array of `tree`, as numpy."""
    if self.mesh is None:
      return jax.tree.map(np.asarray, tree)
    return sharding.process_local_rows(tree, self.mesh)

  def put(self, tree: Any, size: int) -> Any:
    """The batch of `size` rows whose rows here are `tree`'s (host arrays)."""
    return tree if self.mesh is None else sharding.shard_process_local_batch(tree, self.mesh,
                                                                             size)


def host_rollout(sampler: Sampler, env: AgentEnv, params, prompts: Array, prompt_mask: Array,
                 rng: Array, retriever: Retriever, tokenizer: Tokenizer,
                 golden_answers: Sequence[Sequence[str]], group_ids: Array | None = None,
                 forced: Array | None = None, forced_length: Array | None = None) -> Rollout:
  """The same episode as `ingraph_rollout`, with a host turn loop around any `Retriever`.

  Queries go to `retriever.retrieve_ids` when it has one (token-level, e.g. a
  `TokenBM25Retriever`), else to `retrieve` as text: the decoded query tokens, or with text
  tags the query `actions.parse_action` reads from the decoded turn. A `RetrievalError`
  becomes a failure observation and is counted in `Rollout.search_failures`; the episode goes
  on. A document is encoded only as far as an observation can show it
  (`max_observation_tokens` less the tags), so a 10 MB document costs what a short one does.
  The reward is text-level: SQuAD exact match of the last `<answer>` in the decoded action
  tokens. A search's documents are recorded (`Rollout.turn_doc`) where their ids are numbers.
  Arguments as in `ingraph_rollout`, plus the policy's `tokenizer` (its `text` is needed with
  text tags) and the gold answers as strings.

  Given global arrays whose rows are split over processes (a multi-process run), every
  process runs this loop: the programs stay global, and each process reads back its own
  rows' actions, asks its retriever for their queries (one batched call a turn) and builds its
  rows of each observation (`_OwnRows`); no process holds the whole batch.
  """
  text, encode, decode = tokenizer.text, tokenizer.encode, tokenizer.decode
  _check_text(env, text)
  size, own = prompts.shape[0], _OwnRows.of(prompts)
  ep = _start(sampler, env, params, prompts, prompt_mask)
  # The most document tokens an observation shows.
  doc_limit = (env.max_observation_tokens - len(env.tag_tokens("info_open"))
               - len(env.tag_tokens("info_close")))
  for turn in range(env.max_turns):
    if bool(jnp.all(ep.done)):
      break
    f = () if forced is None else (forced[turn], forced_length[turn])
    ep, kind, query = _act(sampler, env, params, ep, jax.random.fold_in(rng, turn),
                           jnp.int32(turn), *f, text=text)
    kind_np, query_np = own.read(kind), own.read(query)
    searching = np.flatnonzero(kind_np == KIND_SEARCH)
    docs: list[list[list[int]]] = [[] for _ in kind_np]
    failed = np.zeros(kind_np.shape, bool)
    doc_ids = np.full((len(kind_np), env.top_k), -1, np.int32)
    if searching.size:
      ids = [[int(t) for t in query_np[i] if t >= 0] for i in searching]
      texts = [decode(q) for q in ids]
      if env.text_tags:
        tokens, turn_ids = own.read(ep.decode.tokens), own.read(ep.turn_ids)
        texts = [_query_text(tokens[i][turn_ids[i] == turn], q, decode)
                 for i, q in zip(searching, texts)]
      got, top, fail = _host_retrieve(retriever, ids, texts, env.top_k, doc_limit, encode)
      for i, row, ids_i in zip(searching, got, top):
        docs[i], doc_ids[i], failed[i] = row, ids_i, fail
    ep = _observe(sampler, env, params, ep, kind, jnp.int32(turn),
                  *own.put((*_pad_docs(docs, env.top_k, doc_limit), failed, doc_ids), size))
  tokens, turn_ids, num_turns = own.read((ep.decode.tokens, ep.turn_ids, ep.num_turns))
  reward = np.zeros(tokens.shape[0], np.float32)
  for b, golds in enumerate(golden_answers[own.rows]):
    segments = [decode(tokens[b][turn_ids[b] == k]) for k in range(num_turns[b])]
    reward[b] = rewards.trajectory_reward(segments, golds)
  return _finish(ep, prompt_mask, _group_ids(size, group_ids), jnp.asarray(own.put(reward, size)))



def rollout_actions(rollout: Rollout, max_turns: int, width: int) -> tuple[np.ndarray,
                                                                           np.ndarray]:
  """A rollout's actions as `ingraph_rollout` forces them: `i32[max_turns, B, width]` tokens
  and `i32[max_turns, B]` lengths (an action longer than `width` is cut)."""
  tokens, turn_ids = np.asarray(rollout.tokens), np.asarray(rollout.turn_ids)
  forced = np.zeros((max_turns, tokens.shape[0], width), np.int32)
  lengths = np.zeros((max_turns, tokens.shape[0]), np.int32)
  for b in range(tokens.shape[0]):
    for k in range(max_turns):
      action = tokens[b][turn_ids[b] == k][:width]
      forced[k, b, :len(action)], lengths[k, b] = action, len(action)
  return forced, lengths


@dataclasses.dataclass(frozen=True, eq=False)
class Agent:
  """What a rollout runs: the sampling settings, the environment's rules, the policy's
  tokenizer and what it searches (a `DeviceIndex` or a host `Retriever`)."""

  sampler: Sampler
  env: AgentEnv
  tokenizer: Tokenizer
  search: DeviceIndex | Retriever

  @property
  def in_graph(self) -> bool:
    """Whether the search runs inside the program (a `DeviceIndex`): the rollout is then one
    XLA program that a jitted step can hold."""
    return isinstance(self.search, DeviceIndex)

  def rollout(self, params, rng: Array, batch: dict, group_ids: Array | None = None,
              golden_answers: Sequence[Sequence[str]] = ()) -> Rollout:
    """A batch of episodes: `ingraph_rollout` over a device index, else `host_rollout`
    (whose text-level reward reads `golden_answers`, the rows' gold answers as strings).

    Args:
      params, rng, group_ids: as in `ingraph_rollout`.
      batch: `prompts`, `prompt_mask` and `gold` (`batch.reward_gold`), optionally
        `gold_docs` (the turns are then labelled, `label_turns`).
      golden_answers: the rows' gold answers as strings (host retrievers).
    """
    if self.in_graph:
      rollout = ingraph_rollout(self.sampler, self.env, params, batch["prompts"],
                                batch["prompt_mask"], rng, self.search, batch["gold"], group_ids,
                                text=self.tokenizer.text)
    else:
      rollout = host_rollout(self.sampler, self.env, params, batch["prompts"],
                             batch["prompt_mask"], rng, self.search, self.tokenizer,
                             golden_answers, group_ids)
    if "gold_docs" in batch:
      rollout = label_turns(rollout, batch["gold_docs"])
    return rollout


@jax.jit
def label_turns(rollout: Rollout, gold_docs: Array) -> Rollout:
  """`rollout` with its turns labelled against the gold chain documents `gold_docs: i32[B, H]`
  (`gold_chain.gold_doc_batch`): `Rollout.turn_label` and `turn_value`, what the
  credit-quality metrics read. One program, also where it is called outside a jitted step."""
  return rollout.replace(
      turn_label=gold_chain.turn_labels(rollout.turn_kind, rollout.turn_doc, gold_docs),
      turn_value=gold_chain.turn_values(rollout.turn_kind, rollout.turn_doc, gold_docs,
                                        rollout.reward, rollout.turn_ids))
