"""A sparse, device-resident BM25 index for corpora too large for `BM25Index`'s `[V, N]` matrix.

The scores are `bm25.BM25Index`'s (Lucene BM25 as `bm25s` computes it with `method="lucene"`;
the same `bm25.bm25_postings` on the host), but only the non-zero weights are stored, in CSR
form per shard of documents:

    indptr:   i32[S, V + 1]  term t's postings in shard s are indptr[s, t] .. indptr[s, t + 1]
    postings: i32[S, P]      their local document ids, by term, then document (-1 padding)
    weights:  f32[S, P]      their BM25 weights

`P` is the most postings of any shard, so memory is the non-zeros (plus `V` per shard), not
`V x N`. A search walks the batch's postings in windows of `chunk` entries: the windows of
every (query, token) pair form one list, and a `lax.while_loop` (its trip count a traced value)
takes Q of them per step, scattering each into its query's `[N / S]` scores; a repeated query
token is walked once per occurrence. Each shard then takes its own top-k, and
the `S x k` candidates are merged by a second top-k. `shard` places the shards on devices:
every device then walks and ranks its own (`jax.shard_map`) and only the candidates are
gathered.

Ties are broken as in `BM25Index`: among equal scores the lower document id comes first.
Documents' tokens (what an observation shows) are kept whole on every device, flat with
offsets; that is the corpus itself, which the in-graph observation needs.
"""

from __future__ import annotations

from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from pbsd_jax.agent.env.bm25 import bm25_postings, check_documents
from pbsd_jax.agent.env.retriever import DeviceIndex
from pbsd_jax.data import storage

Array = jax.Array

# The file `save` writes in an index directory (`scripts/build_index.py --tokenizer`).
INDEX_FILE = "sparse_bm25.npz"
# Postings per window: the search loop's work per lane and step. On CPU a step's fixed cost
# outweighs its scatter until windows are thousands of postings long (docs/benchmarks.md);
# reading a window past a short list costs nothing in memory.
CHUNK = 4096
_FIELDS = ("indptr", "postings", "weights", "doc_flat", "doc_offsets")


@flax.struct.dataclass
class SparseBM25Index(DeviceIndex):
  """The sharded CSR index of the module docstring; a pytree, so a jit argument.

  Attributes:
    indptr, postings, weights: the postings (module docstring).
    doc_flat: `i32[total tokens]` every document's tokens, one after another.
    doc_offsets: `i32[N + 1]` document d is `doc_flat[doc_offsets[d]:doc_offsets[d + 1]]`.
    docs_per_shard: documents per shard (static); shard s holds global ids
      `s * docs_per_shard ...`, the last shard padded with empty documents.
    doc_width: the longest document (static): the width of `documents`.
    chunk: postings per step of a search (static).
    mesh, shard_axes: where `shard` placed the shards (static), or None and ().
  """
  indptr: Array
  postings: Array
  weights: Array
  doc_flat: Array
  doc_offsets: Array
  docs_per_shard: int = flax.struct.field(pytree_node=False)
  doc_width: int = flax.struct.field(pytree_node=False)
  chunk: int = flax.struct.field(pytree_node=False, default=CHUNK)
  mesh: jax.sharding.Mesh | None = flax.struct.field(pytree_node=False, default=None)
  shard_axes: tuple[str, ...] = flax.struct.field(pytree_node=False, default=())

  @property
  def vocab_size(self) -> int:
    return self.indptr.shape[1] - 1

  @property
  def num_docs(self) -> int:
    return self.doc_offsets.shape[0] - 1

  @property
  def num_shards(self) -> int:
    return self.indptr.shape[0]

  @classmethod
  def build(cls, doc_token_ids: Sequence[Sequence[int]], vocab_size: int, k1: float = 1.5,
            b: float = 0.75, ignore_ids: Sequence[int] = (), num_shards: int = 1,
            chunk: int = CHUNK) -> "SparseBM25Index":
    """Builds the index on the host (numpy), arguments as `BM25Index.build`; the documents
    are cut into `num_shards` contiguous shards (`shard` places them on devices)."""
    if num_shards < 1 or chunk < 1:
      raise ValueError(f"num_shards and chunk must be >= 1, got {num_shards}, {chunk}")
    docs = check_documents(doc_token_ids, vocab_size)
    token, doc, weight = bm25_postings(docs, vocab_size, k1, b, ignore_ids)  # token-major
    per = -(-len(docs) // num_shards)
    shard = doc // per
    order = np.argsort(shard, kind="stable")  # by shard, then (still) term and document
    shard, token, local, weight = shard[order], token[order], doc[order] % per, weight[order]
    counts = np.zeros((num_shards, vocab_size), np.int64)
    np.add.at(counts, (shard, token), 1)
    indptr = np.zeros((num_shards, vocab_size + 1), np.int64)
    indptr[:, 1:] = np.cumsum(counts, axis=1)
    width = max(1, int(indptr[:, -1].max()))
    postings = np.full((num_shards, width), -1, np.int32)
    weights = np.zeros((num_shards, width), np.float32)
    rank = np.arange(len(order)) - np.concatenate([[0], np.cumsum(indptr[:, -1])[:-1]])[shard]
    postings[shard, rank], weights[shard, rank] = local, weight
    lengths = np.array([d.size for d in docs], np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    flat = np.concatenate(docs).astype(np.int32) if lengths.sum() else np.zeros(1, np.int32)
    return cls(indptr=jnp.asarray(indptr, jnp.int32), postings=jnp.asarray(postings),
               weights=jnp.asarray(weights), doc_flat=jnp.asarray(flat),
               doc_offsets=jnp.asarray(offsets), docs_per_shard=per,
               doc_width=max(1, int(lengths.max())), chunk=chunk)

  def shard(self, mesh: jax.sharding.Mesh, axes: str | Sequence[str]) -> "SparseBM25Index":
    """The index with its shards over `axes` of `mesh` (`num_shards` a multiple of their
    size) and the documents' tokens replicated; `search` then scores and takes each shard's
    top-k on the shard's device (`jax.shard_map`) and gathers only the candidates."""
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    devices = int(np.prod([mesh.shape[a] for a in axes]))
    if self.num_shards % devices:
      raise ValueError(f"num_shards={self.num_shards} does not split over the {devices} "
                       f"devices of mesh axes {axes}")
    placed = self.replace(mesh=mesh, shard_axes=axes)
    return jax.device_put(placed, placed.shardings(mesh))

  def shardings(self, mesh: jax.sharding.Mesh) -> "SparseBM25Index":
    """Where `shard` placed the arrays: the postings over `shard_axes`, the documents'
    tokens replicated (everything replicated for an index `shard` has not placed)."""
    spread = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(self.shard_axes))
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return self.replace(indptr=spread, postings=spread, weights=spread, doc_flat=whole,
                        doc_offsets=whole)

  def _shard_scores(self, indptr: Array, postings: Array, weights: Array,
                    queries: Array) -> Array:
    """`f32[Q, docs_per_shard]` scores of one shard's documents for `queries: i32[Q, L]`.

    The windows of every (query, token) pair form one list; each loop step takes the next Q
    of them (a window each per lane), so a batch costs its total number of windows over Q
    steps, whatever the queries' mix of common and rare terms."""
    q, width = queries.shape
    valid = ((queries >= 0) & (queries < self.vocab_size)).reshape(-1)
    term = jnp.where(valid, queries.reshape(-1), 0)
    begin = jnp.where(valid, indptr[term], 0)
    end = jnp.where(valid, indptr[term + 1], 0)
    windows = -(-(end - begin) // self.chunk)  # [Q * L] per (query, token)
    ends = jnp.cumsum(windows)  # window g belongs to the first pair j with ends[j] > g
    lanes = jnp.arange(q)

    def body(carry):
      i, scores = carry
      g = i * q + lanes
      j = jnp.minimum(jnp.sum(ends[None, :] <= g[:, None], axis=1), q * width - 1)
      at = (begin[j] + (g - ends[j] + windows[j]) * self.chunk)[:, None] + jnp.arange(self.chunk)
      live = (at < end[j][:, None]) & (g < ends[-1])[:, None]
      at = jnp.minimum(at, postings.shape[0] - 1)
      docs = jnp.where(live, postings[at], self.docs_per_shard)  # out of range: dropped
      scores = scores.at[(j // width)[:, None], docs].add(weights[at], mode="drop")
      return i + 1, scores

    start = (jnp.int32(0), jnp.zeros((q, self.docs_per_shard), jnp.float32))
    with jax.named_scope("posting_windows"):  # its trip count's name (`hlo_cost`)
      return jax.lax.while_loop(lambda c: c[0] * q < ends[-1], body, start)[1]

  def scores(self, query_token_ids: Array) -> Array:
    """`f32[Q, N]` BM25 scores (as `BM25Index.scores`; ids outside `[0, V)` are ignored)."""
    queries = jnp.asarray(query_token_ids, jnp.int32)
    per_shard = jax.lax.map(lambda arrays: self._shard_scores(*arrays, queries),
                            (self.indptr, self.postings, self.weights))  # [S, Q, per]
    return jnp.moveaxis(per_shard, 0, 1).reshape(queries.shape[0], -1)[:, :self.num_docs]

  def search(self, query_token_ids: Array, k: int) -> tuple[Array, Array]:
    """Top-k documents per query, as `BM25Index.search`: `(f32[Q, k], i32[Q, k])`, best first,
    equal scores lower id first; each shard's top-k, then their merge."""
    if not 1 <= k <= self.num_docs:
      raise ValueError(f"k must be in [1, num_docs={self.num_docs}], got {k}")
    queries = jnp.asarray(query_token_ids, jnp.int32)
    local_k = min(k, self.docs_per_shard)

    # The padding documents at the end of the last shard score 0, the least a real document
    # scores, and come after every real one at equal scores; with k <= N they are never
    # returned.
    # One shard after another (`lax.map`): a vmapped loop copied its scores every step.
    shard_top = lambda start, docs, weights, q: jax.lax.map(
        lambda arrays: tuple(jax.lax.top_k(self._shard_scores(*arrays, q), local_k)),
        (start, docs, weights))
    if self.mesh is not None:
      spread, whole = jax.sharding.PartitionSpec(self.shard_axes), jax.sharding.PartitionSpec()
      shard_top = jax.shard_map(shard_top, mesh=self.mesh, in_specs=(spread,) * 3 + (whole,),
                                out_specs=(spread, spread), check_vma=False)
    top, ids = shard_top(self.indptr, self.postings, self.weights, queries)
    ids += (jnp.arange(self.num_shards, dtype=ids.dtype) * self.docs_per_shard)[:, None, None]
    flat = lambda x: jnp.moveaxis(x, 0, 1).reshape(queries.shape[0], -1)  # shard-major
    best, where = jax.lax.top_k(flat(top), k)
    return best, jnp.take_along_axis(flat(ids), where, axis=1).astype(jnp.int32)

  def documents(self, doc_ids: Array) -> tuple[Array, Array]:
    """The tokens of documents `doc_ids: i32[...]`: `(i32[..., doc_width]` right-padded with
    -1, `i32[...]` lengths)."""
    start, end = self.doc_offsets[doc_ids], self.doc_offsets[doc_ids + 1]
    cols = jnp.arange(self.doc_width)
    at = start[..., None] + cols
    tokens = self.doc_flat[jnp.minimum(at, self.doc_flat.shape[0] - 1)]
    return jnp.where(at < end[..., None], tokens, -1), end - start

  def save(self, path: str) -> None:
    """Writes the index to one `.npz` file, which appears only once complete."""
    with storage.replaced(path, "wb") as out:
      np.savez(out, docs_per_shard=self.docs_per_shard, doc_width=self.doc_width,
               chunk=self.chunk, **{f: np.asarray(getattr(self, f)) for f in _FIELDS})

  @classmethod
  def load(cls, path: str) -> "SparseBM25Index":
    """Reads an index `save` wrote."""
    with np.load(path) as data:
      missing = [f for f in (*_FIELDS, "docs_per_shard", "doc_width", "chunk")
                 if f not in data]
      if missing:
        raise ValueError(f"{path}: not a sparse BM25 index (no {missing[0]})")
      return cls(**{f: jnp.asarray(data[f]) for f in _FIELDS},
                 docs_per_shard=int(data["docs_per_shard"]), doc_width=int(data["doc_width"]),
                 chunk=int(data["chunk"]))
