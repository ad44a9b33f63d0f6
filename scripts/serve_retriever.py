"""Serves a retriever over the Search-R1 retrieval-server protocol.

    POST http://HOST:PORT/retrieve  {"queries": [...], "topk": k, "return_scores": true}

Backends:
  --backend=bm25s (default): the host BM25 over a Search-R1 corpus JSONL (`--corpus`), or an
    index saved earlier (`--index_dir`; built from `--corpus` and saved there if it is empty).
  --backend=token: the in-graph BM25 index over the corpus tokenised with a SentencePiece model
    (`--spm_model`), i.e. the retriever of the embedded demo, served to host loops.
  --backend=dense: the faiss index of sentence embeddings that `scripts/build_index.py
    --encoder` saved in `--index_dir` (Search-R1's e5 retriever); queries are embedded with the
    encoder and prefix it records, `--batch_size` per forward pass.

Examples:
  python scripts/serve_retriever.py --corpus=data/corpus.jsonl --port=8000
  python scripts/serve_retriever.py --backend=dense --index_dir=/data/wiki_e5 --port=8000
"""

import os
import signal
import sys

from absl import app, flags, logging

from pbsd_jax import protocol
from pbsd_jax.agent.env.dense_retriever import DenseRetriever
from pbsd_jax.agent.env.host_bm25 import HostBM25Retriever, read_corpus
from pbsd_jax.agent.env.http import RetrievalServer
from pbsd_jax.agent.env.token_retriever import TokenBM25Retriever
from pbsd_jax.run import cli

_BACKEND = flags.DEFINE_enum("backend", "bm25s", ["bm25s", "token", "dense"],
                             "Which index to serve.")
_CORPUS = flags.DEFINE_string("corpus", None, "Corpus JSONL with 'id' and 'contents' fields.")
_INDEX_DIR = flags.DEFINE_string("index_dir", None,
                                 "bm25s backend: load the index saved here, or build from "
                                 "--corpus and save it here; dense backend: the saved index.")
_SPM_MODEL = flags.DEFINE_string("spm_model", None, "token backend: SentencePiece model file.")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Interface to bind (0.0.0.0 for all).")
_PORT = flags.DEFINE_integer("port", 8000, "Port to bind (0: any free port).")
_TOPK = flags.DEFINE_integer("topk", 3, "Documents per query when a request has no 'topk'.")
_K1 = flags.DEFINE_float("k1", 1.5, "BM25 k1.")
_B = flags.DEFINE_float("b", 0.75, "BM25 b.")
_STOPWORDS = flags.DEFINE_string("stopwords", None,
                                 "bm25s backend: stop-word list name (e.g. 'en'), default none.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 512,
                                   "dense backend: queries per forward pass of the encoder.")


def _bm25s_retriever() -> HostBM25Retriever:
  index_dir = _INDEX_DIR.value
  if index_dir and os.path.exists(os.path.join(index_dir, "host_bm25.json")):
    logging.info("Loading the index from %s", index_dir)
    return HostBM25Retriever.load(index_dir)
  if not _CORPUS.value:
    raise app.UsageError("--corpus is required unless --index_dir holds a saved index")
  retriever = HostBM25Retriever.from_jsonl(_CORPUS.value, k1=_K1.value, b=_B.value,
                                           stopwords=_STOPWORDS.value)
  if index_dir:
    retriever.save(index_dir)
    logging.info("Saved the index to %s", index_dir)
  return retriever


def _token_retriever() -> TokenBM25Retriever:
  import sentencepiece  # Only this backend needs it.
  if not _CORPUS.value or not _SPM_MODEL.value:
    raise app.UsageError("--backend=token needs --corpus and --spm_model")
  sp = sentencepiece.SentencePieceProcessor(model_file=_SPM_MODEL.value)
  # Not terms: control/unknown pieces, protocol tags, and whitespace-only pieces.
  ignore_ids = [i for i in range(sp.get_piece_size())
                if sp.is_control(i) or sp.is_unknown(i) or sp.id_to_piece(i) in protocol.TAGS
                or not sp.id_to_piece(i).replace("\u2581", "").strip()]
  ids, contents = read_corpus(_CORPUS.value)
  return TokenBM25Retriever.from_texts(contents, lambda text: sp.encode(text),
                                       vocab_size=sp.get_piece_size(), ids=ids, k1=_K1.value,
                                       b=_B.value, ignore_ids=ignore_ids)


def _dense_retriever() -> DenseRetriever:
  if not _INDEX_DIR.value:
    raise app.UsageError("--backend=dense needs --index_dir (scripts/build_index.py --encoder)")
  try:
    return DenseRetriever.load(_INDEX_DIR.value, batch_size=_BATCH_SIZE.value)
  except ValueError as err:
    raise SystemExit(f"serve_retriever: --index_dir: {err}") from None


def main(argv):
  del argv
  backends = {"bm25s": _bm25s_retriever, "token": _token_retriever, "dense": _dense_retriever}
  retriever = backends[_BACKEND.value]()
  server = RetrievalServer(retriever, host=_HOST.value, port=_PORT.value,
                           default_topk=_TOPK.value)
  server.start()
  logging.info("Serving %s retrieval on %s", _BACKEND.value, server.url)
  print(f"Serving on {server.url}", flush=True)
  # SIGTERM (e.g. from a job scheduler) stops the server cleanly, like Ctrl-C.
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
  try:
    server.serve_forever()
  except KeyboardInterrupt:
    logging.info("Stopped.")


if __name__ == "__main__":
  cli.run(main)
