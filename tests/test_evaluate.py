"""Evaluation: pass@k, statistics, the batched driver on the embedded task, stratification."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pbsd_jax import protocol
from pbsd_jax.agent.batch import gold_batch, prompt_region
from pbsd_jax.agent.env.agent_env import AgentEnv
from pbsd_jax.agent.rollout import ingraph_rollout
from pbsd_jax.data import vocab as vocab_lib
from pbsd_jax.eval import evaluate as ev
from pbsd_jax.generate.sampling import Sampler
from pbsd_jax.models import ModelConfig, init_params
from pbsd_jax.run import policy_checkpoint

P, GOLD = 56, 8


# --- pass@k -------------------------------------------------------------------------------


def _brute_force_pass_at_k(n, c, k):
  """Fraction of the k-subsets of n samples (the first c correct) holding a correct one."""
  subsets = list(itertools.combinations(range(n), k))
  return sum(any(i < c for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_equals_the_fraction_of_k_subsets_with_a_correct_sample():
  for n in range(1, 8):
    for c in range(n + 1):
      for k in range(1, n + 1):
        assert ev.pass_at_k(n, c, k) == pytest.approx(_brute_force_pass_at_k(n, c, k),
                                                      abs=1e-12), (n, c, k)


def test_vectorised_pass_at_k_matches_the_scalar_one_per_question():
  counts = np.array([0, 1, 3, 5, 8, 16, 2])
  for k in (1, 2, 4, 8, 16):
    np.testing.assert_allclose(ev.pass_at_k_array(16, counts, k),
                               [ev.pass_at_k(16, int(c), k) for c in counts], atol=1e-12)


def test_pass_at_k_is_stable_where_binomials_overflow_floats():
  # C(2000, 1000) ~ 1e600 is not a float; the product form still gives 1 - (1/2)^... exactly.
  n, c, k = 2000, 1, 1000
  assert ev.pass_at_k(n, c, k) == pytest.approx(k / n)  # one correct sample: P(drawn) = k/n
  # Half correct: all 1000 draws miss them with probability 1/C(2000, 1000) ~ 1e-600.
  np.testing.assert_allclose(ev.pass_at_k_array(n, [1, 1000], k), [k / n, 1.0], rtol=1e-12)


def test_pass_at_k_rejects_k_above_the_number_of_samples():
  with pytest.raises(ValueError, match="1 <= k <= num_samples=4"):
    ev.pass_at_k(4, 1, 8)
  with pytest.raises(ValueError, match=r"num_correct must be in \[0, 4\]"):
    ev.pass_at_k_array(4, [5], 2)


# --- summarize ----------------------------------------------------------------------------


def _outcomes(reward, turns=None, tokens=None, finished=None, truncated=None):
  m = len(reward)
  return dict(reward=np.asarray(reward, np.float32),
              num_turns=np.asarray(turns if turns is not None else [1] * m),
              num_action_tokens=np.asarray(tokens if tokens is not None else [3] * m),
              finished=np.asarray(finished if finished is not None else [True] * m),
              truncated=np.asarray(truncated if truncated is not None else [False] * m))


def test_per_tier_accuracy_on_hand_made_rows():
  # 4 questions x 2 samples, question-major rows.
  out = _outcomes(reward=[1, 1, 0, 1, 0, 0, 1, 0], turns=[1, 2, 3, 4, 1, 1, 2, 2],
                  tokens=[3, 5, 7, 9, 2, 2, 4, 4],
                  finished=[True, True, False, True, True, True, True, True],
                  truncated=[False, False, True, False, False, False, False, False])
  got = ev.summarize(out, [ev.IN_DOMAIN, "hard", "easy", "hard"], 2, pass_k=(1, 2, 4))
  assert got["accuracy"] == 4 / 8
  assert got["tier_accuracy"] == {"in_domain": 1.0, "easy": 0.0, "hard": (1 + 1) / 4}
  assert list(got["tier_accuracy"]) == ["in_domain", "easy", "hard"]  # the reading order
  assert got["tier_questions"] == {"in_domain": 1, "easy": 1, "hard": 2}
  assert got["solve_counts"] == [2, 1, 0, 1]
  assert got["mean_turns"] == 16 / 8 and got["mean_action_tokens"] == 36 / 8
  assert got["finished"] == 7 / 8 and got["truncated"] == 1 / 8
  # pass@1 = mean of c/n; pass@2 with n=2 = fraction of questions solved at least once.
  assert got["pass_at_k"] == {"1": pytest.approx((1 + 0.5 + 0 + 0.5) / 4), "2": 3 / 4}


def test_empty_tier_field_counts_as_in_domain():
  assert ev.tier_name({"tier": ""}) == ev.IN_DOMAIN and ev.tier_name({}) == ev.IN_DOMAIN
  assert ev.tier_name({"tier": "medium"}) == "medium"


def test_head_per_tier_keeps_every_tier_of_a_file_listed_tier_by_tier():
  records = ([{"q": f"e{i}", "tier": "easy"} for i in range(4)]
             + [{"q": f"m{i}", "tier": "medium"} for i in range(4)]
             + [{"q": f"h{i}", "tier": "hard"} for i in range(2)])
  assert [r["q"] for r in ev.head_per_tier(records, 7)] == ["e0", "e1", "e2", "m0", "m1", "h0",
                                                            "h1"]
  assert ev.head_per_tier(records, 0) == records and ev.head_per_tier(records, 99) == records


def test_summarize_names_a_field_of_the_wrong_length():
  out = _outcomes(reward=[1, 0, 1])
  with pytest.raises(ValueError, match=r"outcomes\['reward'\] has shape \(3,\), expected \(4,\)"):
    ev.summarize(out, ["", ""], 2)


def test_format_table_shows_every_run_and_tier():
  a = ev.summarize(_outcomes([1, 0]), ["", "hard"], 1)
  b = ev.summarize(_outcomes([1, 1, 0, 1]), ["", "hard"], 2)
  table = ev.format_table({"greedy": a, "top_p": b})
  lines = table.splitlines()
  assert "greedy" in lines[0] and "top_p" in lines[0]
  accuracy = next(line for line in lines if line.startswith("accuracy"))
  assert accuracy.split()[1:] == ["50.0%", "75.0%"]
  hard = next(line for line in lines if line.strip().startswith("hard"))
  assert "0.0% (1)" in hard and "50.0% (1)" in hard
  pass2 = next(line for line in lines if line.startswith("pass@2"))
  assert pass2.split()[1:] == ["-", "100.0%"]  # greedy has one sample: no pass@2


# --- stratify -----------------------------------------------------------------------------


COUNTS = [4, 0, 2, 4, 1, 0, 3, 4, 0, 2, 4, 0]  # easy: 0 3 7 10, hard: 1 5 8 11, medium: 2 4 6 9


def test_stratify_puts_all_solved_in_easy_none_in_hard_and_the_rest_in_medium():
  got = ev.stratify(COUNTS, 4, per_tier=4, seed=0)
  assert got == {"easy": [0, 3, 7, 10], "medium": [2, 4, 6, 9], "hard": [1, 5, 8, 11]}


def test_stratify_draws_a_balanced_subset_from_inside_each_tier():
  got = ev.stratify(COUNTS, 4, per_tier=2, seed=1)
  assert [len(v) for v in got.values()] == [2, 2, 2]
  assert set(got["easy"]) <= {0, 3, 7, 10} and set(got["medium"]) <= {2, 4, 6, 9}
  assert set(got["hard"]) <= {1, 5, 8, 11}


def test_stratify_is_deterministic_for_a_seed():
  draws = {seed: ev.stratify(COUNTS, 4, per_tier=2, seed=seed) for seed in range(6)}
  assert draws[3] == ev.stratify(COUNTS, 4, per_tier=2, seed=3)
  assert len({str(d) for d in draws.values()}) > 1  # the seed does choose


def test_stratify_names_the_tier_that_has_too_few_questions():
  with pytest.raises(ValueError, match=r"\['medium'\].*'medium': 1"):
    ev.stratify([4, 4, 0, 0, 2], 4, per_tier=2, seed=0)


# --- the driver on the embedded task ------------------------------------------------------
#
# A real transformer whose weights make it a token automaton: attention and MLP outputs are
# zero, so the logits depend on the current token only. A prompt ending in "." answers at
# once (1 turn, 3 tokens); any other prompt searches first (2 turns, 6 tokens). The answer is
# word A or word B with equal probability (greedy takes A, the lower id).


@pytest.fixture(scope="module")
def automaton(kg):
  env = AgentEnv.from_vocab(kg.vocab, buffer_size=P + 64, max_turns=3, max_action_tokens=8,
                            max_observation_tokens=40, max_query_tokens=4, top_k=1,
                            ignore_ids=vocab_lib.whitespace_ids(kg.vocab))
  ws = set(vocab_lib.whitespace_ids(kg.vocab))
  words = [i for i in range(kg.vocab.vocab_size)
           if kg.decode([i]).strip().isalpha() and len(kg.decode([i]).strip()) > 3
           and [t for t in kg.encode(kg.decode([i])) if t not in ws] == [i]]
  word_a, word_b, word_z, query = words[10], words[11], words[12], words[13]
  period = kg.encode(protocol.format_prompt("Name it."))[-1]
  question_mark = kg.encode(protocol.format_prompt("Who is it?"))[-1]
  assert period != question_mark
  config = ModelConfig(vocab_size=kg.vocab.vocab_size, hidden_size=32, num_layers=1,
                       num_heads=2, num_kv_heads=1, mlp_dim=64)
  params = init_params(config, jax.random.key(0))
  params["layers"]["attn"]["o_kernel"] = jnp.zeros_like(params["layers"]["attn"]["o_kernel"])
  params["layers"]["mlp"]["down_kernel"] = jnp.zeros_like(
      params["layers"]["mlp"]["down_kernel"])
  # state -> (embedding direction, next tokens); every other token is in state 0.
  rules = [((), [env.search_open]), ((env.search_open,), [query]), ((query,), [env.search_close]),
           ((env.info_close,), [env.answer_open]), ((period,), [env.answer_open]),
           ((env.answer_open,), [word_a, word_b]), ((word_a, word_b), [env.answer_close]),
           ((env.answer_close,), [kg.vocab.eos_id])]
  embedding = np.zeros((config.vocab_size, 32), np.float32)
  embedding[:, 0] = 1.0
  lm_head = np.zeros((32, config.vocab_size), np.float32)
  for direction, (tokens, nexts) in enumerate(rules):
    for t in tokens:
      embedding[t] = np.eye(32)[direction]
    lm_head[direction, nexts] = 10.0  # x sqrt(32) after the final RMSNorm: p(other) ~ e^-56
  params["embedding"], params["lm_head"] = jnp.asarray(embedding), jnp.asarray(lm_head)
  text = lambda i: kg.decode([i]).strip()
  a, b, z = text(word_a), text(word_b), text(word_z)
  assert word_a < word_b
  records = [
      {"question": "Name it.", "golden_answers": [a], "tier": ""},             # 1 turn, right
      {"question": "Who is it?", "golden_answers": [a], "tier": ""},           # 2 turns, right
      {"question": "Name the other.", "golden_answers": [b], "tier": "easy"},  # right if B
      {"question": "Who is that?", "golden_answers": [z, a], "tier": "easy"},  # 2nd gold right
      {"question": "Name nothing.", "golden_answers": [z], "tier": "hard"},    # never right
      {"question": "Who is none?", "golden_answers": [z], "tier": "hard"},     # never right
  ]
  return env, config, params, records


def _evaluate(kg, automaton, sampler, batch_size, n=1, rng=0):
  env, _, params, records = automaton
  return ev.evaluate(kg.agent(sampler, env), params, records, batch_size=batch_size,
                     rng=jax.random.key(rng), prompt_width=P,
                     gold_width=GOLD, samples_per_question=n)


def test_greedy_evaluation_gives_the_hand_computed_statistics(kg, automaton):
  _, config, _, _ = automaton
  got = _evaluate(kg, automaton, Sampler(config, temperature=0.0), 4)
  assert got["solve_counts"] == [1, 1, 0, 1, 0, 0]
  assert got["accuracy"] == 3 / 6
  assert got["tier_accuracy"] == {"in_domain": 1.0, "easy": 0.5, "hard": 0.0}
  assert got["mean_turns"] == (1 + 2 + 1 + 2 + 1 + 2) / 6
  assert got["mean_action_tokens"] == (3 + 6 + 3 + 6 + 3 + 6) / 6
  assert got["finished"] == 1.0 and got["truncated"] == 0.0


def test_padded_last_batch_matches_one_direct_rollout_of_all_records(kg, automaton):
  env, config, params, records = automaton
  sampler = Sampler(config, temperature=0.0)
  region = prompt_region([r["question"] for r in records], kg.encode, P)
  gold = gold_batch([r["golden_answers"] for r in records], kg.encode, GOLD)
  direct = ingraph_rollout(sampler, env, params, jnp.asarray(region["prompts"]),
                           jnp.asarray(region["prompt_mask"]), jax.random.key(0),
                           kg.retriever.index, jnp.asarray(gold))
  padded = _evaluate(kg, automaton, sampler, 4)  # batches of 4 rows + 2 rows padded to 4
  assert padded == _evaluate(kg, automaton, sampler, len(records))  # one batch, no padding
  assert padded["solve_counts"] == np.asarray(direct.reward).astype(int).tolist()
  assert padded["accuracy"] == pytest.approx(float(jnp.mean(direct.reward)))
  assert padded["mean_turns"] == pytest.approx(float(jnp.mean(direct.num_turns)))
  assert padded["mean_action_tokens"] == pytest.approx(
      float(jnp.mean(direct.num_action_tokens)))
  assert padded["finished"] == pytest.approx(float(jnp.mean(direct.finished)))
  assert padded["truncated"] == pytest.approx(float(jnp.mean(direct.truncated)))


def test_evaluate_policy_samples_with_top_p_and_reports_pass_at_k(kg, automaton):
  env, config, params, records = automaton
  n = 4
  nucleus = Sampler(config, temperature=1.0, top_p=0.95)  # the paper's setting
  got = ev.evaluate_policy(kg.agent(nucleus, env), params, records, batch_size=4,
                           rng=jax.random.key(1),
                           prompt_width=P, gold_width=GOLD, samples_per_question=n)
  assert got["greedy"]["solve_counts"] == [1, 1, 0, 1, 0, 0]
  assert got["greedy"]["pass_at_k"] == {"1": 0.5}
  counts = np.array(got["top_p"]["solve_counts"])
  # A and B each keep p = 1/2 under top-p 0.95: questions whose gold is A or B are solved
  # by chance, questions whose gold is neither never are.
  assert counts[4] == counts[5] == 0
  assert 0 < counts[:4].sum() < 4 * n
  assert got["top_p"]["accuracy"] == counts.sum() / (6 * n)
  assert set(got["top_p"]["pass_at_k"]) == {"1", "2", "4"}
  for k in (1, 2, 4):
    assert got["top_p"]["pass_at_k"][str(k)] == pytest.approx(
        ev.pass_at_k_array(n, counts, k).mean())


def test_a_prompt_too_long_for_the_width_names_its_record(kg, automaton):
  env, config, params, records = automaton
  long = {"question": "word " * 80, "golden_answers": ["x"]}
  with pytest.raises(ValueError, match=r"record 1: its prompt is \d+ tokens, more than "
                     rf"prompt_width={P}"):
    ev.evaluate(kg.agent(Sampler(config, temperature=0.0), env), params, [records[0], long],
                batch_size=4, rng=jax.random.key(0), prompt_width=P,
                gold_width=GOLD)


# --- reading a policy from a checkpoint ---------------------------------------------------


def test_restore_params_reads_the_latest_train_state_checkpoint(tmp_path):
  from pbsd_jax.rl import train_state
  from pbsd_jax.run import checkpoint
  config = ModelConfig(vocab_size=16, hidden_size=8, num_layers=1, num_heads=2,
                       num_kv_heads=1, mlp_dim=8)
  tx = train_state.make_optimizer(1e-3)
  with checkpoint.Checkpointer(str(tmp_path / "ckpt_rl"), async_save=False) as ckpt:
    for step, seed in ((2, 0), (5, 1)):
      state = train_state.init_train_state(init_params(config, jax.random.key(seed)), tx,
                                       jax.random.key(0))
      ckpt.save(state, {}, step=step, force=True)
  params, step = policy_checkpoint.restore_params(str(tmp_path / "ckpt_rl"))
  assert step == 5
  jax.tree.map(np.testing.assert_array_equal, params, init_params(config, jax.random.key(1)))
  params, _ = policy_checkpoint.restore_params(str(tmp_path / "ckpt_rl"), step=2)
  jax.tree.map(np.testing.assert_array_equal, params, init_params(config, jax.random.key(0)))
  with pytest.raises(FileNotFoundError, match=r"no finished step 3; steps: \[2, 5\]"):
    policy_checkpoint.restore_params(str(tmp_path / "ckpt_rl"), step=3)


def test_restore_params_reads_a_params_directory_and_its_model_config(tmp_path):
  import dataclasses
  import json
  import orbax.checkpoint as ocp
  config = ModelConfig(vocab_size=16, hidden_size=8, num_layers=1, num_heads=2,
                       num_kv_heads=1, mlp_dim=8)
  params = init_params(config, jax.random.key(3))
  saver = ocp.StandardCheckpointer()
  saver.save(str(tmp_path / "params"), {"params": params})
  saver.wait_until_finished()
  (tmp_path / "model_config.json").write_text(json.dumps(dataclasses.asdict(config)))
  restored, step = policy_checkpoint.restore_params(str(tmp_path))
  assert step is None
  jax.tree.map(np.testing.assert_array_equal, restored, params)
  assert policy_checkpoint.find_model_config(str(tmp_path / "params")) == config
  with pytest.raises(FileNotFoundError, match="no finished checkpoint step"):
    policy_checkpoint.restore_params(str(tmp_path / "params"))


@pytest.mark.parametrize("script", ["evaluate", "stratify"])
def test_scripts_end_at_start_up_with_one_line_naming_a_missing_checkpoint(script, tmp_path):
  import os
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  missing = str(tmp_path / "no_such_run" / "ckpt_rl")
  done = subprocess.run([sys.executable, os.path.join(root, "scripts", f"{script}.py"),
                         f"--ckpt_dir={missing}"], cwd=root, capture_output=True, text=True,
                        timeout=120)
  assert done.returncode != 0
  assert done.stderr.strip().splitlines()[-1] == (
      f"{script}: checkpoint directory {missing} does not exist")


def test_credit_summary_pools_labelled_turns_over_trajectories():
  from pbsd_jax.agent import gold_chain
  U, O, R, X = gold_chain.USEFUL, gold_chain.OFF_CHAIN, gold_chain.REPEAT, gold_chain.UNLABELLED
  labels = np.array([[U, O, X], [U, R, X], [O, X, X]])
  evidence = np.array([[0.5, -0.2, 9.0], [0.1, 0.3, 9.0], [-0.4, 9.0, 9.0]], np.float32)
  got = ev.credit_summary(labels, evidence, np.array([True, True, False]))
  # Useful 0.5, 0.1 vs. other -0.2, 0.3, -0.4: 5 of 6 pairs ranked right.
  assert got["auc_evidence"] == pytest.approx(5 / 6)
  assert got["auc_evidence_solved"] == pytest.approx(3 / 4)
  assert np.isnan(got["auc_evidence_failed"])  # no useful turn in the failed trajectory
  assert got["labelled_turns"] == 5 and got["frac_useful"] == pytest.approx(2 / 5)
  assert got["frac_evidence_pos"] == pytest.approx(3 / 5)
  assert got["mean_abs_evidence"] == pytest.approx((0.5 + 0.2 + 0.1 + 0.3 + 0.4) / 5)


def test_credit_summary_scores_progress_against_culprit_turns():
  labels = np.full((3, 3), 1)  # the useful labels do not enter the value metrics
  evidence = np.array([[0.5, -0.2, 9.0], [0.1, 0.3, 9.0], [-0.4, 9.0, 9.0]], np.float32)
  nan = np.nan
  values = np.array([[0.3, -0.1, nan], [0.01, 0.05, nan], [-0.2, nan, nan]], np.float32)
  got = ev.credit_summary(labels, evidence, np.array([True, True, False]), values)
  # Progress 0.5 (0.3), 0.3 (0.05) vs. culprit -0.2 (-0.1), -0.4 (-0.2); 0.01 is neutral.
  assert got["auc_evidence_value"] == 1.0 and got["auc_evidence_value_solved"] == 1.0
  assert got["frac_progress"] == pytest.approx(2 / 5)
  assert got["frac_culprit"] == pytest.approx(2 / 5)
  # Split by the answer in the context: shown before turns (0, 1) and (1, 0). Shown: progress
  # 0.3 vs. culprit -0.2 and the neutral 0.1 left out. Hidden: progress 0.5 vs. culprit -0.4.
  shown = np.array([[False, True, True], [True, True, True], [False, False, False]])
  split = ev.credit_summary(labels, evidence, np.array([True, True, False]), values, shown)
  assert split["auc_evidence_value_answer_shown"] == 1.0
  assert split["auc_evidence_value_answer_hidden"] == 1.0
  assert split["frac_answer_shown"] == pytest.approx(2 / 4)
  # Reversed evidence within the shown turns only: that AUC flips, the other does not.
  flipped = np.where(shown, -evidence, evidence)
  split = ev.credit_summary(labels, flipped, np.array([True, True, False]), values, shown)
  assert split["auc_evidence_value_answer_shown"] == 0.0
  assert split["auc_evidence_value_answer_hidden"] == 1.0
  assert split["auc_evidence_value"] == pytest.approx(3 / 4)


def test_evaluation_labels_the_searches_of_records_with_a_gold_chain(kg, automaton):
  """The automaton searches once on questions ending in '?'; a chain holding the document it
  retrieves makes that search useful, another chain makes it off-chain."""
  from pbsd_jax.rl import algorithms
  env, config, params, records = automaton
  sampler = Sampler(config, temperature=0.0)
  plain = ev.evaluate(kg.agent(sampler, env), params, records, batch_size=4,
                      rng=jax.random.key(0), prompt_width=P, gold_width=GOLD,
                      credit_algo=algorithms.get("pbsd", group_size=1, normalize_std=False))
  assert "credit" not in plain  # no gold chains: nothing to label
  region = prompt_region([records[1]["question"]], kg.encode, P)
  out = ingraph_rollout(sampler, env, params, jnp.asarray(region["prompts"]),
                        jnp.asarray(region["prompt_mask"]), jax.random.key(0),
                        kg.retriever.index, jnp.asarray(gold_batch([["a"]], kg.encode, GOLD)))
  doc = int(out.turn_doc[0, 0, 0])
  assert doc >= 0
  chained = [dict(r, chain=[doc if i == 1 else doc + 1, 0], hops=1)
             for i, r in enumerate(records)]
  got = ev.evaluate(kg.agent(sampler, env), params, chained, batch_size=4,
                    rng=jax.random.key(0), prompt_width=P, gold_width=GOLD,
                    credit_algo=algorithms.get("pbsd", group_size=1, normalize_std=False))
  assert {k: v for k, v in got.items() if k not in ("credit", "horizon")} == plain
  # Searches: records 1, 3, 5 (questions ending in '?'); only record 1's chain holds the doc.
  assert got["credit"]["labelled_turns"] == 3
  assert got["credit"]["frac_useful"] == pytest.approx(1 / 3)
  horizon = got["horizon"]
  assert horizon["searches"] == pytest.approx(3 / len(records))
  assert horizon["hop_searches"][0] == 3 and horizon["hop_advance"][0] == pytest.approx(1 / 3)
  assert horizon["full_progress"] == pytest.approx(1 / len(records))
  assert horizon["tokens"] > got["mean_action_tokens"]  # observations count too


def test_on_a_mesh_each_device_rolls_out_its_own_rows_and_samples_what_one_device_does(
    kg, automaton, monkeypatch):
  from pbsd_jax.agent.rollout import Agent
  from pbsd_jax.models import param_shardings
  from pbsd_jax.parallel import sharding
  env, config, params, records = automaton
  agent = kg.agent(Sampler(config, temperature=1.0, top_p=0.95), env)
  run = lambda p, **kw: ev.evaluate(agent, p, records, batch_size=6, rng=jax.random.key(3),
                                    prompt_width=P, gold_width=GOLD, samples_per_question=2,
                                    **kw)
  one_device = run(params)
  rollouts, rollout = [], Agent.rollout
  monkeypatch.setattr(Agent, "rollout", lambda *a, **kw: rollouts.append(rollout(*a, **kw))
                      or rollouts[-1])
  mesh = sharding.make_mesh(2, 4, 1)  # 8 data-parallel devices
  # 12 rows in batches of 6, each padded to 8 rows on the mesh: the same draws per row.
  assert run(jax.device_put(params, param_shardings(config, mesh)), mesh=mesh) == one_device
  assert len(rollouts) == 2
  for x in (rollouts[0].tokens, rollouts[0].reward, rollouts[0].turn_doc):
    assert x.shape[0] == 8 and x.sharding.spec[0] == ("data", "fsdp")  # a device's own rows
