"""The in-graph BM25 index: Lucene formula, parity with `bm25s`, ties, padding, jit."""

import math
import re

import bm25s
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pbsd_jax import protocol
from pbsd_jax.agent.env.bm25 import BM25Index
from pbsd_jax.agent.env.sparse_bm25 import SparseBM25Index
from pbsd_jax.agent.env.token_retriever import TokenBM25Retriever

DOCS = [[1, 2, 3, 3], [2, 4], [5, 5, 5, 1], [2, 2], [7]]


def lucene_weight(token, doc, docs, k1=1.5, b=0.75):
  """Brute-force Lucene BM25 term weight (no (k1 + 1) numerator, as in bm25s)."""
  n = len(docs)
  df = sum(token in d for d in docs)
  tf = doc.count(token)
  if tf == 0:
    return 0.0
  avgdl = sum(len(d) for d in docs) / n
  idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
  return idf * tf / (tf + k1 * (1 - b + b * len(doc) / avgdl))


def random_corpus(seed, num_docs=60, vocab_size=50):
  """Documents of Zipf-distributed token ids (a few frequent ids, many rare ones)."""
  rng = np.random.default_rng(seed)
  docs = []
  for _ in range(num_docs):
    length = int(rng.integers(3, 30))
    docs.append([int(t) for t in np.minimum(rng.zipf(1.3, length) - 1, vocab_size - 1)])
  return docs


def bm25s_index(docs):
  """bm25s over the same documents, ids written as string tokens (its own vocabulary)."""
  retriever = bm25s.BM25(method="lucene", k1=1.5, b=0.75)
  retriever.index([[str(t) for t in d] for d in docs], show_progress=False)
  return retriever


def test_weights_equal_hand_computed_lucene_formula():
  index = BM25Index.build(DOCS, vocab_size=8)
  expected = np.array([[lucene_weight(t, d, DOCS) for d in DOCS] for t in range(8)])
  np.testing.assert_allclose(index.weights, expected, rtol=1e-6)


def assert_same_ranking_as_bm25s(docs, vocab_size, queries, k=10, index=None):
  """Our scores and top-k (of `index`, by default the dense index of `docs`) equal bm25s's
  on `docs`; returns how many ranks had no tie."""
  index = BM25Index.build(docs, vocab_size=vocab_size) if index is None else index
  reference = bm25s_index(docs)
  width = max(len(q) for q in queries)
  padded = np.array([q + [-1] * (width - len(q)) for q in queries], dtype=np.int32)
  all_scores = index.scores(padded)
  scores, doc_ids = index.search(padded, k)
  num_untied = 0
  for row, q in enumerate(queries):
    expected = reference.get_scores([str(t) for t in q])
    np.testing.assert_allclose(all_scores[row], expected, rtol=1e-5, atol=1e-6)
    ref = reference.retrieve([[str(t) for t in q]], k=k, show_progress=False)
    np.testing.assert_allclose(scores[row], ref.scores[0], rtol=1e-5, atol=1e-6)
    # The same ranking: each returned document has its rank's score under bm25s, and at ranks
    # whose score is apart from its neighbours' (no tie, up to float noise) the ids agree.
    np.testing.assert_allclose(expected[np.asarray(doc_ids[row])], ref.scores[0], rtol=1e-5,
                               atol=1e-6)
    ranked = np.sort(expected)[::-1]
    gap = np.abs(np.diff(ranked)) > 1e-5
    untied = np.concatenate([[True], gap])[:k] & gap[:k]
    np.testing.assert_array_equal(np.asarray(doc_ids[row])[untied], ref.documents[0][untied])
    num_untied += int(untied.sum())
  return num_untied


def test_scores_and_ranking_equal_bm25s_lucene():
  rng = np.random.default_rng(1)
  queries = [[int(t) for t in rng.integers(0, 50, int(rng.integers(1, 6)))] for _ in range(20)]
  queries.append([3, 3, 7, 3])  # repeated tokens
  num_untied = assert_same_ranking_as_bm25s(random_corpus(seed=0), 50, queries)
  assert num_untied > len(queries) * 10 // 2  # the id comparison is not vacuous


def test_ranking_equals_bm25s_on_the_synthetic_corpus():
  from pbsd_jax.data.corpus import corpus_records  # pylint: disable=g-import-not-at-top
  from pbsd_jax.data.world import make_world  # pylint: disable=g-import-not-at-top
  records = corpus_records(make_world(0))
  vocab = {}
  encode = lambda text: [vocab.setdefault(w, len(vocab)) for w in re.findall(r"\w+", text)]
  docs = [encode(r["contents"]) for r in records]
  # Entity names (the oracle's queries) and question-like queries.
  queries = [encode(r["title"]) for r in records[::7]]
  queries += [encode(f"capital of {r['title']} born in works for") for r in records[::29]]
  num_untied = assert_same_ranking_as_bm25s(docs, len(vocab), queries)
  # Name queries leave most documents tied at score 0; the matching ones are compared.
  assert num_untied > 2 * len(queries)


def test_repeated_query_token_counts_once_per_occurrence():
  index = BM25Index.build(DOCS, vocab_size=8)
  once = index.scores(jnp.array([[2, -1]]))
  twice = index.scores(jnp.array([[2, 2]]))
  np.testing.assert_allclose(twice, 2 * once, rtol=1e-6)


def test_ignored_ids_change_neither_documents_nor_queries():
  with_noise = [d + [9, 9] for d in DOCS]
  index = BM25Index.build(with_noise, vocab_size=10, ignore_ids=[9])
  clean = BM25Index.build(DOCS, vocab_size=10)
  np.testing.assert_allclose(index.weights, clean.weights, rtol=1e-6)
  np.testing.assert_allclose(index.scores(jnp.array([[2, 9, 9]])),
                             clean.scores(jnp.array([[2, -1, -1]])), rtol=1e-6)


def test_padding_and_out_of_range_query_ids_are_ignored():
  index = BM25Index.build(DOCS, vocab_size=8)
  np.testing.assert_allclose(index.scores(jnp.array([[-1, 3, 8, 1000, -5]])),
                             index.scores(jnp.array([[3]])), rtol=1e-6)


def test_equal_scores_rank_lower_doc_id_first():
  docs = [[1], [2], [1], [3], [1]]
  index = BM25Index.build(docs, vocab_size=4)
  scores, doc_ids = index.search(jnp.array([[1], [-1]]), 5)
  np.testing.assert_array_equal(doc_ids[0], [0, 2, 4, 1, 3])
  np.testing.assert_array_equal(doc_ids[1], [0, 1, 2, 3, 4])  # empty query: all zero
  assert float(scores[1].max()) == 0.0


def test_index_is_a_jit_argument_and_search_matches_eager():
  index = BM25Index.build(DOCS, vocab_size=8)
  assert len(jax.tree.leaves(index)) == 3
  query = jnp.array([[2, 3, -1], [5, -1, -1]])
  jitted = jax.jit(lambda idx, q: idx.search(q, 3))(index, query)
  eager = index.search(query, 3)
  np.testing.assert_array_equal(jitted[1], eager[1])
  np.testing.assert_allclose(jitted[0], eager[0])


def test_doc_tokens_are_right_padded_with_lengths():
  index = BM25Index.build(DOCS, vocab_size=8)
  assert index.doc_tokens.shape == (5, 4)
  np.testing.assert_array_equal(index.doc_lengths, [4, 2, 4, 2, 1])
  np.testing.assert_array_equal(index.doc_tokens[4], [7, -1, -1, -1])


def test_build_rejects_token_outside_vocabulary_naming_the_document():
  with pytest.raises(ValueError, match=r"doc_token_ids\[1\] contains token id 8"):
    BM25Index.build([[1], [8]], vocab_size=8)


def test_search_rejects_k_larger_than_corpus():
  index = BM25Index.build(DOCS, vocab_size=8)
  with pytest.raises(ValueError, match="k must be in"):
    index.search(jnp.array([[1]]), 6)


class WordTokenizer:
  """Protocol tags, words and punctuation, each one token; ids assigned on first sight."""

  def __init__(self):
    self.ids = {tag: i for i, tag in enumerate(protocol.TAGS)}

  def __call__(self, text):
    pieces = re.findall(r"</?(?:think|search|information|answer)>|\w+|[^\w\s]", text)
    return [self.ids.setdefault(p, len(self.ids)) for p in pieces]


CONTENTS = ["Velora Quint\nVelora Quint was born in Marrow City.",
            "Valora Quint\nValora Quint works for Ostrel Works.",
            "Marrow City\nMarrow City is a city in Pell. <answer>Pell</answer>",
            "Ostrel Works\nOstrel Works is headquartered in Marrow City."]


def test_token_retriever_returns_the_index_top_k_with_contents():
  encode = WordTokenizer()
  retriever = TokenBM25Retriever.from_texts(CONTENTS, encode, vocab_size=200,
                                            ids=["a", "b", "c", "d"])
  docs = retriever.retrieve(["Valora Quint", "Marrow City"], k=2)
  scores, doc_ids = retriever.index.search(jnp.array([encode("Valora Quint") + [-1, -1],
                                                      encode("Marrow City") + [-1, -1]]), 2)
  assert [[d.id for d in row] for row in docs] == [["abcd"[i] for i in r] for r in doc_ids]
  np.testing.assert_allclose([[d.score for d in row] for row in docs], scores, rtol=1e-6)
  assert docs[0][0].contents == CONTENTS[1]


def test_token_retriever_indexes_escaped_documents_without_tag_tokens():
  encode = WordTokenizer()
  retriever = TokenBM25Retriever.from_texts(CONTENTS, encode, vocab_size=200)
  row = np.asarray(retriever.index.doc_tokens[2][:int(retriever.index.doc_lengths[2])])
  tag_ids = {encode(tag)[0] for tag in protocol.TAGS}
  assert not tag_ids & set(row.tolist())


# --- the sparse index ---------------------------------------------------------------------


@pytest.mark.parametrize("shards, chunk", [(1, 128), (3, 2), (7, 1), (60, 3)])
def test_sparse_index_scores_and_ranks_as_the_dense_index(shards, chunk):
  # Several chunks per term, shards of one document, a last shard padded with empty ones.
  docs = random_corpus(seed=2) + [[]]
  dense = BM25Index.build(docs, vocab_size=50, ignore_ids=[0])
  sparse = SparseBM25Index.build(docs, vocab_size=50, ignore_ids=[0], num_shards=shards,
                                 chunk=chunk)
  rng = np.random.default_rng(3)
  queries = rng.integers(0, 50, (12, 6))
  queries[rng.random(queries.shape) < 0.2] = -1
  queries[0] = [3, 3, 7, 3, 60, -4]  # repeats, ids outside [0, V)
  queries[1] = -1  # an empty query: every score 0, ids in order
  np.testing.assert_allclose(sparse.scores(queries), dense.scores(queries), rtol=1e-6,
                             atol=1e-7)
  search = jax.jit(lambda index, q: index.search(q, 8))
  (want_scores, want_ids), (got_scores, got_ids) = search(dense, queries), search(sparse, queries)
  np.testing.assert_allclose(got_scores, want_scores, rtol=1e-6, atol=1e-7)
  np.testing.assert_array_equal(got_ids, want_ids)
  np.testing.assert_array_equal(got_ids[1], np.arange(8))
  for got, want in zip(sparse.documents(got_ids), dense.documents(got_ids)):
    np.testing.assert_array_equal(got, want)


def _docstrings():
  """Real English text: the docstrings of some of Python's standard library."""
  import argparse, collections, email.message, functools, inspect, json, logging, os, pathlib
  import subprocess, threading, typing, urllib.parse  # noqa: E401
  texts = []
  for module in (argparse, collections, email.message, functools, inspect, json, logging, os,
                 pathlib, subprocess, threading, typing, urllib.parse):
    for name in sorted(dir(module)):
      doc = getattr(getattr(module, name), "__doc__", None)
      if isinstance(doc, str) and len(doc) > 80:
        texts.append(doc)
  return sorted(set(texts))


def test_sharded_sparse_index_ranks_real_text_as_bm25s_lucene():
  from pbsd_jax.parallel import sharding
  texts = _docstrings()
  vocab = {}
  encode = lambda text: [vocab.setdefault(w, len(vocab)) for w in re.findall(r"\w+",
                                                                            text.lower())]
  docs = [encode(t) for t in texts]
  assert len(docs) > 400
  mesh = sharding.make_mesh(2, 4, 1)
  index = SparseBM25Index.build(docs, len(vocab), num_shards=16, chunk=64).shard(
      mesh, sharding.MESH_AXES)
  # Each device holds two of the 16 shards, and the postings are the non-zeros (shards padded
  # to the fullest one), not [V, N].
  assert {s.data.shape[0] for s in index.postings.addressable_shards} == {2}
  nonzeros = sum(len(set(d)) for d in docs)
  assert int((index.postings >= 0).sum()) == nonzeros
  assert index.postings.size < 2 * nonzeros < len(vocab) * len(docs) / 20
  rng = np.random.default_rng(0)
  queries = [encode(" ".join(rng.choice(re.findall(r"\w+", t), 4))) for t in texts[::25]]
  queries += [encode("return the path of a file"), encode("thread lock acquire release")]
  num_untied = assert_same_ranking_as_bm25s(docs, len(vocab), queries, index=index)
  assert num_untied > 5 * len(queries)


def test_sparse_index_saves_and_loads(tmp_path):
  index = SparseBM25Index.build(random_corpus(seed=4), vocab_size=50, num_shards=2, chunk=4)
  index.save(str(tmp_path / "index.npz"))
  loaded = SparseBM25Index.load(str(tmp_path / "index.npz"))
  assert (loaded.docs_per_shard, loaded.doc_width, loaded.chunk) == (
      index.docs_per_shard, index.doc_width, 4)
  jax.tree.map(np.testing.assert_array_equal, loaded, index)
  np.savez(tmp_path / "other.npz", weights=np.zeros(3))
  with pytest.raises(ValueError, match="not a sparse BM25 index"):
    SparseBM25Index.load(str(tmp_path / "other.npz"))
