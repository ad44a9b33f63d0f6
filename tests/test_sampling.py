"""The sampler: filters, greedy limit, the sampling distribution, stops, budgets, appends."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pbsd_jax.generate import sampling
from pbsd_jax.generate.sampling import Sampler, sample_token, stop_sequence_array
from pbsd_jax.models import ModelConfig, Transformer, init_params
from pbsd_jax.models.attention import cpu_kernels
from pbsd_jax.rl.likelihood import token_logprobs

CONFIG = ModelConfig(vocab_size=40, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                     mlp_dim=48)
PARAMS = jax.tree.map(lambda x: x * 20.0, init_params(CONFIG, jax.random.key(0)))  # peaky
PROMPT = jnp.array([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12], [0, 0, 0, 0, 13]])
PMASK = jnp.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]], bool)


def _samples(n, logits, **kw):
  draw = jax.jit(jax.vmap(lambda k, x: sample_token(k, x, **kw)[0], in_axes=(0, None)))
  return np.asarray(draw(jax.random.split(jax.random.key(0), n), logits)).reshape(-1)


def test_greedy_is_the_first_argmax_over_blocks_ties_and_padding():
  rng = np.random.default_rng(0)
  logits = rng.standard_normal((7, 300)).astype(np.float32)  # blocks of 8: the last is short
  logits[0, [17, 250]] = 9.0      # tied maxima in different blocks: the first wins
  logits[1, [40, 43]] = 9.0       # tied within one block
  logits[2, 299] = 9.0            # in the padded last block
  logits[3, :] = -np.inf          # nothing allowed: index 0, as jnp.argmax
  logits[4, 5:] = -np.inf
  logits[5, [3, 200]] = np.nan    # NaN counts as the maximum in jnp.argmax
  got = sampling.greedy(jnp.asarray(logits), block=8)
  want = jnp.argmax(jnp.asarray(logits), axis=-1)
  np.testing.assert_array_equal(got, want)
  assert list(np.asarray(got)[:3]) == [17, 40, 299]


def test_top_k_never_emits_tokens_outside_the_k_most_likely():
  logits = jnp.array([[0.0, 3.0, 1.0, 2.9, -1.0, 2.8, 0.5]])
  seen = set(_samples(4000, logits, top_k=3))
  assert seen == {1, 3, 5}


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass():
  probs = jnp.array([[0.05, 0.5, 0.1, 0.3, 0.05]])
  seen = set(_samples(4000, jnp.log(probs), top_p=0.75))
  assert seen == {1, 3}  # 0.5 < 0.75, so 0.3 is needed; then 0.8 >= 0.75 stops.
  assert set(_samples(2000, jnp.log(probs), top_p=0.4)) == {1}  # the top token always stays


def test_empirical_distribution_matches_softmax():
  logits = jnp.array([[1.0, 0.0, -1.0, 2.0, 0.5, -0.5]])
  n = 40_000
  counts = np.bincount(_samples(n, logits, temperature=0.7), minlength=6) / n
  p = np.asarray(jax.nn.softmax(logits[0] / 0.7))
  sigma = np.sqrt(p * (1 - p) / n)
  assert np.all(np.abs(counts - p) < 5 * sigma + 1e-4), (counts, p)



def test_two_stage_draw_matches_softmax_across_blocks():
  # 10 ids in blocks of 4: three blocks, the last padded; id 5 can never be drawn.
  logits = jnp.array([1.0, 0.0, -1.0, 2.0, 0.5, -jnp.inf, 1.5, -0.5, 0.3, 1.2])
  n = 40_000
  rows = jnp.broadcast_to(logits, (n, 10))
  drawn = np.asarray(sampling.categorical(jax.random.key(5), rows, block=4))
  counts = np.bincount(drawn, minlength=10) / n
  p = np.asarray(jax.nn.softmax(logits))
  sigma = np.sqrt(p * (1 - p) / n)
  assert counts.shape == (10,) and counts[5] == 0  # nothing from padding, nothing at -inf
  assert np.all(np.abs(counts - p) < 5 * sigma + 1e-4), (counts, p)

def test_sampled_logp_is_the_temperature_scaled_log_softmax():
  logits = jnp.array([[1.0, 0.0, -1.0], [0.3, 0.2, 0.1]])
  tok, logp = sample_token(jax.random.key(3), logits, temperature=0.5)
  want = jax.nn.log_softmax(logits / 0.5)[jnp.arange(2), tok]
  np.testing.assert_allclose(logp, want, atol=1e-6)
  # Filtered, the log-prob is still under the unfiltered distribution.
  for kw in ({"top_k": 2}, {"top_p": 0.5}):
    tok, logp = sample_token(jax.random.key(4), logits, temperature=0.5, **kw)
    want = jax.nn.log_softmax(logits / 0.5)[jnp.arange(2), tok]
    assert float(jnp.max(jnp.abs(want - jax.nn.log_softmax(jnp.where(
        jnp.arange(3) == 2, -jnp.inf, logits / 0.5))[jnp.arange(2), tok]))) > 0.05
    np.testing.assert_allclose(logp, want, atol=1e-6)


@jax.jit
def _next_greedy(tokens, length):
  """Greedy next token after the first `length` tokens of a right-padded `i32[16]` row."""
  mask = jnp.arange(16) < length
  logits = Transformer(CONFIG).apply({"params": PARAMS}, tokens[None], mask[None]).logits
  return jnp.argmax(logits[0, length - 1])


def _greedy_reference(tokens, mask, steps):
  """Brute force: a full forward over the whole sequence for every new token."""
  rows = []
  for b in range(tokens.shape[0]):
    seq = [int(t) for t, m in zip(tokens[b], mask[b]) if m]
    for _ in range(steps):
      padded = jnp.array(seq + [0] * (16 - len(seq)))
      seq.append(int(_next_greedy(padded, len(seq))))
    rows.append(seq[-steps:])
  return np.array(rows)


def test_temperature_zero_equals_brute_force_greedy():
  state, _ = Sampler(CONFIG, temperature=0.0).generate(PARAMS, PROMPT, PMASK,
                                                       jax.random.key(1), 6)
  np.testing.assert_array_equal(state.tokens[:, 5:11], _greedy_reference(PROMPT, PMASK, 6))


def test_temperature_to_zero_limit_is_greedy():
  cold, _ = Sampler(CONFIG, temperature=1e-4).generate(PARAMS, PROMPT, PMASK,
                                                       jax.random.key(7), 6)
  greedy, _ = Sampler(CONFIG, temperature=0.0).generate(PARAMS, PROMPT, PMASK,
                                                        jax.random.key(8), 6)
  np.testing.assert_array_equal(cold.tokens, greedy.tokens)


def test_same_key_same_tokens_and_other_key_other_tokens():
  s = Sampler(CONFIG)
  params = init_params(CONFIG, jax.random.key(0))  # flat distribution: keys matter
  a, _ = s.generate(params, PROMPT, PMASK, jax.random.key(1), 8)
  b, _ = s.generate(params, PROMPT, PMASK, jax.random.key(1), 8)
  c, _ = s.generate(params, PROMPT, PMASK, jax.random.key(2), 8)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  assert not np.array_equal(a.tokens, c.tokens)


def test_sample_logp_equals_the_models_token_logprobs():
  params = init_params(CONFIG, jax.random.key(0))
  state, _ = Sampler(CONFIG).generate(params, PROMPT, PMASK, jax.random.key(4), 8)
  lp = token_logprobs(params, CONFIG, state.tokens, state.mask)
  np.testing.assert_allclose(jnp.where(state.sampled, lp, 0.0), state.sample_logp, atol=1e-5)


def test_multi_token_stop_sequences_end_each_row_right_after_the_stop():
  s = Sampler(CONFIG, temperature=0.0)
  free, _ = s.generate(PARAMS, PROMPT, PMASK, jax.random.key(0), 12)
  gen = np.asarray(free.tokens[:, 5:])
  # Per-row stop: the pair of tokens at generated positions (3, 4); the row must stop at the
  # first occurrence of that pair.
  stops, want_len = [], []
  for row in gen:
    pair = [int(row[3]), int(row[4])]
    first = next(i for i in range(1, 12) if [int(row[i - 1]), int(row[i])] == pair)
    stops.append(stop_sequence_array([pair, [CONFIG.vocab_size + 5]]))  # 2nd never matches
    want_len.append(first + 1)
  state, res = s.generate(PARAMS, PROMPT, PMASK, jax.random.key(0), 12,
                          stop_sequences=jnp.stack(stops))
  np.testing.assert_array_equal(res.num_new, want_len)
  np.testing.assert_array_equal(res.stop_reason, [sampling.STOP_SEQUENCE] * 3)
  np.testing.assert_array_equal(res.stop_index, [0, 0, 0])
  np.testing.assert_array_equal(state.sampled.sum(1), want_len)
  for b, n in enumerate(want_len):
    np.testing.assert_array_equal(state.tokens[b, 5:5 + n], gen[b, :n])
    assert np.all(np.asarray(state.tokens[b, 5 + n:]) == 0)


def test_per_row_budgets_hold():
  s = Sampler(CONFIG)
  state, res = s.generate(PARAMS, PROMPT, PMASK, jax.random.key(0), 10,
                          budget=jnp.array([3, 10, 0]))
  np.testing.assert_array_equal(res.num_new, [3, 10, 0])
  np.testing.assert_array_equal(state.sampled.sum(1), [3, 10, 0])
  np.testing.assert_array_equal(state.cursor, [8, 15, 5])
  np.testing.assert_array_equal(res.stop_reason, [sampling.STOP_BUDGET] * 3)


def test_eos_ends_a_row_and_is_kept_as_its_last_token():
  free, _ = Sampler(CONFIG, temperature=0.0).generate(PARAMS, PROMPT, PMASK,
                                                      jax.random.key(0), 6)
  eos = int(free.tokens[1, 7])  # row 1's third greedy token
  state, res = Sampler(CONFIG, temperature=0.0).generate(
      PARAMS, PROMPT, PMASK, jax.random.key(0), 6, eos_id=eos)
  first = int(np.argmax(np.asarray(free.tokens[1, 5:]) == eos))
  assert int(res.num_new[1]) == first + 1 and int(res.stop_reason[1]) == sampling.STOP_EOS
  assert int(state.tokens[1, 5 + first]) == eos


def test_inactive_rows_are_untouched():
  s = Sampler(CONFIG)
  state = s.prefill(PARAMS, PROMPT, PMASK, 12)
  new, res = s.decode(PARAMS, state, jax.random.key(0), jnp.full((3,), 4),
                      active=jnp.array([True, False, True]), max_steps=4)
  np.testing.assert_array_equal(new.cursor, [9, 5, 9])
  np.testing.assert_array_equal(new.tokens[1], state.tokens[1])
  np.testing.assert_array_equal(new.logits[1], state.logits[1])
  assert int(res.stop_reason[1]) == sampling.RUNNING


def test_append_then_decode_equals_a_plain_forward_over_the_whole_row():
  s = Sampler(CONFIG, temperature=0.0)
  state = s.prefill(PARAMS, PROMPT, PMASK, 16)
  obs = jnp.array([[20, 21, 22], [23, 0, 0], [0, 0, 0]])
  state = s.append(PARAMS, state, obs, jnp.array([3, 1, 0]))
  np.testing.assert_array_equal(state.cursor, [8, 6, 5])
  state, _ = s.decode(PARAMS, state, jax.random.key(0), jnp.full((3,), 3), max_steps=3)
  for b in range(3):
    real = np.asarray(state.tokens[b])[np.asarray(state.mask[b])]
    ref = _greedy_reference(jnp.array([real[:-3]]), jnp.ones((1, len(real) - 3), bool), 3)
    np.testing.assert_array_equal(real[-3:], ref[0])
  assert not bool(state.sampled[0, 5:8].any())  # appended tokens are not the policy's


def test_an_append_in_chunks_equals_a_plain_forward_over_the_whole_row():
  # 40 columns go in chunks of 10: row 0 fills 4 chunks, row 1 part of one, row 2 none.
  assert sampling.append_chunk(40) == 10 and sampling.append_chunk(16) == 16
  s = Sampler(CONFIG, temperature=0.0)
  state = s.prefill(PARAMS, PROMPT, PMASK, 64)
  obs = jnp.asarray(np.random.default_rng(0).integers(1, CONFIG.vocab_size, (3, 40)), jnp.int32)
  lengths = np.array([37, 4, 0])
  state = s.append(PARAMS, state, obs, jnp.asarray(lengths))
  np.testing.assert_array_equal(state.cursor, 5 + lengths)
  # Right padding to one width: a causal row's logits do not see what follows them.
  forward = jax.jit(lambda row: Transformer(CONFIG).apply({"params": PARAMS}, row[None]).logits)
  last_logits = lambda row: np.asarray(forward(np.pad(row, (0, 64 - len(row)))))[
      0, len(row) - 1]
  rows = []
  for b in range(3):
    row = np.concatenate([np.asarray(PROMPT[b])[np.asarray(PMASK[b])], obs[b, :lengths[b]]])
    np.testing.assert_array_equal(np.asarray(state.tokens[b])[np.asarray(state.mask[b])], row)
    np.testing.assert_allclose(state.logits[b], last_logits(row), rtol=1e-4, atol=1e-4)
    rows.append(row)
  state, _ = s.decode(PARAMS, state, jax.random.key(0), jnp.full((3,), 2), max_steps=2)
  for b, row in enumerate(rows):  # greedy continuations, each token from a full forward
    for _ in range(2):
      row = np.append(row, np.argmax(last_logits(row)))
    np.testing.assert_array_equal(np.asarray(state.tokens[b])[np.asarray(state.mask[b])], row)


def test_bad_sampler_settings_raise():
  with pytest.raises(ValueError, match="top_p"):
    Sampler(CONFIG, top_p=0.0)
  with pytest.raises(ValueError, match="temperature"):
    Sampler(CONFIG, temperature=-1.0)
  with pytest.raises(ValueError, match="top_k"):
    Sampler(CONFIG, top_k=CONFIG.vocab_size + 1)


@pytest.mark.parametrize("settings, message", [
    (dict(temperature=-0.5), "Sampler.temperature must be >= 0, got -0.5"),
    (dict(top_p=0.0), r"Sampler.top_p must be in \(0, 1\], got 0.0"),
    (dict(top_p=1.5), r"Sampler.top_p must be in \(0, 1\], got 1.5"),
    (dict(top_k=-1), r"Sampler.top_k must be in \[0, vocab_size=40\], got -1"),
])
def test_sampler_names_the_field_that_cannot_run(settings, message):
  with pytest.raises(ValueError, match=f"^{message}$"):
    Sampler(CONFIG, **settings)


MOE = ModelConfig(vocab_size=40, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  mlp_dim=48, num_experts=4, num_experts_per_tok=2)


def test_recorded_routes_are_the_routes_of_the_tokens_as_written():
  # Prefill, a decode, an append of uneven lengths and a second decode: every written slot
  # holds the experts its token was routed to, which a full forward over the final buffer
  # (the same parameters, so the same routing) recomputes; empty slots hold -1.
  params = jax.tree.map(lambda x: x * 20.0, init_params(MOE, jax.random.key(1)))
  sampler = Sampler(MOE, temperature=1.0, record_routes=True)
  state = sampler.prefill(params, PROMPT, PMASK, 24)
  budget = jnp.array([3, 5, 2])
  state, _ = sampler.decode(params, state, jax.random.key(0), budget, max_steps=5)
  state = sampler.append(params, state, jnp.array([[21, 22, 23]] * 3), jnp.array([3, 0, 2]))
  state, _ = sampler.decode(params, state, jax.random.key(1), budget, max_steps=5)
  full = Transformer(MOE).apply({"params": params}, state.tokens, state.mask).routes
  full = np.moveaxis(np.asarray(full), 0, 2)  # [B, S, layers, k]
  got, mask = np.asarray(state.routes), np.asarray(state.mask)
  assert got.shape == (3, 24, 2, 2) and mask.sum() > 20
  np.testing.assert_array_equal(got[mask], full[mask])
  assert np.all(got[~mask] == -1)
  # Decoding takes the same tokens whether or not the routes are recorded.
  plain = Sampler(MOE, temperature=1.0).prefill(params, PROMPT, PMASK, 24)
  plain, _ = Sampler(MOE, temperature=1.0).decode(params, plain, jax.random.key(0), budget,
                                                  max_steps=5)
  again, _ = sampler.decode(params, sampler.prefill(params, PROMPT, PMASK, 24),
                            jax.random.key(0), budget, max_steps=5)
  np.testing.assert_array_equal(plain.tokens, again.tokens)


def test_recording_routes_needs_an_moe_model():
  with pytest.raises(ValueError, match="record_routes needs an MoE model"):
    Sampler(CONFIG, record_routes=True)


@pytest.mark.parametrize("write", ["cpu-kernel", "xla"])
@pytest.mark.parametrize("config", [CONFIG, MOE], ids=["dense", "moe"])
def test_a_per_layer_cache_runs_the_layers_one_by_one_as_the_layer_scan_does(config, write,
                                                                               monkeypatch,
                                                                               request):
  # With the layer scan fully unrolled the cache holds one array per layer and the layers
  # run one after another over their own arrays; prefill, decode, an uneven append and a
  # second decode give the tokens, log-probs, logits, cache and routes of the stacked cache.
  # The cache is written in place by the CPU kernel, or by XLA's scatter (as on accelerators).
  if write == "xla":
    monkeypatch.setattr(cpu_kernels, "write_cache", lambda *args: None)
    # The samplers' jitted methods trace anew, without the kernel, and with it again after
    # this test (the other programs of this process keep their compilations).
    for method in (Sampler.prefill, Sampler.append, Sampler.decode):
      method.clear_cache()
      request.addfinalizer(method.clear_cache)
  params = jax.tree.map(lambda x: x * 20.0, init_params(config, jax.random.key(1)))
  states = []
  for unroll in (1, config.num_layers):
    model = config.replace(scan_unroll=unroll)
    sampler = Sampler(model, temperature=1.0, record_routes=model.is_moe)
    state = sampler.prefill(params, PROMPT, PMASK, 24)
    budget = jnp.array([3, 5, 2])
    state, _ = sampler.decode(params, state, jax.random.key(0), budget, max_steps=5)
    state = sampler.append(params, state, jnp.array([[21, 22, 23]] * 3), jnp.array([3, 0, 2]))
    state, _ = sampler.decode(params, state, jax.random.key(1), budget, max_steps=5)
    states.append(state)
    lowered = Sampler.decode.lower(sampler, params, state, jax.random.key(1), budget,
                                   max_steps=5).as_text()
    assert (write == "xla") != any(t in lowered for t in cpu_kernels.WRITE_TARGETS.values())
  stacked, per_layer = states
  assert not isinstance(stacked.cache.k, tuple)
  assert isinstance(per_layer.cache.k, tuple) and len(per_layer.cache.k) == config.num_layers
  assert int(per_layer.cache.mask.sum()) > 20
  np.testing.assert_array_equal(per_layer.tokens, stacked.tokens)
  np.testing.assert_array_equal(per_layer.cache.mask, stacked.cache.mask)
  for got, want in [(per_layer.sample_logp, stacked.sample_logp),
                    (per_layer.logits, stacked.logits),
                    (jnp.stack(per_layer.cache.k), stacked.cache.k),
                    (jnp.stack(per_layer.cache.v), stacked.cache.v)]:
    assert float(jnp.max(jnp.abs(want))) > 0.1
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  if config.is_moe:
    np.testing.assert_array_equal(per_layer.routes, stacked.routes)
