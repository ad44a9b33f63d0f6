"""Builds the host BM25 index (`bm25s`) of a corpus and saves it, for `env.retriever=bm25s`
(`config.env.index_dir`) or `scripts/serve_retriever.py --index_dir`.

  python scripts/build_index.py --corpus=/data/wiki-18.jsonl --out=/data/wiki_bm25

The corpus is Search-R1's JSONL: one object per line with `contents` (and `id`).
"""

from absl import app, flags

from pbsd_jax.env.host_bm25 import HostBM25Retriever

_CORPUS = flags.DEFINE_string("corpus", None, "Corpus JSONL with 'id' and 'contents'.",
                              required=True)
_OUT = flags.DEFINE_string("out", None, "Directory to save the index in.", required=True)
_K1 = flags.DEFINE_float("k1", 1.5, "BM25 k1.")
_B = flags.DEFINE_float("b", 0.75, "BM25 b.")
_STOPWORDS = flags.DEFINE_string("stopwords", None, "Stop-word list name (e.g. 'en').")


def main(argv):
  del argv
  try:
    retriever = HostBM25Retriever.from_jsonl(_CORPUS.value, k1=_K1.value, b=_B.value,
                                             stopwords=_STOPWORDS.value)
  except (FileNotFoundError, ValueError) as err:
    raise SystemExit(f"build_index: {err}") from None
  retriever.save(_OUT.value)
  print(f"indexed {len(retriever.ids)} documents into {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
