"""Credit quality: turn labels from the gold chain, the rank AUC, and the metrics of an RL step."""

import dataclasses
import fractions
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pbsd_jax.agent import privileged
from pbsd_jax.agent.batch import forced_batch, gold_batch, prompt_region, question_batch
from pbsd_jax.agent.env.agent_env import AgentEnv, KIND_ANSWER, KIND_INVALID, KIND_SEARCH
from pbsd_jax.agent.rollout import host_rollout, ingraph_rollout, label_turns
from pbsd_jax.data import vocab as vocab_lib
from pbsd_jax.generate.sampling import Sampler
from pbsd_jax.models import ModelConfig, init_params
from pbsd_jax.agent import gold_chain
from pbsd_jax.rl import algorithms, credit_quality as cq, learner, likelihood, train_state

P, MAX_TURNS, ACTION = 72, 7, 40


def _pairwise_auc(score, positive):
  """P(positive > negative) + P(tie) / 2 by looping over every pair."""
  pos, neg = score[positive], score[~positive]
  if not len(pos) or not len(neg):
    return float("nan")
  return float(np.mean([(p > n) + 0.5 * (p == n) for p in pos for n in neg]))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(-3, 3), st.booleans(), st.booleans()), min_size=1,
                max_size=40))
def test_rank_auc_equals_the_pairwise_count_with_ties_and_a_mask(rows):
  score, positive, valid = (np.asarray(x) for x in zip(*rows))
  score = score.astype(np.float32) / 2
  got = float(cq.roc_auc(jnp.asarray(score), jnp.asarray(positive), jnp.asarray(valid)))
  want = _pairwise_auc(score[valid], positive[valid])
  if np.isnan(want):
    assert np.isnan(got)
  else:
    assert got == pytest.approx(want, abs=1e-6)


def test_turn_labels_follow_the_chain_repeats_and_invalid_actions():
  S, I, A = KIND_SEARCH, KIND_INVALID, KIND_ANSWER
  kind = jnp.array([[S, S, S, S, I, A, -1],
                    [S, S, A, -1, -1, -1, -1],
                    [S, S, A, -1, -1, -1, -1]])
  doc = jnp.array([[7, 9, 7, 8, -1, -1, -1],    # chain 7 -> 8; 9 is a neighbour
                   [5, -1, -1, -1, -1, -1, -1],  # the second search failed
                   [7, 8, -1, -1, -1, -1, -1]])
  gold = jnp.array([[7, 8, -1], [5, 6, -1], [-1, -1, -1]])  # row 2: no chain known
  got = np.asarray(gold_chain.turn_labels(kind, doc[..., None], gold))
  U, X = gold_chain.USEFUL, gold_chain.UNLABELLED
  np.testing.assert_array_equal(got, [[U, gold_chain.OFF_CHAIN, gold_chain.REPEAT, U, gold_chain.INVALID, X, X],
                                      [U, X, X, X, X, X, X],
                                      [X] * 7])


def test_turn_labels_and_values_read_every_document_a_search_showed():
  """Two documents a search (chain 7 -> 8 -> 9, one hop per search). Turn 0 shows 4 and the
  chain's 7: useful. Turn 1 shows 7 again and 5: new, but off the chain. Turn 2 shows 8
  second: useful. Turn 3 shows 5 and 8 again: a repeat. Turn 4 shows 9 where the
  observation had room for only the first document (-1): useful."""
  S, A = KIND_SEARCH, KIND_ANSWER
  kind = jnp.array([[S, S, S, S, S, A]])
  doc = jnp.array([[[4, 7], [7, 5], [6, 8], [5, 8], [9, -1], [-1, -1]]])
  gold = jnp.array([[7, 8, 9]])
  U = gold_chain.USEFUL
  np.testing.assert_array_equal(gold_chain.turn_labels(kind, doc, gold),
                                [[U, gold_chain.OFF_CHAIN, U, gold_chain.REPEAT, U,
                                  gold_chain.UNLABELLED]])
  # Progress 0 -> 1 -> 1 -> 2 -> 2 -> 3: the values are those of the same walk with each
  # search's chain document on top.
  tops = jnp.array([[[7], [5], [8], [5], [9], [-1]]])
  ids = jnp.asarray(_turn_ids([[10, 20, 30, 40, 50, 60]], 100))
  np.testing.assert_array_equal(gold_chain.turn_labels(kind, tops, gold),
                                gold_chain.turn_labels(kind, doc, gold))
  np.testing.assert_allclose(gold_chain.turn_values(kind, doc, gold, jnp.array([1.0]), ids),
                             gold_chain.turn_values(kind, tops, gold, jnp.array([1.0]), ids))


def test_horizon_summary_by_hand():
  """Row 0 (chain 7 -> 8) reads 7, misses with 9, reads 8, answers right; row 1 (chain 5 -> 6)
  reads 5 and answers (wrong) before reading 6; row 2 has no chain and is left out."""
  S, A = KIND_SEARCH, KIND_ANSWER
  kind = np.array([[S, S, S, A], [S, A, -1, -1], [S, A, -1, -1]])
  doc = np.array([[7, 9, 8, -1], [5, -1, -1, -1], [7, -1, -1, -1]])[..., None]
  gold = np.array([[7, 8], [5, 6], [-1, -1]])
  got = gold_chain.horizon_summary(kind, doc, gold, np.array([1.0, 0.0, 1.0]))
  assert got == {"searches": 2.0, "hop_searches": [2, 2], "hop_advance": [1.0, 0.5],
                 "full_progress": 0.5, "answers_at_full": 0.5, "accuracy_at_full": 1.0}


def test_the_answer_is_in_the_context_after_a_search_shows_the_last_chain_document():
  """Row 0 (chain 7 -> 8) shows 8, the answer's document, at turn 2 behind 9: in context from
  turn 3. Row 1 (chain 5 -> 6) shows 6 out of order at turn 0, then answers. Row 2 never
  shows 4; row 3 shows 8 but has no chain."""
  doc = jnp.array([[[7, -1], [9, -1], [9, 8], [-1, -1]],
                   [[6, -1], [-1, -1], [-1, -1], [-1, -1]],
                   [[3, -1], [3, -1], [-1, -1], [-1, -1]],
                   [[8, -1], [-1, -1], [-1, -1], [-1, -1]]])
  gold = jnp.array([[7, 8], [5, 6], [3, 4], [-1, -1]])
  np.testing.assert_array_equal(gold_chain.answer_shown(doc, gold),
                                [[False, False, False, True], [False, True, True, True],
                                 [False] * 4, [False] * 4])


def test_gold_doc_batch_takes_the_documents_that_state_each_hop():
  records = [{"chain": [3, 1, 4, 1], "hops": 3}, {"chain": [5, 9], "hops": 1}, {"question": "q"}]
  np.testing.assert_array_equal(gold_chain.gold_doc_batch(records, 4),
                                [[3, 1, 4, -1], [5, -1, -1, -1], [-1, -1, -1, -1]])
  with pytest.raises(ValueError, match="record 0 has 3 chain documents"):
    gold_chain.gold_doc_batch(records, 2)


@pytest.fixture(scope="module")
def setup(kg):
  env = AgentEnv.from_vocab(kg.vocab, buffer_size=600, max_turns=MAX_TURNS,
                            max_action_tokens=ACTION, max_observation_tokens=80,
                            max_query_tokens=16, top_k=1,
                            ignore_ids=vocab_lib.whitespace_ids(kg.vocab))
  model = ModelConfig(vocab_size=kg.vocab.vocab_size, hidden_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=1, mlp_dim=64)
  return env, model, init_params(model, jax.random.key(0))


def _detoured_records(kg, n):
  """SFT records whose oracle takes a neighbour detour (an off-chain search), then others."""
  records = kg.records("sft")
  detour = [r for r in records
            if any(d and g is not None for d, g in zip(r["detour_turns"], r["gold_doc_ids"]))]
  plain = [r for r in records if not any(r["detour_turns"])]
  return [r for pair in zip(detour, plain) for r in pair][:n]


def _replay(kg, setup, records, actions):
  env, model, params = setup
  region = prompt_region([r["question"] for r in records], kg.encode, P,
                         answers=[r["golden_answers"][0] for r in records])
  forced = forced_batch(actions, kg.encode, MAX_TURNS, ACTION)
  golds = [r["golden_answers"] for r in records]
  gold_docs = gold_chain.gold_doc_batch(records, 5)
  args = (Sampler(model), env, params, region["prompts"], region["prompt_mask"],
          jax.random.key(0))
  graph = ingraph_rollout(*args, kg.retriever.index, gold_batch(golds, kg.encode, 12),
                          jnp.arange(len(records)) // 2, *forced)
  host = host_rollout(*args, kg.retriever, kg.tokenizer, golds,
                      jnp.arange(len(records)) // 2, *forced)
  return label_turns(graph, gold_docs), label_turns(host, gold_docs), region


def _turn_ids(starts, buffer):
  """`i32[B, T]` with turn k's action tokens from `starts[b][k]` for 3 columns."""
  ids = np.full((len(starts), buffer), -1, np.int32)
  for b, row in enumerate(starts):
    for k, col in enumerate(row):
      ids[b, col:col + 3] = k
  return ids


def test_turn_values_by_hand():
  """Two one-hop rows, two turns each. Row 0 reads the chain document, then answers right;
  row 1 misses it, then answers wrong. The batch's rates: a search at progress 0 advances
  (1 + 1) / (2 + 2) = 1/2 of the time; an answer at full progress is right (1 + 1) / (1 + 2)
  = 2/3 of the time. V(1, t >= 1) = 2/3, V(0, 1) = 0, V(0, 2) = 1/2 * 2/3 = 1/3."""
  kind = jnp.array([[KIND_SEARCH, KIND_ANSWER], [KIND_SEARCH, KIND_ANSWER]])
  doc = jnp.array([[[7], [-1]], [[3], [-1]]])
  gold = jnp.array([[7], [9]])
  ids = jnp.asarray(_turn_ids([[10, 20], [10, 20]], 100))  # 10 tokens a turn; room for 9
  values = gold_chain.turn_values(kind, doc, gold, jnp.array([1.0, 0.0]), ids)
  np.testing.assert_allclose(values, [[2 / 3 - 1 / 3, 1 - 2 / 3], [0 - 1 / 3, 0 - 0]],
                             atol=1e-6)
  np.testing.assert_array_equal(gold_chain.value_labels(values),
                                [[gold_chain.PROGRESS, gold_chain.PROGRESS],
                                 [gold_chain.CULPRIT, gold_chain.NEUTRAL]])
  # A buffer that holds one turn of 10 tokens at the first turn: no room to search and then
  # answer, so the search is worth nothing (V(1, 0) - V(0, 1) = 0); the answer turn has
  # itself (V(1, 1) = 2/3).
  tight = jnp.asarray(_turn_ids([[10, 20], [10, 20]], 21))
  values = gold_chain.turn_values(kind, doc, gold, jnp.array([1.0, 0.0]), tight)
  np.testing.assert_allclose(values, [[0.0, 1 - 2 / 3], [0.0, 0.0]], atol=1e-6)
  # Turns not taken and rows without a chain are unlabelled.
  none = gold_chain.turn_values(jnp.array([[KIND_SEARCH, -1]]), jnp.array([[[7], [-1]]]),
                                jnp.array([[-1]]), jnp.array([0.0]),
                                jnp.asarray(_turn_ids([[10]], 100)))
  assert np.all(np.isnan(none))


def _reference_values(kind, doc, gold, reward, starts, buffer, max_turns):
  """`turn_values` by loops and a memoised recursion (module docstring of gold_chain)."""
  b_rows, h = len(kind), len(gold[0])
  hops = [sum(g >= 0 for g in row) for row in gold]
  before, after = [], []
  for b in range(b_rows):
    read, row_before, row_after = set(), [], []
    for k in range(max_turns):
      p = next(m for m in range(h + 1) if m == hops[b] or gold[b][m] not in read)
      row_before.append(p)
      if kind[b][k] == KIND_SEARCH:
        read.update(d for d in doc[b][k] if d >= 0)
      row_after.append(next(m for m in range(h + 1) if m == hops[b] or gold[b][m] not in read))
    before.append(row_before)
    after.append(row_after)
  taken = lambda b, k: kind[b][k] >= 0
  searching = lambda b, k: taken(b, k) and kind[b][k] not in (KIND_ANSWER, 3)
  a = []
  for p in range(h + 1):
    n = [(b, k) for b in range(b_rows) for k in range(max_turns)
         if searching(b, k) and before[b][k] == p]
    a.append((sum(after[b][k] > p for b, k in n) + 1) / (len(n) + 2))
  full = [(b, k) for b in range(b_rows) for k in range(max_turns)
          if kind[b][k] == KIND_ANSWER and before[b][k] == hops[b]]
  c = (sum(reward[b] > 0 for b, _ in full) + 1) / (len(full) + 2)
  spans = [starts[b][k + 1] - starts[b][k] for b in range(b_rows) for k in range(max_turns - 1)
           if taken(b, k) and taken(b, k + 1)]
  per_turn = max(fractions.Fraction(sum(spans), max(len(spans), 1)), 1)

  def v(b, p, t):
    if t <= 0:
      return 0.0
    if p == hops[b]:
      return c
    return a[p] * v(b, p + 1, t - 1) + (1 - a[p]) * v(b, p, t - 1)

  out = np.full((b_rows, max_turns), np.nan)
  for b in range(b_rows):
    if not hops[b]:
      continue
    for k in range(max_turns):
      if not taken(b, k):
        continue
      start = starts[b][k] if k < len(starts[b]) else buffer
      t = max(min(max_turns - k, int((buffer - start) // per_turn)), 1)
      now = v(b, before[b][k], t)
      if kind[b][k] == KIND_ANSWER:
        out[b, k] = reward[b] - now
      elif kind[b][k] == 3:
        out[b, k] = -now
      else:
        out[b, k] = v(b, after[b][k], t - 1) - now
  return out


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000))
def test_turn_values_equal_a_brute_force_reference(seed):
  rng = np.random.default_rng(seed)
  b_rows, k_turns, h, buffer = 5, 6, 3, 90
  gold = np.full((b_rows, h), -1)
  kind = np.full((b_rows, k_turns), -1)
  shown = rng.integers(1, 3)  # documents a search shows
  doc = np.full((b_rows, k_turns, shown), -1)
  starts = []
  for b in range(b_rows):
    hops = rng.integers(0, h + 1)
    gold[b, :hops] = rng.choice(20, hops, replace=False)
    n = rng.integers(1, k_turns + 1)
    kind[b, :n - 1] = rng.choice([KIND_SEARCH, KIND_SEARCH, KIND_SEARCH, KIND_INVALID], n - 1)
    kind[b, n - 1] = rng.choice([KIND_SEARCH, KIND_ANSWER, KIND_ANSWER, 3])
    pool = np.concatenate([gold[b, :hops], rng.choice(20, 3), [-1]])
    doc[b, :n] = np.where(kind[b, :n, None] == KIND_SEARCH, rng.choice(pool, (n, shown)), -1)
    starts.append(list(np.cumsum(rng.integers(4, 16, n)) + 8))
  reward = (rng.random(b_rows) < 0.5).astype(np.float32)
  got = gold_chain.turn_values(jnp.asarray(kind), jnp.asarray(doc), jnp.asarray(gold),
                               jnp.asarray(reward), jnp.asarray(_turn_ids(starts, buffer)))
  want = _reference_values(kind, doc, gold, reward, starts, buffer, k_turns)
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)


def test_oracle_replay_labels_its_detours_off_chain_and_its_chain_searches_useful(kg, setup):
  records = _detoured_records(kg, 6)
  graph, host, _ = _replay(kg, setup, records, [r["actions"] for r in records])
  for field in ("turn_kind", "turn_doc", "turn_label"):
    np.testing.assert_array_equal(getattr(graph, field), getattr(host, field), err_msg=field)
  for b, r in enumerate(records):
    n = len(r["actions"])
    kinds, docs, labels = (np.asarray(x[b]) for x in (graph.turn_kind, graph.turn_doc,
                                                      graph.turn_label))
    np.testing.assert_array_equal(kinds, [KIND_SEARCH] * (n - 1) + [KIND_ANSWER]
                                  + [-1] * (MAX_TURNS - n))
    for k, (gold_doc, detour) in enumerate(zip(r["gold_doc_ids"][:-1], r["detour_turns"])):
      if gold_doc is not None:
        assert docs[k][0] == gold_doc  # the exact name finds its document
      if gold_doc is not None and not detour:
        assert labels[k] == gold_chain.USEFUL, (b, k)
      elif gold_doc is not None:
        assert labels[k] == gold_chain.OFF_CHAIN, (b, k)
    assert np.all(labels[n - 1:] == gold_chain.UNLABELLED)


def test_a_rollout_records_every_document_its_observation_showed(kg, setup):
  """top_k 2: the first document is the top_k 1 rollout's, the second a different one where
  the observation has room for it and -1 where it shows only the first document's first
  token; the device and host turn loops record the same."""
  env, model, params = setup
  records = _detoured_records(kg, 4)
  actions = [r["actions"] for r in records]
  one, _, _ = _replay(kg, setup, records, actions)
  search = np.asarray(one.turn_kind) == KIND_SEARCH
  tags = len(env.tag_tokens("info_open")) + len(env.tag_tokens("info_close"))
  for room, second_shown in ((160, True), (tags + 1, False)):
    wide = dataclasses.replace(env, top_k=2, max_observation_tokens=room, buffer_size=1200)
    graph, host, _ = _replay(kg, (wide, model, params), records, actions)
    np.testing.assert_array_equal(graph.turn_doc, host.turn_doc)
    docs = np.asarray(graph.turn_doc)
    np.testing.assert_array_equal(docs[..., 0], np.asarray(one.turn_doc)[..., 0])
    if second_shown:
      np.testing.assert_array_equal(docs[..., 1] >= 0, search)
      assert np.all(docs[..., 1][search] != docs[..., 0][search])
    else:
      assert np.all(docs[..., 1] == -1)


def test_an_rl_step_reports_the_auc_of_the_evidence_and_of_the_signed_credit(kg, setup):
  """Pairs of rows per question: the oracle (solved) and the same searches ending in a wrong
  answer (failed), so every group has advantages of both signs; the metrics must equal a
  pairwise AUC over an independent dual-likelihood pass."""
  env, model, params = setup
  records = [r for r in _detoured_records(kg, 8) for _ in range(2)]
  actions = [r["actions"] if i % 2 == 0 else
             r["actions"][:-1] + ["<think> I give up. </think><answer> Nobody </answer>"]
             for i, r in enumerate(records)]
  rollout, _, region = _replay(kg, setup, records, actions)
  np.testing.assert_array_equal(rollout.reward, np.arange(len(records)) % 2 == 0)
  algo = algorithms.get("pbsd", group_size=2, delta=0.3)
  tx = train_state.make_optimizer(1e-3)
  state = train_state.init_train_state(params, tx, jax.random.key(1))
  _, metrics = learner.rl_step(state, rollout, jnp.asarray(region["teacher_prompt"]),
                               jnp.asarray(region["teacher_prompt_mask"]), model=model, tx=tx,
                               algo=algo, max_turns=MAX_TURNS)

  teacher = privileged.teacher_sequence(rollout.tokens, rollout.mask,
                                        jnp.asarray(region["teacher_prompt"]),
                                        jnp.asarray(region["teacher_prompt_mask"]))
  student, teach = likelihood.dual_logprobs(params, model, rollout.tokens, rollout.mask, *teacher)
  ratio, turn_ids = np.asarray(teach - student), np.asarray(rollout.turn_ids)
  s = np.array([[ratio[b][turn_ids[b] == k].mean() if np.any(turn_ids[b] == k) else 0.0
                 for k in range(MAX_TURNS)] for b in range(len(records))])
  solved = np.asarray(rollout.reward) > 0
  sign = np.where(solved, 1.0, -1.0)  # each group: one solved and one failed row
  filtered = np.where((s > algo.eps_pos) | (s < -algo.eps_neg), s, 0.0)
  signed_w = sign[:, None] * (1 + algo.clip * np.tanh(sign[:, None] * filtered / algo.delta))
  labels = np.asarray(rollout.turn_label)
  labelled, useful = labels != gold_chain.UNLABELLED, labels == gold_chain.USEFUL
  assert 0 < useful[labelled].mean() < 1  # both classes
  assert float(metrics["credit/frac_useful"]) == pytest.approx(useful[labelled].mean())
  for suffix, rows in (("", np.ones_like(solved)), ("_solved", solved), ("_failed", ~solved)):
    keep = labelled & rows[:, None]
    want_s = _pairwise_auc(s[keep], useful[keep])
    want_w = _pairwise_auc(signed_w[keep], useful[keep])
    assert float(metrics[f"credit/auc_evidence{suffix}"]) == pytest.approx(want_s, abs=2e-3)
    assert float(metrics[f"credit/auc_weight{suffix}"]) == pytest.approx(want_w, abs=2e-3)
  value = gold_chain.value_labels(rollout.turn_value)
  scored = (value == gold_chain.PROGRESS) | (value == gold_chain.CULPRIT)
  progress = value == gold_chain.PROGRESS
  assert 0 < progress[scored].mean() < 1  # both classes: the wrong answers are culprits
  for suffix, rows in (("", np.ones_like(solved)), ("_solved", solved), ("_failed", ~solved)):
    keep = scored & rows[:, None]
    if 0 < progress[keep].mean() < 1:
      assert float(metrics[f"credit/auc_evidence_value{suffix}"]) == pytest.approx(
          _pairwise_auc(s[keep], progress[keep]), abs=2e-3)
  # The sign of the outcome alone (GRPO's flat credit) separates by outcome, not by turn.
  grpo = algorithms.get("grpo", group_size=2)
  _, grpo_metrics = learner.rl_step(state, rollout, jnp.asarray(region["teacher_prompt"]),
                                    jnp.asarray(region["teacher_prompt_mask"]), model=model,
                                    tx=tx, algo=grpo, max_turns=MAX_TURNS)
  assert "credit/auc_evidence" not in grpo_metrics
  assert float(grpo_metrics["credit/auc_weight_solved"]) == 0.5
  assert float(grpo_metrics["credit/auc_weight"]) == pytest.approx(
      _pairwise_auc(sign[:, None].repeat(MAX_TURNS, 1)[labelled], useful[labelled]))


def test_flat_advantages_give_exactly_the_sign_of_the_outcome_in_any_turn_length():
  """XLA divides by a reciprocal: without rounding, `A / A` over a turn was an ulp off 1 on
  some rows, and the AUC of GRPO's credit within solved trajectories came out 0.2-0.4."""
  outcome = jax.random.uniform(jax.random.key(0), (64,), minval=-2.0, maxval=2.0)
  outcome = outcome.at[:3].set(0.0)
  lengths = np.random.default_rng(0).integers(1, 60, size=(64, 4))
  turn_ids = np.full((64, 250), -1, np.int32)
  for b, row in enumerate(lengths):
    turn_ids[b, :row.sum()] = np.repeat(np.arange(4), row)
  tokens = jnp.where(jnp.asarray(turn_ids) >= 0, outcome[:, None], 0.0)
  got = np.asarray(jax.jit(cq.turn_signed_credit, static_argnums=3)(
      tokens, outcome, jnp.asarray(turn_ids), 5))
  want = np.where(np.arange(5) < 4, np.sign(np.asarray(outcome))[:, None], 0.0)
  np.testing.assert_array_equal(got, want)


def test_monte_carlo_values_of_oracle_trajectories_under_a_random_policy(kg, setup):
  """Oracle trajectories continued by an untrained policy, which never solves a question on
  its own: every continuation fails unless the trajectory's own answer is replayed, so the
  answer turn's Monte Carlo value is exactly 1 and every search's 0; the world's values call
  the answers progress, and they agree there."""
  from pbsd_jax.agent.rollout import Agent
  from pbsd_jax.agent.tokenizer import Tokenizer
  from pbsd_jax.eval import label_check
  env, model, params = setup
  records = kg.records("sft")[:4]
  agent = Agent(Sampler(model, temperature=1.0), env, Tokenizer(kg.vocab),
                kg.retriever.index)
  batch = question_batch(records, agent.tokenizer, prompt_width=P, gold_width=12,
                         gold_chains=True)
  forced = forced_batch([r["actions"] for r in records], kg.encode, MAX_TURNS, ACTION)
  base = label_turns(ingraph_rollout(agent.sampler, env, params, batch["prompts"],
                                     batch["prompt_mask"], jax.random.key(0), agent.search,
                                     batch["gold"], None, *map(jnp.asarray, forced)),
                     batch["gold_docs"])
  np.testing.assert_array_equal(base.reward, np.ones(4))
  got = label_check.monte_carlo_values(agent, params, batch, base, continuations=3,
                                       rng=jax.random.key(1))
  for b, r in enumerate(records):
    n = len(r["actions"])
    np.testing.assert_array_equal(got["mc"][b, :n], [0.0] * (n - 1) + [1.0])
    assert np.all(np.isnan(got["mc"][b, n:]))
  labels = np.asarray(gold_chain.value_labels(jnp.asarray(got["value"])))
  answers = np.array([[k == len(r["actions"]) - 1 for k in range(MAX_TURNS)] for r in records])
  assert np.all(labels[answers] == gold_chain.PROGRESS)
  summary = label_check.agreement(got["value"], got["mc"])
  assert summary["turns"] == sum(len(r["actions"]) for r in records)
  assert summary["progress_turns"] >= 4
  # A search's 0 agrees only with a neutral label; the answers all agree.
  want = (4 + np.sum(labels[~answers & (labels > 0)] == gold_chain.NEUTRAL)) / summary["turns"]
  assert summary["agreement"] == pytest.approx(want)
