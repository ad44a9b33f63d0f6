"""The dense retriever against the host BM25 on one corpus: queries per second at batch 64 and 512.

  python benchmarks/ours_dense.py [--docs 2000 --batches 64,512 --repeats 3]

The encoder has the shape of all-MiniLM-L6-v2 (a `transformers` BERT: 6 layers, hidden 384, 12
heads, MLP 1536, vocabulary 30,522) with seeded random weights and a WordPiece tokenizer trained
on the corpus, written here: its speed is a real sentence encoder's, its ranking is not.
The corpus is `--docs` synthetic documents of 40-80 pseudo-words (a title line, then words
drawn Zipf-like from 8,000, exponent 1.1); queries are 2-8 of the same words. Both retrievers
index the same documents: `DenseRetriever` (`faiss.IndexFlatIP`, e5 prefixes, documents
embedded 64 per forward pass) and `HostBM25Retriever` (`bm25s`). Each batch size is searched
(top 3) once to warm up, then the best of `--repeats` calls counts; for the dense retriever the
query encoding alone is timed as well. Prints a table; the last line is `RESULT {json}`.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np
import tokenizers
import torch
import transformers

from pbsd_jax.agent.env.dense_retriever import DenseRetriever
from pbsd_jax.agent.env.host_bm25 import HostBM25Retriever
from pbsd_jax.agent.env.sentence_encoder import SentenceEncoder

MINILM_L6 = dict(num_hidden_layers=6, hidden_size=384, num_attention_heads=12,
                 intermediate_size=1536, vocab_size=30_522, max_position_embeddings=512)
_SYLLABLES = ("ka", "lo", "mi", "ren", "tor", "vas", "el", "quin", "dra", "sul", "bo", "nith",
              "ar", "pel", "ost", "ux")


def words(num: int, seed: int = 0) -> list[str]:
  """`num` distinct pseudo-words of 2-4 syllables."""
  rng = np.random.default_rng(seed)
  out: dict[str, None] = {}
  while len(out) < num:
    out["".join(rng.choice(_SYLLABLES, int(rng.integers(2, 5))))] = None
  return list(out)


def zipf_words(rng: np.random.Generator, vocab: list[str], num: int) -> list[str]:
  """`num` words of `vocab` drawn Zipf-like (exponent 1.1): the first most often."""
  return [vocab[min(int(i), len(vocab)) - 1] for i in rng.zipf(1.1, num)]


def corpus(num_docs: int, vocab: list[str], seed: int = 0) -> list[str]:
  """`num_docs` documents: a two-word title line, then 40-80 words."""
  rng = np.random.default_rng(seed)
  return [" ".join(zipf_words(rng, vocab, 2)).title() + "\n"
          + " ".join(zipf_words(rng, vocab, int(rng.integers(40, 81))))
          for _ in range(num_docs)]


def queries(num: int, vocab: list[str], seed: int) -> list[str]:
  """`num` queries of 2-8 words."""
  rng = np.random.default_rng(seed)
  return [" ".join(zipf_words(rng, vocab, int(rng.integers(2, 9)))) for _ in range(num)]


def write_encoder(path: str, texts: list[str]) -> None:
  """A random-weight BERT of the MiniLM-L6 shape and a lower-casing WordPiece tokenizer
  trained on `texts` and the prefixes (at most 30,522 entries), saved by `transformers`."""
  tokenizer = tokenizers.BertWordPieceTokenizer()
  tokenizer.train_from_iterator(["query: passage:", *texts], show_progress=False,
                                vocab_size=MINILM_L6["vocab_size"])
  tokenizer_file = os.path.join(path, "tokenizer.json")
  tokenizer.save(tokenizer_file)
  transformers.BertTokenizerFast(tokenizer_file=tokenizer_file).save_pretrained(path)
  torch.manual_seed(0)
  transformers.BertModel(transformers.BertConfig(**MINILM_L6)).save_pretrained(path)


def best_seconds(fn, repeats: int) -> float:
  """The fastest of `repeats` calls of `fn`, after one warm-up call."""
  fn()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return min(times)


def run(num_docs: int, batches: list[int], repeats: int) -> dict:
  vocab = words(8_000)
  docs = corpus(num_docs, vocab)
  with tempfile.TemporaryDirectory() as encoder_dir:
    write_encoder(encoder_dir, docs)
    encoder = SentenceEncoder(encoder_dir)
    start = time.perf_counter()
    dense = DenseRetriever.from_texts(encoder, docs, batch_size=64)
    dense_build = time.perf_counter() - start
  start = time.perf_counter()
  bm25 = HostBM25Retriever.from_texts(docs)
  bm25_build = time.perf_counter() - start
  rows = []
  for batch in batches:
    q = queries(batch, vocab, seed=batch)
    dense_s = best_seconds(lambda: dense.retrieve(q, 3), repeats)
    encode_s = best_seconds(lambda: encoder.embed(q, encoder.query_prefix), repeats)
    bm25_s = best_seconds(lambda: bm25.retrieve(q, 3), repeats)
    rows.append(dict(batch=batch, dense_qps=batch / dense_s, encode_qps=batch / encode_s,
                     bm25_qps=batch / bm25_s))
  return dict(docs=num_docs, torch_threads=torch.get_num_threads(), cpus=os.cpu_count(),
              dense_build_s=dense_build, bm25_build_s=bm25_build, rows=rows)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--docs", type=int, default=2_000)
  parser.add_argument("--batches", default="64,512", help="queries per retrieve call")
  parser.add_argument("--repeats", type=int, default=3, help="timed calls after the warm-up")
  args = parser.parse_args()
  result = run(args.docs, [int(b) for b in args.batches.split(",")], args.repeats)
  print(f"{result['docs']:,} documents; build: dense {result['dense_build_s']:.1f} s, bm25s "
        f"{result['bm25_build_s']:.1f} s; torch threads {result['torch_threads']}")
  print("| batch | queries/s: dense / bm25s | dense: query encoding alone |")
  print("|---|---|---|")
  for r in result["rows"]:
    print(f"| {r['batch']} | {r['dense_qps']:,.0f} / {r['bm25_qps']:,.0f} | "
          f"{r['encode_qps']:,.0f} |")
  print("RESULT " + json.dumps(result))


if __name__ == "__main__":
  main()
