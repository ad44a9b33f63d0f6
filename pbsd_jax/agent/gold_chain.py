"""Turn labels where the world knows its gold chains: which turns of a rollout helped.

The synthetic generator knows each question's gold chain `(e_0, ..., e_h)`; the document of
`e_k` (corpus row `e_k`) states the fact that leads to `e_{k+1}`, so the chain's documents are
`e_0 ... e_{h-1}` (`gold_doc_batch`). Each turn of a rollout then gets a label
(`turn_labels`): a search whose top document is a chain document not retrieved earlier in the
episode is USEFUL; a search whose top document is off the chain (a confusable neighbour, a
sloppy query) is OFF_CHAIN; one that retrieves a document already seen is REPEAT; an invalid
action is INVALID. Answer and EOS turns, failed retrievals, absent turns and rows without a
known chain are UNLABELLED.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pbsd_jax.agent.env.agent_env import KIND_INVALID, KIND_SEARCH

Array = jax.Array

UNLABELLED, USEFUL, OFF_CHAIN, REPEAT, INVALID = 0, 1, 2, 3, 4
LABEL_NAMES = {UNLABELLED: "", USEFUL: "useful", OFF_CHAIN: "off-chain", REPEAT: "repeat",
               INVALID: "invalid"}


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


def turn_labels(turn_kind: Array, turn_doc: Array, gold_docs: Array) -> Array:
  """`i32[B, K]` label of every turn (module docstring).

  Args:
    turn_kind: `i32[B, K]` each turn's `agent_env.KIND_*`, -1 for a turn not taken.
    turn_doc: `i32[B, K]` the top document of each search turn, -1 where there is none (not
      a search, or the retrieval failed).
    gold_docs: `i32[B, H]` the chain documents (`gold_doc_batch`), -1 padded.
  """
  k = turn_doc.shape[1]
  searched = (turn_kind == KIND_SEARCH) & (turn_doc >= 0)
  on_chain = jnp.any((turn_doc[:, :, None] == gold_docs[:, None, :])
                     & (gold_docs[:, None, :] >= 0), axis=2)
  same = turn_doc[:, :, None] == turn_doc[:, None, :]  # [B, k, j]
  earlier = jnp.arange(k)[None, :] < jnp.arange(k)[:, None]  # j < k
  repeat = jnp.any(same & earlier[None] & searched[:, None, :], axis=2)
  label = jnp.where(repeat, REPEAT, jnp.where(on_chain, USEFUL, OFF_CHAIN))
  label = jnp.where(searched, label, jnp.where(turn_kind == KIND_INVALID, INVALID, UNLABELLED))
  has_chain = jnp.any(gold_docs >= 0, axis=1, keepdims=True)
  return jnp.where(has_chain, label, UNLABELLED).astype(jnp.int32)
