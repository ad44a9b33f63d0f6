"""A device-resident, jittable BM25 index over token-id documents (the in-graph retriever).

Scoring is Lucene BM25 exactly as the `bm25s` library computes it with `method="lucene"`:

    idf(t)      = log(1 + (N - n_t + 0.5) / (n_t + 0.5))
    w(t, d)     = idf(t) * tf(t, d) / (tf(t, d) + k1 * (1 - b + b * |d| / avgdl))
    score(q, d) = sum over the query's tokens, repeats included, of w(t, d)

`N` is the number of documents, `n_t` the number containing `t`, `tf` the count of `t` in `d`,
`|d|` the document length and `avgdl` the mean length. Like `bm25s` (and Lucene since 8.0) the
tf factor has no `(k1 + 1)` numerator: it rescales every score by the same constant and leaves
rankings unchanged. A token repeated in the query counts once per occurrence (as in `bm25s`).
Tokens in `ignore_ids` (protocol tags, pad, EOS, whitespace pieces) are dropped from every
document before counting, so they change neither `tf`, `|d|` nor `avgdl`, and weigh 0 in queries.

The index stores the dense weight matrix `w[V, N]`, so a search is a gather of the query's rows
and a sum: `scores = bag_of_query_tokens[Q, V] @ w[V, N]` without materialising the bag. Dense is
right for the embedded corpus (thousands of documents, a few thousand vocabulary entries); a
large corpus takes `sparse_bm25.SparseBM25Index` (the same scores from CSR postings, sharded
over devices) or the host retriever (`host_bm25.py`).

Ties are broken by `lax.top_k`: among equal scores the lower document index comes first.
"""

from __future__ import annotations

from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from pbsd_jax.agent.env.retriever import DeviceIndex

Array = jax.Array


@flax.struct.dataclass
class BM25Index(DeviceIndex):
  """BM25 term weights and the documents' tokens, all on device; a pytree, so a jit argument.

  Attributes:
    weights: `f32[V, N]`, `weights[t, d]` = BM25 weight of token `t` in document `d` (0 where
      `t` is absent from `d` or ignored).
    doc_tokens: `i32[N, Ldoc]`, each document's full token ids (ignored ids included: these are
      the tokens an observation shows), right-padded with -1.
    doc_lengths: `i32[N]`, the number of real tokens in each row of `doc_tokens`.
  """
  weights: Array
  doc_tokens: Array
  doc_lengths: Array

  @property
  def vocab_size(self) -> int:
    """V, the size of the token-id space (query ids outside `[0, V)` are padding)."""
    return self.weights.shape[0]

  @property
  def num_docs(self) -> int:
    """N, the number of documents."""
    return self.weights.shape[1]

  @classmethod
  def build(cls, doc_token_ids: Sequence[Sequence[int]], vocab_size: int, k1: float = 1.5,
            b: float = 0.75, ignore_ids: Sequence[int] = ()) -> "BM25Index":
    """Builds the index on the host (numpy, float64) and moves it to the default device.

    Args:
      doc_token_ids: `N` documents, each a sequence of token ids in `[0, vocab_size)`.
      vocab_size: V.
      k1: BM25 term-frequency saturation.
      b: BM25 length normalisation.
      ignore_ids: token ids that are not terms (dropped before counting; see module doc).

    Returns:
      The index, with `weights f32[V, N]`, `doc_tokens i32[N, max(1, max |d|)]`, `doc_lengths`.
    """
    docs = check_documents(doc_token_ids, vocab_size)
    weights = bm25_weights(docs, vocab_size, k1, b, ignore_ids)
    lengths = np.array([d.size for d in docs], dtype=np.int32)
    doc_tokens = np.full((len(docs), max(1, int(lengths.max()))), -1, dtype=np.int32)
    for i, d in enumerate(docs):
      doc_tokens[i, :d.size] = d
    return cls(weights=jnp.asarray(weights), doc_tokens=jnp.asarray(doc_tokens),
               doc_lengths=jnp.asarray(lengths))

  def scores(self, query_token_ids: Array) -> Array:
    """BM25 scores of every document for every query.

    Args:
      query_token_ids: `i32[Q, L]`; ids outside `[0, V)` (e.g. the padding value -1) are ignored.

    Returns:
      `f32[Q, N]`.
    """
    query_token_ids = jnp.asarray(query_token_ids, jnp.int32)
    valid = (query_token_ids >= 0) & (query_token_ids < self.vocab_size)
    rows = jnp.take(self.weights, jnp.where(valid, query_token_ids, 0), axis=0)  # [Q, L, N]
    return jnp.sum(jnp.where(valid[..., None], rows, 0.0), axis=1)

  def search(self, query_token_ids: Array, k: int) -> tuple[Array, Array]:
    """Top-k documents per query.

    Args:
      query_token_ids: `i32[Q, L]`, padded with -1.
      k: static number of results, `1 <= k <= N`.

    Returns:
      `(scores f32[Q, k], doc_ids i32[Q, k])`, best first; equal scores: lower doc id first.
    """
    if not 1 <= k <= self.num_docs:
      raise ValueError(f"k must be in [1, num_docs={self.num_docs}], got {k}")
    scores, doc_ids = jax.lax.top_k(self.scores(query_token_ids), k)
    return scores, doc_ids.astype(jnp.int32)

  def documents(self, doc_ids: Array) -> tuple[Array, Array]:
    """The tokens of documents `doc_ids: i32[...]`: `(i32[..., Ldoc]` right-padded with -1,
    `i32[...]` lengths)."""
    return self.doc_tokens[doc_ids], self.doc_lengths[doc_ids]


def check_documents(doc_token_ids: Sequence[Sequence[int]], vocab_size: int
                    ) -> list[np.ndarray]:
  """The documents as int arrays; an empty corpus, a bad `vocab_size` or an id outside
  `[0, vocab_size)` raises a `ValueError` naming the document."""
  if not len(doc_token_ids):
    raise ValueError("doc_token_ids is empty: a BM25 index needs at least one document")
  if vocab_size < 1:
    raise ValueError(f"vocab_size must be positive, got {vocab_size}")
  docs = [np.asarray(d, dtype=np.int64).reshape(-1) for d in doc_token_ids]
  for i, d in enumerate(docs):
    if d.size and (d.min() < 0 or d.max() >= vocab_size):
      bad = int(d[(d < 0) | (d >= vocab_size)][0])
      raise ValueError(f"doc_token_ids[{i}] contains token id {bad} outside "
                       f"[0, vocab_size={vocab_size})")
  return docs


def bm25_postings(docs: Sequence[np.ndarray], vocab_size: int, k1: float, b: float,
                  ignore_ids: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The non-zero BM25 weights of the module docstring (host, numpy, computed in float64):
  `(token, doc, f32 weight)`, sorted by token, then document.

  Args:
    docs: `N` int arrays of token ids in `[0, vocab_size)`.
    vocab_size: V.
    k1, b: BM25 parameters.
    ignore_ids: ids dropped from every document before counting.
  """
  num_docs = len(docs)
  ignore = np.asarray(sorted(set(int(i) for i in ignore_ids)), dtype=np.int64)
  terms = [d[~np.isin(d, ignore)] for d in docs]
  lengths = np.array([t.size for t in terms], dtype=np.float64)
  avgdl = lengths.mean()
  doc_index = np.repeat(np.arange(num_docs), [t.size for t in terms])
  flat = np.concatenate(terms) if terms else np.zeros(0, np.int64)
  # Counting (token, doc) pairs gives every tf at once.
  pairs, tf = np.unique(flat * num_docs + doc_index, return_counts=True)
  token, doc = pairs // num_docs, pairs % num_docs
  df = np.bincount(token, minlength=vocab_size).astype(np.float64)
  idf = np.log1p((num_docs - df + 0.5) / (df + 0.5))
  norm = k1 * (1.0 - b + b * lengths[doc] / avgdl)
  return token, doc, (idf[token] * tf / (tf + norm)).astype(np.float32)


def bm25_weights(docs: Sequence[np.ndarray], vocab_size: int, k1: float, b: float,
                 ignore_ids: Sequence[int] = ()) -> np.ndarray:
  """The dense BM25 weight matrix `f32[V, N]` of the module docstring (host, numpy; arguments
  as `bm25_postings`)."""
  token, doc, weight = bm25_postings(docs, vocab_size, k1, b, ignore_ids)
  weights = np.zeros((vocab_size, len(docs)), dtype=np.float32)
  weights[token, doc] = weight
  return weights
