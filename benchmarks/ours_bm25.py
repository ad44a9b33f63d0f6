"""The sparse in-graph BM25 against `bm25s` at scale: build time, queries per second, memory.

  python benchmarks/ours_bm25.py [--docs 100000,1000000 --vocab 30000 --queries 64]

A synthetic corpus of token ids (document lengths uniform in [20, 100], tokens Zipf-distributed
over `--vocab` ids, exponent 1.1: a few very common ids and a long tail) is indexed by
`SparseBM25Index.build` and by `bm25s` (`method="lucene"`, the same ids as its vocabulary).
Then batches of `--queries` queries of 2-8 ids drawn from the same distribution are searched
(top 5) by both, on the same machine in the same run: ours one jitted call per batch after a
warm-up call, `bm25s.retrieve` on the same batch (its default: one thread for small batches).
Memory: the bytes of our index's device arrays against the `f32[V, N]` dense index. Prints a
table; the last line is `RESULT {json}`.
"""

from __future__ import annotations

import argparse
import json
import time

import bm25s
import jax
import numpy as np

from pbsd_jax.agent.env import sparse_bm25
from pbsd_jax.agent.env.sparse_bm25 import SparseBM25Index


def corpus(num_docs: int, vocab: int, seed: int = 0) -> list[np.ndarray]:
  rng = np.random.default_rng(seed)
  lengths = rng.integers(20, 101, num_docs)
  flat = np.minimum(rng.zipf(1.1, int(lengths.sum())) - 1, vocab - 1)
  return np.split(flat, np.cumsum(lengths)[:-1])


def queries(num: int, vocab: int, seed: int) -> np.ndarray:
  rng = np.random.default_rng(seed)
  out = np.full((num, 8), -1, np.int32)
  for row in out:
    n = int(rng.integers(2, 9))
    row[:n] = np.minimum(rng.zipf(1.1, n) - 1, vocab - 1)
  return out


def run(num_docs: int, vocab: int, num_queries: int, batches: int, chunk: int) -> dict:
  docs = corpus(num_docs, vocab)
  start = time.perf_counter()
  index = SparseBM25Index.build(docs, vocab, chunk=chunk)
  jax.block_until_ready(index)
  ours_build = time.perf_counter() - start

  start = time.perf_counter()
  reference = bm25s.BM25(method="lucene", k1=1.5, b=0.75)
  reference.index(bm25s.tokenization.Tokenized(ids=[d.tolist() for d in docs],
                                               vocab={str(i): i for i in range(vocab)}),
                  show_progress=False)
  bm25s_build = time.perf_counter() - start

  search = jax.jit(lambda idx, q: idx.search(q, 5))
  batch = [queries(num_queries, vocab, seed) for seed in range(batches + 1)]
  jax.block_until_ready(search(index, batch[0]))  # compile
  start = time.perf_counter()
  for q in batch[1:]:
    _, ours_ids = jax.block_until_ready(search(index, q))
  ours_qps = batches * num_queries / (time.perf_counter() - start)

  as_tokens = lambda q: bm25s.tokenization.Tokenized(
      ids=[[int(t) for t in row if t >= 0] for row in q], vocab={str(i): i for i in range(vocab)})
  start = time.perf_counter()
  for q in batch[1:]:
    ref_ids, ref_scores = reference.retrieve(as_tokens(q), k=5, show_progress=False)
  bm25s_qps = batches * num_queries / (time.perf_counter() - start)
  # The last batch's top-5 agree where the scores have no near-tie.
  ours_scores, _ = search(index, batch[-1])
  agree = float(np.mean(np.asarray(ours_ids) == ref_ids))
  score_gap = float(np.max(np.abs(np.asarray(ours_scores) - ref_scores)))

  nbytes = sum(x.nbytes for x in (index.indptr, index.postings, index.weights))
  return dict(docs=num_docs, vocab=vocab, postings=int((np.asarray(index.postings) >= 0).sum()),
              ours_build_s=ours_build, bm25s_build_s=bm25s_build, ours_qps=ours_qps,
              bm25s_qps=bm25s_qps, ours_index_mb=nbytes / 2**20,
              corpus_tokens_mb=(index.doc_flat.nbytes + index.doc_offsets.nbytes) / 2**20,
              dense_index_mb=4 * vocab * num_docs / 2**20, top5_agree=agree,
              max_score_diff=score_gap)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--docs", default="100000,1000000")
  parser.add_argument("--vocab", type=int, default=30_000)
  parser.add_argument("--queries", type=int, default=64)
  parser.add_argument("--batches", type=int, default=5)
  parser.add_argument("--chunk", type=int, default=sparse_bm25.CHUNK,
                      help="postings per loop step and lane")
  args = parser.parse_args()
  rows = [run(int(n), args.vocab, args.queries, args.batches, args.chunk)
          for n in args.docs.split(",")]
  print("| docs | postings | build ours / bm25s (s) | queries/s ours / bm25s | index MB ours / "
        "dense | top-5 agree |")
  print("|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['docs']:,} | {r['postings']:,} | {r['ours_build_s']:.1f} / "
          f"{r['bm25s_build_s']:.1f} | {r['ours_qps']:.0f} / {r['bm25s_qps']:.0f} | "
          f"{r['ours_index_mb']:.0f} / {r['dense_index_mb']:,.0f} | {r['top5_agree']:.3f} |")
  print("RESULT " + json.dumps(rows))


if __name__ == "__main__":
  main()
