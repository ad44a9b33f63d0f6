"""The protocol on the text of the tokens, for vocabularies whose tags are several tokens.

A real tokenizer writes `</search>` as `</`, `search`, `>` or merges its end with what follows,
so no token id names a tag. The rollout then works on bytes, on device:
  * a turn ends when its text first contains `</search>` or `</answer>`: the stop-string
    automata of `pbsd_jax.generate.stop_strings`, one table lookup per sampled token;
  * `classify_text_turn` lays the turn's tokens out as their bytes (`TokenText.bytes`, each
    token's text as the tokenizer decodes it) and applies `env.actions.parse_action`'s rules to
    them: the text, trailing whitespace aside, ends with the closing tag; the query is the text
    between the last opening tag before it and the closing tag, stripped, non-empty and free of
    protocol tags.

The query reaches a host retriever as text (`parse_action` of the decoded turn). Its token ids
(`classify_text_turn`'s `query`) are the tokens that hold a byte of the stripped query, so a
token that merges the opening tag with the query's first word is part of it.

Whitespace is the one-byte characters `str.isspace` accepts; a multi-byte Unicode space
(U+00A0, U+2000...) at the end of a turn is text here and whitespace to `parse_action`.
"""

from __future__ import annotations

import string
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pbsd_jax import protocol
from pbsd_jax.agent.env import rewards
from pbsd_jax.generate import stop_strings

Array = jax.Array

WHITESPACE = (9, 10, 11, 12, 13, 28, 29, 30, 31, 32)


@struct.dataclass
class TokenText:
  """A vocabulary's text on device.

  Attributes:
    bytes: `u8[V, W]` each token's bytes, 0 padded; W the longest token's byte length.
    length: `i32[V]` each token's byte length (0 for the end-of-sequence and pad ids, which
      decoding drops).
    stops: the automata of `protocol.STOP_TAGS` (`stop_strings.build`).
  """

  bytes: Array
  length: Array
  stops: stop_strings.StopStrings


def build(token_bytes: Sequence[bytes], silent_ids: Sequence[int] = ()) -> TokenText:
  """The `TokenText` of a vocabulary whose token i appends `token_bytes[i]` to the text;
  `silent_ids` (EOS, pad) append nothing."""
  token_bytes = [b"" if i in set(silent_ids) else b for i, b in enumerate(token_bytes)]
  width = max(1, max(len(b) for b in token_bytes))
  data = np.zeros((len(token_bytes), width), np.uint8)
  for i, b in enumerate(token_bytes):
    data[i, :len(b)] = np.frombuffer(b, np.uint8)
  return TokenText(bytes=jnp.asarray(data),
                   length=jnp.asarray([len(b) for b in token_bytes], jnp.int32),
                   stops=stop_strings.build(token_bytes, protocol.STOP_TAGS))


def turn_bytes(tokens: Array, start: Array, end: Array, width: int, text: TokenText
               ) -> tuple[Array, Array, Array]:
  """The text of each row's turn `tokens[b, start[b]:end[b]]` (at most `width` tokens).

  Returns:
    `(s i32[B, N], n i32[B], owner i32[B, N])`: the bytes (-1 past the end, N = width * W),
    their number, and the turn-relative index of the token each byte belongs to.
  """
  b, t = tokens.shape
  cols = start[:, None] + jnp.arange(width)[None, :]
  tok = jnp.take_along_axis(tokens, jnp.clip(cols, 0, t - 1), 1)
  lengths = jnp.where(cols < end[:, None], text.length[tok], 0)  # [B, width]
  offsets = jnp.cumsum(lengths, 1) - lengths
  w = text.bytes.shape[1]
  n = width * w
  j = jnp.arange(w)[None, None, :]
  pos = jnp.where(j < lengths[..., None], offsets[..., None] + j, n)  # [B, width, W]
  rows = jnp.arange(b)[:, None, None]
  s = jnp.full((b, n + 1), -1, jnp.int32).at[rows, pos].set(
      text.bytes[tok].astype(jnp.int32))[:, :n]
  owner = jnp.zeros((b, n + 1), jnp.int32).at[rows, pos].set(
      jnp.broadcast_to(jnp.arange(width)[None, :, None], pos.shape))[:, :n]
  return s, jnp.sum(lengths, 1), owner


def occurrences(s: Array, tag: str) -> Array:
  """`bool[B, N]`: `tag`'s bytes start at this byte of `s`."""
  pattern = tag.encode()
  padded = jnp.pad(s, [(0, 0), (0, len(pattern))], constant_values=-1)
  hit = jnp.ones(s.shape, bool)
  for k, c in enumerate(pattern):
    hit &= padded[:, k:k + s.shape[1]] == c
  return hit


def classify_text_turn(tokens: Array, start: Array, end: Array, env, text: TokenText
                       ) -> tuple[Array, Array]:
  """`agent_env.classify_turn` for text tags: `(kind i32[B], query i32[B, max_query_tokens])`.

  The rules are `actions.parse_action`'s on the turn's text (module docstring); a search whose
  query spans more than `env.max_query_tokens` tokens is invalid. A turn whose last token is
  `env.eos_id` is `KIND_EOS`.
  """
  s, n, owner = turn_bytes(tokens, start, end, env.max_action_tokens, text)
  return classify_bytes(tokens, start, end, env, s, n, owner)


def classify_bytes(tokens: Array, start: Array, end: Array, env, s: Array, n: Array,
                   owner: Array) -> tuple[Array, Array]:
  """`classify_text_turn` on the turn's bytes (`turn_bytes`)."""
  from pbsd_jax.agent.env.agent_env import KIND_ANSWER, KIND_EOS, KIND_INVALID, KIND_SEARCH
  b, t = tokens.shape
  p = jnp.arange(s.shape[1])[None, :]
  text_byte = (p < n[:, None]) & ~jnp.isin(s, jnp.array(WHITESPACE))
  body_end = jnp.max(jnp.where(text_byte, p, -1), 1) + 1  # the rstripped text's length
  occ = {tag: occurrences(s, tag) for tag in protocol.TAGS}

  def ends_with(tag):
    at = body_end - len(tag)
    return (at >= 0) & jnp.take_along_axis(occ[tag], jnp.maximum(at, 0)[:, None], 1)[:, 0]

  close = body_end - len(protocol.SEARCH_CLOSE)
  opened = _last_before(occ, protocol.SEARCH_OPEN, close)
  q0 = opened + len(protocol.SEARCH_OPEN)
  in_query = (p >= q0[:, None]) & (p < close[:, None])
  first = jnp.min(jnp.where(in_query & text_byte, p, s.shape[1]), 1)
  last = jnp.max(jnp.where(in_query & text_byte, p, -1), 1)
  has_tag = jnp.zeros((b,), bool)
  for tag in protocol.TAGS:
    has_tag |= jnp.any(occ[tag] & in_query & (p + len(tag) <= close[:, None]), 1)
  byte_owner = lambda i: jnp.take_along_axis(owner, jnp.clip(i, 0, s.shape[1] - 1)[:, None],
                                             1)[:, 0]
  q_first, q_len = byte_owner(first), byte_owner(last) - byte_owner(first) + 1
  search = (ends_with(protocol.SEARCH_CLOSE) & (opened >= 0) & (last >= 0)
            & (q_len <= env.max_query_tokens) & ~has_tag)
  answer = ends_with(protocol.ANSWER_CLOSE) & (
      _last_before(occ, protocol.ANSWER_OPEN, body_end - len(protocol.ANSWER_CLOSE)) >= 0)
  last_token = jnp.take_along_axis(tokens, jnp.clip(end - 1, 0, t - 1)[:, None], 1)[:, 0]
  eos = (end > start) & (last_token == env.eos_id)
  kind = jnp.select([eos, search, answer], [KIND_EOS, KIND_SEARCH, KIND_ANSWER], KIND_INVALID)
  k = jnp.arange(env.max_query_tokens)[None, :]
  q_cols = jnp.clip(start[:, None] + q_first[:, None] + k, 0, t - 1)
  query = jnp.where((kind == KIND_SEARCH)[:, None] & (k < q_len[:, None]),
                    jnp.take_along_axis(tokens, q_cols, 1), -1)
  return kind.astype(jnp.int32), query.astype(jnp.int32)


def _last_before(occ: dict, tag: str, limit: Array) -> Array:
  """`i32[B]` start of `tag`'s last occurrence that ends by `limit` (-1: none)."""
  p = jnp.arange(occ[tag].shape[1])[None, :]
  return jnp.max(jnp.where(occ[tag] & (p + len(tag) <= limit[:, None]), p, -1), 1)


_PUNCTUATION = tuple(string.punctuation.encode())


def normalize_bytes(s: Array, keep: Array) -> tuple[Array, Array]:
  """SQuAD's `rewards.normalize_answer` on the bytes `s` where `keep`: lower-case, no
  punctuation, no articles, single spaces. `(i32[B, N] -1 padded, length i32[B])`.

  On ASCII text it equals `normalize_answer(...).encode()`; it lower-cases ASCII letters only,
  and a non-ASCII symbol glued to an article ("the—") keeps the article, where Python's
  `\b` would drop it.
  """
  lower = jnp.where((s >= 65) & (s <= 90), s + 32, s)
  space = jnp.isin(s, jnp.array(WHITESPACE))
  c, _ = rewards.compact(jnp.where(space, 32, lower), keep & ~jnp.isin(s, jnp.array(_PUNCTUATION)))
  word = (c >= 0) & (c != 32)
  before = jnp.pad(word, [(0, 0), (1, 0)])[:, :-1]
  after = lambda k: jnp.pad(word, [(0, 0), (0, k)])[:, k:]
  padded = jnp.pad(c, [(0, 0), (0, 4)], constant_values=-1)
  article = jnp.zeros(c.shape, bool)
  for art in (b"a", b"an", b"the"):
    hit = word & ~before & ~after(len(art))
    for k, byte in enumerate(art):
      hit &= padded[:, k:k + c.shape[1]] == byte
    for k in range(len(art)):
      article |= jnp.pad(hit, [(0, 0), (k, 0)])[:, :c.shape[1]]
  kept = word & ~article
  # One space for each run of separators (spaces, dropped articles) between kept words.
  ahead = jnp.flip(jax.lax.cummax(jnp.flip(kept, 1).astype(jnp.int32), axis=1), 1) > 0
  joiner = (~kept & jnp.pad(kept, [(0, 0), (1, 0)])[:, :-1]
            & jnp.pad(ahead, [(0, 0), (0, 1)])[:, 1:])
  return rewards.compact(jnp.where(joiner, 32, c), kept | joiner)


def answer_match(s: Array, n: Array, gold: Array) -> tuple[Array, Array]:
  """The turn's answer against the gold answers, as `rewards.trajectory_reward` judges text.

  Args:
    s, n: the turn's bytes (`turn_bytes`).
    gold: `i32[B, G, L]` the gold answers' normalised bytes, -1 padded
      (`batch.gold_text_batch`).

  Returns:
    `(has bool[B], correct bool[B])`: the turn holds a complete `<answer>...</answer>` (the
    last closing tag and the last opening tag before it), and its normalised content equals a
    non-empty gold answer.
  """
  p = jnp.arange(s.shape[1])[None, :]
  occ = {tag: occurrences(s, tag) for tag in (protocol.ANSWER_OPEN, protocol.ANSWER_CLOSE)}
  close = _last_before(occ, protocol.ANSWER_CLOSE, n)
  opened = _last_before(occ, protocol.ANSWER_OPEN, close)
  has = (close >= 0) & (opened >= 0)
  span = (p >= (opened + len(protocol.ANSWER_OPEN))[:, None]) & (p < close[:, None])
  answer, length = normalize_bytes(s, span & has[:, None])
  width = gold.shape[-1]
  answer = jnp.pad(answer, [(0, 0), (0, max(0, width - answer.shape[1]))],
                   constant_values=-1)[:, :width]
  gold_length = jnp.sum(gold >= 0, -1)
  same = jnp.all(answer[:, None, :] == gold, -1) & (length[:, None] == gold_length)
  return has, has & jnp.any(same & (gold_length > 0), 1)
