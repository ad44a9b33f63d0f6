"""The bm25s-backed host retriever: scores, JSONL corpora, save/load, corpus errors."""

import json
import re

import numpy as np
import pytest

from pbsd_jax.agent.env.bm25 import BM25Index
from pbsd_jax.agent.env.host_bm25 import HostBM25Retriever, read_corpus

CONTENTS = ["Velora Quint\nVelora Quint was born in Marrow City and works for Ostrel Works.",
            "Valora Quint\nValora Quint was born in Pell Harbor.",
            "Marrow City\nMarrow City is the capital of Pell. Marrow City hosts Ostrel Works.",
            "Ostrel Works\nOstrel Works is a company founded by Velora Quint.",
            "Pell\nPell is a country."]


def words(text):
  """The host retriever's split: lower-cased runs of word characters."""
  return re.findall(r"\b\w+\b", text.lower())


def test_host_scores_equal_the_token_index_on_the_same_words():
  retriever = HostBM25Retriever.from_texts(CONTENTS)
  vocab = {}
  docs = [[vocab.setdefault(w, len(vocab)) for w in words(c)] for c in CONTENTS]
  index = BM25Index.build(docs, vocab_size=len(vocab))
  query = "Where was Velora Quint born? 3 a"
  ids = np.array([[vocab.get(w, -1) for w in words(query)]])
  expected_scores, expected_ids = index.search(ids, 3)
  got = retriever.retrieve([query], k=3)[0]
  assert [d.id for d in got] == [str(i) for i in expected_ids[0]]
  np.testing.assert_allclose([d.score for d in got], expected_scores[0], rtol=1e-5)
  assert got[0].contents == CONTENTS[0]


def test_single_character_terms_such_as_digits_are_searchable():
  retriever = HostBM25Retriever.from_texts(["Entity 1 lives here.", "Entity 3 lives here.",
                                            "Entity 5 lives here."])
  assert retriever.retrieve(["entity 3"], 1)[0][0].id == "1"


def test_k_is_capped_at_corpus_size_and_empty_query_returns_zero_scores():
  retriever = HostBM25Retriever.from_texts(CONTENTS)
  docs = retriever.retrieve(["", "Pell"], k=10)
  assert [len(row) for row in docs] == [5, 5]
  assert [d.score for d in docs[0]] == [0.0] * 5
  assert [d.id for d in docs[0]] == ["0", "1", "2", "3", "4"]  # ties: lower index first


def test_from_jsonl_then_save_and_load_retrieve_the_same(tmp_path):
  corpus = tmp_path / "corpus.jsonl"
  corpus.write_text("".join(json.dumps({"id": f"doc{i}", "title": c.split("\n")[0],
                                        "contents": c}) + "\n"
                            for i, c in enumerate(CONTENTS)))
  retriever = HostBM25Retriever.from_jsonl(str(corpus), stopwords="en")
  retriever.save(str(tmp_path / "index"))
  loaded = HostBM25Retriever.load(str(tmp_path / "index"))
  queries = ["the capital of Pell", "Ostrel Works founder"]
  assert loaded.retrieve(queries, 3) == retriever.retrieve(queries, 3)
  assert loaded.stopwords == "en"
  assert retriever.retrieve(queries, 1)[0][0].id == "doc2"


@pytest.mark.parametrize("line, error", [
    ('{"id": "a", "contents": "x"\n', "line 2: invalid JSON"),
    ('["contents"]\n', "line 2: expected a JSON object"),
    ('{"id": "a", "text": "x"}\n', "line 2: field 'contents' must be a string"),
    ('{"id": [1], "contents": "x"}\n', "line 2: field 'id' must be a string or int"),
])
def test_malformed_corpus_line_is_named_with_file_line_and_field(tmp_path, line, error):
  corpus = tmp_path / "corpus.jsonl"
  corpus.write_text('{"id": 0, "contents": "fine"}\n' + line)
  with pytest.raises(ValueError, match=re.escape(f"{corpus}, {error}")):
    read_corpus(str(corpus))


def test_load_rejects_a_directory_without_an_index(tmp_path):
  with pytest.raises(ValueError, match="not a saved HostBM25Retriever"):
    HostBM25Retriever.load(str(tmp_path))
