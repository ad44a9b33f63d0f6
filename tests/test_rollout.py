"""The multi-turn rollout on the embedded task: both compositions, replay, turn rules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pbsd_jax import protocol
from pbsd_jax.agent.batch import forced_batch, gold_batch, prompt_region
from pbsd_jax.agent.env.agent_env import (AgentEnv, KIND_ANSWER, KIND_EOS, KIND_INVALID,
                                          KIND_SEARCH, assemble_observation, classify_turn)
from pbsd_jax.agent.env.http import HttpRetriever, RetrievalServer
from pbsd_jax.agent.env.observations import format_document
from pbsd_jax.agent.rollout import host_rollout, ingraph_rollout, rollout_actions
from pbsd_jax.agent.tokenizer import Tokenizer
from pbsd_jax.data import vocab as vocab_lib
from pbsd_jax.generate.sampling import Sampler
from pbsd_jax.models import ModelConfig, init_params
from script_env import script_env

P, MAX_TURNS, ACTION = 40, 6, 40
FIELDS = ("tokens", "action_mask", "turn_ids", "num_turns", "length", "prompt_length",
          "finished", "truncated", "reward", "search_failures")


def _assert_same_rollout(a, b):
  for field in FIELDS:
    np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
  # Two compilations of the same math may differ in the last float bit.
  np.testing.assert_allclose(a.sample_logp, b.sample_logp, atol=1e-5)


@pytest.fixture(scope="module")
def setup(kg):
  env = AgentEnv.from_vocab(kg.vocab, buffer_size=720, max_turns=MAX_TURNS,
                            max_action_tokens=ACTION, max_observation_tokens=160,
                            max_query_tokens=16, top_k=3,
                            ignore_ids=vocab_lib.whitespace_ids(kg.vocab))
  config = ModelConfig(vocab_size=kg.vocab.vocab_size, hidden_size=32, num_layers=1,
                       num_heads=2, num_kv_heads=1, mlp_dim=64)
  sampler = Sampler(config)
  return env, sampler, init_params(config, jax.random.key(0))


def _prompts(kg, records):
  region = prompt_region([r["question"] for r in records], kg.encode, P)
  return jnp.asarray(region["prompts"]), jnp.asarray(region["prompt_mask"])


def _forced(kg, action_lists):
  return tuple(map(jnp.asarray, forced_batch(action_lists, kg.encode, MAX_TURNS, ACTION)))


def _gold(kg, golden_answers):
  return jnp.asarray(gold_batch(golden_answers, kg.encode, 12))


def _both(kg, setup, records, rng, forced=(None, None), retriever=None):
  env, sampler, params = setup
  tokens, mask = _prompts(kg, records)
  golds = [r["golden_answers"] for r in records]
  graph = ingraph_rollout(sampler, env, params, tokens, mask, rng, kg.retriever.index,
                          _gold(kg, golds), None, *forced)
  host = host_rollout(sampler, env, params, tokens, mask, rng, retriever or kg.retriever,
                      kg.tokenizer, golds, None, *forced)
  return graph, host


def test_ingraph_and_host_rollouts_are_identical_when_replaying_oracle_actions(kg, setup):
  records = kg.records("sft")[:6]
  graph, host = _both(kg, setup, records, jax.random.key(0),
                      _forced(kg, [r["actions"] for r in records]))
  _assert_same_rollout(graph, host)
  np.testing.assert_array_equal(graph.reward, np.ones(6))
  np.testing.assert_array_equal(graph.num_turns, [len(r["actions"]) for r in records])
  assert bool(graph.finished.all()) and not bool(graph.truncated.any())


def test_ingraph_and_host_rollouts_are_identical_when_sampling(kg, setup):
  graph, host = _both(kg, setup, kg.records("rl_validation")[:4], jax.random.key(3))
  _assert_same_rollout(graph, host)
  assert int(graph.num_action_tokens.min()) > 0
  # The untrained policy rarely closes a tag: it runs out of turns and scores nothing.
  assert bool(graph.truncated.any())


def test_oracle_replay_reproduces_actions_observations_and_turn_ids(kg, setup):
  env, _, _ = setup
  records = kg.records("sft")[:6]
  out, _ = _both(kg, setup, records, jax.random.key(0),
                 _forced(kg, [r["actions"] for r in records]))
  for b, r in enumerate(records):
    prompt = kg.encode(protocol.format_prompt(r["question"]))
    row = np.asarray(out.tokens[b])
    np.testing.assert_array_equal(row[P - len(prompt):P], prompt)
    assert int(out.prompt_length[b]) == len(prompt)
    col = P
    for k, action in enumerate(r["actions"]):
      ids = kg.encode(action)
      np.testing.assert_array_equal(row[col:col + len(ids)], ids)
      assert np.all(np.asarray(out.action_mask[b, col:col + len(ids)]))
      assert np.all(np.asarray(out.turn_ids[b, col:col + len(ids)]) == k)
      col += len(ids)
      if k == len(r["actions"]) - 1:
        break
      query = action.split(protocol.SEARCH_OPEN)[1].split(protocol.SEARCH_CLOSE)[0]
      docs = kg.retriever.retrieve_ids([kg.encode(query)], 3)[0]
      body = [t for d in docs for t in kg.encode(format_document(d))]
      body = body[:env.max_observation_tokens - 2]
      want = [env.info_open] + body + [env.info_close]
      np.testing.assert_array_equal(row[col:col + len(want)], want)
      assert not np.any(np.asarray(out.action_mask[b, col:col + len(want)]))
      assert np.all(np.asarray(out.turn_ids[b, col:col + len(want)]) == -1)
      if r["gold_doc_ids"][k] is not None:
        assert docs[0].id == str(r["gold_doc_ids"][k])  # the exact name finds its document
      col += len(want)
    assert int(out.length[b]) == col
  assert not np.any(np.asarray(out.action_mask[:, :P]))


def test_a_forced_prefix_then_sampled_rollout_is_the_trajectory_then_the_policy(kg, setup):
  """The oracle's first two turns replayed, the random policy after them."""
  env, sampler, params = setup
  records = kg.records("sft")[:6]
  tokens, mask = _prompts(kg, records)
  gold = _gold(kg, [r["golden_answers"] for r in records])
  run = lambda rng, *forced, prefix=None: ingraph_rollout(
      sampler, env, params, tokens, mask, rng, kg.retriever.index, gold, None, *forced,
      prefix_turns=prefix)
  oracle = _forced(kg, [r["actions"] for r in records])
  full = run(jax.random.key(0), *oracle)
  rng = jax.random.key(5)
  mixed = run(rng, *oracle, prefix=jnp.int32(2))
  ids, full_ids = np.asarray(mixed.turn_ids), np.asarray(full.turn_ids)
  for b in range(len(records)):
    start = int(np.argmax(full_ids[b] == 2))  # where the oracle's third turn began
    np.testing.assert_array_equal(mixed.tokens[b, :start], full.tokens[b, :start])
    assert np.any(ids[b] == 2) and not np.array_equal(mixed.tokens[b, start:start + 8],
                                                      full.tokens[b, start:start + 8])
  # The continuation is the environment's: forcing every action it took gives it back.
  again = run(rng, *map(jnp.asarray, rollout_actions(mixed, MAX_TURNS, ACTION)))
  for field in ("tokens", "turn_ids", "action_mask", "num_turns", "length", "reward",
                "turn_kind", "turn_doc"):
    np.testing.assert_array_equal(getattr(again, field), getattr(mixed, field), err_msg=field)
  # A prefix of every turn is the replay; a prefix of none, the policy's own rollout.
  np.testing.assert_array_equal(run(rng, *oracle, prefix=jnp.int32(MAX_TURNS)).tokens,
                                full.tokens)
  np.testing.assert_array_equal(run(rng, *oracle, prefix=jnp.int32(0)).tokens, run(rng).tokens)


def test_observation_tokens_are_never_marked_as_actions(kg, setup):
  env, _, _ = setup
  graph, _ = _both(kg, setup, kg.records("sft")[6:10], jax.random.key(1),
                   _forced(kg, [r["actions"] for r in kg.records("sft")[6:10]]))
  info = np.isin(np.asarray(graph.tokens), [env.info_open, env.info_close])
  assert info.sum() > 0 and not np.any(info & np.asarray(graph.action_mask))
  np.testing.assert_array_equal(np.asarray(graph.turn_ids) >= 0, graph.action_mask)


def test_invalid_action_gets_a_notice_and_the_episode_goes_on(kg, setup):
  env, _, _ = setup
  record = kg.records("sft")[0]
  actions = ["<think> hmm </think> no tag here"] + record["actions"]
  out, _ = _both(kg, setup, [record], jax.random.key(0), _forced(kg, [actions]))
  first = len(kg.encode(actions[0]))
  notice = np.asarray(out.tokens[0, P + first:P + first + len(env.notice)])
  np.testing.assert_array_equal(notice, env.notice)
  assert float(out.reward[0]) == 1.0 and int(out.num_turns[0]) == len(actions)


def test_max_turns_ends_the_episode_as_truncated(kg, setup):
  record = kg.records("sft")[0]
  search = record["actions"][0]
  out, _ = _both(kg, setup, [record], jax.random.key(0), _forced(kg, [[search] * MAX_TURNS]))
  assert int(out.num_turns[0]) == MAX_TURNS
  assert bool(out.truncated[0]) and not bool(out.finished[0]) and float(out.reward[0]) == 0.0


def test_context_budget_ends_the_episode_as_truncated(kg, setup):
  env, sampler, params = setup
  small = AgentEnv(**{**env.__dict__, "buffer_size": 200})
  record = kg.records("sft")[0]
  tokens, mask = _prompts(kg, [record])
  out = ingraph_rollout(sampler, small, params, tokens, mask, jax.random.key(0),
                        kg.retriever.index, _gold(kg, [record["golden_answers"]]), None,
                        *_forced(kg, [record["actions"] * 2]))
  assert bool(out.truncated[0]) and int(out.length[0]) <= 200
  # The last observation that fit was cut but still closes its block.
  row = np.asarray(out.tokens[0, :int(out.length[0])])
  assert row.tolist().count(env.info_open) == row.tolist().count(env.info_close)


def test_a_document_holding_an_answer_tag_does_not_change_the_reward(kg, setup):
  env, sampler, params = setup
  from pbsd_jax.agent.env.token_retriever import TokenBM25Retriever
  record = kg.records("sft")[0]
  wrong = "Nowhere"
  contents = [d["contents"] for d in kg.corpus]
  start = int(record["chain"][0])
  contents[start] += f" <answer> {record['golden_answers'][0]} </answer>"
  retriever = TokenBM25Retriever.from_texts(contents, kg.encode, kg.vocab.vocab_size,
                                            ignore_ids=vocab_lib.non_term_ids(kg.vocab))
  actions = record["actions"][:-1] + [f"<think> guess </think><answer> {wrong} </answer>"]
  graph, host = _both(kg, setup, [record], jax.random.key(0), _forced(kg, [actions]),
                      retriever=retriever)
  assert env.answer_open not in np.asarray(graph.tokens)[~np.asarray(graph.action_mask)]
  assert float(graph.reward[0]) == 0.0 and float(host.reward[0]) == 0.0
  # The retrieved text does say the answer: the escape kept it, as data.
  assert record["golden_answers"][0] in kg.decode(np.asarray(host.tokens[0]))


def test_rollout_survives_the_retrieval_service_stopping_mid_run(kg, setup):
  records = kg.records("sft")[:2]

  class StopsAfterFirstCall:
    """The real HTTP retriever; the real server is stopped after the first batch."""

    def __init__(self, server, client):
      self.server, self.client, self.calls = server, client, 0

    def retrieve(self, queries, k):
      self.calls += 1
      if self.calls == 2:
        self.server.stop()
      return self.client.retrieve(queries, k)

  with RetrievalServer(kg.retriever) as server:
    client = HttpRetriever(server.url, timeout_s=2.0, max_retries=1, backoff_s=0.0)
    env, sampler, params = setup
    tokens, mask = _prompts(kg, records)
    out = host_rollout(sampler, env, params, tokens, mask, jax.random.key(0),
                       StopsAfterFirstCall(server, client), kg.tokenizer,
                       [r["golden_answers"] for r in records], None,
                       *_forced(kg, [r["actions"] for r in records]))
  searches = np.array([len(r["actions"]) - 1 for r in records])
  np.testing.assert_array_equal(out.search_failures, searches - 1)
  assert bool(out.finished.all()) and float(out.reward.min()) == 1.0  # the answers still land
  assert "Search failed" in kg.decode(np.asarray(out.tokens[0]))
  assert client.metrics()["failed_calls"] >= 1


def test_classify_turn_follows_the_last_closing_tag():
  env = AgentEnv(buffer_size=12, max_turns=2, max_action_tokens=8, max_observation_tokens=8,
                 max_query_tokens=3, top_k=1, search_open=5, search_close=6, answer_open=9,
                 answer_close=10, info_open=7, info_close=8, eos_id=1, notice=(30,))
  rows = np.array([
      [0, 0, 5, 20, 21, 6, 0, 0, 0, 0, 0, 0],    # search "20 21"
      [0, 0, 5, 20, 5, 22, 6, 0, 0, 0, 0, 0],    # the last <search> wins: "22"
      [0, 0, 5, 6, 0, 0, 0, 0, 0, 0, 0, 0],      # empty query
      [0, 0, 5, 20, 21, 22, 23, 6, 0, 0, 0, 0],  # 4 tokens > max 3
      [0, 0, 9, 20, 10, 0, 0, 0, 0, 0, 0, 0],    # answer
      [0, 0, 20, 10, 0, 0, 0, 0, 0, 0, 0, 0],    # </answer> without <answer>
      [0, 0, 20, 21, 1, 0, 0, 0, 0, 0, 0, 0],    # EOS
      [0, 0, 20, 21, 22, 0, 0, 0, 0, 0, 0, 0],   # budget ran out
      [0, 0, 5, 9, 6, 0, 0, 0, 0, 0, 0, 0],      # a tag inside the query
      [5, 20, 6, 0, 0, 0, 0, 0, 0, 0, 0, 0],     # <search> before the turn starts: invalid
  ])
  start = np.array([2] * 9 + [1])
  end = np.array([6, 7, 4, 8, 5, 4, 5, 5, 5, 3])
  kind, query = classify_turn(jnp.asarray(rows), jnp.asarray(start), jnp.asarray(end), env)
  np.testing.assert_array_equal(kind, [KIND_SEARCH, KIND_SEARCH, KIND_INVALID, KIND_INVALID,
                                       KIND_ANSWER, KIND_INVALID, KIND_EOS, KIND_INVALID,
                                       KIND_INVALID, KIND_INVALID])
  np.testing.assert_array_equal(query[0], [20, 21, -1])
  np.testing.assert_array_equal(query[1], [22, -1, -1])


def test_assemble_observation_concatenates_documents_and_keeps_the_closing_tag():
  docs = jnp.array([[[11, 12, 13], [21, 22, -1]], [[31, -1, -1], [41, 42, 43]]])
  lengths = jnp.array([[3, 2], [1, 3]])
  obs, n = assemble_observation(docs, lengths, jnp.array([100, 5]), (7,), (8,))
  np.testing.assert_array_equal(n, [7, 5])
  np.testing.assert_array_equal(obs[0, :7], [7, 11, 12, 13, 21, 22, 8])
  np.testing.assert_array_equal(obs[1, :5], [7, 31, 41, 42, 8])  # cut to the budget of 5
  assert np.all(np.asarray(obs[:, 7:]) == 0) and np.all(np.asarray(obs[1, 5:]) == 0)
  # Tags of several tokens (a real tokenizer's): the budget counts them, the body is cut.
  obs, n = assemble_observation(docs, lengths, jnp.array([100, 6]), (7, 70), (8, 80, 88))
  np.testing.assert_array_equal(n, [10, 6])
  np.testing.assert_array_equal(obs[0, :10], [7, 70, 11, 12, 13, 21, 22, 8, 80, 88])
  np.testing.assert_array_equal(obs[1, :6], [7, 70, 31, 8, 80, 88])
  assert np.all(np.asarray(obs[1, 6:]) == 0)
  # A budget below the tags and one token shows nothing.
  _, n = assemble_observation(docs, lengths, jnp.array([5, 6]), (7, 70), (8, 80, 88))
  np.testing.assert_array_equal(n, [0, 6])


_ENV_FIELDS = dict(buffer_size=12, max_turns=2, max_action_tokens=8, max_observation_tokens=8,
                   max_query_tokens=3, top_k=1, search_open=5, search_close=6, answer_open=9,
                   answer_close=10, info_open=7, info_close=8, eos_id=1, notice=(30,))


@pytest.mark.parametrize("field, value, why", [
    ("buffer_size", 0, "must be an int >= 1, got 0"),
    ("max_turns", 0, "must be an int >= 1, got 0"),
    ("max_action_tokens", -1, "must be an int >= 1, got -1"),
    ("max_query_tokens", 0, "must be an int >= 1, got 0"),
    ("top_k", 0, "must be an int >= 1, got 0"),
    ("top_k", 1.5, "must be an int >= 1, got 1.5"),
    ("max_observation_tokens", 2, r"must be an int >= 3 \(two tags and a token\), got 2"),
    ("search_close", -1, "must be a token id >= 0, got -1"),
    ("answer_close", 6, "must differ from AgentEnv.search_close, both are 6"),
    ("eos_id", 9, "must differ from AgentEnv.answer_open, both are 9"),
    ("notice", [30], r"must be a tuple of token ids \(hashable\), got \[30\]"),
    ("notice", (), "must not be empty"),
])
def test_agent_env_names_the_field_that_cannot_run(field, value, why):
  with pytest.raises(ValueError, match=f"^AgentEnv.{field} {why}$"):
    AgentEnv(**{**_ENV_FIELDS, field: value})


def test_tags_of_several_tokens_are_kept_as_sequences_and_need_the_vocabulary_text():
  class TwoTokenSearch:
    eos_id = 1

    def encode(self, text):
      ids = {tag: [3 + i] for i, tag in enumerate(protocol.TAGS)}
      return [40, 41] if text == protocol.SEARCH_OPEN else ids.get(text, [50, 51])

  env = AgentEnv.from_vocab(TwoTokenSearch(), buffer_size=8, max_turns=1, max_action_tokens=4,
                            max_observation_tokens=4, max_query_tokens=2, top_k=1)
  assert env.text_tags
  assert env.search_open == (40, 41) and env.tag_tokens("info_open") == (7,)
  with pytest.raises(ValueError, match="several tokens"):
    env.stop_sequences
  prompts = jnp.ones((1, 2), jnp.int32)
  config = ModelConfig(vocab_size=64, hidden_size=16, num_layers=1, num_heads=2,
                       num_kv_heads=1, mlp_dim=32)
  with pytest.raises(ValueError, match="TokenText"):
    ingraph_rollout(Sampler(config), env, None, prompts, prompts > 0, jax.random.key(0),
                    None, jnp.zeros((1, 1, 2), jnp.int32))
  with pytest.raises(ValueError, match="TokenText"):
    host_rollout(Sampler(config), env, None, prompts, prompts > 0, jax.random.key(0), None,
                 Tokenizer(TwoTokenSearch()), [["a"]])


def _oracle_answer(kg, question, relations, start_name, first_query=None):
  """An agent that reads what the environment returns: each hop searches the name it last
  read and follows the relation from the top document's entity. With `first_query`, it gets
  one search only and must chain through the documents that search returned."""
  world = kg.world
  if first_query is not None:
    docs = {int(d.id) for d in kg.retriever.retrieve([first_query], 3)[0]}
    entity = next((i for i in docs if world.entities[i].name == start_name), None)
    for relation in relations:
      if entity is None or entity not in docs:
        return None
      entity = world.follow(entity, relation)
    return world.entities[entity].name
  name = start_name
  for relation in relations:
    top = kg.retriever.retrieve([name], 3)[0][0]
    name = world.entities[world.follow(int(top.id), relation)].name
  return name


def test_the_task_is_solvable_with_good_searches_and_needs_more_than_one(kg):
  from pbsd_jax.agent.env.rewards import exact_match
  records = kg.records("rl_validation")
  oracle = [exact_match(_oracle_answer(kg, r["question"], r["relations"], r["chain_names"][0]),
                        r["golden_answers"]) for r in records]
  assert np.mean(oracle) >= 0.95
  multi = [r for r in records if r["hops"] >= 2]
  one_search = [exact_match(_oracle_answer(kg, r["question"], r["relations"],
                                           r["chain_names"][0], first_query=r["question"])
                            or "", r["golden_answers"]) for r in multi]
  oracle_multi = np.mean([o for o, r in zip(oracle, records) if r["hops"] >= 2])
  assert np.mean(one_search) < oracle_multi - 0.5, (np.mean(one_search), oracle_multi)


def test_moe_rollouts_record_the_routes_that_replayed_evidence_reads(kg, setup):
  from pbsd_jax.agent import privileged
  from pbsd_jax.models import Transformer
  from pbsd_jax.rl import algorithms, evidence, likelihood
  env = setup[0]
  config = ModelConfig(vocab_size=kg.vocab.vocab_size, hidden_size=32, num_layers=1,
                       num_heads=2, num_kv_heads=1, mlp_dim=64, num_experts=4,
                       num_experts_per_tok=2, expert_mlp_dim=32)
  params = init_params(config, jax.random.key(0))
  # A decisive router (random init is near-uniform), so no route is a float tie.
  params["layers"]["moe"]["router_kernel"] *= 100.0
  sampler = Sampler(config, record_routes=True)
  records = kg.records("rl_validation")[:4]
  width = 80
  region = prompt_region([r["question"] for r in records], kg.encode, width,
                         answers=[r["golden_answers"][0] for r in records])
  prompts, pmask = jnp.asarray(region["prompts"]), jnp.asarray(region["prompt_mask"])
  golds = [r["golden_answers"] for r in records]
  graph = ingraph_rollout(sampler, env, params, prompts, pmask, jax.random.key(2),
                          kg.retriever.index, _gold(kg, golds))
  host = host_rollout(sampler, env, params, prompts, pmask, jax.random.key(2), kg.retriever,
                      kg.tokenizer, golds)
  assert int(graph.num_action_tokens.min()) > 0 and int(jnp.sum(graph.observation_mask)) > 0
  for out in (graph, host):
    full = Transformer(config).apply({"params": params}, out.tokens, out.mask).routes
    mask = np.asarray(out.mask)
    np.testing.assert_array_equal(np.asarray(out.routes)[mask],
                                  np.moveaxis(np.asarray(full), 0, 2)[mask])
    assert np.all(np.asarray(out.routes)[~mask] == -1)

  # Replayed evidence: the teacher's trajectory tokens take the student's routes, its
  # privileged prompt is routed afresh; fresh evidence routes the teacher on its own.
  teacher, tmask = jnp.asarray(region["teacher_prompt"]), jnp.asarray(region["teacher_prompt_mask"])
  batch = lambda **kw: evidence.policy_batch(
      params, graph, teacher, tmask, jnp.int32(0), model=config, max_turns=MAX_TURNS,
      algo=algorithms.get("pbsd", group_size=4, **kw)).inputs
  replayed, fresh = batch(replay_routing=True), batch()
  t_tokens, t_mask = privileged.teacher_sequence(graph.tokens, graph.mask, teacher, tmask)
  routes = jnp.moveaxis(graph.routes, 2, 0)
  routes = jnp.where(jnp.arange(routes.shape[2])[None, None, :, None] < width, -1, routes)
  reference = likelihood.token_logprobs(params, config, t_tokens, t_mask, routes=routes,
                                        score_from=width)
  act = np.asarray(graph.action_mask)
  np.testing.assert_allclose(np.asarray(replayed.logp_teacher)[act],
                             np.asarray(reference)[act], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(replayed.logp_student)[act],
                             np.asarray(fresh.logp_student)[act], rtol=1e-5, atol=1e-5)
  gap = np.abs(np.asarray(replayed.logp_teacher) - np.asarray(fresh.logp_teacher))[act]
  assert gap.max() > 1e-3


def test_the_sparse_index_of_build_index_is_what_the_in_graph_run_searches(kg, setup,
                                                                          tmp_path):
  # scripts/build_index.py --tokenizer writes it, prepare_task loads it (env.index_dir) and
  # places its shards on the 8 devices, and in-graph rollouts replaying the oracle's searches
  # see the observations the dense index gives.
  import os
  import subprocess
  import sys
  from pbsd_jax.agent.env.sparse_bm25 import SparseBM25Index
  from pbsd_jax.run import task as task_lib
  from test_configs import load_spec
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  done = subprocess.run(
      [sys.executable, os.path.join(root, "scripts", "build_index.py"),
       f"--corpus={kg.paths['corpus']}", f"--out={tmp_path / 'index'}",
       f"--tokenizer={kg.paths['spm_model']}", "--shards=8"],
      capture_output=True, text=True, timeout=300, env=script_env())
  assert done.returncode == 0, done.stderr[-2000:]
  spec = load_spec("pbsd", f"--config.data.dir={os.path.dirname(kg.paths['spm_model'])}",
                   f"--config.env.index_dir={tmp_path / 'index'}")
  task = task_lib.prepare_task(spec, str(tmp_path / "run"))
  index = task.index
  assert isinstance(index, SparseBM25Index) and index.num_docs == len(kg.corpus)
  assert len({s.device for s in index.postings.addressable_shards}) == 8
  records = kg.records("sft")[:6]
  env, sampler, params = setup
  tokens, mask = _prompts(kg, records)
  gold = _gold(kg, [r["golden_answers"] for r in records])
  forced = _forced(kg, [r["actions"] for r in records])
  sparse = ingraph_rollout(sampler, env, params, tokens, mask, jax.random.key(0), index, gold,
                           None, *forced)
  dense = ingraph_rollout(sampler, env, params, tokens, mask, jax.random.key(0),
                          kg.retriever.index, gold, None, *forced)
  _assert_same_rollout(sparse, dense)
  assert int(sparse.searches.sum()) >= 6 and bool((sparse.reward == 1).all())
