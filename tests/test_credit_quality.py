"""Credit quality: turn labels from the gold chain, the rank AUC, and the metrics of an RL step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pbsd_jax.agent import privileged
from pbsd_jax.agent.batch import forced_batch, gold_batch, prompt_region
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
  got = np.asarray(gold_chain.turn_labels(kind, doc, gold))
  U, X = gold_chain.USEFUL, gold_chain.UNLABELLED
  np.testing.assert_array_equal(got, [[U, gold_chain.OFF_CHAIN, gold_chain.REPEAT, U, gold_chain.INVALID, X, X],
                                      [U, X, X, X, X, X, X],
                                      [X] * 7])


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
        assert docs[k] == gold_doc  # the exact name finds its document
      if gold_doc is not None and not detour:
        assert labels[k] == gold_chain.USEFUL, (b, k)
      elif gold_doc is not None:
        assert labels[k] == gold_chain.OFF_CHAIN, (b, k)
    assert np.all(labels[n - 1:] == gold_chain.UNLABELLED)


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
