"""The dense retriever (Search-R1's e5 setup): a tiny random BERT written by `transformers` and a
WordPiece tokenizer built by `tokenizers`, a faiss index over 50 documents, checked against a
brute-force cosine over embeddings computed here by hand, through save / load,
scripts/build_index.py, scripts/serve_retriever.py on loopback and `env.retriever=dense`."""

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request

import numpy as np
import pytest
import torch
import transformers

from pbsd_jax.agent.env.dense_retriever import DenseRetriever, read_settings
from pbsd_jax.agent.env.http import HttpRetriever, format_response
from pbsd_jax.agent.env.sentence_encoder import SentenceEncoder
from script_env import script_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The encoder is tiny: one thread is fastest, and the same thread count in this process and in
# the server's makes their float results the same bits.
torch.set_num_threads(1)

WORDS = ("river city lake mountain castle bridge harbor forest valley island tower market "
         "north south east west old new red blue green golden silver iron stone glass built "
         "founded crossed painted known famous small large ancient quiet busy near far").split()
QUERIES = ["old stone bridge", "golden harbor market", "", "Ironvale", "quiet green valley"]


def _documents(num=50, seed=0):
  """`num` documents `"Title\\ntext"` of random words (titles: two words joined)."""
  rng = np.random.default_rng(seed)
  docs = []
  for _ in range(num):
    title = "".join(w.capitalize() for w in rng.choice(WORDS, 2, replace=False))
    docs.append(title + "\n" + " ".join(rng.choice(WORDS, int(rng.integers(6, 16)))) + ".")
  return docs


def _write_encoder(path, words=WORDS):
  """A 2-layer, 32-wide BERT with random weights and a lower-casing WordPiece tokenizer over
  `words` (titles split into word pieces), both saved by `transformers`."""
  import tokenizers
  vocab = (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "query", "passage", ":", "."]
           + list(words) + ["##" + w for w in words])
  tokenizer = tokenizers.BertWordPieceTokenizer(vocab={w: i for i, w in enumerate(vocab)})
  os.makedirs(path)
  tokenizer.save(os.path.join(path, "tokenizer.json"))
  transformers.BertTokenizerFast(
      tokenizer_file=os.path.join(path, "tokenizer.json")).save_pretrained(path)
  torch.manual_seed(0)
  config = transformers.BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, intermediate_size=64,
                                   max_position_embeddings=128)
  transformers.BertModel(config).save_pretrained(path)


def _brute_force_embeddings(encoder_dir, texts):
  """`f32[N, D]`: each text alone through the model, its hidden states averaged over all of
  its tokens (no padding), divided by their norm."""
  tokenizer = transformers.AutoTokenizer.from_pretrained(encoder_dir)
  model = transformers.AutoModel.from_pretrained(encoder_dir).eval()
  rows = []
  with torch.no_grad():
    for text in texts:
      hidden = model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0]
      mean = hidden.mean(dim=0)
      rows.append((mean / mean.norm()).numpy())
  return np.stack(rows)


def _script(name, *args):
  """Runs scripts/<name> to completion; returns its output."""
  done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", name), *args],
                        env=script_env(OMP_NUM_THREADS="1"),
                        cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
  return done.stdout


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  """The encoder directory, the corpus file (ids "doc0", ...) and its documents."""
  root = tmp_path_factory.mktemp("dense")
  encoder_dir = str(root / "encoder")
  _write_encoder(encoder_dir)
  contents = _documents()
  corpus = root / "corpus.jsonl"
  corpus.write_text("".join(json.dumps({"id": f"doc{i}", "contents": c}) + "\n"
                            for i, c in enumerate(contents)))
  return dict(root=root, encoder=encoder_dir, corpus=str(corpus), contents=contents)


@pytest.fixture(scope="module")
def retriever(world):
  """The exact index, its documents embedded 16 at a time (several padded batches)."""
  return DenseRetriever.from_jsonl(world["corpus"], SentenceEncoder(world["encoder"]),
                                   batch_size=16)


@pytest.fixture(scope="module")
def built_index(world):
  """The directory scripts/build_index.py --encoder writes."""
  out = str(world["root"] / "index")
  printed = _script("build_index.py", f"--corpus={world['corpus']}", f"--out={out}",
                    f"--encoder={world['encoder']}")
  assert "indexed 50 documents (flat, 32-wide embeddings, prefixes e5)" in printed
  return out


def test_ranking_and_scores_equal_a_brute_force_cosine(world, retriever):
  documents = _brute_force_embeddings(world["encoder"],
                                      ["passage: " + c for c in world["contents"]])
  queries = _brute_force_embeddings(world["encoder"], ["query: " + q for q in QUERIES])
  cosine = queries @ documents.T  # f32[Q, N]
  for q, docs in enumerate(retriever.retrieve(QUERIES, k=5)):
    expected = np.argsort(-cosine[q], kind="stable")[:5]
    assert [d.id for d in docs] == [f"doc{i}" for i in expected], QUERIES[q]
    np.testing.assert_allclose([d.score for d in docs], cosine[q, expected], atol=1e-5)
    assert [d.contents for d in docs] == [world["contents"][i] for i in expected]


def test_k_is_capped_at_the_corpus_size(world):
  small = DenseRetriever.from_texts(SentenceEncoder(world["encoder"]), world["contents"][:4])
  docs = small.retrieve(["river"], k=10)[0]
  assert sorted(d.id for d in docs) == ["0", "1", "2", "3"]
  assert [d.score for d in docs] == sorted((d.score for d in docs), reverse=True)


def test_hnsw_finds_the_exact_top_documents_on_a_small_corpus(world, retriever):
  """50 nodes with 32 links each and 64 candidates per search: the graph search visits every
  document, so the approximate index ranks as the exact one."""
  hnsw = DenseRetriever.from_jsonl(world["corpus"], SentenceEncoder(world["encoder"]),
                                   index_type="hnsw")
  for exact, approximate in zip(retriever.retrieve(QUERIES, 3), hnsw.retrieve(QUERIES, 3)):
    assert [d.id for d in approximate] == [d.id for d in exact]
    np.testing.assert_allclose([d.score for d in approximate], [d.score for d in exact],
                               atol=1e-6)


def test_a_saved_index_loads_with_its_encoder_and_prefixes(world, retriever, tmp_path):
  retriever.save(str(tmp_path / "index"))
  assert read_settings(str(tmp_path / "index")) == {
      "encoder": os.path.abspath(world["encoder"]), "prefixes": "e5", "max_length": 256,
      "dim": 32, "index_type": "flat", "num_docs": 50}
  loaded = DenseRetriever.load(str(tmp_path / "index"))
  assert loaded.retrieve(QUERIES, 3) == retriever.retrieve(QUERIES, 3)


def test_build_index_script_writes_the_index_of_the_corpus(built_index, retriever):
  loaded = DenseRetriever.load(built_index)
  assert loaded.encoder.prefixes == "e5" and loaded.index_type == "flat"
  for got, want in zip(loaded.retrieve(QUERIES, 3), retriever.retrieve(QUERIES, 3)):
    assert [(d.id, d.contents) for d in got] == [(d.id, d.contents) for d in want]
    np.testing.assert_allclose([d.score for d in got], [d.score for d in want], atol=1e-6)


def test_server_answers_search_r1_requests_byte_for_byte(built_index):
  server = subprocess.Popen(
      [sys.executable, os.path.join(ROOT, "scripts", "serve_retriever.py"), "--backend=dense",
       f"--index_dir={built_index}", "--port=0", "--topk=3"],
      env=script_env(OMP_NUM_THREADS="1"),
      cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  try:
    for line in server.stdout:  # log lines, then the address
      if match := re.search(r"Serving on (http://\S+)", line):
        break
    assert match, server.poll()
    url = match.group(1)
    local = DenseRetriever.load(built_index)
    queries = QUERIES[:3]
    for return_scores in (True, False):
      # Search-R1's client: `requests.post(url, json=payload).json()["result"]`.
      payload = {"queries": queries, "topk": 3, "return_scores": return_scores}
      request = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                       headers={"Content-Type": "application/json"})
      with urllib.request.urlopen(request, timeout=30) as response:
        body = response.read()
      expected = format_response(local.retrieve(queries, 3), return_scores)
      assert body == json.dumps(expected).encode()
    # Search-R1's `_passages2string` reads each item's document contents: title, then text.
    for item in json.loads(body)["result"][0]:
      title, text = item["contents"].split("\n", 1)
      assert f"{title}\n{text}" in _documents()
    assert HttpRetriever(url).retrieve(queries, 3) == local.retrieve(queries, 3)
  finally:
    server.send_signal(signal.SIGTERM)
    server.wait(timeout=30)


def test_env_retriever_dense_searches_the_saved_index(kg, built_index, tmp_path):
  from test_configs import load
  from pbsd_jax.run import run_config, task as task_lib
  config = load("grpo", f"--config.data.dir={os.path.dirname(kg.paths['spm_model'])}",
                "--config.env.retriever=dense", f"--config.env.index_dir={built_index}")
  task = task_lib.prepare_task(run_config.validate(config, num_devices=1), str(tmp_path))
  assert isinstance(task.search, DenseRetriever)
  assert task.search.retrieve(QUERIES, 3) == DenseRetriever.load(built_index).retrieve(QUERIES, 3)


@pytest.mark.parametrize("index_dir, why", [
    ("", "needs the directory of a dense index"),
    ("{tmp}", "is not a saved dense index"),
])
def test_env_retriever_dense_without_an_index_fails_naming_the_field(index_dir, why, tmp_path):
  from test_configs import load
  from pbsd_jax.run import run_config
  config = load("grpo", "--config.env.retriever=dense",
                f"--config.env.index_dir={index_dir.format(tmp=tmp_path)}")
  with pytest.raises(run_config.ConfigError, match=r"^config\.env\.index_dir\b") as error:
    run_config.validate(config, num_devices=1)
  assert why in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("corpus, error", [
    ("", "the corpus has no documents"),
    ('{"id": "a", "contents": "x"}\n{"id": "b", "text": "y"}\n',
     "line 2: field 'contents' must be a string"),
])
def test_a_bad_corpus_is_named_with_file_and_line(world, tmp_path, corpus, error):
  path = tmp_path / "corpus.jsonl"
  path.write_text(corpus)
  with pytest.raises(ValueError, match=re.escape(f"{path}") + ".*" + re.escape(error)):
    DenseRetriever.from_jsonl(str(path), SentenceEncoder(world["encoder"]))


def test_bad_arguments_are_named(world, retriever, tmp_path):
  with pytest.raises(ValueError, match="k must be a positive int"):
    retriever.retrieve(["river"], 0)
  with pytest.raises(ValueError, match="prefixes must be one of"):
    SentenceEncoder(world["encoder"], prefixes="bge")
  with pytest.raises(ValueError, match="not a Hugging Face model directory"):
    SentenceEncoder(str(tmp_path))
  with pytest.raises(ValueError, match="index_type must be one of"):
    DenseRetriever.from_texts(retriever.encoder, ["a"], index_type="ivf")
  with pytest.raises(ValueError, match="not a saved dense index"):
    DenseRetriever.load(str(tmp_path))
