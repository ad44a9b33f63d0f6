"""The protocol on the tokens' text (tags of several tokens): the answer normalisation on
device against `rewards.normalize_answer`, and the in-graph rollout against the host rollout
with a real BPE tokenizer."""

import string

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st

from pbsd_jax import protocol
from pbsd_jax.agent.batch import forced_batch, gold_text_batch, prompt_region
from pbsd_jax.agent.env import rewards, token_text
from pbsd_jax.agent.env.agent_env import AgentEnv, KIND_ANSWER, KIND_INVALID, KIND_SEARCH
from pbsd_jax.agent.env.token_retriever import TokenBM25Retriever
from pbsd_jax.agent.rollout import host_rollout, ingraph_rollout
from pbsd_jax.agent.tokenizer import Tokenizer
from pbsd_jax.data import vocab as vocab_lib
from pbsd_jax.generate.sampling import Sampler
from pbsd_jax.models import ModelConfig, init_params
from test_real_model import DOCUMENTS, QUESTIONS, _contents, _write_tokenizer

WORDS = ["a", "an", "the", "The", "A", "ANd", "then", "ant", "x", "Cold", "ash", "an.", "the,",
         "'the'", "a-b", "U.S.", "1,000", "(the)", "thea", "ta"]


WIDTH = 64
_normalize = jax.jit(token_text.normalize_bytes)


@hypothesis.settings(max_examples=300, deadline=None, database=None)
@hypothesis.given(st.lists(st.one_of(st.sampled_from(WORDS),
                                     st.sampled_from([" ", "  ", "\t", "\n", " . "]),
                                     st.text(string.ascii_letters + string.punctuation + " ",
                                             max_size=4)), max_size=10))
def test_normalize_bytes_is_squad_normalisation_on_ascii(parts):
  text = "".join(parts)
  data = np.frombuffer(text.encode(), np.uint8).astype(np.int32)[:WIDTH - 2]
  s = np.full((1, WIDTH), -1, np.int32)
  s[0, 1:1 + len(data)] = data
  keep = (np.arange(WIDTH) >= 1) & (np.arange(WIDTH) < 1 + len(data))  # one byte left out
  got, n = _normalize(jnp.asarray(s), jnp.asarray(keep[None]))
  text = text.encode()[:WIDTH - 2].decode()
  got = bytes(int(b) for b in np.asarray(got)[0, :int(n[0])])
  assert got == rewards.normalize_answer(text).encode(), repr(text)


@pytest.fixture(scope="module")
def bpe_task(tmp_path_factory):
  """The real-model test's BPE tokenizer (tags several tokens), a token BM25 over its corpus
  and a random tiny model."""
  path = tmp_path_factory.mktemp("bpe")
  _write_tokenizer(str(path))
  vocab = vocab_lib.HfTokenizerVocabulary(str(path / "tokenizer.json"))
  encode = lambda text: list(vocab.encode(text))
  retriever = TokenBM25Retriever.from_texts(
      [_contents(*d) for d in DOCUMENTS], encode, vocab.vocab_size,
      ignore_ids=vocab_lib.non_term_ids(vocab))
  env = AgentEnv.from_vocab(vocab, buffer_size=160, max_turns=3, max_action_tokens=28,
                            max_observation_tokens=48, max_query_tokens=12, top_k=1,
                            ignore_ids=vocab_lib.whitespace_ids(vocab))
  assert env.text_tags
  text = token_text.build(vocab_lib.token_bytes(vocab), (vocab.eos_id, vocab.pad_id))
  model = ModelConfig(vocab_size=vocab.vocab_size, hidden_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, mlp_dim=64)
  return vocab, encode, retriever, env, text, model, init_params(model, jax.random.key(0))


# Forced plans: a right answer after a search, a wrong one, an answer with articles and
# punctuation, an invalid turn then an answer, and a search whose tags are glued to text.
PLANS = [
    ["<search> Varnhollow founder </search>", "<answer> Ditu Ponn </answer>"],
    ["<search>Ditu Ponn born</search>", "<answer>Varnhollow</answer>"],
    ["<answer> the  Blue boats! </answer>"],
    ["I think </answer>", "<search> Cold Ash </search>", "x <answer>Grey Lake</answer>\n"],
    ["<think>hm</think><search>Amon Tell</search>", "<answer>Varnhollow.</answer>"],
]
GOLD = [["Ditu Ponn"], ["Sel Marra"], ["blue boats"], ["Grey Lake", "the lake"],
        ["Varnhollow"]]


def test_the_in_graph_rollout_agrees_with_the_host_rollout_with_text_tags(bpe_task):
  """Token for token, turn kinds and rewards: forced Search-R1 actions (tags several tokens,
  some glued to text) and sampled turns, in-graph over the `BM25Index` and in the host loop
  over the same index; the in-graph reward (normalised bytes on device) equals the host's
  text exact match, and both equal the hand-computed one."""
  vocab, encode, retriever, env, text, model, params = bpe_task
  questions = [q for q, _, _ in QUESTIONS[:len(PLANS)]]
  region = prompt_region(questions, encode, 40)
  forced, lengths = forced_batch(PLANS, encode, env.max_turns, env.max_action_tokens)
  gold = gold_text_batch(GOLD, 32)
  sampler = Sampler(model)
  for f in ((forced, lengths), (None, None)):  # forced, then sampled from random weights
    graph = ingraph_rollout(sampler, env, params, region["prompts"], region["prompt_mask"],
                            jax.random.key(3), retriever.index, gold, None, *f, text=text)
    host = host_rollout(sampler, env, params, region["prompts"], region["prompt_mask"],
                        jax.random.key(3), retriever, Tokenizer(vocab, text), GOLD, None, *f)
    for field in ("tokens", "action_mask", "turn_ids", "num_turns", "length", "turn_kind",
                  "reward", "searches", "finished"):
      np.testing.assert_array_equal(getattr(graph, field), getattr(host, field), field)
  np.testing.assert_array_equal(graph.reward, np.zeros(len(PLANS)))  # random weights
  forced_graph = ingraph_rollout(sampler, env, params, region["prompts"], region["prompt_mask"],
                                 jax.random.key(3), retriever.index, gold, None, forced,
                                 lengths, text=text)
  np.testing.assert_array_equal(forced_graph.reward, [1, 0, 1, 1, 1])
  np.testing.assert_array_equal(np.asarray(forced_graph.turn_kind), [
      [KIND_SEARCH, KIND_ANSWER, -1], [KIND_SEARCH, KIND_ANSWER, -1], [KIND_ANSWER, -1, -1],
      [KIND_INVALID, KIND_SEARCH, KIND_ANSWER], [KIND_SEARCH, KIND_ANSWER, -1]])
  # The search observed the document holding the answer, its tags written as token sequences.
  row = np.asarray(forced_graph.tokens)[0, 40:int(forced_graph.length[0])].tolist()
  action = encode(PLANS[0][0])
  assert row[:len(action)] == action
  observation = vocab.decode(row[len(action):len(action) + env.max_observation_tokens])
  assert any(observation.startswith(f"{protocol.INFO_OPEN}{_contents(*d)}\n{protocol.INFO_CLOSE}")
             for d in DOCUMENTS), observation
