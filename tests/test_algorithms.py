"""GRPO / DAPO advantages and losses, the registry, PBSD on top, gradient hygiene (DESIGN §2)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pbsd_jax.models import ModelConfig, init_params
from pbsd_jax.rl import algorithms
from pbsd_jax.rl.algorithms import AdvantageInputs
from pbsd_jax.rl.likelihood import dual_logprobs, token_logprobs


def inputs(rewards, action_mask, turn_ids=None, max_turns=2, **optional):
  action_mask = jnp.asarray(action_mask, bool)
  if turn_ids is None:
    turn_ids = jnp.where(action_mask, 0, -1)
  return AdvantageInputs(rewards=jnp.asarray(rewards, jnp.float32), action_mask=action_mask,
                         turn_ids=jnp.asarray(turn_ids, jnp.int32), step=jnp.asarray(0),
                         max_turns=max_turns, **optional)


# Group advantages.


@pytest.mark.parametrize("ddof", [0, 1])
def test_group_advantages_match_numpy(ddof):
  rewards = np.random.default_rng(0).uniform(size=12).astype(np.float32)
  got = algorithms.group_advantages(jnp.asarray(rewards), group_size=4, std_ddof=ddof)
  r = rewards.reshape(3, 4)
  expected = (r - r.mean(1, keepdims=True)) / (r.std(1, ddof=ddof, keepdims=True) + 1e-6)
  np.testing.assert_allclose(got, expected.reshape(-1), rtol=1e-5)


def test_group_advantages_without_std_normalisation_are_centred_rewards():
  got = algorithms.group_advantages(jnp.array([1.0, 0.0, 0.0, 0.0]), 2, normalize_std=False)
  np.testing.assert_allclose(got, [0.5, -0.5, 0.0, 0.0])


def test_binary_group_advantages_hand_computed():
  # Group [1, 0, 0, 0]: mean 0.25, sample std sqrt(0.25) = 0.5.
  got = algorithms.group_advantages(jnp.array([1.0, 0.0, 0.0, 0.0]), 4, eps=0.0)
  np.testing.assert_allclose(got, [1.5, -0.5, -0.5, -0.5], rtol=1e-6)


def test_constant_group_gets_zero_advantage():
  got = algorithms.group_advantages(jnp.array([1.0, 1.0, 0.0, 0.0]), 2)
  np.testing.assert_array_equal(got, np.zeros(4))


def test_group_advantages_reject_a_partial_group():
  with pytest.raises(ValueError, match="group_size=4"):
    algorithms.group_advantages(jnp.zeros(6), 4)


# Clipped surrogate and aggregation.

LOG_RATIO = np.log(np.array([[0.5, 1.0, 1.5], [0.5, 1.0, 1.5]], np.float32))
ADV = np.array([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]], np.float32)
FULL = np.ones((2, 3), bool)


def test_clipped_surrogate_hand_computed():
  loss, clipped, _ = algorithms.clipped_surrogate(
      jnp.asarray(LOG_RATIO), jnp.zeros((2, 3)), jnp.asarray(ADV), jnp.asarray(FULL))
  # A > 0: -min(r, clip(r, 0.8, 1.28)); A < 0: max(r, clip(r, 0.8, 1.28)).
  np.testing.assert_allclose(loss, [[-0.5, -1.0, -1.28], [0.8, 1.0, 1.5]], rtol=1e-6)
  np.testing.assert_array_equal(clipped, [[False, False, True], [True, False, False]])


def test_pg_clipfrac_counts_tokens_whose_clip_is_active():
  _, _, metrics = algorithms.policy_loss(jnp.asarray(LOG_RATIO), jnp.zeros((2, 3)),
                                         jnp.asarray(ADV), jnp.asarray(FULL))
  np.testing.assert_allclose(metrics["pg_clipfrac"], 2 / 6, rtol=1e-6)


def test_dual_clip_caps_negative_advantage_tokens_at_c_times_minus_a():
  log_ratio = jnp.log(jnp.array([[5.0, 2.0, 5.0]]))
  adv = jnp.array([[-1.0, -1.0, 1.0]])
  mask = jnp.ones((1, 3), bool)
  plain, _, _ = algorithms.clipped_surrogate(log_ratio, jnp.zeros((1, 3)), adv, mask)
  dual, _, capped = algorithms.clipped_surrogate(log_ratio, jnp.zeros((1, 3)), adv, mask,
                                                 dual_clip=3.0)
  np.testing.assert_allclose(plain, [[5.0, 2.0, -1.28]], rtol=1e-6)
  np.testing.assert_allclose(dual, [[3.0, 2.0, -1.28]], rtol=1e-6)
  np.testing.assert_array_equal(capped, [[True, False, False]])


def test_clipped_surrogate_is_zero_and_finite_off_the_mask():
  loss, _, _ = algorithms.clipped_surrogate(jnp.array([[0.0, 200.0]]), jnp.array([[0.0, -200.0]]),
                                            jnp.ones((1, 2)), jnp.array([[True, False]]))
  np.testing.assert_array_equal(loss, [[-1.0, 0.0]])


TOKEN_LOSS = jnp.array([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 0.0, 0.0], [7.0, 7.0, 7.0, 7.0]])
LOSS_MASK = jnp.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], bool)  # row 2 is dropped


@pytest.mark.parametrize("mode, norm_len, expected, weight", [
    ("token-mean", None, (1 + 2 + 3 + 5) / 4, 4),
    ("seq-mean-token-mean", None, ((1 + 2 + 3) / 3 + 5 / 1) / 2, 2),
    ("seq-mean-token-sum", None, ((1 + 2 + 3) + 5) / 2, 2),
    ("seq-mean-token-sum-norm", None, ((1 + 2 + 3) + 5) / (2 * 4), 2),
    ("seq-mean-token-sum-norm", 10, ((1 + 2 + 3) + 5) / (2 * 10), 2),
])
def test_aggregation_modes_hand_computed_with_their_normaliser(mode, norm_len, expected, weight):
  """The weight is what the mode divides by: loss tokens, or rows with loss tokens."""
  got, got_weight = algorithms.aggregate_loss(TOKEN_LOSS, LOSS_MASK, mode, norm_len)
  np.testing.assert_allclose(got, expected, rtol=1e-6)
  assert float(got_weight) == weight


def test_unknown_aggregation_is_rejected_by_name():
  with pytest.raises(ValueError, match="GRPO.aggregation"):
    algorithms.get("grpo", aggregation="sum")


# DAPO options.


def test_dynamic_sampling_drops_groups_with_equal_rewards():
  keep = algorithms.dynamic_sampling_mask(jnp.array([1.0, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0]), 4)
  np.testing.assert_array_equal(keep, [False] * 4 + [True] * 4 + [False] * 4)


def test_dynamic_sampling_removes_dropped_rows_from_the_loss_mask():
  algo = algorithms.get("grpo", group_size=2, dynamic_sampling=True)
  adv, loss_mask, metrics = algo.advantages(inputs([1.0, 1.0, 1.0, 0.0], np.ones((4, 3))))
  np.testing.assert_array_equal(loss_mask.any(axis=1), [False, False, True, True])
  np.testing.assert_array_equal(adv[:2], 0.0)
  np.testing.assert_allclose(metrics["frac_groups_kept"], 0.5)


def test_overlong_penalty_hand_computed():
  # max_len 10, buffer 4: no penalty up to 6 (inclusive), linear to -1 at 10, -1 beyond.
  got = algorithms.overlong_penalty(jnp.array([5, 6, 8, 10, 12]), max_len=10, buffer_len=4)
  np.testing.assert_allclose(got, [0.0, 0.0, -0.5, -1.0, -1.0])


def test_overlong_penalty_shapes_the_reward_by_action_token_count():
  algo = algorithms.get("grpo", group_size=2, normalize_std=False, overlong_max_len=4,
                        overlong_buffer_len=2)
  # Both rows reward 1, but row 1 generated 4 tokens: reward 1 + (2 - 4) / 2 = 0.
  action = np.array([[1, 1, 0, 0, 0], [1, 1, 1, 1, 0]], bool)
  adv, _, _ = algo.advantages(inputs([1.0, 1.0], action))
  np.testing.assert_allclose(adv, [[0.5, 0.5, 0, 0, 0], [-0.5, -0.5, -0.5, -0.5, 0]])


# Registry.


def test_registry_lists_the_algorithms():
  assert set(algorithms.names()) == {"grpo", "pbsd", "opsd", "rlsd", "gear", "oracle_credit"}


def test_registry_rejects_unknown_names_and_hyperparameters():
  with pytest.raises(ValueError, match="unknown algorithm 'ppo'"):
    algorithms.get("ppo")
  with pytest.raises(ValueError, match="'dleta'"):
    algorithms.get("pbsd", dleta=0.2)


def test_registered_algorithms_are_static_jit_arguments():
  algo = algorithms.get("pbsd", group_size=2)
  assert hash(algo) == hash(algorithms.get("pbsd", group_size=2))

  @functools.partial(jax.jit, static_argnums=0)
  def step(a, batch):
    return a.advantages(batch)[0]

  batch = inputs([1.0, 0.0], np.ones((2, 3)), logp_student=jnp.zeros((2, 3)),
                 logp_teacher=jnp.zeros((2, 3)))
  assert step(algo, batch).shape == (2, 3)


def test_missing_required_input_is_named():
  with pytest.raises(ValueError, match="AdvantageInputs.logp_teacher"):
    algorithms.get("pbsd", group_size=2).advantages(
        inputs([1.0, 0.0], np.ones((2, 3)), logp_student=jnp.zeros((2, 3))))


# PBSD as an algorithm.

TURNS = np.array([[-1, 0, 0, -1, 1, 1], [-1, 0, 0, -1, 1, -1],
                  [-1, 0, -1, 1, 1, 1], [-1, 0, 0, 0, -1, -1]], np.int32)


def pbsd_inputs(seed=0):
  rng = np.random.default_rng(seed)
  return inputs([1.0, 0.0, 0.0, 1.0], TURNS >= 0, TURNS,
                logp_student=jnp.asarray(rng.normal(size=(4, 6)), jnp.float32),
                logp_teacher=jnp.asarray(rng.normal(size=(4, 6)), jnp.float32))


def test_pbsd_with_huge_delta_equals_grpo():
  grpo_adv, grpo_mask, _ = algorithms.get("grpo", group_size=2).advantages(pbsd_inputs())
  adv, mask, _ = algorithms.get("pbsd", group_size=2, delta=1e9).advantages(pbsd_inputs())
  np.testing.assert_allclose(adv, grpo_adv, rtol=1e-6)
  np.testing.assert_array_equal(mask, grpo_mask)


def _turn_means(values):
  """Per-turn means of `values: [4, 6]` over the tokens of TURNS (brute force), listed for
  the turns that exist, and the row of each."""
  turns = [(b, k) for b in range(4) for k in range(2) if np.any(TURNS[b] == k)]
  return (np.array([values[b][TURNS[b] == k].mean() for b, k in turns]),
          np.array([b for b, _ in turns]))


def test_pbsd_reports_the_credit_metrics_brute_force():
  inp = pbsd_inputs()
  _, _, metrics = algorithms.get("pbsd", group_size=2).advantages(inp)
  s, rows = _turn_means(np.asarray(inp.logp_teacher) - np.asarray(inp.logp_student))
  assert len(s) == 7  # row 3 has no turn 1
  kept = np.where((s > 0.001) | (s < -0.003), s, 0.0)
  # Groups [1, 0] and [0, 1]: A = +-0.7071, signs [+, -, -, +].
  sign = np.array([1.0, -1.0, -1.0, 1.0])[rows]
  w = 1 + 0.1 * np.tanh(sign * kept / 0.1)
  expected = {"frac_evidence_pos": np.mean(s > 0), "mean_abs_evidence": np.mean(np.abs(s)),
              "frac_deadband": np.mean(kept == 0), "weight_mean": w.mean(),
              "weight_min": w.min(), "weight_max": w.max()}
  assert 0 < expected["frac_evidence_pos"] < 1 and w.min() < 1 < w.max()  # not degenerate
  for key, value in expected.items():
    np.testing.assert_allclose(metrics[f"credit/{key}"], value, rtol=1e-5, err_msg=key)


def test_pbsd_adds_no_loss_term():
  """PBSD's objective is the plain clipped surrogate, token-mean, on PBSD's advantages."""
  rng = np.random.default_rng(3)
  logp, old = (np.asarray(rng.normal(scale=0.3, size=(4, 6)), np.float32) for _ in range(2))
  pbsd = algorithms.get("pbsd", group_size=2)
  adv, mask, _ = pbsd.advantages(pbsd_inputs())
  grpo_adv, _, _ = algorithms.get("grpo", group_size=2).advantages(pbsd_inputs())
  assert np.max(np.abs(np.asarray(adv) - np.asarray(grpo_adv))) > 1e-3  # credit is active
  loss, weight, _ = pbsd.loss(jnp.asarray(logp), jnp.asarray(old), adv, mask)
  a, m = np.asarray(adv, np.float64), np.asarray(mask)
  ratio = np.exp(logp - old)
  per_token = np.maximum(-a * ratio, -a * np.clip(ratio, 0.8, 1.28))
  assert np.any(m & ((ratio < 0.8) | (ratio > 1.28)))  # some tokens take the clipped branch
  np.testing.assert_allclose(float(loss), per_token[m].sum() / m.sum(), rtol=1e-5)
  assert float(weight) == m.sum()


# Gradient hygiene.

TINY = ModelConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                   mlp_dim=32)


def test_pbsd_gradient_equals_grpo_gradient_with_the_same_token_advantages():
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, 32, size=(4, 10)).astype(np.int32)
  teacher = tokens.copy()
  teacher[:, :3] = rng.integers(1, 32, size=(4, 3))  # a different (privileged) prompt region
  mask = np.ones((4, 10), bool)
  mask[0, 9] = False
  turns = np.full((4, 10), -1, np.int32)
  turns[:, 3:5], turns[:, 6:9] = 0, 1
  turns[0, 9] = -1
  batch = dict(rewards=jnp.array([1.0, 0.0, 0.0, 1.0]), action_mask=jnp.asarray(turns >= 0),
               turn_ids=jnp.asarray(turns), step=jnp.asarray(0), max_turns=2)
  params = init_params(TINY, jax.random.key(1))
  pbsd = algorithms.get("pbsd", group_size=2, delta=0.01, eps_pos=0.0, eps_neg=0.0)
  grpo = algorithms.get("grpo", group_size=2)

  def pbsd_objective(p):
    logp = dual_logprobs(p, TINY, tokens, mask, teacher, mask)
    adv, loss_mask, _ = pbsd.advantages(
        AdvantageInputs(**batch, logp_student=logp[0], logp_teacher=logp[1]))
    return pbsd.loss(token_logprobs(p, TINY, tokens, mask), logp[0], adv, loss_mask)[0]

  @jax.jit
  def precompute(p):
    logp = dual_logprobs(p, TINY, tokens, mask, teacher, mask)
    adv, loss_mask, _ = pbsd.advantages(
        AdvantageInputs(**batch, logp_student=logp[0], logp_teacher=logp[1]))
    return logp, adv, loss_mask

  logp, adv, loss_mask = precompute(params)
  plain_adv, _, _ = grpo.advantages(AdvantageInputs(**batch))
  assert np.max(np.abs(np.asarray(adv) - np.asarray(plain_adv))) > 1e-3  # credit is active

  def grpo_objective(p):
    return grpo.loss(token_logprobs(p, TINY, tokens, mask), logp[0], adv, loss_mask)[0]

  g_pbsd = jax.jit(jax.grad(pbsd_objective))(params)
  g_grpo = jax.jit(jax.grad(grpo_objective))(params)
  assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(g_grpo)) > 1e-4
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
               g_pbsd, g_grpo)


def test_oracle_credit_weights_each_turn_by_its_value_by_hand():
  """One group of two rows: solved (A = +1/sqrt(2)) and failed (A = -1/sqrt(2)); two turns
  of two tokens each. Values: row 0 +0.3 (progress) and +0.01 (inside the 0.02 deadband);
  row 1 -0.2 (a culprit) and NaN (unlabelled)."""
  turn_ids = jnp.array([[0, 0, 1, 1, -1], [0, 0, 1, 1, -1]])
  inputs = AdvantageInputs(rewards=jnp.array([1.0, 0.0]), action_mask=turn_ids >= 0,
                           turn_ids=turn_ids, step=jnp.int32(0), max_turns=2,
                           turn_value=jnp.array([[0.3, 0.01], [-0.2, jnp.nan]]))
  algo = algorithms.get("oracle_credit", group_size=2)
  adv, mask, metrics = algo.advantages(inputs)
  a = 1 / np.sqrt(2)
  # w = 1 + 0.1 tanh(sign(A) v~ / 0.1): row 0 turn 0 1 + 0.1 tanh(3); row 1 turn 0 (a culprit
  # in a failed row: its negative advantage grows) 1 + 0.1 tanh(2); the others 1.
  w = np.array([[1 + 0.1 * np.tanh(3.0), 1.0], [1 + 0.1 * np.tanh(2.0), 1.0]])
  want = np.array([[a * w[0, 0]] * 2 + [a] * 2 + [0.0], [-a * w[1, 0]] * 2 + [-a] * 2 + [0.0]])
  np.testing.assert_allclose(np.where(mask, adv, 0.0), want, rtol=1e-5)
  assert float(metrics["credit/frac_deadband"]) == 0.5
  assert "logp_teacher" not in algo.needs  # no teacher pass: its evidence is the world's
  with pytest.raises(ValueError, match="turn_value"):
    algo.advantages(inputs.replace(turn_value=None))
