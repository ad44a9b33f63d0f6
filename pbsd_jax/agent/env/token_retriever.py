"""A text `Retriever` over the in-graph index (`BM25Index`, or `SparseBM25Index` for a large
corpus), so the host loop can use the same index.

Queries are encoded with the policy's tokenizer and scored by the same jitted `search` the
in-graph rollout runs, so host and in-graph compositions retrieve identical documents for
identical query tokens.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import numpy as np

from pbsd_jax.agent.env.bm25 import BM25Index
from pbsd_jax.agent.env.observations import format_document
from pbsd_jax.agent.env.retriever import Document, check_k
from pbsd_jax.agent.env.sparse_bm25 import SparseBM25Index


@functools.partial(jax.jit, static_argnames="k")
def _search(index: BM25Index | SparseBM25Index, query_token_ids: jax.Array, k: int):
  return index.search(query_token_ids, k)


def build_index(contents: Sequence[str], encode: Callable[[str], list[int]], vocab_size: int,
                ids: Sequence[str], sparse_shards: int = 0, **settings
                ) -> BM25Index | SparseBM25Index:
  """The in-graph index of documents `contents` (ids `ids`) rendered for observations
  (`TokenBM25Retriever.from_texts`); `settings`: k1, b, ignore_ids."""
  tokens = [encode(format_document(Document(id=i, contents=c, score=0.0)))
            for i, c in zip(ids, contents)]
  if sparse_shards:
    return SparseBM25Index.build(tokens, vocab_size, num_shards=sparse_shards, **settings)
  return BM25Index.build(tokens, vocab_size, **settings)


def _bucket(n: int) -> int:
  return 1 << max(0, n - 1).bit_length()


class TokenBM25Retriever:
  """`Retriever` over an in-graph index whose document `i` has text `contents[i]` and id
  `ids[i]`."""

  def __init__(self, index: BM25Index | SparseBM25Index, encode: Callable[[str], list[int]],
               contents: Sequence[str], ids: Sequence[str] | None = None):
    """Wraps an index.

    Args:
      index: the BM25 index over the `N` documents.
      encode: text -> token ids, the tokenizer the index was built with.
      contents: `N` document texts, in index order.
      ids: `N` document ids (default: "0", "1", ...).
    """
    ids = [str(i) for i in range(len(contents))] if ids is None else list(ids)
    if len(contents) != index.num_docs or len(ids) != index.num_docs:
      raise ValueError(f"the index has {index.num_docs} documents but got {len(contents)} "
                       f"contents and {len(ids)} ids")
    self.index = index
    self.encode = encode
    self.contents = list(contents)
    self.ids = ids

  @classmethod
  def from_texts(cls, contents: Sequence[str], encode: Callable[[str], list[int]],
                 vocab_size: int, ids: Sequence[str] | None = None, k1: float = 1.5,
                 b: float = 0.75, ignore_ids: Sequence[int] = (), sparse_shards: int = 0
                 ) -> "TokenBM25Retriever":
    """Builds the index from each document's observation rendering: a `BM25Index`, or with
    `sparse_shards > 0` a `SparseBM25Index` of that many shards.

    Document `i` is indexed (and, in-graph, shown) as `encode(format_document(doc_i))`, the
    escaped compact form, so an in-graph observation equals the host one token for token.
    """
    ids = [str(i) for i in range(len(contents))] if ids is None else list(ids)
    return cls(build_index(contents, encode, vocab_size, ids, k1=k1, b=b, ignore_ids=ignore_ids,
                           sparse_shards=sparse_shards), encode, contents, ids)

  def retrieve_ids(self, query_token_ids: Sequence[Sequence[int]],
                   k: int) -> list[list[Document]]:
    """`retrieve` for already-tokenised queries (`Q` lists of token ids)."""
    check_k(k)
    if not query_token_ids:
      return []
    k = min(k, self.index.num_docs)
    # Power-of-two buckets bound the number of compiled shapes; padding rows are dropped.
    num = len(query_token_ids)
    width = max(len(q) for q in query_token_ids)
    queries = np.full((_bucket(num), _bucket(width)), -1, dtype=np.int32)
    for row, q in enumerate(query_token_ids):
      queries[row, :len(q)] = q
    scores, doc_ids = jax.device_get(_search(self.index, queries, k))
    scores, doc_ids = scores[:num], doc_ids[:num]
    return [[Document(id=self.ids[d], contents=self.contents[d], score=float(s))
             for s, d in zip(row_scores, row_ids)]
            for row_scores, row_ids in zip(scores, doc_ids)]

  def retrieve(self, queries: Sequence[str], k: int) -> list[list[Document]]:
    """Top-`min(k, N)` documents per text query (see `Retriever.retrieve`)."""
    return self.retrieve_ids([self.encode(q) for q in queries], k)
