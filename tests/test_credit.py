"""PBSD credit (DESIGN §2): evidence, deadband, modulation, token advantages."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pbsd_jax.rl import credit

TANH1 = 0.7615941559557649  # tanh(1)
TANH2 = 0.9640275800758169  # tanh(2)

# A hand-made 2x8 batch (DESIGN §3 layout). Row 0: prompt, prompt, turn 0 x2, observation,
# turn 1 x2, padding. Row 1: prompt, turn 0 x3, observation, turn 1, observation, turn 2.
TURN_IDS = np.array([[-1, -1, 0, 0, -1, 1, 1, -1],
                     [-1, 0, 0, 0, -1, 1, -1, 2]], np.int32)
# Teacher-minus-student log-ratios; values on non-action slots must be ignored.
LOG_RATIO = np.array([[9.0, 9.0, 0.2, 0.0, 9.0, -0.002, 0.0, 9.0],
                      [9.0, 0.3, -0.1, 0.1, 9.0, -0.2, 9.0, 0.0005]], np.float32)
ADVANTAGES = np.array([1.0, -0.5], np.float32)
# The paper's settings (PBSD's defaults); the hand-computed values below assume them.
PAPER = dict(delta=0.1, clip=0.1, eps_pos=0.001, eps_neg=0.003, reduction="mean", form="tanh")


def pbsd_advantages(*args, **settings):
  return credit.pbsd_advantages(*args, **{**PAPER, **settings})


def test_hand_computed_2x8_example():
  # Turn means: row 0 = [0.1, -0.001 (inside the deadband), empty]; row 1 = [0.1, -0.2,
  # 0.0005 (inside the deadband)]. Weights 1 + 0.1 tanh(sign(A) s / 0.1).
  w00 = 1 + 0.1 * TANH1
  w10, w11 = 1 - 0.1 * TANH1, 1 + 0.1 * TANH2
  expected = np.array([[0, 0, w00, w00, 0, 1, 1, 0],
                       [0, -0.5 * w10, -0.5 * w10, -0.5 * w10, 0, -0.5 * w11, 0, -0.5]])
  adv, turns, metrics = pbsd_advantages(
      jnp.asarray(ADVANTAGES), jnp.asarray(LOG_RATIO), jnp.zeros((2, 8)),
      jnp.asarray(TURN_IDS), max_turns=3)
  np.testing.assert_allclose(adv, expected, rtol=1e-5, atol=1e-6)
  # The turn credit behind them (an absent turn: evidence 0, weight 1).
  np.testing.assert_allclose(turns.evidence, [[0.1, -0.001, 0.0], [0.1, -0.2, 0.0005]],
                             rtol=1e-5)
  np.testing.assert_allclose(turns.filtered, [[0.1, 0.0, 0.0], [0.1, -0.2, 0.0]], rtol=1e-5)
  np.testing.assert_allclose(turns.weights, [[w00, 1, 1], [w10, w11, 1]], rtol=1e-6)
  # Five turns exist; s > 0 on three; two are zeroed by the deadband.
  np.testing.assert_allclose(metrics["frac_evidence_pos"], 3 / 5, rtol=1e-6)
  np.testing.assert_allclose(metrics["mean_abs_evidence"],
                             (0.1 + 0.001 + 0.1 + 0.2 + 0.0005) / 5, rtol=1e-5)
  np.testing.assert_allclose(metrics["frac_deadband"], 2 / 5, rtol=1e-6)
  np.testing.assert_allclose(metrics["weight_mean"], (w00 + 1 + w10 + w11 + 1) / 5, rtol=1e-6)
  np.testing.assert_allclose(metrics["weight_min"], w10, rtol=1e-6)
  np.testing.assert_allclose(metrics["weight_max"], w11, rtol=1e-6)


def test_turn_evidence_mean_and_sum_ignore_non_action_tokens():
  mean = credit.turn_evidence(jnp.asarray(LOG_RATIO), jnp.asarray(TURN_IDS), 3, "mean")
  total = credit.turn_evidence(jnp.asarray(LOG_RATIO), jnp.asarray(TURN_IDS), 3, "sum")
  np.testing.assert_allclose(mean, [[0.1, -0.001, 0.0], [0.1, -0.2, 0.0005]], rtol=1e-5)
  np.testing.assert_allclose(total, [[0.2, -0.002, 0.0], [0.3, -0.2, 0.0005]], rtol=1e-5)


def test_turn_evidence_rejects_unknown_reduction():
  with pytest.raises(ValueError, match="reduction"):
    credit.turn_evidence(jnp.zeros((1, 2)), jnp.zeros((1, 2), jnp.int32), 1, "max")


def test_delta_to_infinity_recovers_grpo():
  adv, _, _ = pbsd_advantages(
      jnp.asarray(ADVANTAGES), jnp.asarray(LOG_RATIO * 50), jnp.zeros((2, 8)),
      jnp.asarray(TURN_IDS), max_turns=3, delta=1e9)
  grpo = np.where(TURN_IDS >= 0, ADVANTAGES[:, None], 0.0)
  np.testing.assert_allclose(adv, grpo, rtol=1e-6, atol=0)


def test_zero_advantage_gives_zero_token_advantages():
  adv, _, _ = pbsd_advantages(
      jnp.zeros(2), jnp.asarray(LOG_RATIO), jnp.zeros((2, 8)), jnp.asarray(TURN_IDS), 3)
  np.testing.assert_array_equal(adv, np.zeros((2, 8)))


@pytest.mark.parametrize("form", credit.FORMS)
def test_weights_stay_within_one_plus_minus_clip(form):
  rng = np.random.default_rng(0)
  evidence = rng.normal(scale=10.0, size=(64, 5)).astype(np.float32)
  advantages = rng.normal(size=64).astype(np.float32)
  w = credit.modulation_weights(jnp.asarray(advantages), jnp.asarray(evidence), delta=0.01,
                                clip=0.2, form=form)
  assert np.all(np.asarray(w) >= 0.8 - 1e-7) and np.all(np.asarray(w) <= 1.2 + 1e-7)
  # Saturated evidence reaches the bounds.
  assert np.isclose(np.max(w), 1.2, atol=1e-6) and np.isclose(np.min(w), 0.8, atol=1e-6)


def test_clipped_tanh_form_clips_the_tanh_not_scales_it():
  w = credit.modulation_weights(jnp.array([1.0]), jnp.array([[0.02, 1.0, -0.01]]),
                                delta=0.1, clip=0.3, form="clipped_tanh")
  np.testing.assert_allclose(w, [[1 + np.tanh(0.2), 1.3, 1 + np.tanh(-0.1)]], rtol=1e-6)


def test_modulation_is_sign_aware():
  # The same supportive evidence raises credit when A > 0 and softens blame when A < 0.
  w = credit.modulation_weights(jnp.array([2.0, -2.0]), jnp.array([[0.1], [0.1]]), 0.1, 0.1)
  np.testing.assert_allclose(w, [[1 + 0.1 * TANH1], [1 - 0.1 * TANH1]], rtol=1e-6)
  adv = credit.token_advantages(jnp.array([2.0, -2.0]), w, jnp.zeros((2, 1), jnp.int32))
  assert adv[0, 0] > 2.0 and -2.0 < adv[1, 0] < 0.0


def test_deadband_zeroes_values_equal_to_the_thresholds():
  above, below = np.nextafter(np.float32(0.25), 1), np.nextafter(np.float32(-0.5), -1)
  evidence = np.array([[0.25, -0.5, above, below, 0.1, -0.3]], np.float32)
  out = credit.deadband(jnp.asarray(evidence), eps_pos=0.25, eps_neg=0.5)
  np.testing.assert_array_equal(out, np.array([[0, 0, above, below, 0, 0]], np.float32))


def test_deadband_default_thresholds_are_direction_specific():
  evidence = jnp.array([[0.002, -0.002, 0.001, -0.003, -0.0031]], jnp.float32)
  out = credit.deadband(evidence, eps_pos=0.001, eps_neg=0.003)
  np.testing.assert_array_equal(out, np.array([[0.002, 0.0, 0.0, 0.0, -0.0031]], np.float32))


def test_swapping_teacher_and_student_mirrors_every_weight():
  rng = np.random.default_rng(1)
  logp_a = rng.normal(scale=0.1, size=(2, 8)).astype(np.float32)
  logp_b = rng.normal(scale=0.1, size=(2, 8)).astype(np.float32)
  args = (jnp.asarray(TURN_IDS), 3)
  kw = dict(eps_pos=0.002, eps_neg=0.002)  # a symmetric deadband mirrors exactly
  adv, _, _ = pbsd_advantages(jnp.asarray(ADVANTAGES), logp_a, logp_b, *args, **kw)
  swapped, _, _ = pbsd_advantages(jnp.asarray(ADVANTAGES), logp_b, logp_a, *args, **kw)
  base = np.where(TURN_IDS >= 0, ADVANTAGES[:, None], 0.0)
  np.testing.assert_allclose(np.asarray(swapped) - base, -(np.asarray(adv) - base), atol=1e-6)
  assert np.any(np.abs(np.asarray(adv) - base) > 1e-3)


def test_swapping_teacher_and_student_flips_the_direction_of_every_change():
  rng = np.random.default_rng(2)
  logp_a = rng.normal(scale=0.01, size=(2, 8)).astype(np.float32)
  logp_b = rng.normal(scale=0.01, size=(2, 8)).astype(np.float32)
  adv, _, _ = pbsd_advantages(jnp.asarray(ADVANTAGES), logp_a, logp_b,
                                  jnp.asarray(TURN_IDS), 3)
  swapped, _, _ = pbsd_advantages(jnp.asarray(ADVANTAGES), logp_b, logp_a,
                                      jnp.asarray(TURN_IDS), 3)
  base = np.where(TURN_IDS >= 0, ADVANTAGES[:, None], 0.0)
  change, change_swapped = np.asarray(adv) - base, np.asarray(swapped) - base
  assert np.all(change * change_swapped <= 0)
  assert np.any(change != 0)


def test_token_advantages_are_zero_off_action_tokens():
  weights = jnp.array([[2.0, 3.0]])
  adv = credit.token_advantages(jnp.array([1.5]), weights, jnp.array([[-1, 0, 1, -1, 1]]))
  np.testing.assert_allclose(adv, [[0.0, 3.0, 4.5, 0.0, 4.5]])


def test_evidence_is_a_constant_to_the_optimiser():
  grad = jax.grad(lambda lt: jnp.sum(pbsd_advantages(
      jnp.asarray(ADVANTAGES), lt, jnp.zeros((2, 8)), jnp.asarray(TURN_IDS), 3)[0]))(
          jnp.asarray(LOG_RATIO))
  np.testing.assert_array_equal(grad, np.zeros((2, 8)))
