"""The generated corpus under its own SentencePiece vocabulary: exact-name retrieval and
token budgets (what the retriever and the tiny model's context rely on)."""

import json
import os

import bm25s
import numpy as np
import pytest
import sentencepiece as spm

from pbsd_jax import protocol
from pbsd_jax.data import build


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("kg"))
  build.make_dataset(out, seed=0)
  return out


def _jsonl(data_dir, name):
  with open(os.path.join(data_dir, name)) as f:
    return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def sp(data_dir):
  return spm.SentencePieceProcessor(model_file=os.path.join(data_dir, "spm.model"))


@pytest.fixture(scope="module")
def docs(data_dir):
  return _jsonl(data_dir, "corpus.jsonl")


def test_exact_name_query_ranks_the_entitys_own_document_first(sp, docs):
  # Lucene BM25 (bm25s) over SentencePiece token ids, the in-graph retriever's view.
  as_terms = lambda text: [str(i) for i in sp.encode(text)]
  retriever = bm25s.BM25(method="lucene", k1=1.5, b=0.75)
  retriever.index([as_terms(d["contents"]) for d in docs], show_progress=False)
  top, scores = retriever.retrieve([as_terms(d["title"]) for d in docs], k=2,
                                   show_progress=False)
  np.testing.assert_array_equal(top[:, 0], np.arange(len(docs)))
  assert (scores[:, 0] > scores[:, 1]).all()


def test_query_tokens_cut_from_an_encoded_action_rank_the_own_document_first(sp, docs):
  # The in-graph retriever never decodes: its query is the token ids between the search tags
  # of the action, including the whitespace piece before the closing tag.
  as_terms = lambda ids: [str(i) for i in ids]
  retriever = bm25s.BM25(method="lucene", k1=1.5, b=0.75)
  retriever.index([as_terms(sp.encode(d["contents"])) for d in docs], show_progress=False)
  open_id, close_id = sp.piece_to_id(protocol.SEARCH_OPEN), sp.piece_to_id(protocol.SEARCH_CLOSE)
  queries = []
  for d in docs:
    ids = sp.encode(f"{protocol.SEARCH_OPEN} {d['title']} {protocol.SEARCH_CLOSE}")
    queries.append(as_terms(ids[ids.index(open_id) + 1:ids.index(close_id)]))
  top, _ = retriever.retrieve(queries, k=1, show_progress=False)
  np.testing.assert_array_equal(top[:, 0], np.arange(len(docs)))


def test_documents_are_short(sp, docs):
  lengths = [len(sp.encode(d["contents"])) for d in docs]
  assert 20 <= min(lengths) and max(lengths) <= 80


def test_sft_trajectory_with_three_documents_per_search_fits_in_1k_tokens(sp, docs, data_dir):
  longest_doc = max(len(sp.encode(d["contents"])) for d in docs)
  for r in _jsonl(data_dir, "sft.jsonl"):
    searches = sum(protocol.SEARCH_OPEN in a for a in r["actions"])
    # Per search: the two information tags and three documents with a title header each.
    total = (len(sp.encode(protocol.format_prompt(r["question"])))
             + sum(len(sp.encode(a)) for a in r["actions"])
             + searches * (2 + 3 * (longest_doc + 8)))
    assert total <= 1024, r["question"]
