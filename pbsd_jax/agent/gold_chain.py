"""Turn labels where the world knows its gold chains: which turns of a rollout helped.

The synthetic generator knows each question's gold chain `(e_0, ..., e_h)`; the document of
`e_k` (corpus row `e_k`) states the fact that leads to `e_{k+1}`, so the chain's documents are
`e_0 ... e_{h-1}` (`gold_doc_batch`). Each turn of a rollout then gets a label
(`turn_labels`) from the documents each search showed (all of `top_k` that the observation
had room for): a search that showed a chain document not shown earlier in the episode is
USEFUL; one that showed new documents, none on the chain (a confusable neighbour, a sloppy
query), is OFF_CHAIN; one that showed nothing new is REPEAT; an invalid action is INVALID.
Answer and EOS turns, failed retrievals, absent turns and rows without a known chain are
UNLABELLED.

Those labels break at long horizons (a corrective search after a lucky sloppy one is a
"repeat", answers go unlabelled, every search after a wrong commitment is "off-chain"), so
each turn also gets its *value* (`turn_values`): the change it makes to the chance that the
row is solved, read from the world and from the batch's own rollouts.
- Progress `p`: how far along the gold chain the agent has read, the longest prefix
  `e_0 .. e_{p-1}` of chain documents among those its searches showed.
- The chance of success `V(p, t)` with `t` turns left: a search at progress `p` advances with
  the batch's rate `a_p` (searches that read the next chain document, of those taken at `p`),
  and an answer at full progress is right with the batch's rate `c`:
  `V(h, t >= 1) = c`, `V(p < h, t) = a_p V(p + 1, t - 1) + (1 - a_p) V(p, t - 1)`,
  `V(., 0) = 0`. Rates are Laplace-smoothed (`(k + 1) / (n + 2)`).
- Turns left at turn k: `max_turns - k`, and no more than the tokens left in the buffer hold
  at the batch's mean tokens per turn (but the turn itself).
- A turn's value: a search or invalid turn `V(p_after, t - 1) - V(p_before, t)`; an answer
  `reward - V(p_before, t)`; an EOS `-V(p_before, t)`. NaN for a turn not taken and for rows
  without a chain.
`value_labels` names them: PROGRESS above `VALUE_TOLERANCE`, CULPRIT below minus it, NEUTRAL
between.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pbsd_jax.agent.env.agent_env import KIND_ANSWER, KIND_EOS, KIND_INVALID, KIND_SEARCH

Array = jax.Array

UNLABELLED, USEFUL, OFF_CHAIN, REPEAT, INVALID = 0, 1, 2, 3, 4
LABEL_NAMES = {UNLABELLED: "", USEFUL: "useful", OFF_CHAIN: "off-chain", REPEAT: "repeat",
               INVALID: "invalid"}
PROGRESS, CULPRIT, NEUTRAL = 1, 2, 3  # `value_labels` (0: UNLABELLED)
VALUE_LABEL_NAMES = {UNLABELLED: "", PROGRESS: "progress", CULPRIT: "culprit",
                     NEUTRAL: "neutral"}
# A turn whose value is within this of 0 changes the chance of success by too little to
# call it either way.
VALUE_TOLERANCE = 0.02


def gold_doc_batch(records: Sequence[Mapping], width: int) -> np.ndarray:
  """`i32[B, width]` each record's chain documents `chain[:hops]`, -1 padded (all -1 for a
  record without a `chain`, e.g. user data)."""
  out = np.full((len(records), width), -1, np.int32)
  for b, record in enumerate(records):
    docs = list(record.get("chain", []))[:record.get("hops", 0)]
    if len(docs) > width:
      raise ValueError(f"record {b} has {len(docs)} chain documents, more than width={width}")
    out[b, :len(docs)] = docs
  return out


@jax.jit
def turn_labels(turn_kind: Array, turn_doc: Array, gold_docs: Array) -> Array:
  """`i32[B, K]` label of every turn (module docstring).

  Args:
    turn_kind: `i32[B, K]` each turn's `agent_env.KIND_*`, -1 for a turn not taken.
    turn_doc: `i32[B, K, D]` the documents each search turn showed, best first, -1 where
      there is none (not a search, the retrieval failed, no room to show it).
    gold_docs: `i32[B, H]` the chain documents (`gold_doc_batch`), -1 padded.
  """
  b, k, d = turn_doc.shape
  shown = turn_doc >= 0
  searched = (turn_kind == KIND_SEARCH) & jnp.any(shown, axis=2)
  flat, flat_shown = turn_doc.reshape(b, 1, k * d), shown.reshape(b, 1, k * d)
  earlier = jnp.repeat(jnp.arange(k), d)[None, None, :] < jnp.arange(k)[None, :, None]
  seen = jnp.any((turn_doc[..., None] == flat[:, :, None, :]) & flat_shown[:, :, None, :]
                 & earlier[:, :, None, :], axis=3)  # [B, K, D] shown by an earlier turn
  new = shown & ~seen
  on_chain = jnp.any((turn_doc[..., None] == gold_docs[:, None, None, :])
                     & (gold_docs[:, None, None, :] >= 0), axis=3)
  label = jnp.where(jnp.any(new & on_chain, axis=2), USEFUL,
                    jnp.where(jnp.any(new, axis=2), OFF_CHAIN, REPEAT))
  label = jnp.where(searched, label, jnp.where(turn_kind == KIND_INVALID, INVALID, UNLABELLED))
  has_chain = jnp.any(gold_docs >= 0, axis=1, keepdims=True)
  return jnp.where(has_chain, label, UNLABELLED).astype(jnp.int32)


def _read(turn_doc: Array, gold_docs: Array) -> Array:
  """`bool[B, K, H]`: chain document j shown by turn k or earlier."""
  hit = jnp.any((turn_doc[..., None] == gold_docs[:, None, None, :])
                & (gold_docs[:, None, None, :] >= 0) & (turn_doc[..., None] >= 0), axis=2)
  return jnp.cumsum(hit, axis=1) > 0


def _before(after: Array) -> Array:
  """The value of a per-turn cumulative quantity before each turn: shifted by one turn."""
  return jnp.concatenate([jnp.zeros_like(after[:, :1]), after[:, :-1]], axis=1)


@jax.jit
def progress(turn_doc: Array, gold_docs: Array) -> tuple[Array, Array]:
  """`(before, after)`, `i32[B, K]` each: how far along its gold chain a row has read before
  and after each turn (module docstring). Arguments as in `turn_labels`."""
  after = jnp.sum(jnp.cumprod(_read(turn_doc, gold_docs), axis=2), axis=2).astype(jnp.int32)
  return _before(after), after


@jax.jit
def answer_shown(turn_doc: Array, gold_docs: Array) -> Array:
  """`bool[B, K]`: whether the answer was in the context before each turn, i.e. an earlier
  search showed the chain's last document (the one whose fact names the answer), in or out
  of the chain's order. False for rows without a chain. Arguments as in `turn_labels`."""
  hops = jnp.sum(gold_docs >= 0, axis=1)
  last = jnp.take_along_axis(_read(turn_doc, gold_docs),
                             jnp.maximum(hops - 1, 0)[:, None, None], axis=2)[..., 0]
  return _before(last & (hops[:, None] > 0))


def horizon_summary(turn_kind: np.ndarray, turn_doc: np.ndarray, gold_docs: np.ndarray,
                    reward: np.ndarray) -> dict:
  """How far rollouts get along their chains, pooled over rows with a chain:
  `searches` (mean per trajectory), `hop_searches[p]` (searches taken at progress p) and
  `hop_advance[p]` (the share of them that read the next chain document: 1 minus the
  per-hop error rate; NaN where none), `full_progress` (the share of trajectories that read
  their whole chain), `answers_at_full` (the share of answers given with the whole chain read)
  and `accuracy_at_full` (of those, the share right)."""
  before, after = (np.asarray(x) for x in progress(jnp.asarray(turn_doc),
                                                   jnp.asarray(gold_docs)))
  hops = np.sum(gold_docs >= 0, axis=1)
  rows = hops > 0
  kind, reward = turn_kind[rows], reward[rows]
  before, after, hops = before[rows], after[rows], hops[rows]
  search = (kind == KIND_SEARCH) | (kind == KIND_INVALID)
  answer = kind == KIND_ANSWER
  full = answer & (before == hops[:, None])
  h = gold_docs.shape[1]
  at = [search & (before == p) for p in range(h)]
  ratio = lambda n, d: float(n / d) if d else float("nan")
  return {"searches": ratio(np.sum(kind == KIND_SEARCH), len(kind)),
          "hop_searches": [int(np.sum(m)) for m in at],
          "hop_advance": [ratio(np.sum(m & (after > before)), np.sum(m)) for m in at],
          "full_progress": ratio(np.sum(np.max(after, axis=1, initial=0) >= hops), len(kind)),
          "answers_at_full": ratio(np.sum(full), np.sum(answer)),
          "accuracy_at_full": ratio(np.sum(full & (reward[:, None] > 0)), np.sum(full))}


def _rate(hits: Array, trials: Array) -> Array:
  return (jnp.sum(hits, axis=-1) + 1.0) / (jnp.sum(trials, axis=-1) + 2.0)


@jax.jit
def turn_values(turn_kind: Array, turn_doc: Array, gold_docs: Array, reward: Array,
                turn_ids: Array) -> Array:
  """`f32[B, K]` each turn's value, the change it makes to the chance of success (module
  docstring); NaN where unlabelled.

  Args:
    turn_kind, turn_doc, gold_docs: as in `turn_labels`.
    reward: `f32[B]` the rows' outcome rewards.
    turn_ids: `i32[B, T]` the turn index of each action token (-1 elsewhere); T is the
      buffer, and a turn starts at its first action token.
  """
  b, k = turn_kind.shape
  hops = jnp.sum(gold_docs >= 0, axis=1)  # [B]
  taken = turn_kind >= 0
  before, after = progress(turn_doc, gold_docs)
  answering = (turn_kind == KIND_ANSWER) | (turn_kind == KIND_EOS)
  searching = taken & ~answering
  h = gold_docs.shape[1]
  at = before[None] == jnp.arange(h + 1)[:, None, None]  # [H + 1, B, K]
  advance = _rate((at & searching & (after > before)).reshape(h + 1, -1),
                  (at & searching).reshape(h + 1, -1))  # a_p, [H + 1]
  full = (turn_kind == KIND_ANSWER) & (before == hops[:, None])
  correct = _rate((full & (reward[:, None] > 0)).reshape(-1), full.reshape(-1))  # c

  # Turns left: by count, and by the tokens left at the batch's mean tokens per turn.
  cols = jnp.arange(turn_ids.shape[1])
  start = jnp.min(jnp.where(turn_ids[:, None, :] == jnp.arange(k)[None, :, None],
                            cols, turn_ids.shape[1]), axis=2)  # [B, K]
  both = taken[:, 1:] & taken[:, :-1]
  spans = jnp.sum(jnp.where(both, start[:, 1:] - start[:, :-1], 0))
  count = jnp.sum(both)
  # floor(tokens left / max(spans / count, 1)) in integers: a turn that fits exactly fits.
  tokens_left = turn_ids.shape[1] - start
  by_tokens = jnp.where(spans > count, tokens_left * count // jnp.maximum(spans, 1), tokens_left)
  # A turn being taken has itself at least.
  left = jnp.maximum(jnp.minimum(k - jnp.arange(k)[None, :], by_tokens), 1)  # [B, K]

  def step(v, _):  # V(., t) from V(., t - 1): [B, H + 1]
    ahead = jnp.concatenate([v[:, 1:], jnp.zeros((b, 1))], axis=1)
    p = jnp.arange(h + 1)[None, :]
    nxt = jnp.where(p == hops[:, None], correct, advance * ahead + (1.0 - advance) * v)
    nxt = jnp.where(p > hops[:, None], 0.0, nxt)
    return nxt, nxt

  _, table = jax.lax.scan(step, jnp.zeros((b, h + 1)), None, length=k)
  table = jnp.concatenate([jnp.zeros((1, b, h + 1)), table])  # [K + 1, B, H + 1]: V(., t)
  value = lambda t, p: table[jnp.clip(t, 0, k), jnp.arange(b)[:, None], p]
  now = value(left, before)
  delta = jnp.where(turn_kind == KIND_ANSWER, reward[:, None] - now,
                    jnp.where(turn_kind == KIND_EOS, -now, value(left - 1, after) - now))
  labelled = taken & (hops[:, None] > 0)
  return jnp.where(labelled, delta, jnp.nan).astype(jnp.float32)


def value_labels(values: Array) -> Array:
  """`i32[B, K]` PROGRESS / CULPRIT / NEUTRAL of `turn_values` (UNLABELLED where NaN)."""
  return jnp.where(jnp.isnan(values), UNLABELLED,
                   jnp.where(values > VALUE_TOLERANCE, PROGRESS,
                             jnp.where(values < -VALUE_TOLERANCE, CULPRIT, NEUTRAL)))
