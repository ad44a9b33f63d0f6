"""Builds a BM25 index of a corpus and saves it: the host `bm25s` index, for
`env.retriever=bm25s` (`config.env.index_dir`) or `scripts/serve_retriever.py --index_dir`; or,
with `--tokenizer`, the sparse in-graph index (`pbsd_jax.agent.env.sparse_bm25`) over the policy's
token ids, for `env.retriever=ingraph` (or `host`) with `config.env.index_dir` and the same
`config.data.corpus`.

  python scripts/build_index.py --corpus=/data/wiki-18.jsonl --out=/data/wiki_bm25
  python scripts/build_index.py --corpus=/data/wiki-18.jsonl --out=/data/wiki_ingraph \
      --tokenizer=/ckpt/qwen2.5-3b --shards=8

The corpus is Search-R1's JSONL: one object per line with `contents` (and `id`). Each
document is indexed in-graph as the observation shows it (`observations.format_document`,
encoded by the tokenizer, its protocol tags and whitespace pieces not counted as terms); the
shards (`--shards`, a multiple of the run's device count) are placed one per device.
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


def main(argv):
  del argv
  from pbsd_jax.agent.env.host_bm25 import HostBM25Retriever, read_corpus
  try:
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
