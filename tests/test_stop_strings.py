"""Stop strings on device against a brute-force decode-and-search of the text, over a real
byte-level BPE vocabulary (trained here by `tokenizers`, protocol tags several tokens each) and
the embedded task's SentencePiece vocabulary."""

import json
import re

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
from hypothesis import strategies as st
from tokenizers import decoders, models, pre_tokenizers, trainers

from pbsd_jax import protocol
from pbsd_jax.data import vocab as vocab_lib
from pbsd_jax.generate import stop_strings
from pbsd_jax.generate.sampling import STOP_SEQUENCE, Sampler
from pbsd_jax.models import ModelConfig, init_params

STOPS = (protocol.SEARCH_CLOSE, protocol.ANSWER_CLOSE)
CORPUS = ["<search> Varnhollow founder </search>.", "<answer>Ditu Ponn</answer>\"",
          "</search>\n<information>Doc 1: Varnhollow was founded by Ditu Ponn.</information>",
          "I need to search for the founder. <search>founder of Varnhollow</search>",
          "héllo wörld — «ünïcode» </answer>!", "search answer searching answered >> </ /> <>"]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
  """A Qwen-style byte-level BPE `tokenizer.json` as our `HfTokenizerVocabulary`."""
  tokenizer = tokenizers.Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.train_from_iterator(CORPUS * 8, trainers.BpeTrainer(
      vocab_size=420, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
  path = str(tmp_path_factory.mktemp("bpe") / "tokenizer.json")
  tokenizer.save(path)
  return vocab_lib.HfTokenizerVocabulary(path, eos_token="<|im_end|>")


@pytest.fixture(scope="module")
def metaspace(tmp_path_factory):
  """A SentencePiece-style BPE (`▁` word starts, Metaspace decoder, Llama-2 style)."""
  tokenizer = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
  tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
  tokenizer.decoder = decoders.Metaspace()
  tokenizer.train_from_iterator(CORPUS * 8, trainers.BpeTrainer(
      vocab_size=300, special_tokens=["<unk>", "</s>"], show_progress=False))
  path = str(tmp_path_factory.mktemp("metaspace") / "tokenizer.json")
  tokenizer.save(path)
  return vocab_lib.HfTokenizerVocabulary(path, eos_token="</s>")


def _decode(vocab, ids):
  """The text as the tokenizer itself decodes it (special tokens written out)."""
  if isinstance(vocab, vocab_lib.HfTokenizerVocabulary):
    return vocab.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)
  return vocab.tokenizer.decode([int(i) for i in ids])


def _first_stop(vocab, ids, stops=STOPS):
  """Brute force: the first prefix length whose decoded text contains a stop, and which."""
  for n in range(1, len(ids) + 1):
    text = _decode(vocab, ids[:n])
    found = [i for i, s in enumerate(stops) if s in text]
    if found:
      return n, found[0]
  return None, -1


@jax.jit
def _device_first_stop(table, ids, length):
  """`advance` over one row's first `length` tokens (`ids` padded to any width): the first
  step where a string occurs, and which."""
  def step(state, token):
    state, occurred = stop_strings.advance(table, state, token[None])
    return state, occurred[0]
  _, occurred = jax.lax.scan(step, stop_strings.start_state(table, 1), ids)
  hit = jnp.any(occurred, -1) & (jnp.arange(ids.shape[0]) < length)
  n = jnp.where(jnp.any(hit), jnp.argmax(hit) + 1, -1)
  return n, jnp.where(jnp.any(hit), jnp.argmax(occurred[jnp.argmax(hit)]), -1)


def test_the_protocol_tags_are_several_tokens_in_the_bpe_vocabulary(bpe):
  for tag in STOPS:
    assert len(bpe.encode(tag)) > 1, tag
  # ... and a merge carries a tag's end into the text after it: a token that holds ">" and more.
  pieces = vocab_lib.token_bytes(bpe)
  assert any(p.startswith(b">") and len(p) > 1 for p in pieces)


def test_token_bytes_concatenate_to_the_decoded_text(bpe, metaspace, kg):
  rng = np.random.default_rng(0)
  for vocab in (bpe, metaspace, kg.vocab):
    pieces = vocab_lib.token_bytes(vocab)
    assert len(pieces) == vocab.vocab_size
    for _ in range(200):
      ids = rng.integers(0, vocab.vocab_size, rng.integers(1, 30))
      ids = [i for i in ids if i not in (vocab.eos_id, vocab.pad_id)]
      text = b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")
      # Tokenizers replace a broken UTF-8 sequence by one or several U+FFFD: compare runs.
      want = re.sub("\ufffd+", "\ufffd", _decode(vocab, ids)).lstrip(" ")
      assert re.sub("\ufffd+", "\ufffd", text).lstrip(" ") == want, ids


def _sequences(vocab):
  """Token sequences where tags occur: encoded protocol fragments mixed with random ids."""
  fragments = [list(vocab.encode(t)) for t in
               (*STOPS, "</", "search", ">", "answer", "</sea", "rch>", "<search>", " x",
                "Ditu Ponn", "</search>.", "answer>\"", "<", "/")]
  piece = st.one_of(st.sampled_from(fragments),
                    st.lists(st.integers(0, vocab.vocab_size - 1), min_size=1, max_size=3))
  return st.lists(piece, min_size=1, max_size=12).map(lambda parts: sum(parts, [])[:48])


@pytest.mark.parametrize("which", ["bpe", "metaspace", "sentencepiece"])
def test_the_device_matcher_stops_where_decode_and_search_does(which, bpe, metaspace, kg):
  vocab = {"bpe": bpe, "metaspace": metaspace, "sentencepiece": kg.vocab}[which]
  table = stop_strings.build(vocab_lib.token_bytes(vocab), STOPS)
  seen = {"stopped": 0, "across_tokens": 0, "never": 0}

  @hypothesis.settings(max_examples=300, deadline=None, database=None,
                       suppress_health_check=list(hypothesis.HealthCheck))
  @hypothesis.given(_sequences(vocab))
  def check(ids):
    ids = [i for i in ids if i not in (vocab.eos_id, vocab.pad_id)] or [ids[0]]
    want_n, want_i = _first_stop(vocab, ids)
    padded = np.zeros(48, np.int32)  # every sequence's width: one program
    padded[:len(ids)] = ids
    n, i = (int(x) for x in _device_first_stop(table, padded, len(ids)))
    assert (n, i) == (want_n or -1, want_i), (ids, _decode(vocab, ids))
    if want_n is None:
      seen["never"] += 1
    else:
      seen["stopped"] += 1
      last = _decode(vocab, ids[want_n - 1:want_n])
      seen["across_tokens"] += STOPS[want_i] not in last

  check()
  # Both outcomes occurred, and tags completed by a token that does not hold them whole.
  assert seen["stopped"] > 30 and seen["never"] > 30, seen
  if which == "bpe":
    assert seen["across_tokens"] > 10, seen


def test_sampling_stops_right_after_the_token_that_completes_a_string(bpe):
  """Random weights, temperature 1, short stop strings that samples often complete: each row
  stops exactly where its sampled text first holds one (whole or across tokens, which the
  matcher test above covers), with that string's index; the other rows use their budget."""
  stops = ("ar", "in", "e ")
  table = stop_strings.build(vocab_lib.token_bytes(bpe), stops)
  config = ModelConfig(vocab_size=bpe.vocab_size, hidden_size=32, num_layers=1, num_heads=2,
                       num_kv_heads=1, mlp_dim=64)
  params = init_params(config, jax.random.key(0))
  rows, budget = 32, 24
  prompt = jnp.zeros((rows, 1), jnp.int32)
  state, result = Sampler(config).generate(params, prompt, jnp.ones((rows, 1), bool),
                                           jax.random.key(1), budget, stop_strings=table)
  tokens, num_new = np.asarray(state.tokens), np.asarray(result.num_new)
  reasons, index = np.asarray(result.stop_reason), np.asarray(result.stop_index)
  for r in range(rows):
    sampled = tokens[r, 1:1 + num_new[r]].tolist()
    n, i = _first_stop(bpe, sampled, stops)
    if reasons[r] == STOP_SEQUENCE:
      assert (n, i) == (num_new[r], index[r]), (r, _decode(bpe, sampled))
    else:
      assert n is None and num_new[r] == budget, (r, _decode(bpe, sampled))
  stopped = reasons == STOP_SEQUENCE
  assert 0 < stopped.sum() < rows and len(set(index[stopped])) >= 2, (reasons, index)


def test_stop_strings_must_be_non_empty():
  with pytest.raises(ValueError, match="non-empty"):
    stop_strings.build([b"a"], ["</search>", ""])


def test_an_unsupported_decoder_is_named(tmp_path):
  tokenizer = tokenizers.Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
  tokenizer.decoder = decoders.WordPiece()
  path = str(tmp_path / "tokenizer.json")
  tokenizer.save(path)
  spec = json.loads(open(path).read())
  assert spec["decoder"]["type"] == "WordPiece"
  with pytest.raises(ValueError, match="WordPiece"):
    vocab_lib.token_bytes(vocab_lib.HfTokenizerVocabulary(path, eos_token="[UNK]"))


def _turn_sequences(vocab):
  """Whole turns: junk, an opening tag, a query or answer, a closing tag and a tail, each part
  drawn from protocol fragments (tags whole and split, other tags, whitespace) and random
  ids; sometimes ended by EOS."""
  enc = lambda *texts: [list(vocab.encode(t)) for t in texts]
  junk = st.one_of(st.sampled_from(enc(*protocol.TAGS, "</", "search", ">", "<search", "  ",
                                       "answer>", " x", "\n", "</search>.")),
                   st.lists(st.integers(0, vocab.vocab_size - 1), min_size=1, max_size=2))
  part = lambda *texts: st.one_of(st.sampled_from(enc(*texts)), st.sampled_from(enc(*texts)),
                                  junk, st.just([]))
  tags = {"search": (("<search>", " <search> ", "<search>\n"), ("</search>", "</search>\n")),
          "answer": (("<answer>", " <answer>"), ("</answer>", " </answer>"))}
  turn = st.sampled_from(sorted(tags)).flatmap(lambda kind: st.tuples(
      st.lists(junk, max_size=3).map(lambda parts: sum(parts, [])), part(*tags[kind][0]),
      part("Ditu Ponn", " founder of Varnhollow ", " ", "x"), part(*tags[kind][1]),
      part(" ", "\n", "", ".")))
  ids = turn.map(lambda parts: sum(parts, [])[:40])
  return st.tuples(ids, st.sampled_from([False, False, False, True])).map(
      lambda t: ([i for i in t[0] if i not in (vocab.eos_id, vocab.pad_id)] or [32])
      + [vocab.eos_id] * t[1])


@pytest.mark.parametrize("which", ["bpe", "metaspace"])
def test_text_turns_are_classified_as_parse_action_reads_the_decoded_text(which, bpe, metaspace):
  """`classify_text_turn` on device against `actions.parse_action` of the decoded turn: the
  kind, and the query tokens hold the parsed query (they are the tokens holding its bytes)."""
  from pbsd_jax.agent.env import actions, token_text
  from pbsd_jax.agent.env.agent_env import (AgentEnv, KIND_ANSWER, KIND_EOS, KIND_INVALID,
                                            KIND_SEARCH)
  vocab = {"bpe": bpe, "metaspace": metaspace}[which]
  env = AgentEnv.from_vocab(vocab, buffer_size=64, max_turns=1, max_action_tokens=48,
                            max_observation_tokens=40, max_query_tokens=48, top_k=1)
  assert env.text_tags
  text = token_text.build(vocab_lib.token_bytes(vocab), (vocab.eos_id, vocab.pad_id))
  classify = jax.jit(token_text.classify_text_turn, static_argnums=3)
  kinds = {actions.SEARCH: KIND_SEARCH, actions.ANSWER: KIND_ANSWER,
           actions.INVALID: KIND_INVALID}
  seen = {k: 0 for k in (KIND_SEARCH, KIND_ANSWER, KIND_INVALID, KIND_EOS)}

  @hypothesis.settings(max_examples=300, deadline=None, database=None,
                       suppress_health_check=list(hypothesis.HealthCheck))
  @hypothesis.given(_turn_sequences(vocab))
  def check(ids):
    row = np.zeros((1, 64), np.int32)
    row[0, 5:5 + len(ids)] = ids  # the turn starts after other tokens
    kind, query = classify(jnp.asarray(row), jnp.array([5]), jnp.array([5 + len(ids)]), env,
                           text)
    kind, query = int(kind[0]), [int(t) for t in query[0] if t >= 0]
    parsed = actions.parse_action(vocab.decode(ids), max_query_chars=10 ** 6)
    want = KIND_EOS if ids and ids[-1] == vocab.eos_id else kinds[parsed.kind]
    assert kind == want, (ids, vocab.decode(ids), parsed)
    seen[kind] += 1
    if kind == KIND_SEARCH:
      assert parsed.content in vocab.decode(query), (vocab.decode(ids), vocab.decode(query))
      # The query tokens are a contiguous run of the turn's.
      start = next(i for i in range(len(ids)) if ids[i:i + len(query)] == query)
      assert ids[start:start + len(query)] == query
    else:
      assert not query

  check()
  assert min(seen.values()) >= 20, seen
