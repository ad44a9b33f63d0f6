"""The multi-turn search agent rollout: the `Rollout` layout and its two compositions.

Token layout (DESIGN.md §3, the contract every stage shares): `tokens: i32[B, T]` holds the
prompt region, left-padded to a fixed width P, then the trajectory written contiguously from
column P by a per-row cursor (actions and observations alternating), then right padding.
`action_mask` is True exactly on the tokens the policy sampled (including the tag that ended a
turn and EOS); `turn_ids` is k on the action tokens of turn k and -1 elsewhere.

One turn: decode until `</search>`, `</answer>`, EOS or the per-turn budget; classify the action
from its tokens (`classify_turn`); a search retrieves top-k documents whose tokens are appended
as one `<information>...</information>` observation in a single batched prefill; an answer or
EOS ends the episode; anything else gets a short notice. After `max_turns`, or when the
buffer is full, the episode ends as truncated.

Two compositions of the same jitted pieces (`_act`, `_observe`):
  * `ingraph_rollout`: the retriever is a device-resident `BM25Index`, so the whole episode,
    turn loop included, is one XLA program;
  * `host_rollout`: a Python turn loop that calls any `Retriever` between the jitted pieces.
Both need the protocol tags to be single tokens (true for our SentencePiece vocabulary).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pbsd_jax import rewards
from pbsd_jax.env import observations, protocol
from pbsd_jax.env.bm25 import BM25Index
from pbsd_jax.env.retriever import Document, RetrievalError
from pbsd_jax.sampling import DecodeState, Sampler, STOP_BUFFER_FULL

Array = jax.Array

# What a turn's action was (`classify_turn`).
KIND_INVALID, KIND_SEARCH, KIND_ANSWER, KIND_EOS = 0, 1, 2, 3


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
    search_failures: `i32[B]` searches whose retrieval failed (host retrievers only).
    prompt_width: P (static).
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
  search_failures: Array
  prompt_width: int = struct.field(pytree_node=False)

  @property
  def mask(self) -> Array:
    """`bool[B, T]` real tokens: the prompt's and the trajectory's."""
    cols = jnp.arange(self.tokens.shape[1])[None, :]
    return ((cols >= self.prompt_width - self.prompt_length[:, None])
            & (cols < self.length[:, None]))

  @property
  def observation_mask(self) -> Array:
    """`bool[B, T]` environment-written trajectory tokens (never trained on)."""
    cols = jnp.arange(self.tokens.shape[1])[None, :]
    return self.mask & (cols >= self.prompt_width) & ~self.action_mask

  @property
  def num_action_tokens(self) -> Array:
    """`i32[B]` tokens the policy generated."""
    return jnp.sum(self.action_mask, axis=1)


@dataclasses.dataclass(frozen=True)
class AgentEnv:
  """Static settings of the search environment (hashable: a static jit argument).

  Attributes:
    buffer_size: T, the whole context (prompt region + trajectory).
    max_turns: turns before an episode ends as truncated.
    max_action_tokens: per-turn generation budget.
    max_observation_tokens: an observation's budget, its two tags included.
    max_query_tokens: longer queries are invalid actions.
    top_k: documents per search.
    search_open, search_close, answer_open, answer_close, info_open, info_close: tag ids.
    eos_id: end of sequence.
    notice: token ids of the invalid-action notice.
    ignore_ids: ids dropped when comparing answers (whitespace-only pieces).
  """

  buffer_size: int
  max_turns: int
  max_action_tokens: int
  max_observation_tokens: int
  max_query_tokens: int
  top_k: int
  search_open: int
  search_close: int
  answer_open: int
  answer_close: int
  info_open: int
  info_close: int
  eos_id: int
  notice: tuple[int, ...]
  ignore_ids: tuple[int, ...] = ()

  def __post_init__(self):
    for name in ("buffer_size", "max_turns", "max_action_tokens", "max_query_tokens", "top_k"):
      if getattr(self, name) < 1:
        raise ValueError(f"AgentEnv.{name} must be >= 1, got {getattr(self, name)}")
    if self.max_observation_tokens < 3:
      raise ValueError("AgentEnv.max_observation_tokens must be >= 3 (two tags and a token), "
                       f"got {self.max_observation_tokens}")
    if not self.notice:
      raise ValueError("AgentEnv.notice must not be empty")

  @classmethod
  def from_vocab(cls, vocab: Any, **settings) -> "AgentEnv":
    """Reads the tag ids from a vocabulary with `encode`/`eos_id`; tags must be single tokens."""
    ids = {}
    for name, tag in [("search_open", protocol.SEARCH_OPEN), ("search_close", protocol.SEARCH_CLOSE),
                      ("answer_open", protocol.ANSWER_OPEN), ("answer_close", protocol.ANSWER_CLOSE),
                      ("info_open", protocol.INFO_OPEN), ("info_close", protocol.INFO_CLOSE)]:
      encoded = [t for t in vocab.encode(tag) if t not in settings.get("ignore_ids", ())]
      if len(encoded) != 1:
        raise ValueError(f"tag {tag!r} is {len(encoded)} tokens {encoded} in this vocabulary; "
                         "the rollout needs single-token tags")
      ids[name] = encoded[0]
    notice = tuple(vocab.encode(observations.INVALID_ACTION_NOTICE))
    return cls(eos_id=vocab.eos_id, notice=notice, **ids, **settings)

  @property
  def tag_ids(self) -> tuple[int, ...]:
    return (self.search_open, self.search_close, self.answer_open, self.answer_close,
            self.info_open, self.info_close)

  @property
  def stop_sequences(self) -> Array:
    """`i32[2, 1]`: a turn ends after `</search>` or `</answer>`."""
    return jnp.array([[self.search_close], [self.answer_close]], jnp.int32)


@struct.dataclass
class Episode:
  """The turn loop's state.

  Attributes:
    decode: the sampler state (buffer, cache, cursors, next-token logits).
    turn_ids: `i32[B, T]` as in `Rollout`.
    num_turns: `i32[B]` turns taken so far.
    finished: `bool[B]` ended by an answer or EOS.
    truncated: `bool[B]` ended by max_turns or the context budget.
    search_failures: `i32[B]` failed retrievals so far.
  """

  decode: DecodeState
  turn_ids: Array
  num_turns: Array
  finished: Array
  truncated: Array
  search_failures: Array

  @property
  def done(self) -> Array:
    return self.finished | self.truncated


def classify_turn(tokens: Array, start: Array, end: Array, env: AgentEnv
                  ) -> tuple[Array, Array]:
  """Decides each row's action from the tokens of its turn, `tokens[b, start[b]:end[b]]`.

  The turn's last token decides, as `env.actions.parse_action` does on text: `</search>` with
  a `<search>` before it is a search whose query is the tokens after the last `<search>`
  (invalid if empty, longer than `max_query_tokens`, or holding a tag); `</answer>` with an
  `<answer>` before it is an answer; EOS ends the episode; anything else is invalid.

  Args:
    tokens: `i32[B, T]` the buffer.
    start: `i32[B]` first column of the turn's action.
    end: `i32[B]` one past its last column.
    env: the environment settings.

  Returns:
    `(kind i32[B], query i32[B, max_query_tokens])`, the query -1 padded.
  """
  b, t = tokens.shape
  cols = jnp.arange(t)[None, :]
  in_turn = (cols >= start[:, None]) & (cols < end[:, None])
  last = jnp.take_along_axis(tokens, jnp.maximum(end - 1, 0)[:, None], 1)[:, 0]
  last = jnp.where(end > start, last, -1)
  before_last = in_turn & (cols < end[:, None] - 1)

  def last_index(tag):
    return jnp.max(jnp.where(before_last & (tokens == tag), cols, -1), axis=1)

  open_search, open_answer = last_index(env.search_open), last_index(env.answer_open)
  q_len = end - 1 - (open_search + 1)
  q_cols = open_search[:, None] + 1 + jnp.arange(env.max_query_tokens)[None, :]
  q_valid = jnp.arange(env.max_query_tokens)[None, :] < q_len[:, None]
  query = jnp.where(q_valid, jnp.take_along_axis(tokens, jnp.clip(q_cols, 0, t - 1), 1), -1)
  has_tag = jnp.any(jnp.isin(query, jnp.array(env.tag_ids)), axis=1)
  good_search = ((last == env.search_close) & (open_search >= 0) & (q_len >= 1)
                 & (q_len <= env.max_query_tokens) & ~has_tag)
  kind = jnp.select([good_search, (last == env.answer_close) & (open_answer >= 0),
                     last == env.eos_id], [KIND_SEARCH, KIND_ANSWER, KIND_EOS], KIND_INVALID)
  return kind.astype(jnp.int32), query.astype(jnp.int32)


def assemble_observation(doc_tokens: Array, doc_lengths: Array, budget: Array,
                         info_open: int, info_close: int) -> tuple[Array, Array]:
  """`<information>` + the documents' tokens, concatenated + `</information>`, per row.

  Args:
    doc_tokens: `i32[B, k, L]` each retrieved document's tokens, best first.
    doc_lengths: `i32[B, k]` real tokens in each.
    budget: `i32[B]` most tokens the observation may take, tags included; the documents are
      truncated so the closing tag always fits (a budget below 3 gives an empty observation).

  Returns:
    `(obs i32[B, W], length i32[B])` with W = 2 + k * L.
  """
  b, k, l = doc_tokens.shape
  width = 2 + k * l
  ends = jnp.cumsum(doc_lengths, axis=1)  # [B, k]
  body_len = jnp.minimum(ends[:, -1], budget - 2)
  j = jnp.arange(width)[None, :] - 1  # body position of each output column
  doc = jnp.sum(j[:, :, None] >= ends[:, None, :], axis=-1)  # [B, W]
  doc = jnp.minimum(doc, k - 1)
  offset = j - (jnp.take_along_axis(ends, doc, 1) - jnp.take_along_axis(doc_lengths, doc, 1))
  body = doc_tokens[jnp.arange(b)[:, None], doc, jnp.clip(offset, 0, l - 1)]
  obs = jnp.select([j == -1, j < body_len[:, None], j == body_len[:, None]],
                   [info_open, body, info_close], 0)
  length = jnp.where(budget >= 3, body_len + 2, 0)
  return obs.astype(jnp.int32), length.astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _start(sampler: Sampler, env: AgentEnv, params, prompts: Array, prompt_mask: Array
           ) -> Episode:
  b = prompts.shape[0]
  state = sampler.prefill(params, prompts, prompt_mask, env.buffer_size)
  zeros = jnp.zeros((b,), jnp.int32)
  return Episode(decode=state, turn_ids=jnp.full(state.tokens.shape, -1, jnp.int32),
                 num_turns=zeros, finished=zeros.astype(bool),
                 truncated=(state.cursor >= env.buffer_size), search_failures=zeros)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _act(sampler: Sampler, env: AgentEnv, params, ep: Episode, rng: Array, turn: Array,
         forced: Array | None = None, forced_length: Array | None = None
         ) -> tuple[Episode, Array, Array]:
  """One action per live row, sampled (or forced: `i32[B, La]` with lengths), classified."""
  live = ~ep.done
  state = ep.decode
  start = state.cursor
  room = env.buffer_size - start
  if forced is None:
    budget = jnp.minimum(env.max_action_tokens, room)
    state, result = sampler.decode(params, state, rng, budget, env.stop_sequences, live,
                                   max_steps=env.max_action_tokens)
    out_of_room = result.stop_reason == STOP_BUFFER_FULL
  else:
    lengths = jnp.where(live, jnp.minimum(forced_length, room), 0)
    state = sampler.append(params, state, forced, lengths, as_actions=True)
    out_of_room = forced_length > room
  end = state.cursor
  cols = jnp.arange(env.buffer_size)[None, :]
  this_turn = live[:, None] & (cols >= start[:, None]) & (cols < end[:, None])
  kind, query = classify_turn(state.tokens, start, end, env)
  ends_episode = live & ((kind == KIND_ANSWER) | (kind == KIND_EOS))
  ep = ep.replace(
      decode=state, turn_ids=jnp.where(this_turn, turn, ep.turn_ids),
      num_turns=ep.num_turns + live, finished=ep.finished | ends_episode,
      truncated=ep.truncated | (live & ~ends_episode & (out_of_room | (end >= env.buffer_size))))
  return ep, jnp.where(live, kind, KIND_EOS), query


@functools.partial(jax.jit, static_argnums=(0, 1))
def _observe(sampler: Sampler, env: AgentEnv, params, ep: Episode, kind: Array, turn: Array,
             doc_tokens: Array, doc_lengths: Array, failed: Array) -> Episode:
  """Appends each live row's observation (documents or the notice) in one batched prefill."""
  live = ~ep.done
  room = env.buffer_size - ep.decode.cursor
  budget = jnp.minimum(env.max_observation_tokens, room)
  obs, obs_len = assemble_observation(doc_tokens, doc_lengths, budget, env.info_open,
                                      env.info_close)
  notice = jnp.broadcast_to(jnp.array(env.notice, jnp.int32), (obs.shape[0], len(env.notice)))
  width = max(obs.shape[1], len(env.notice))
  pad = lambda x: jnp.pad(x, [(0, 0), (0, width - x.shape[1])])
  search = kind == KIND_SEARCH
  tokens = jnp.where(search[:, None], pad(obs), pad(notice))
  lengths = jnp.where(search, obs_len, jnp.minimum(len(env.notice), room))
  lengths = jnp.where(live, lengths, 0)
  state = sampler.append(params, ep.decode, tokens, lengths)
  out_of_room = live & ((state.cursor >= env.buffer_size) | (search & (budget < 3)))
  last_turn = live & (turn + 1 >= env.max_turns)
  return ep.replace(decode=state, truncated=ep.truncated | out_of_room | last_turn,
                    search_failures=ep.search_failures + (live & search & failed))


def _finish(ep: Episode, prompt_mask: Array, group_ids: Array, reward: Array) -> Rollout:
  state = ep.decode
  return Rollout(tokens=state.tokens, action_mask=state.sampled, turn_ids=ep.turn_ids,
                 num_turns=ep.num_turns, length=state.cursor,
                 prompt_length=jnp.sum(prompt_mask, axis=1).astype(jnp.int32),
                 finished=ep.finished, truncated=ep.truncated & ~ep.finished,
                 group_ids=group_ids, sample_logp=state.sample_logp, reward=reward,
                 search_failures=ep.search_failures, prompt_width=prompt_mask.shape[1])


def _group_ids(b: int, group_ids: Array | None) -> Array:
  return jnp.arange(b, dtype=jnp.int32) if group_ids is None else jnp.asarray(group_ids,
                                                                              jnp.int32)


@functools.partial(jax.jit, static_argnums=(0, 1))
def ingraph_rollout(sampler: Sampler, env: AgentEnv, params, prompts: Array,
                    prompt_mask: Array, rng: Array, index: BM25Index, gold: Array,
                    group_ids: Array | None = None, forced: Array | None = None,
                    forced_length: Array | None = None) -> Rollout:
  """The whole multi-turn rollout as one XLA program, retrieving from a `BM25Index`.

  Args:
    sampler: sampling settings (static).
    env: environment settings (static).
    params: policy parameters.
    prompts: `i32[B, P]` left-padded prompts; `prompt_mask: bool[B, P]`.
    rng: PRNG key (turn k uses `fold_in(rng, k)`).
    index: the device-resident BM25 index.
    gold: `i32[B, G, L]` tokenised gold answers (-1 padded) for the token-level reward.
    group_ids: `i32[B]` (default: each row its own group).
    forced: optional `i32[max_turns, B, La]` actions to force instead of sampling, with
      `forced_length: i32[max_turns, B]` (for replaying oracle trajectories).

  Returns:
    A `Rollout`.
  """
  ep = _start(sampler, env, params, prompts, prompt_mask)

  def body(carry):
    ep, turn = carry
    f = None if forced is None else (forced[turn], forced_length[turn])
    ep, kind, query = _act(sampler, env, params, ep, jax.random.fold_in(rng, turn), turn,
                           *(f or ()))
    _, doc_ids = index.search(query, env.top_k)
    docs = index.doc_tokens[doc_ids]  # [B, k, L]
    ep = _observe(sampler, env, params, ep, kind, turn, docs, index.doc_lengths[doc_ids],
                  jnp.zeros(kind.shape, bool))
    return ep, turn + 1

  ep, _ = jax.lax.while_loop(lambda c: jnp.any(~c[0].done) & (c[1] < env.max_turns), body,
                             (ep, jnp.int32(0)))
  reward = rewards.token_answer_reward(ep.decode.tokens, ep.decode.sampled, env.answer_open,
                                       env.answer_close, gold, env.ignore_ids)
  return _finish(ep, prompt_mask, _group_ids(prompts.shape[0], group_ids), reward)


def _host_retrieve(retriever: Any, queries: list[list[int]], k: int,
                   encode: Callable[[str], list[int]], decode: Callable[[Sequence[int]], str]
                   ) -> tuple[list[list[list[int]]], bool]:
  """Documents' observation tokens per query, and whether retrieval failed."""
  try:
    if hasattr(retriever, "retrieve_ids"):
      results = retriever.retrieve_ids(queries, k)
    else:
      results = retriever.retrieve([decode(q) for q in queries], k)
  except RetrievalError as err:
    notice = Document(id="", contents=f"Search failed: {err.reason}.", score=0.0)
    return [[encode(observations.format_document(notice))] for _ in queries], True
  return [[encode(observations.format_document(d)) for d in docs] for docs in results], False


def _pad_docs(docs: list[list[list[int]]], k: int) -> tuple[np.ndarray, np.ndarray]:
  width = max([1] + [len(d) for row in docs for d in row])
  tokens = np.full((len(docs), k, width), -1, np.int32)
  lengths = np.zeros((len(docs), k), np.int32)
  for b, row in enumerate(docs):
    for i, d in enumerate(row[:k]):
      tokens[b, i, :len(d)] = d
      lengths[b, i] = len(d)
  return tokens, lengths


def host_rollout(sampler: Sampler, env: AgentEnv, params, prompts: Array, prompt_mask: Array,
                 rng: Array, retriever: Any, encode: Callable[[str], list[int]],
                 decode: Callable[[Sequence[int]], str], golden_answers: Sequence[Sequence[str]],
                 group_ids: Array | None = None, forced: Array | None = None,
                 forced_length: Array | None = None) -> Rollout:
  """The same episode as `ingraph_rollout`, with a host turn loop around any `Retriever`.

  Queries go to `retriever.retrieve_ids` when it has one (token-level, e.g. a
  `TokenBM25Retriever`), else to `retrieve` as decoded text. A `RetrievalError` becomes a
  failure observation and is counted in `Rollout.search_failures`; the episode goes on. The
  reward is text-level: SQuAD exact match of the last `<answer>` in the decoded action tokens.
  Arguments as in `ingraph_rollout`, plus `encode`/`decode` (the policy's tokenizer) and the
  gold answers as strings.
  """
  ep = _start(sampler, env, params, prompts, prompt_mask)
  for turn in range(env.max_turns):
    if bool(jnp.all(ep.done)):
      break
    f = () if forced is None else (forced[turn], forced_length[turn])
    ep, kind, query = _act(sampler, env, params, ep, jax.random.fold_in(rng, turn),
                           jnp.int32(turn), *f)
    kind_np, query_np = np.asarray(kind), np.asarray(query)
    searching = np.flatnonzero(kind_np == KIND_SEARCH)
    docs: list[list[list[int]]] = [[] for _ in kind_np]
    failed = np.zeros(kind_np.shape, bool)
    if searching.size:
      got, fail = _host_retrieve(retriever, [[int(t) for t in query_np[i] if t >= 0]
                                             for i in searching], env.top_k, encode, decode)
      for i, row in zip(searching, got):
        docs[i], failed[i] = row, fail
    doc_tokens, doc_lengths = _pad_docs(docs, env.top_k)
    ep = _observe(sampler, env, params, ep, kind, jnp.int32(turn), doc_tokens, doc_lengths,
                  failed)
  tokens = np.asarray(ep.decode.tokens)
  turn_ids = np.asarray(ep.turn_ids)
  reward = np.zeros(tokens.shape[0], np.float32)
  for b, golds in enumerate(golden_answers):
    segments = [decode(tokens[b][turn_ids[b] == k]) for k in range(int(ep.num_turns[b]))]
    reward[b] = rewards.trajectory_reward(segments, golds)
  return _finish(ep, prompt_mask, _group_ids(prompts.shape[0], group_ids), jnp.asarray(reward))
