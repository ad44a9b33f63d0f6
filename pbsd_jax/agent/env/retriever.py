"""The retriever interface every search backend implements, and its failure type.

A retriever maps a batch of text queries to ranked documents. Backends: the device-resident
`BM25Index` behind `TokenBM25Retriever`, the `bm25s`-backed `HostBM25Retriever`, and
`HttpRetriever` (a Search-R1 retrieval server). The host turn loop only sees this interface.

Failure contract: `retrieve` either returns one list per query or raises `RetrievalError`, and
nothing else, for failures the episode should survive (service down, timeouts, malformed
responses). The environment turns the error into an observation text
(`observations.retrieval_failure_observation`) and the episode goes on. Programming errors
(e.g. `k < 1`) raise `ValueError` as usual.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence, runtime_checkable


@dataclasses.dataclass(frozen=True)
class Document:
  """One retrieved document.

  Attributes:
    id: the corpus id (a string, as in Search-R1 corpora).
    contents: the document text; by corpus convention its first line is the title.
    score: the retriever's relevance score (higher is better).
  """
  id: str
  contents: str
  score: float


class RetrievalError(Exception):
  """A retrieval the episode should survive failed; `reason` says why, in a short phrase."""

  def __init__(self, reason: str):
    super().__init__(reason)
    self.reason = reason


@runtime_checkable
class Retriever(Protocol):
  """Anything that retrieves top-k documents for a batch of text queries."""

  def retrieve(self, queries: Sequence[str], k: int) -> list[list[Document]]:
    """Returns, for each of the `Q` queries, up to `k` documents, best first.

    Args:
      queries: `Q` query strings (possibly empty strings).
      k: the number of documents per query, `k >= 1`.

    Returns:
      `Q` lists of documents sorted by decreasing score (ties: lower corpus index first).

    Raises:
      RetrievalError: the backend failed; the caller turns it into an observation.
    """
    ...


def check_k(k: int) -> int:
  """Returns `k` if it is a positive int, else raises a ValueError naming `k`."""
  if isinstance(k, bool) or not isinstance(k, int) or k < 1:
    raise ValueError(f"k must be a positive int, got {k!r}")
  return k
