"""A host dense retriever: sentence embeddings of the corpus in a faiss inner-product index.

Search-R1's published retriever: each document's `contents` (its first line is the title) is
embedded with `passage: ` before it, each query with `query: ` (`SentenceEncoder`, e5's
prefixes), both mean-pooled and normalised, and a document's score is the inner product, i.e.
the cosine. The index is exact (`faiss.IndexFlatIP`, `index_type="flat"`) or, for corpora too
large to scan per query, approximate (`faiss.IndexHNSWFlat` over the inner product, `"hnsw"`:
`HNSW_M` links per node, at least `HNSW_EF_SEARCH` candidates visited per query).

A saved index is a directory: `index.faiss` (`faiss.write_index`), `documents.jsonl` (the
corpus, in index order) and `dense_index.json` (`read_settings`: the encoder directory, its
prefixes and `max_length`, the embedding width, the index type, the document count), so the
directory and the encoder it names are all that serving needs.

torch, transformers and faiss are imported when a retriever is built or loaded, not with this
module.
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import numpy as np

from pbsd_jax.agent.env.host_bm25 import read_corpus
from pbsd_jax.agent.env.retriever import Document, check_k
from pbsd_jax.agent.env.sentence_encoder import SentenceEncoder
from pbsd_jax.data import storage
from pbsd_jax.data.jsonl import write_jsonl

INDEX_TYPES = ("flat", "hnsw")
HNSW_M = 32
HNSW_EF_SEARCH = 64
# Search-R1's server embeds up to 512 queries per forward pass.
BATCH_SIZE = 512
_SETTINGS = "dense_index.json"
_INDEX = "index.faiss"
_DOCUMENTS = "documents.jsonl"


def read_settings(directory: str) -> dict[str, Any]:
  """The settings a saved `DenseRetriever` was built with (`dense_index.json`).

  Raises:
    ValueError: `directory` holds no saved dense index.
  """
  path = os.path.join(directory, _SETTINGS)
  if not os.path.isfile(path):
    raise ValueError(f"{directory!r} is not a saved dense index (no {_SETTINGS}; "
                     "scripts/build_index.py --encoder writes one)")
  with open(path, encoding="utf-8") as f:
    return json.load(f)


class DenseRetriever:
  """`Retriever` over a faiss index of the `N` documents' unit-length embeddings `f32[N, D]`,
  row `i` being document `(ids[i], contents[i])`."""

  def __init__(self, encoder: SentenceEncoder, index: Any, ids: Sequence[str],
               contents: Sequence[str], index_type: str = "flat",
               batch_size: int = BATCH_SIZE):
    """Wraps a built index.

    Args:
      encoder: the encoder the documents were embedded with.
      index: a faiss index (`IndexFlatIP` or `IndexHNSWFlat`) of the `N` documents.
      ids, contents: the documents, in the index's order.
      index_type: `"flat"` or `"hnsw"`, which `index` is.
      batch_size: queries embedded per forward pass.
    """
    if index_type not in INDEX_TYPES:
      raise ValueError(f"index_type must be one of {INDEX_TYPES}, got {index_type!r}")
    if batch_size < 1:
      raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
    if len(ids) != len(contents) or len(ids) != index.ntotal:
      raise ValueError(f"the faiss index holds {index.ntotal} documents but got {len(ids)} ids "
                       f"and {len(contents)} contents")
    self.encoder = encoder
    self.index = index
    self.ids = list(ids)
    self.contents = list(contents)
    self.index_type = index_type
    self.batch_size = batch_size

  @classmethod
  def from_texts(cls, encoder: SentenceEncoder, contents: Sequence[str],
                 ids: Sequence[str] | None = None, index_type: str = "flat",
                 batch_size: int = 64, show_progress: bool = False) -> "DenseRetriever":
    """Embeds `contents` (ids default to "0", "1", ...), `batch_size` documents per forward
    pass, each batch added to the index as it is embedded."""
    import faiss  # pylint: disable=g-import-not-at-top
    import tqdm  # pylint: disable=g-import-not-at-top
    if not contents:
      raise ValueError("contents is empty: a dense index needs at least one document")
    if index_type not in INDEX_TYPES:
      raise ValueError(f"index_type must be one of {INDEX_TYPES}, got {index_type!r}")
    if batch_size < 1:
      raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
    ids = [str(i) for i in range(len(contents))] if ids is None else [str(i) for i in ids]
    index = None
    for start in tqdm.trange(0, len(contents), batch_size, disable=not show_progress,
                             desc="embedding documents", unit_scale=batch_size):
      embeddings = encoder.embed(contents[start:start + batch_size], encoder.passage_prefix)
      if index is None:
        index = _new_index(embeddings.shape[1], index_type)
      index.add(embeddings)
    return cls(encoder, index, ids, contents, index_type)

  @classmethod
  def from_jsonl(cls, corpus_path: str, encoder: SentenceEncoder, index_type: str = "flat",
                 batch_size: int = 64, show_progress: bool = False) -> "DenseRetriever":
    """Indexes a Search-R1 corpus file (`host_bm25.read_corpus`)."""
    ids, contents = read_corpus(corpus_path)
    return cls.from_texts(encoder, contents, ids, index_type, batch_size, show_progress)

  def save(self, directory: str) -> None:
    """Writes the index, the documents and the settings to `directory`, which appears (or
    replaces an older index) only once complete (`storage.replaced_directory`)."""
    import faiss  # pylint: disable=g-import-not-at-top
    with storage.replaced_directory(directory) as tmp:
      faiss.write_index(self.index, os.path.join(tmp, _INDEX))
      write_jsonl(os.path.join(tmp, _DOCUMENTS),
                  ({"id": i, "contents": c} for i, c in zip(self.ids, self.contents)))
      settings = {"encoder": self.encoder.model_dir, "prefixes": self.encoder.prefixes,
                  "max_length": self.encoder.max_length, "dim": self.index.d,
                  "index_type": self.index_type, "num_docs": len(self.ids)}
      with open(os.path.join(tmp, _SETTINGS), "w", encoding="utf-8") as f:
        json.dump(settings, f, indent=1)

  @classmethod
  def load(cls, directory: str, batch_size: int = BATCH_SIZE) -> "DenseRetriever":
    """Reads an index written by `save`, with the encoder and prefixes it was built with."""
    import faiss  # pylint: disable=g-import-not-at-top
    settings = read_settings(directory)
    encoder = SentenceEncoder(settings["encoder"], settings["prefixes"], settings["max_length"])
    index = faiss.read_index(os.path.join(directory, _INDEX))
    if index.d != settings["dim"]:
      raise ValueError(f"{directory}: the faiss index holds {index.d}-wide embeddings, "
                       f"{_SETTINGS} says {settings['dim']}")
    ids, contents = read_corpus(os.path.join(directory, _DOCUMENTS))
    return cls(encoder, index, ids, contents, settings["index_type"], batch_size)

  def retrieve(self, queries: Sequence[str], k: int) -> list[list[Document]]:
    """Top-`min(k, N)` documents per query by cosine (fewer where an HNSW search finds fewer);
    ties: lower corpus index first."""
    import faiss  # pylint: disable=g-import-not-at-top
    check_k(k)
    if not queries:
      return []
    k = min(k, len(self.ids))
    embeddings = np.concatenate([
        self.encoder.embed(queries[start:start + self.batch_size], self.encoder.query_prefix)
        for start in range(0, len(queries), self.batch_size)])
    # Search parameters per call (not set on the index): the server searches from threads.
    params = (faiss.SearchParametersHNSW(efSearch=max(HNSW_EF_SEARCH, k))
              if self.index_type == "hnsw" else None)
    scores, rows = self.index.search(embeddings, k, params=params)  # f32[Q, k], i64[Q, k]
    order = np.lexsort((rows, -scores), axis=-1)
    scores, rows = (np.take_along_axis(a, order, axis=-1) for a in (scores, rows))
    return [[Document(id=self.ids[d], contents=self.contents[d], score=float(s))
             for d, s in zip(row_ids, row_scores) if d >= 0]
            for row_ids, row_scores in zip(rows, scores)]


def _new_index(dim: int, index_type: str) -> Any:
  """An empty faiss inner-product index of `dim`-wide vectors."""
  import faiss  # pylint: disable=g-import-not-at-top
  if index_type == "flat":
    return faiss.IndexFlatIP(dim)
  return faiss.IndexHNSWFlat(dim, HNSW_M, faiss.METRIC_INNER_PRODUCT)
