"""OPSD, RLSD and GEAR baselines (DESIGN §2 "Baselines")."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pbsd_jax.models import ModelConfig, Transformer, init_params
from pbsd_jax.rl import algorithms
from pbsd_jax.rl.algorithms import AdvantageInputs
from pbsd_jax.rl.likelihood import generalized_jsd, token_divergence


def log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def kl(log_p, log_q):
  return np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)


LOGITS_S, LOGITS_T = np.random.default_rng(0).normal(scale=2.0, size=(2, 3, 5, 7))


# OPSD: the generalised JSD over the full vocabulary.


def test_jsd_beta_one_is_brute_force_reverse_kl():
  got = generalized_jsd(jnp.asarray(LOGITS_S), jnp.asarray(LOGITS_T), beta=1.0)
  np.testing.assert_allclose(got, kl(log_softmax(LOGITS_S), log_softmax(LOGITS_T)), rtol=1e-5)


def test_jsd_beta_zero_is_brute_force_forward_kl():
  got = generalized_jsd(jnp.asarray(LOGITS_S), jnp.asarray(LOGITS_T), beta=0.0)
  np.testing.assert_allclose(got, kl(log_softmax(LOGITS_T), log_softmax(LOGITS_S)), rtol=1e-5)


def test_jsd_intermediate_beta_is_the_gkd_mixture():
  beta = 0.3
  p, q = np.exp(log_softmax(LOGITS_T)), np.exp(log_softmax(LOGITS_S))  # teacher, student
  log_m = np.log(beta * p + (1 - beta) * q)
  expected = beta * kl(np.log(p), log_m) + (1 - beta) * kl(np.log(q), log_m)
  got = generalized_jsd(jnp.asarray(LOGITS_S), jnp.asarray(LOGITS_T), beta=beta)
  np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_jsd_swapping_models_mirrors_beta():
  a = generalized_jsd(jnp.asarray(LOGITS_S), jnp.asarray(LOGITS_T), beta=0.3)
  b = generalized_jsd(jnp.asarray(LOGITS_T), jnp.asarray(LOGITS_S), beta=0.7)
  np.testing.assert_allclose(a, b, rtol=1e-5)


def test_jsd_rejects_beta_outside_unit_interval():
  with pytest.raises(ValueError, match="beta"):
    generalized_jsd(jnp.zeros((1, 3)), jnp.zeros((1, 3)), beta=1.5)


# OPSD: chunked per-token divergence between two models.

TINY = ModelConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                   mlp_dim=32)


@functools.lru_cache(maxsize=None)
def two_models():
  """Student and teacher params and a left-padded student / teacher batch `[2, 9]`."""
  student = init_params(TINY, jax.random.key(0))
  rng = np.random.default_rng(0)
  # A different model: the student's parameters plus noise (cheaper than a second init).
  teacher = jax.tree.map(lambda x: x + 0.5 * rng.normal(size=x.shape).astype(x.dtype), student)
  tokens = rng.integers(1, 32, size=(2, 9)).astype(np.int32)
  t_tokens = tokens.copy()
  t_tokens[:, :3] = rng.integers(1, 32, size=(2, 3))
  s_mask = np.ones((2, 9), bool)
  s_mask[0, :2] = False  # left padding in the student prompt region
  t_mask = np.ones((2, 9), bool)
  t_mask[1, 8] = False  # right padding at the end of row 1 (both views)
  s_mask[1, 8] = False
  return student, teacher, tokens, s_mask, t_tokens, t_mask


def full_logprobs(params, tokens, mask):
  logits = Transformer(TINY).apply({"params": params}, jnp.asarray(tokens), jnp.asarray(mask))
  return log_softmax(np.asarray(logits.logits, np.float64))


@pytest.mark.parametrize("beta", [1.0, 0.0])
def test_token_divergence_matches_brute_force_full_vocabulary_kl(beta):
  student, teacher, tokens, s_mask, t_tokens, t_mask = two_models()
  div, entropy, logp = jax.jit(functools.partial(
      token_divergence, model=TINY, beta=beta, chunk_size=3))(
          student, teacher, student_tokens=tokens, student_mask=s_mask,
          teacher_tokens=t_tokens, teacher_mask=t_mask)
  log_s, log_t = full_logprobs(student, tokens, s_mask), full_logprobs(teacher, t_tokens, t_mask)
  per_slot = kl(log_s, log_t) if beta == 1.0 else kl(log_t, log_s)
  # Column t holds the divergence of the distributions predicting token t (slot t - 1).
  scored = s_mask[:, 1:] & s_mask[:, :-1] & t_mask[:, 1:] & t_mask[:, :-1]
  expected = np.pad(np.where(scored, per_slot[:, :-1], 0.0), [(0, 0), (1, 0)])
  np.testing.assert_allclose(div, expected, rtol=1e-4, atol=1e-6)
  ent = -np.sum(np.exp(log_s) * log_s, axis=-1)
  np.testing.assert_allclose(entropy, np.pad(np.where(scored, ent[:, :-1], 0.0),
                                             [(0, 0), (1, 0)]), rtol=1e-4, atol=1e-6)
  # The student's token log-probs come from the same forward.
  token = np.take_along_axis(log_s[:, :-1], np.asarray(tokens)[:, 1:, None], axis=-1)[..., 0]
  np.testing.assert_allclose(logp, np.pad(np.where(scored, token, 0.0), [(0, 0), (1, 0)]),
                             rtol=1e-4, atol=1e-6)


def test_token_divergence_sends_no_gradient_to_the_teacher():
  student, teacher, tokens, s_mask, t_tokens, t_mask = two_models()
  loss = lambda s, t: jnp.sum(token_divergence(s, t, TINY, tokens, s_mask, t_tokens, t_mask,
                                               chunk_size=4).divergence)
  g_student, g_teacher = jax.jit(jax.grad(loss, argnums=(0, 1)))(student, teacher)
  assert all(np.all(np.asarray(g) == 0) for g in jax.tree.leaves(g_teacher))
  assert any(np.any(np.asarray(g) != 0) for g in jax.tree.leaves(g_student))


def test_token_divergence_entropy_carries_no_gradient():
  student, teacher, tokens, s_mask, t_tokens, t_mask = two_models()

  def loss(s, entropy_weight):
    scores = token_divergence(s, teacher, TINY, tokens, s_mask, t_tokens, t_mask, chunk_size=4)
    return jnp.sum(scores.divergence) + entropy_weight * jnp.sum(scores.entropy)

  plain, weighted = (jax.grad(loss)(student, w) for w in (0.0, 10.0))
  for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(weighted)):
    np.testing.assert_array_equal(a, b)
  assert float(loss(student, 1.0) - loss(student, 0.0)) > 0.5  # the entropy is not zero


def test_opsd_loss_is_token_mean_divergence_plus_rl_coef_times_grpo():
  rng = np.random.default_rng(1)
  logp, old, adv, div = (jnp.asarray(rng.normal(size=(2, 4)), jnp.float32) for _ in range(4))
  mask = jnp.array([[True, True, False, False], [True, True, True, False]])
  distill = float(np.sum(np.where(mask, div, 0.0)) / 5)
  pure, weight, metrics = algorithms.get("opsd", group_size=2).loss(logp, old, adv, mask,
                                                                    divergence=div)
  np.testing.assert_allclose(pure, distill, rtol=1e-6)
  assert float(weight) == 5  # a token mean over the 5 loss tokens
  mixed, _, _ = algorithms.get("opsd", group_size=2, rl_coef=0.5).loss(logp, old, adv, mask,
                                                                       divergence=div)
  grpo, _, grpo_metrics = algorithms.get("grpo", group_size=2).loss(logp, old, adv, mask)
  np.testing.assert_allclose(mixed, distill + 0.5 * float(grpo), rtol=1e-6)
  # The PG diagnostics are reported even when the PG term is off.
  np.testing.assert_allclose(metrics["pg_clipfrac"], grpo_metrics["pg_clipfrac"])


def test_opsd_loss_requires_the_divergence():
  with pytest.raises(ValueError, match="divergence"):
    algorithms.get("opsd", group_size=2).loss(jnp.zeros((2, 3)), jnp.zeros((2, 3)),
                                              jnp.zeros((2, 3)), jnp.ones((2, 3), bool))


def test_only_opsd_asks_for_a_distillation_divergence():
  betas = {name: algorithms.get(name).distillation_beta for name in algorithms.names()}
  assert betas == {"grpo": None, "pbsd": None, "opsd": 1.0, "rlsd": None, "gear": None,
                   "oracle_credit": None}


# RLSD.


def rlsd_inputs(step, logp_teacher):
  action = np.ones((2, 2), bool)
  return AdvantageInputs(rewards=jnp.array([1.0, 0.0]), action_mask=jnp.asarray(action),
                         turn_ids=jnp.zeros((2, 2), jnp.int32), step=jnp.asarray(step),
                         max_turns=1, logp_student=jnp.zeros((2, 2)),
                         logp_teacher=jnp.asarray(logp_teacher, jnp.float32))


D = np.array([[0.1, -1.0], [0.1, 0.5]], np.float32)


def test_rlsd_lambda_decays_linearly_from_half_to_zero_over_fifty_steps():
  got = [float(algorithms.rlsd_lambda(s)) for s in (0, 25, 50, 80)]
  np.testing.assert_allclose(got, [0.5, 0.25, 0.0, 0.0])


def test_rlsd_at_step_zero_hand_computed():
  algo = algorithms.get("rlsd", group_size=2, normalize_std=False)  # A = [0.5, -0.5]
  adv, _, _ = algo.advantages(rlsd_inputs(0, D))
  # w = exp(sign(A) D) clipped to [0.8, 1.2]; credit = 0.5 + 0.5 w.
  credit = 0.5 + 0.5 * np.array([[np.exp(0.1), 0.8], [np.exp(-0.1), 0.8]])
  np.testing.assert_allclose(adv, np.array([[0.5], [-0.5]]) * credit, rtol=1e-6)


@pytest.mark.parametrize("step", [50, 51, 500])
def test_rlsd_after_step_fifty_equals_grpo_exactly(step):
  rng = np.random.default_rng(step)
  batch = rlsd_inputs(step, rng.normal(scale=5.0, size=(2, 2)))
  rlsd, _, _ = algorithms.get("rlsd", group_size=2).advantages(batch)
  grpo, _, _ = algorithms.get("grpo", group_size=2).advantages(batch)
  np.testing.assert_array_equal(rlsd, grpo)


# GEAR.

ACTION = np.array([[0, 1, 1, 1, 1, 1, 0, 1, 1, 1],
                   [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]], bool)
KL = np.array([[0.0, 0.1, 0.5, 0.2, 0.3, 0.9, 0.0, 0.6, 0.1, 0.1],
               [0.7, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]], np.float32)
ENTROPY = np.array([[0.0, 2.0, 0.5, 2.0, 2.0, 1.0, 0.0, 2.0, 1.5, 2.0],
                    [0.1, 2.0, 2.0, 1.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]], np.float32)


def test_gear_segmentation_hand_made_example():
  in_segment, anchor_kl = algorithms.gear_segments(
      jnp.asarray(KL), jnp.asarray(ENTROPY), jnp.asarray(ACTION))
  # Row 0: a high-entropy token before any anchor is outside; the anchor at 2 (KL 0.5) runs
  # through 4; a new anchor at 5 (0.9); the observation at 6 closes it; the anchor at 7 (0.6)
  # is closed by entropy 1.5 (not > 1.5) at 8, and 9 stays outside.
  # Row 1: an anchor in the first column extends over the high-entropy 1, 2; 3 closes it.
  np.testing.assert_array_equal(in_segment, [[0, 0, 1, 1, 1, 1, 0, 1, 0, 0],
                                             [1, 1, 1, 0, 0, 0, 0, 0, 0, 0]])
  np.testing.assert_allclose(anchor_kl, [[-1, -1, .5, .5, .5, .9, -1, .6, -1, -1],
                                         [.7, .7, .7, -1, -1, -1, -1, -1, -1, -1]], rtol=1e-6)


def brute_force_segments(kl_, entropy, action, kl_threshold, entropy_threshold):
  anchor = np.full(kl_.shape, -1.0)
  for b in range(kl_.shape[0]):
    current = -1.0
    for t in range(kl_.shape[1]):
      if action[b, t] and kl_[b, t] > kl_threshold:
        current = kl_[b, t]
      elif not (action[b, t] and entropy[b, t] > entropy_threshold):
        current = -1.0
      anchor[b, t] = current
  return anchor


def test_gear_segmentation_matches_a_sequential_loop():
  rng = np.random.default_rng(0)
  kl_ = rng.exponential(0.3, size=(6, 40)).astype(np.float32)
  entropy = rng.uniform(0, 3, size=(6, 40)).astype(np.float32)
  action = rng.uniform(size=(6, 40)) < 0.8
  _, anchor_kl = algorithms.gear_segments(jnp.asarray(kl_), jnp.asarray(entropy),
                                          jnp.asarray(action))
  np.testing.assert_allclose(anchor_kl, brute_force_segments(kl_, entropy, action, 0.4, 1.5),
                             rtol=1e-6)


def test_gear_scales_segments_and_keeps_outcome_advantage_elsewhere():
  algo = algorithms.get("gear", group_size=2, normalize_std=False)  # A = [0.5, -0.5]
  batch = AdvantageInputs(rewards=jnp.array([1.0, 0.0]), action_mask=jnp.asarray(ACTION),
                          turn_ids=jnp.where(jnp.asarray(ACTION), 0, -1), step=jnp.asarray(0),
                          max_turns=1, divergence=jnp.asarray(KL), entropy=jnp.asarray(ENTROPY))
  adv, _, _ = algo.advantages(batch)
  g = lambda k: 1 + 0.5 * np.tanh(k - 0.4)
  row0 = 0.5 * np.array([0, 1, g(.5), g(.5), g(.5), g(.9), 0, g(.6), 1, 1])
  row1 = -0.5 * np.array([g(.7), g(.7), g(.7), 1, 1, 1, 1, 1, 1, 1])
  np.testing.assert_allclose(adv, np.stack([row0, row1]), rtol=1e-6)


def test_gear_scale_is_bounded_and_one_at_the_threshold():
  k = jnp.array([0.4, 1.0, 100.0])
  np.testing.assert_allclose(algorithms.gear_scale(k), [1.0, 1 + 0.5 * np.tanh(0.6), 1.5],
                             rtol=1e-6)
