"""Privileged prompt and the vmapped dual-conditioning likelihood (DESIGN §2, §3)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pbsd_jax.agent import privileged
from pbsd_jax.models import ModelConfig, Transformer, init_params
from pbsd_jax.rl.likelihood import dual_logprobs, token_logprobs

CONFIG = ModelConfig(vocab_size=256, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                     mlp_dim=32)
PAD = 0
SENTINEL = "@#@"  # no question or trajectory below contains '@' or '#'
TEMPLATE = "(T) {answer}\n"  # short: byte-level tokens
WIDTH, LENGTH = 36, 44
QUESTIONS = ["Question: where?\n", "Question: who founded it?\n"]
TRAJECTORIES = [[97, 98, 99, 100, 101, 102], [110, 111, 112]]  # right-padded after the rollout


def encode(text):
  """A byte-level tokenizer: ids are the UTF-8 bytes."""
  return list(text.encode("utf-8"))


@functools.lru_cache(maxsize=None)
def batch():
  """Student and teacher sequences `[2, LENGTH]` sharing the trajectory columns from WIDTH."""
  width, length = WIDTH, LENGTH
  student_prompts = [encode(q) for q in QUESTIONS]
  s_prompt, s_prompt_mask, t_prompt, t_prompt_mask = privileged.dual_prompts(
      student_prompts, [SENTINEL, SENTINEL], encode, width, PAD, TEMPLATE)
  tokens = np.full((2, length), PAD, np.int32)
  mask = np.zeros((2, length), bool)
  tokens[:, :width], mask[:, :width] = s_prompt, s_prompt_mask
  for row, traj in enumerate(TRAJECTORIES):
    tokens[row, width:width + len(traj)] = traj
    mask[row, width:width + len(traj)] = True
  t_tokens, t_mask = privileged.teacher_sequence(
      jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(t_prompt), jnp.asarray(t_prompt_mask))
  return tokens, mask, np.asarray(t_tokens), np.asarray(t_mask)


@functools.lru_cache(maxsize=None)
def dual():
  params = init_params(CONFIG, jax.random.key(0))
  tokens, mask, t_tokens, t_mask = batch()
  out = jax.jit(functools.partial(dual_logprobs, model=CONFIG, chunk_size=7))(
      params, student_tokens=tokens, student_mask=mask, teacher_tokens=t_tokens,
      teacher_mask=t_mask)
  return params, np.asarray(out)


def test_dual_logprobs_shape_is_two_by_batch_by_length():
  assert dual()[1].shape == (2, 2, LENGTH)


def test_student_half_equals_a_plain_forward_on_the_student_sequence():
  params, out = dual()
  tokens, mask, _, _ = batch()
  plain = token_logprobs(params, CONFIG, jnp.asarray(tokens), jnp.asarray(mask))
  np.testing.assert_allclose(out[0], plain, rtol=1e-5, atol=1e-5)



@pytest.mark.parametrize("chunk_size", [None, 5])
def test_scoring_from_the_prompt_width_equals_brute_force_on_the_trajectory(chunk_size):
  params, _ = dual()
  tokens, mask, _, _ = map(jnp.asarray, batch())
  # Brute force: the distribution at column t - 1 scores the token at t.
  log_p = jax.nn.log_softmax(Transformer(CONFIG).apply({"params": params}, tokens, mask).logits)
  full = jnp.take_along_axis(log_p[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
  full = jnp.pad(jnp.where(mask[:, 1:] & mask[:, :-1], full, 0.0), [(0, 0), (1, 0)])
  full_entropy = jnp.pad(-jnp.sum(jnp.exp(log_p) * log_p, -1)[:, :-1], [(0, 0), (1, 0)])
  cut, cut_entropy = token_logprobs(params, CONFIG, tokens, mask, with_entropy=True,
                                    chunk_size=chunk_size, score_from=WIDTH)
  assert np.all(np.asarray(cut)[:, :WIDTH] == 0) and np.all(np.asarray(cut_entropy)[:, :WIDTH] == 0)
  assert np.any(np.asarray(full)[:, :WIDTH] != 0)  # the prompt columns really were skipped
  np.testing.assert_allclose(cut[:, WIDTH:], full[:, WIDTH:], rtol=1e-5, atol=1e-6)
  real = np.asarray(mask[:, WIDTH:] & mask[:, WIDTH - 1:-1])
  np.testing.assert_allclose(np.asarray(cut_entropy)[:, WIDTH:][real],
                             np.asarray(full_entropy)[:, WIDTH:][real], rtol=1e-5, atol=1e-6)


def test_teacher_half_equals_a_plain_forward_on_the_unpadded_teacher_sequence():
  params, out = dual()
  _, _, t_tokens, t_mask = batch()
  for row in range(2):
    real = t_tokens[row][t_mask[row]][None]
    alone = token_logprobs(params, CONFIG, jnp.asarray(real), jnp.ones(real.shape, bool))
    np.testing.assert_allclose(out[1, row][t_mask[row]], alone[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out[1, row][~t_mask[row]], 0.0)


def test_trajectory_columns_line_up_between_student_and_teacher():
  tokens, mask, t_tokens, t_mask = batch()
  np.testing.assert_array_equal(tokens[:, WIDTH:], t_tokens[:, WIDTH:])
  np.testing.assert_array_equal(mask[:, WIDTH:], t_mask[:, WIDTH:])
  # The privileged block makes the teacher prompt longer, and both fit the same width.
  assert np.all(t_mask[:, :WIDTH].sum(1) > mask[:, :WIDTH].sum(1))


def test_the_teacher_condition_changes_the_trajectory_log_probs():
  _, out = dual()
  _, mask, _, _ = batch()
  traj = mask & (np.arange(LENGTH) > WIDTH)
  assert np.max(np.abs(out[1] - out[0])[traj]) > 1e-4


def test_sentinel_answer_never_appears_on_the_student_side():
  tokens, mask, t_tokens, _ = batch()
  answer_ids = set(encode(SENTINEL))
  assert answer_ids.isdisjoint(tokens[mask].tolist())
  assert answer_ids.isdisjoint(tokens.ravel().tolist())
  assert answer_ids <= set(t_tokens.ravel().tolist())


def test_dual_logprobs_carries_no_gradient():
  params, _ = dual()
  tokens, mask, t_tokens, t_mask = batch()
  grads = jax.grad(lambda p: jnp.sum(dual_logprobs(p, CONFIG, tokens, mask, t_tokens, t_mask)))(
      params)
  assert all(np.all(np.asarray(g) == 0) for g in jax.tree.leaves(grads))


def test_privileged_prompt_extends_the_student_prompt_ids():
  student = encode(QUESTIONS[0])
  teacher = privileged.privileged_prompt(student, "Paris", encode)
  assert teacher[:len(student)] == student
  assert teacher[len(student):] == encode(privileged.privileged_block("Paris"))


def test_custom_template_is_used_verbatim():
  block = privileged.privileged_block("42", template="[gold: {answer}]")
  assert block == "[gold: 42]"


def test_template_without_answer_field_is_rejected():
  with pytest.raises(ValueError, match="answer"):
    privileged.privileged_block("42", template="no field here")


def test_the_chain_block_states_the_answer_and_the_gold_chain():
  record = {"golden_answers": ["Talvoria"], "chain_names": ["Velora Quint", "Quint Dynamics",
                                                            "Talvoria"]}
  block = privileged.privileged_block("Talvoria", privileged.TEMPLATES["chain"],
                                      privileged.chain_text(record))
  assert block == ("(Teacher-only) The verified answer is: Talvoria. The facts lead through: "
                   "Velora Quint -> Quint Dynamics -> Talvoria. Reason and search as if you did "
                   "not know them.\n")
  with pytest.raises(ValueError, match="gold chain"):
    privileged.privileged_block("Talvoria", privileged.TEMPLATES["chain"])


def test_left_pad_right_aligns_real_tokens():
  tokens, mask = privileged.left_pad([[5, 6], [7], []], width=3, pad_id=0)
  np.testing.assert_array_equal(tokens, [[0, 5, 6], [0, 0, 7], [0, 0, 0]])
  np.testing.assert_array_equal(mask, [[False, True, True], [False, False, True],
                                       [False, False, False]])


def test_left_pad_names_the_prompt_that_is_too_long():
  with pytest.raises(ValueError, match="prompt 1 has 4 tokens.*width 3"):
    privileged.left_pad([[1], [1, 2, 3, 4]], width=3, pad_id=0)


def test_dual_prompts_reports_a_teacher_prompt_that_does_not_fit():
  with pytest.raises(ValueError, match="teacher"):
    privileged.dual_prompts([encode("hi")], ["an answer"], encode, width=4, pad_id=0)


def test_replayed_routes_per_condition_or_shared_reach_the_model():
  moe = ModelConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                    mlp_dim=16, num_experts=4, num_experts_per_tok=2)
  params = init_params(moe, jax.random.key(0))
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(1, 32, size=(2, 6)), jnp.int32)
  teacher = tokens.at[:, :2].set(jnp.asarray(rng.integers(1, 32, size=(2, 2)), jnp.int32))
  mask = jnp.ones((2, 6), bool)
  route = jax.jit(lambda t: Transformer(moe).apply({"params": params}, t, mask).routes)
  own = jnp.stack([route(tokens), route(teacher)])
  run = jax.jit(functools.partial(dual_logprobs, model=moe))
  fresh = run(params, student_tokens=tokens, student_mask=mask, teacher_tokens=teacher,
              teacher_mask=mask)
  # Replaying each condition's own routes reproduces fresh routing.
  replayed = run(params, student_tokens=tokens, student_mask=mask, teacher_tokens=teacher,
                 teacher_mask=mask, routes=own)
  np.testing.assert_allclose(replayed, fresh, rtol=1e-5, atol=1e-6)
  # Shared routes (the student's, for both) apply to both conditions.
  shared = run(params, student_tokens=tokens, student_mask=mask, teacher_tokens=teacher,
               teacher_mask=mask, routes=own[0])
  np.testing.assert_allclose(shared[0], fresh[0], rtol=1e-5, atol=1e-6)
  assert np.max(np.abs(np.asarray(shared[1]) - np.asarray(fresh[1]))) > 1e-6


def test_routes_of_minus_one_are_routed_afresh():
  moe = ModelConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                    mlp_dim=16, num_experts=4, num_experts_per_tok=2)
  params = jax.tree.map(lambda x: 10 * x, init_params(moe, jax.random.key(2)))
  tokens = jnp.asarray(np.random.default_rng(1).integers(1, 32, size=(2, 8)), jnp.int32)
  apply = jax.jit(lambda t, r=None: Transformer(moe).apply({"params": params}, t, routes=r))
  fresh = apply(tokens)
  # The two experts each token's fresh routing did not choose.
  chosen = jnp.sum(jax.nn.one_hot(fresh.routes, 4, dtype=jnp.int32), axis=-2)
  forced = jnp.argsort(chosen, axis=-1, stable=True)[..., :2].astype(jnp.int32)
  part = jnp.arange(8)[None, None, :, None] < 3  # the first 3 positions routed afresh
  mixed = apply(tokens, jnp.where(part, -1, forced))
  explicit = jnp.where(part, fresh.routes, forced)
  np.testing.assert_array_equal(mixed.routes, explicit)
  np.testing.assert_allclose(mixed.logits, apply(tokens, explicit).logits, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(mixed.logits[:, :3], fresh.logits[:, :3], rtol=1e-5, atol=1e-6)
  assert np.max(np.abs(np.asarray(mixed.logits[:, 3:] - fresh.logits[:, 3:]))) > 1e-3
  np.testing.assert_array_equal(apply(tokens, jnp.full_like(forced, -1)).routes, fresh.routes)
