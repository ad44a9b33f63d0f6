"""A host BM25 retriever over large text corpora, backed by the `bm25s` library.

Text is split by `bm25s.tokenize`: lower-cased runs of word characters (single characters
kept, unlike bm25s's default, so digits such as "3" are terms), no stemmer, optional stop-word
removal (`stopwords`, default none). Scoring is `bm25s`'s Lucene BM25 (the formula of
`bm25.py`). The corpus is the Search-R1 JSONL format: one object per line
with a string `contents` and an optional `id` (default: the 0-based row number).

`bm25s` is imported lazily: importing it runs a JAX computation, which must not happen before
`jax.distributed.initialize` in a multi-host job that merely imports this module.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Sequence

from pbsd_jax.agent.env.retriever import Document, check_k
from pbsd_jax.data import storage
from pbsd_jax.data.jsonl import iter_jsonl

if TYPE_CHECKING:
  import bm25s

_CONFIG = "host_bm25.json"
_DOCUMENTS = "documents.jsonl"
_TOKEN_PATTERN = r"(?u)\b\w+\b"


def _tokenize(texts: Sequence[str], stopwords: str | None) -> list[list[str]]:
  import bm25s  # pylint: disable=g-import-not-at-top
  return bm25s.tokenize(list(texts), lower=True, token_pattern=_TOKEN_PATTERN,
                        stopwords=stopwords, stemmer=None, return_ids=False,
                        show_progress=False)


def read_corpus(path: str) -> tuple[list[str], list[str]]:
  """Reads a Search-R1 corpus JSONL file.

  Returns:
    `(ids, contents)`, one entry per non-blank line.

  Raises:
    ValueError: naming the file, the 1-based line and the field, for bad JSON, a missing or
      non-string `contents`, or an `id` that is not a string or int.
  """
  ids, contents = [], []
  for line_no, row in iter_jsonl(path):
    if not isinstance(row, dict):
      raise ValueError(f"{path}, line {line_no}: expected a JSON object, got "
                       f"{type(row).__name__}")
    text = row.get("contents")
    if not isinstance(text, str):
      raise ValueError(f"{path}, line {line_no}: field 'contents' must be a string, got "
                       f"{type(text).__name__}")
    doc_id = row.get("id", len(ids))
    if isinstance(doc_id, bool) or not isinstance(doc_id, (str, int)):
      raise ValueError(f"{path}, line {line_no}: field 'id' must be a string or int, got "
                       f"{type(doc_id).__name__}")
    ids.append(str(doc_id))
    contents.append(text)
  if not contents:
    raise ValueError(f"{path}: the corpus has no documents")
  return ids, contents


class HostBM25Retriever:
  """`Retriever` over a `bm25s.BM25` index of `N` text documents."""

  def __init__(self, bm25: bm25s.BM25, ids: Sequence[str], contents: Sequence[str],
               stopwords: str | None = None):
    """Wraps a built `bm25s` index whose document `i` is `(ids[i], contents[i])`."""
    if len(ids) != len(contents) or len(ids) != bm25.scores["num_docs"]:
      raise ValueError(f"the bm25s index has {bm25.scores['num_docs']} documents but got "
                       f"{len(ids)} ids and {len(contents)} contents")
    self.bm25 = bm25
    self.ids = list(ids)
    self.contents = list(contents)
    self.stopwords = stopwords

  @classmethod
  def from_texts(cls, contents: Sequence[str], ids: Sequence[str] | None = None,
                 k1: float = 1.5, b: float = 0.75,
                 stopwords: str | None = None) -> "HostBM25Retriever":
    """Indexes `contents` (ids default to "0", "1", ...)."""
    if not contents:
      raise ValueError("contents is empty: a BM25 index needs at least one document")
    import bm25s  # pylint: disable=g-import-not-at-top
    ids = [str(i) for i in range(len(contents))] if ids is None else [str(i) for i in ids]
    bm25 = bm25s.BM25(k1=k1, b=b, method="lucene")
    bm25.index(_tokenize(contents, stopwords), show_progress=False)
    return cls(bm25, ids, contents, stopwords)

  @classmethod
  def from_jsonl(cls, corpus_path: str, k1: float = 1.5, b: float = 0.75,
                 stopwords: str | None = None) -> "HostBM25Retriever":
    """Indexes a Search-R1 corpus file (see `read_corpus`)."""
    ids, contents = read_corpus(corpus_path)
    return cls.from_texts(contents, ids, k1=k1, b=b, stopwords=stopwords)

  def save(self, directory: str) -> None:
    """Writes the index, the documents and the tokenizer settings to `directory`, which
    appears (or replaces an older index) only once complete (`storage.replaced_directory`)."""
    with storage.replaced_directory(directory) as tmp:
      self.bm25.save(tmp, show_progress=False)
      with open(os.path.join(tmp, _DOCUMENTS), "w", encoding="utf-8") as f:
        for doc_id, text in zip(self.ids, self.contents):
          f.write(json.dumps({"id": doc_id, "contents": text}, ensure_ascii=False) + "\n")
      with open(os.path.join(tmp, _CONFIG), "w", encoding="utf-8") as f:
        json.dump({"stopwords": self.stopwords, "num_docs": len(self.ids)}, f)

  @classmethod
  def load(cls, directory: str) -> "HostBM25Retriever":
    """Reads an index written by `save`."""
    config_path = os.path.join(directory, _CONFIG)
    if not os.path.exists(config_path):
      raise ValueError(f"{directory} is not a saved HostBM25Retriever (no {_CONFIG})")
    with open(config_path, encoding="utf-8") as f:
      config = json.load(f)
    import bm25s  # pylint: disable=g-import-not-at-top
    ids, contents = read_corpus(os.path.join(directory, _DOCUMENTS))
    bm25 = bm25s.BM25.load(directory, show_progress=False)
    return cls(bm25, ids, contents, config["stopwords"])

  def retrieve(self, queries: Sequence[str], k: int) -> list[list[Document]]:
    """Top-`min(k, N)` documents per query; ties: lower corpus index first."""
    check_k(k)
    if not queries:
      return []
    k = min(k, len(self.ids))
    results = self.bm25.retrieve(_tokenize(queries, self.stopwords), k=k, show_progress=False,
                                 backend_selection="jax")
    return [[Document(id=self.ids[d], contents=self.contents[d], score=float(s))
             for d, s in zip(row_ids, row_scores)]
            for row_ids, row_scores in zip(results.documents, results.scores)]
