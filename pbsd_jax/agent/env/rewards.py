"""Outcome rewards: answer extraction from action text or tokens, SQuAD normalisation, EM / F1.

The answer is read from action text only (docs/design.md §3): the caller passes the policy's action
segments, never observations, so a retrieved document containing `<answer>X</answer>` cannot
become the answer. The decisive span is the last complete one: the last `</answer>` that has an
`<answer>` before it in the same action segment; its content is the text between that closing
tag and the nearest `<answer>` before it. `extract_answer` (text) and `token_answer_reward`
(token ids, jittable, for the in-graph composition) apply the same rule.
"""

from __future__ import annotations

import collections
import re
import string
from typing import Sequence

import jax
import jax.numpy as jnp

from pbsd_jax import protocol

Array = jax.Array

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
  """SQuAD normalisation: lower-case, drop punctuation, drop articles, collapse whitespace."""
  text = text.lower().translate(_PUNCTUATION)
  return " ".join(_ARTICLES.sub(" ", text).split())


def _as_list(golds: str | Sequence[str]) -> list[str]:
  return [golds] if isinstance(golds, str) else list(golds)


def exact_match(prediction: str, golds: str | Sequence[str]) -> float:
  """1.0 if the normalised prediction equals any normalised gold answer, else 0.0."""
  pred = normalize_answer(prediction)
  return float(any(pred == normalize_answer(g) for g in _as_list(golds)))


def _token_f1(prediction: str, gold: str) -> float:
  pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
  common = sum((collections.Counter(pred) & collections.Counter(ref)).values())
  if common == 0:
    return 0.0
  precision, recall = common / len(pred), common / len(ref)
  return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str, golds: str | Sequence[str]) -> float:
  """SQuAD token F1 of the normalised prediction, maximised over the gold answers."""
  return max((_token_f1(prediction, g) for g in _as_list(golds)), default=0.0)


def extract_answer(action_texts: Sequence[str]) -> str | None:
  """The content of the last complete `<answer>...</answer>` in the action segments.

  Args:
    action_texts: the decoded action text of each turn, in order (no observations).

  Returns:
    The stripped answer text, or None when no segment holds a complete answer span.
  """
  for text in reversed(action_texts):
    end = text.rfind(protocol.ANSWER_CLOSE)
    if end < 0:
      continue
    start = text.rfind(protocol.ANSWER_OPEN, 0, end)
    if start >= 0:
      return text[start + len(protocol.ANSWER_OPEN):end].strip()
  return None


def trajectory_reward(action_texts: Sequence[str], golds: str | Sequence[str]) -> float:
  """Exact-match reward of a trajectory: 0.0 without an answer."""
  answer = extract_answer(action_texts)
  return 0.0 if answer is None else exact_match(answer, golds)


def compact(tokens: Array, keep: Array) -> tuple[Array, Array]:
  """Moves the kept tokens of each row to the front, in order, padding with -1.

  Args:
    tokens: `i32[..., N]`; keep: `bool[..., N]`.

  Returns:
    `(compacted i32[..., N], count i32[...])`.
  """
  rank = jnp.cumsum(keep, axis=-1) - 1
  n = tokens.shape[-1]
  target = jnp.where(keep, rank, n)  # Dropped tokens go to an overflow slot, then cut.
  out = jnp.full(tokens.shape[:-1] + (n + 1,), -1, tokens.dtype)
  out = jnp.put_along_axis(out, target, tokens, axis=-1, inplace=False)
  return out[..., :n], jnp.sum(keep, axis=-1)


def token_answer_reward(tokens: Array, action_mask: Array, answer_open_id: int,
                        answer_close_id: int, gold: Array,
                        ignore_ids: Sequence[int] = ()) -> Array:
  """Exact-match reward on token ids, for the in-graph composition (jittable).

  Requires `<answer>` and `</answer>` to be single tokens (true for our SentencePiece
  vocabulary; with multi-token tags use the text path). An action segment is a maximal run of
  action tokens; the answer span is chosen as in the module docstring. The span's tokens, with
  `ignore_ids` (whitespace-only pieces) dropped, must equal one gold variant's tokens with
  `ignore_ids` and the -1 padding dropped. Gold variants that are empty after dropping never
  match, nor does an empty answer.

  Args:
    tokens: `i32[B, T]` trajectories (token layout of docs/design.md §3).
    action_mask: `bool[B, T]`, True on policy-sampled tokens.
    answer_open_id: the `<answer>` token id.
    answer_close_id: the `</answer>` token id.
    gold: `i32[B, G, L]`, G tokenised gold answers per row (e.g. the canonical tokenisation and
      its whitespace variants), right-padded with -1.
    ignore_ids: static token ids dropped from both sides before comparing.

  Returns:
    `f32[B]`, 1.0 where the answer matches a gold variant.
  """
  tokens = jnp.asarray(tokens, jnp.int32)
  gold = jnp.asarray(gold, jnp.int32)
  _, t = tokens.shape
  idx = jnp.broadcast_to(jnp.arange(t), tokens.shape)
  # Last non-action position at or before each column: an `<answer>` before it is in an
  # earlier segment.
  boundary = jax.lax.cummax(jnp.where(action_mask, -1, idx), axis=1)
  last_open = jax.lax.cummax(jnp.where(action_mask & (tokens == answer_open_id), idx, -1), axis=1)
  complete = action_mask & (tokens == answer_close_id) & (last_open > boundary)
  close = jnp.max(jnp.where(complete, idx, -1), axis=1)  # [B]; -1: no answer
  start = jnp.take_along_axis(last_open, jnp.maximum(close, 0)[:, None], axis=1)[:, 0]
  ignored = jnp.isin(tokens, jnp.asarray(ignore_ids, jnp.int32)) if ignore_ids else (
      jnp.zeros_like(action_mask, bool))
  in_span = (idx > start[:, None]) & (idx < close[:, None]) & ~ignored
  answer, answer_len = compact(tokens, in_span)  # [B, T], [B]

  gold_keep = (gold >= 0) & ~(jnp.isin(gold, jnp.asarray(ignore_ids, jnp.int32))
                              if ignore_ids else jnp.zeros_like(gold, bool))
  gold, gold_len = compact(gold, gold_keep)  # [B, G, L], [B, G]
  length = gold.shape[-1]
  # Compare the first L answer tokens; a longer answer fails the length test anyway.
  answer = jnp.pad(answer, ((0, 0), (0, max(0, length - t))), constant_values=-1)[:, :length]
  same = jnp.all(answer[:, None, :] == gold, axis=-1) & (answer_len[:, None] == gold_len)
  match = same & (gold_len > 0) & (close >= 0)[:, None]
  return jnp.any(match, axis=1).astype(jnp.float32)
