"""Builds a search index of a corpus and saves it: the host `bm25s` index, for
`env.retriever=bm25s` (`config.env.index_dir`) or `scripts/serve_retriever.py --index_dir`; or,
with `--tokenizer`, the sparse in-graph index (`pbsd_jax.agent.env.sparse_bm25`) over the policy's
token ids, for `env.retriever=ingraph` (or `host`) with `config.env.index_dir` and the same
`config.data.corpus`; or, with `--encoder`, a faiss index of the documents' sentence embeddings
(`pbsd_jax.agent.env.dense_retriever`, Search-R1's dense retriever), for `env.retriever=dense`
or `scripts/serve_retriever.py --backend=dense`.

  python scripts/build_index.py --corpus=/data/wiki-18.jsonl --out=/data/wiki_bm25
  python scripts/build_index.py --corpus=/data/wiki-18.jsonl --out=/data/wiki_ingraph \
      --tokenizer=/ckpt/qwen2.5-3b --shards=8
  python scripts/build_index.py --corpus=/data/wiki-18.jsonl --out=/data/wiki_e5 \
      --encoder=/models/e5-base-v2 [--index_type=hnsw]

The corpus is Search-R1's JSONL: one object per line with `contents` (and `id`). Each
document is indexed in-graph as the observation shows it (`observations.format_document`,
encoded by the tokenizer, its protocol tags and whitespace pieces not counted as terms); the
shards (`--shards`, a multiple of the run's device count) are placed one per device.

The dense index embeds each document's `contents` with `--prefixes` (default `e5`: `passage: `
before documents and `query: ` before queries, as Search-R1's e5-base-v2 index; `none` for
models trained without prefixes), mean-pooled and normalised, into an exact inner-product index
(`--index_type=flat`) or an HNSW graph (`hnsw`: approximate, for corpora too large to scan). The
index directory records the encoder directory and its prefixes, so serving embeds queries as
the documents were.
"""

import os

from absl import flags

from pbsd_jax.run import cli

_CORPUS = flags.DEFINE_string("corpus", None, "Corpus JSONL with 'id' and 'contents'.",
                              required=True)
_OUT = flags.DEFINE_string("out", None, "Directory to save the index in.", required=True)
_K1 = flags.DEFINE_float("k1", 1.5, "BM25 k1.")
_B = flags.DEFINE_float("b", 0.75, "BM25 b.")
_STOPWORDS = flags.DEFINE_string("stopwords", None, "Stop-word list name (e.g. 'en'; bm25s).")
_TOKENIZER = flags.DEFINE_string(
    "tokenizer", None, "The policy's tokenizer (a model directory with tokenizer.json or "
    "tokenizer.model, or a SentencePiece .model file): build the in-graph index.")
_SHARDS = flags.DEFINE_integer("shards", 1, "Document shards of the in-graph index.")
_ENCODER = flags.DEFINE_string(
    "encoder", None, "A sentence-embedding model directory (Hugging Face, e.g. e5-base-v2): "
    "build the dense index.")
_PREFIXES = flags.DEFINE_enum("prefixes", "e5", ["e5", "none"],
                              "Dense index: the query / passage prefixes of the encoder.")
_INDEX_TYPE = flags.DEFINE_enum("index_type", "flat", ["flat", "hnsw"],
                                "Dense index: exact inner product, or an HNSW graph.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 64,
                                   "Dense index: documents per forward pass of the encoder.")


def _build_dense() -> None:
  from pbsd_jax.agent.env.dense_retriever import DenseRetriever
  from pbsd_jax.agent.env.sentence_encoder import SentenceEncoder
  encoder = SentenceEncoder(_ENCODER.value, _PREFIXES.value)
  retriever = DenseRetriever.from_jsonl(_CORPUS.value, encoder, _INDEX_TYPE.value,
                                        _BATCH_SIZE.value, show_progress=True)
  retriever.save(_OUT.value)
  print(f"indexed {len(retriever.ids)} documents ({_INDEX_TYPE.value}, {retriever.index.d}-wide "
        f"embeddings, prefixes {_PREFIXES.value}) into {_OUT.value}")


def main(argv):
  del argv
  from pbsd_jax.agent.env.host_bm25 import HostBM25Retriever, read_corpus
  if _ENCODER.value is not None and _TOKENIZER.value is not None:
    raise SystemExit("build_index: pass --encoder (dense index) or --tokenizer (in-graph "
                     "index), not both")
  try:
    if _ENCODER.value is not None:
      _build_dense()
      return
    if _TOKENIZER.value is None:
      retriever = HostBM25Retriever.from_jsonl(_CORPUS.value, k1=_K1.value, b=_B.value,
                                               stopwords=_STOPWORDS.value)
      retriever.save(_OUT.value)
      print(f"indexed {len(retriever.ids)} documents into {_OUT.value}")
      return
    from pbsd_jax.agent.env.sparse_bm25 import INDEX_FILE
    from pbsd_jax.agent.env.token_retriever import build_index
    from pbsd_jax.data import vocab as vocab_lib
    path = _TOKENIZER.value
    vocab = (vocab_lib.sentencepiece_vocabulary(path) if path.endswith(".model")
             else vocab_lib.model_vocabulary(path))
    ids, contents = read_corpus(_CORPUS.value)
    index = build_index(contents, lambda t: list(vocab.encode(t)), vocab.vocab_size, ids,
                        k1=_K1.value, b=_B.value, ignore_ids=vocab_lib.non_term_ids(vocab),
                        sparse_shards=_SHARDS.value)
  except (FileNotFoundError, ValueError) as err:
    raise SystemExit(f"build_index: {err}") from None
  index.save(os.path.join(_OUT.value, INDEX_FILE))
  print(f"indexed {index.num_docs} documents ({int((index.postings >= 0).sum())} postings, "
        f"{index.num_shards} shards) into {os.path.join(_OUT.value, INDEX_FILE)}")


if __name__ == "__main__":
  cli.run(main)
