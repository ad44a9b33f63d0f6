"""The two search interfaces, device and host, and the host one's failure type.

A search backend is one of two kinds, and the rollout dispatches on which
(`pbsd_jax.agent.rollout.rollout`):
  * a `DeviceIndex` lives on the devices and is searched inside the jitted turn loop, so a
    whole episode is one XLA program: `BM25Index` (a dense `[V, N]` weight matrix) and
    `SparseBM25Index` (CSR postings, sharded over the devices for a large corpus). Each
    declares where its arrays live on a mesh (`shardings`), which a jitted step uses as the
    index argument's sharding.
  * a `Retriever` maps a batch of text queries to ranked documents from the host, between the
    jitted pieces of the turn loop: `TokenBM25Retriever` (a device index behind a host call),
    the `bm25s`-backed `HostBM25Retriever`, the faiss-backed `DenseRetriever` (sentence
    embeddings) and `HttpRetriever` (a Search-R1 retrieval server).

Failure contract: `retrieve` either returns one list per query or raises `RetrievalError`, and
nothing else, for failures the episode should survive (service down, timeouts, malformed
responses). The environment turns the error into an observation text
(`observations.retrieval_failure_observation`) and the episode goes on. Programming errors
(e.g. `k < 1`) raise `ValueError` as usual.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence, runtime_checkable

import jax


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


class DeviceIndex:
  """A search index on the devices, searched inside jitted programs; a pytree (the index
  classes are `flax.struct` dataclasses), so a jit argument."""

  def search(self, query_token_ids: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Top-k documents of each query `i32[Q, L]` (-1 padded): `(f32[Q, k] scores,
    i32[Q, k] document ids)`, best first, equal scores lower id first."""
    raise NotImplementedError

  def documents(self, doc_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The tokens of documents `doc_ids: i32[...]`: `(i32[..., width]` right-padded with -1,
    `i32[...]` lengths)."""
    raise NotImplementedError

  def shardings(self, mesh: jax.sharding.Mesh) -> Any:
    """The index's pytree with each array replaced by its `NamedSharding` on `mesh` (the
    index argument's sharding in a jitted step): replicated unless the index spreads itself
    over the devices."""
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.tree.map(lambda _: whole, self)


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
