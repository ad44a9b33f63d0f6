"""The search environment's rules on token ids: settings, turn classification, observations.

These are the token-level counterparts of the text protocol: `classify_turn` decides a turn's
action from its tokens as `actions.parse_action` does from its text, and
`assemble_observation` writes the retrieved documents' tokens between the `<information>`
tags as `observations.format_observation` does with text. Both are jittable, so the in-graph
rollout runs them on device; the host rollout runs the same functions. They read tag ids, so
they serve vocabularies whose protocol tags are single tokens (our SentencePiece vocabulary);
where a tag is several tokens (every real tokenizer), `AgentEnv.from_vocab` stores each tag's
token sequence instead, `AgentEnv.text_tags` is True, and turns are ended and classified on
their text (`pbsd_jax.agent.env.token_text`). Observation tags are written as token sequences in
both cases.

`AgentEnv` holds the settings and the token ids, including the end-of-sequence id: the
environment, not the sampler, decides that EOS ends a turn and the episode.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pbsd_jax import protocol
from pbsd_jax.agent.env import observations

Array = jax.Array

# What a turn's action was (`classify_turn`).
KIND_INVALID, KIND_SEARCH, KIND_ANSWER, KIND_EOS = 0, 1, 2, 3

_TAG_FIELDS = ("search_open", "search_close", "answer_open", "answer_close", "info_open",
               "info_close")


def _is_int(value: Any) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


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
    search_open, search_close, answer_open, answer_close, info_open, info_close: tag ids, or
      each tag's token sequence (a tuple) where the tags are several tokens (`text_tags`).
    eos_id: end of sequence; sampling it ends the turn and the episode.
    notice: token ids of the invalid-action notice.
    ignore_ids: ids dropped when comparing answers (whitespace-only pieces).

  Raises:
    ValueError: naming the field as `AgentEnv.<field>` for a value that cannot run.
  """

  buffer_size: int
  max_turns: int
  max_action_tokens: int
  max_observation_tokens: int
  max_query_tokens: int
  top_k: int
  search_open: int | tuple[int, ...]
  search_close: int | tuple[int, ...]
  answer_open: int | tuple[int, ...]
  answer_close: int | tuple[int, ...]
  info_open: int | tuple[int, ...]
  info_close: int | tuple[int, ...]
  eos_id: int
  notice: tuple[int, ...]
  ignore_ids: tuple[int, ...] = ()

  def __post_init__(self):
    for name in ("buffer_size", "max_turns", "max_action_tokens", "max_query_tokens", "top_k"):
      value = getattr(self, name)
      if not _is_int(value) or value < 1:
        raise ValueError(f"AgentEnv.{name} must be an int >= 1, got {value!r}")
    if not _is_int(self.max_observation_tokens) or self.max_observation_tokens < 3:
      raise ValueError("AgentEnv.max_observation_tokens must be an int >= 3 (two tags and a "
                       f"token), got {self.max_observation_tokens!r}")
    seen = {}
    for name in (*_TAG_FIELDS, "eos_id"):
      value = getattr(self, name)
      if name != "eos_id" and isinstance(value, tuple) and value and all(
          _is_int(t) and t >= 0 for t in value):
        continue  # a tag of several tokens: it is matched on text
      if not _is_int(value) or value < 0:
        raise ValueError(f"AgentEnv.{name} must be a token id >= 0, got {value!r}")
      if value in seen:
        raise ValueError(f"AgentEnv.{name} must differ from AgentEnv.{seen[value]}, both are "
                         f"{value}")
      seen[value] = name
    for name in ("notice", "ignore_ids"):
      value = getattr(self, name)
      if not isinstance(value, tuple) or not all(_is_int(t) and t >= 0 for t in value):
        raise ValueError(f"AgentEnv.{name} must be a tuple of token ids (hashable), got "
                         f"{value!r}")
    if not self.notice:
      raise ValueError("AgentEnv.notice must not be empty")
    tags = len(self.tag_tokens("info_open")) + len(self.tag_tokens("info_close"))
    if self.max_observation_tokens < tags + 1:
      raise ValueError(f"AgentEnv.max_observation_tokens must hold the {tags} tokens of the "
                       f"observation tags and one more, got {self.max_observation_tokens}")

  @classmethod
  def from_vocab(cls, vocab: Any, **settings) -> "AgentEnv":
    """Reads the tags from a vocabulary with `encode`/`eos_id`: their ids when every tag is
    one token (whitespace-only `ignore_ids` aside), else their token sequences (`text_tags`)."""
    encoded = {}
    for name, tag in zip(_TAG_FIELDS, (protocol.SEARCH_OPEN, protocol.SEARCH_CLOSE,
                                       protocol.ANSWER_OPEN, protocol.ANSWER_CLOSE,
                                       protocol.INFO_OPEN, protocol.INFO_CLOSE)):
      ids = tuple(int(t) for t in vocab.encode(tag))
      single = [t for t in ids if t not in settings.get("ignore_ids", ())]
      encoded[name] = (ids, single)
    if all(len(single) == 1 for _, single in encoded.values()):
      tags = {name: single[0] for name, (_, single) in encoded.items()}
    else:
      tags = {name: ids for name, (ids, _) in encoded.items()}
    notice = tuple(vocab.encode(observations.INVALID_ACTION_NOTICE))
    return cls(eos_id=vocab.eos_id, notice=notice, **tags, **settings)

  @property
  def text_tags(self) -> bool:
    """The tags are token sequences: turns end and are classified on their text."""
    return any(isinstance(getattr(self, name), tuple) for name in _TAG_FIELDS)

  @property
  def tag_ids(self) -> tuple[int, ...]:
    if self.text_tags:
      raise ValueError("AgentEnv.tag_ids: the tags are several tokens each (text_tags)")
    return tuple(getattr(self, name) for name in _TAG_FIELDS)

  def tag_tokens(self, name: str) -> tuple[int, ...]:
    """A tag's token ids as a sequence (one id where the tags are single tokens)."""
    value = getattr(self, name)
    return value if isinstance(value, tuple) else (value,)

  @property
  def stop_sequences(self) -> Array:
    """`i32[2, 1]`: a turn ends after `</search>` or `</answer>` (or EOS, `eos_id`); with
    `text_tags` the turn's text decides instead (`token_text.TokenText.stops`)."""
    if self.text_tags:
      raise ValueError("AgentEnv.stop_sequences: the tags are several tokens each; stop on "
                       "their text (token_text.TokenText.stops)")
    return jnp.array([[self.search_close], [self.answer_close]], jnp.int32)


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
                         info_open: Sequence[int], info_close: Sequence[int]
                         ) -> tuple[Array, Array]:
  """`<information>` + the documents' tokens, concatenated + `</information>`, per row.

  Args:
    doc_tokens: `i32[B, k, L]` each retrieved document's tokens, best first.
    doc_lengths: `i32[B, k]` real tokens in each.
    budget: `i32[B]` most tokens the observation may take, tags included; the documents are
      truncated so the closing tag always fits (a budget below the two tags and one token
      gives an empty observation).
    info_open, info_close: the tags' token ids (`AgentEnv.tag_tokens`).

  Returns:
    `(obs i32[B, W], length i32[B])` with W = tags + k * L.
  """
  b, k, l = doc_tokens.shape
  lo, lc = len(info_open), len(info_close)
  width = lo + lc + k * l
  ends = jnp.cumsum(doc_lengths, axis=1)  # [B, k]
  body_len = jnp.minimum(ends[:, -1], budget - lo - lc)
  j = jnp.arange(width)[None, :] - lo  # body position of each output column
  doc = jnp.sum(j[:, :, None] >= ends[:, None, :], axis=-1)  # [B, W]
  doc = jnp.minimum(doc, k - 1)
  offset = j - (jnp.take_along_axis(ends, doc, 1) - jnp.take_along_axis(doc_lengths, doc, 1))
  body = doc_tokens[jnp.arange(b)[:, None], doc, jnp.clip(offset, 0, l - 1)]
  opening = jnp.asarray(info_open, jnp.int32)[jnp.clip(j + lo, 0, lo - 1)]
  closing = jnp.asarray(info_close, jnp.int32)[jnp.clip(j - body_len[:, None], 0, lc - 1)]
  obs = jnp.select([j < 0, j < body_len[:, None], j < body_len[:, None] + lc],
                   [opening, body, closing], 0)
  length = jnp.where(budget >= lo + lc + 1, body_len + lo + lc, 0)
  return obs.astype(jnp.int32), length.astype(jnp.int32)
