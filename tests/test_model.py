"""The transformer: cache/full-forward equivalence, padding invariance, MoE routing, configs."""

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pbsd_jax.generate.sampling import Sampler
from pbsd_jax.models import (KVCache, ModelConfig, Transformer, attention, init_params, param_axes,
                             param_shapes, transformer)
from pbsd_jax.models.attention import cpu_kernels, flash
from pbsd_jax.models.attention import decode as decode_lib
from pbsd_jax.models.sizes import SIZES
from pbsd_jax.rl.likelihood import token_logprobs

DENSE = ModelConfig(vocab_size=61, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                    mlp_dim=48, qkv_bias=True)
QWEN3 = ModelConfig(vocab_size=61, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=1,
                    head_dim=12, mlp_dim=48, qk_norm=True, rope_theta=1e6, tie_embeddings=True)
MOE = ModelConfig(vocab_size=61, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  mlp_dim=48, qk_norm=True, num_experts=4, num_experts_per_tok=2,
                  expert_mlp_dim=24)


@jax.jit
def _randomize(params, seed=0):
  """Random values everywhere (norm scales and biases too), so a wrong mapping shows."""
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(tree, [x + 0.1 * jax.random.normal(k, x.shape, x.dtype)
                                   for x, k in zip(leaves, keys)])


def _setup(config, seed=0):
  return _randomize(init_params(config, jax.random.key(seed)), seed)


@functools.partial(jax.jit, static_argnums=0, static_argnames="empty_cache")
def _forward(config, params, tokens, mask=None, cache=None, write_index=None, routes=None,
             empty_cache=False):
  return Transformer(config).apply({"params": params}, tokens, mask, cache=cache,
                                   write_index=write_index, routes=routes,
                                   empty_cache=empty_cache)


token_logprobs = jax.jit(token_logprobs, static_argnums=1,
                         static_argnames=("chunk_size", "with_entropy"))


def _prefill_then_decode(config, params, tokens, prompt: int, size: int):
  """`(logits f32[B, T, V], cache)`: a prefill of `tokens[:, :prompt]` into a cache of `size`
  slots, then one decode step per remaining token."""
  b = tokens.shape[0]
  out = _forward(config, params, tokens[:, :prompt], cache=KVCache.init(config, b, size),
                 write_index=jnp.zeros(b, jnp.int32))
  logits, cache = [out.logits], out.cache
  for i in range(prompt, tokens.shape[1]):
    out = _forward(config, params, tokens[:, i:i + 1], cache=cache,
                   write_index=jnp.full((b,), i))
    logits.append(out.logits)
    cache = out.cache
  return jnp.concatenate(logits, 1), cache


@pytest.mark.parametrize("config", [DENSE, QWEN3, MOE], ids=["dense", "qwen3", "moe"])
def test_cached_decode_reproduces_full_forward_logits(config):
  params = _setup(config)
  tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, config.vocab_size)
  full = _forward(config, params, tokens).logits
  logits, _ = _prefill_then_decode(config, params, tokens, 5, 16)
  np.testing.assert_allclose(logits, full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", [False, True], ids=["xla", "cpu-kernel"])
@pytest.mark.parametrize("size", [16, 22])  # whole blocks, and a last block that overlaps
def test_decode_reads_only_the_filled_blocks_and_equals_the_full_forward(size, kernel,
                                                                         monkeypatch):
  """Decode attention in blocks of 4 slots with an online softmax (XLA's), or the CPU
  kernel, rows filled to different lengths: the logits equal the full forward's, and the
  blocks past the longest filled prefix are never read (they hold NaN here, which any read
  would spread)."""
  monkeypatch.setattr(decode_lib, "DECODE_BLOCK", 4)
  if not kernel:
    monkeypatch.setattr(cpu_kernels, "decode_attention", lambda *args: None)
  # A function of its own, so that no cached trace of `_forward` (with blocks of 256) is used.
  forward = jax.jit(lambda *args, **kw: _forward.__wrapped__(*args, **kw), static_argnums=0)
  params = _setup(DENSE)
  tokens = jax.random.randint(jax.random.key(1), (2, 10), 0, DENSE.vocab_size)
  full = forward(DENSE, params, tokens).logits
  out = forward(DENSE, params, tokens[:, :3], cache=KVCache.init(DENSE, 2, size),
                write_index=jnp.zeros(2, jnp.int32))
  cache = out.cache
  # Slots 12.. are past every fill below: the keys' last axis, the values' second to last.
  cache = cache.replace(k=cache.k.at[..., 12:].set(jnp.nan),
                        v=cache.v.at[..., 12:, :].set(jnp.nan))
  logits = [out.logits]
  for i in range(3, 10):
    out = forward(DENSE, params, tokens[:, i:i + 1], cache=cache,
                  write_index=jnp.full((2,), i))
    logits.append(out.logits)
    cache = out.cache
  np.testing.assert_allclose(jnp.concatenate(logits, 1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_cpu_decode_attention_kernel_equals_the_xla_decode_attention(dtype):
  """`cpu_kernels.decode_attention` against `attention.decode_attention`: a stacked cache
  read at layer 1 of 2, 700 slots (XLA's blocks of 234 overlap at the end; the kernel's 256
  do not divide it), rows ending mid-block, at a block's first slot, at slot 0 and at the
  last, holes in the mask, a row whose scores spread over hundreds and one whose scores all
  lie far below exp's underflow (the running maximum must start below them)."""
  assert cpu_kernels.load() is not None, "the kernel did not build on this machine"
  layers, b, kvh, g, hd, size = 2, 6, 2, 3, 32, 700
  rng = np.random.default_rng(0)
  keys = rng.standard_normal((layers, b, kvh, hd, size))
  keys[:, 4] = keys[:, 4] * 0.2 - 5.0  # row 4's scores all lie below -700: the softmax holds
  keys = jnp.asarray(keys, dtype)
  values = jnp.asarray(rng.standard_normal((layers, b, kvh, size, hd)), dtype)
  last = jnp.array([699, 300, 0, 256, 455, 611], jnp.int32)
  mask = rng.random((b, size)) < 0.8
  mask[np.arange(b), last] = True  # a row's own slot is real
  query = rng.standard_normal((b, kvh, g, hd)).astype(np.float32) / np.sqrt(hd)
  query[4] = 5.0
  query[5] *= 60.0
  args = (jnp.asarray(query), keys, values, 1, jnp.asarray(mask), last)
  got = jax.jit(cpu_kernels.decode_attention)(*args)
  want = jax.jit(attention.decode_attention)(*args)
  # Brute force for one row: a softmax over its allowed slots.
  allowed = mask[1, :301]
  k1, v1 = np.asarray(keys[1, 1], np.float64), np.asarray(values[1, 1], np.float64)
  scores = np.einsum("hgd,hds->hgs", query[1], k1[..., :301])[..., allowed]
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  brute = np.einsum("hgs,hsd->hgd", probs / probs.sum(-1, keepdims=True),
                    v1[:, :301][:, allowed])
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
  np.testing.assert_allclose(got[1], brute, rtol=2e-5, atol=2e-6)
  assert float(jnp.max(jnp.abs(got[5] - got[4]))) > 0.1  # the rows differ: no trivial equality


def test_a_cpu_decode_step_runs_the_kernel_and_equals_xla_decoding(monkeypatch):
  """The model's decode step on the CPU calls the kernel (its target is in the program) and
  gives the logits of the XLA decode attention; prefill does not call it."""
  params = _setup(DENSE)
  tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, DENSE.vocab_size)
  prefill = _forward(DENSE, params, tokens[:, :8], cache=KVCache.init(DENSE, 2, 12),
                     write_index=jnp.zeros(2, jnp.int32))

  def step(params, token, cache):
    return Transformer(DENSE).apply({"params": params}, token, cache=cache,
                                    write_index=jnp.full((2,), 8)).logits

  args = (params, tokens[:, 8:], prefill.cache)
  assert "PbsdDecodeAttentionF32" in jax.jit(step).lower(*args).as_text()
  with_kernel = jax.jit(step)(*args)
  monkeypatch.setattr(cpu_kernels, "decode_attention", lambda *a: None)
  xla_step = jax.jit(lambda *a: step(*a))  # a function of its own: traced again
  assert "PbsdDecodeAttentionF32" not in xla_step.lower(*args).as_text()
  np.testing.assert_allclose(with_kernel, xla_step(*args), rtol=1e-5, atol=1e-5)
  full = _forward(DENSE, params, tokens).logits[:, 8:]
  np.testing.assert_allclose(with_kernel, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("stacked", [True, False], ids=["all-layers", "one-layer"])
def test_the_cpu_cache_write_stores_the_new_slots_and_nothing_else(dtype, stacked):
  """`cpu_kernels.write_cache` against numpy assignment: three new tokens per row at per-row
  slots, one row's run past the end of the buffer (dropped), into layer 1 of an all-layer
  cache or into one layer's own arrays. The operands keep their values: the write is in
  place on XLA's copy of them, never on an array the caller still holds."""
  assert cpu_kernels.load() is not None, "the kernels did not build on this machine"
  layers, b, kvh, hd, size, n = 2, 3, 2, 8, 10, 3
  rng = np.random.default_rng(0)
  draw = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
  keys, values = draw(layers, b, kvh, hd, size), draw(layers, b, kvh, size, hd)
  new_keys, new_values = draw(b, kvh, n, hd), draw(b, kvh, n, hd)
  slots = jnp.array([0, 4, 8], jnp.int32)[:, None] + jnp.arange(n, dtype=jnp.int32)
  layer = 1 if stacked else 0
  operands = (keys, values) if stacked else (keys[1], values[1])
  before = [np.asarray(x, np.float32) for x in operands]
  got = jax.jit(cpu_kernels.write_cache)(*operands, layer, new_keys, new_values, slots)
  want_k, want_v = [x.copy() for x in before]
  at = (layer,) if stacked else ()
  for row in range(b):
    for j, slot in enumerate(np.asarray(slots[row])):
      if slot < size:  # row 2's slot 10 lies past the buffer
        want_k[(*at, row, slice(None), slice(None), slot)] = np.asarray(new_keys[row, :, j],
                                                                        np.float32)
        want_v[(*at, row, slice(None), slot)] = np.asarray(new_values[row, :, j], np.float32)
  for x, want, old in zip(got, (want_k, want_v), before):
    assert x.dtype == dtype
    np.testing.assert_array_equal(np.asarray(x, np.float32), want)
    assert np.sum(want != old) == kvh * hd * 8  # eight slots written, the ninth dropped
  for x, old in zip(operands, before):
    np.testing.assert_array_equal(np.asarray(x, np.float32), old)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("unroll", [1, 2], ids=["layer-scan", "per-layer-cache"])
def test_cpu_decode_steps_write_the_cache_where_it_lies(dtype, unroll):
  """A loop of decode steps, as the sampler's, compiles with no whole-cache op but the
  kernels: no copy, no convert, no scatter of a cache-shaped array (XLA:CPU's scatter into a
  bfloat16 cache converted all of it to float32 and back, every layer of every step), over a
  stacked cache or a per-layer one."""
  config = DENSE.replace(dtype=dtype, scan_unroll=unroll)
  params, cache = _setup(config), KVCache.init(config, 2, 64)

  def steps(params, cache):
    def step(i, carry):
      cache, token = carry
      out = Transformer(config).apply({"params": params}, token, cache=cache,
                                      write_index=jnp.full((2,), i))
      return out.cache, jnp.argmax(out.logits[:, -1], -1)[:, None].astype(jnp.int32)

    return jax.lax.fori_loop(0, 4, step, (cache, jnp.ones((2, 1), jnp.int32)))[0]

  program = jax.jit(steps, donate_argnums=1).lower(params, cache).compile().as_text()
  shapes = {",".join(map(str, x.shape)) for x in jax.tree.leaves((cache.k, cache.v))}
  made = [m.group(2) for m in re.finditer(
      r"\n\s*(?:ROOT )?%\S+ = \w+\[([\d,]*)\]\{[^}]*\} ([\w-]+)\(", program)
      if m.group(1) in shapes]
  assert made and set(made) <= {"parameter", "get-tuple-element", "bitcast"}, sorted(made)
  assert "PbsdWriteCache" in program


@pytest.mark.parametrize("unroll", [1, 2], ids=["layer-scan", "per-layer-cache"])
def test_a_bfloat16_cache_under_float32_compute_holds_the_rounded_keys_and_values(unroll):
  """`cache_dtype="bfloat16"` with float32 compute: prefill and decode steps store the first
  layer's keys and values as the float32 cache's rounded to bfloat16 (they depend on the
  tokens alone), and the logits stay within bfloat16 rounding of the float32 cache's while
  differing from them (the cache's dtype is what the steps read)."""
  f32_config = DENSE.replace(scan_unroll=unroll)
  params = _setup(DENSE)
  tokens = jax.random.randint(jax.random.key(1), (2, 10), 0, DENSE.vocab_size)
  runs = {}
  for config in (f32_config, f32_config.replace(cache_dtype="bfloat16")):
    logits, cache = _prefill_then_decode(config, params, tokens, 4, 12)
    # Layer 0: the first of the per-layer arrays, or the first row of the stacked ones.
    runs[config.cache_dtype] = (logits, cache.k[0], cache.v[0])
  (f32_logits, f32_k, f32_v), (logits, k, v) = runs[""], runs["bfloat16"]
  assert k.dtype == v.dtype == jnp.bfloat16
  np.testing.assert_array_equal(k, f32_k.astype(jnp.bfloat16))
  np.testing.assert_array_equal(v, f32_v.astype(jnp.bfloat16))
  assert float(jnp.max(jnp.abs(f32_k))) > 0.5
  gap = float(jnp.max(jnp.abs(logits - f32_logits)))
  assert 1e-6 < gap < 2e-2 * float(jnp.max(jnp.abs(f32_logits))), gap


@pytest.mark.parametrize("index", [[0, 1, 3333], [3334, 6667, 10000], [9999, 0, 6666]])
def test_real_before_counts_the_real_slots_before_each_index(index):
  """Blocks of 3334 slots tile 10,000 with the last overlapping the one before by 2."""
  mask = np.random.default_rng(0).random((3, 10000)) < 0.7
  index = np.array(index, np.int32)
  want = [int(mask[b, :i].sum()) for b, i in enumerate(index)]
  got = jax.jit(transformer.real_before, static_argnums=2)(mask, index, 4096)
  np.testing.assert_array_equal(got, want)


def test_the_cpu_kernels_refuse_operands_that_disagree():
  keys, values = jnp.zeros((1, 2, 1, 4, 8)), jnp.zeros((1, 2, 1, 8, 4))
  with pytest.raises(Exception, match="decode attention: .* disagree"):
    jax.block_until_ready(cpu_kernels.decode_attention(
        jnp.zeros((2, 1, 1, 4)), keys, values, 0, jnp.ones((2, 8), bool),
        jnp.zeros(3, jnp.int32)))  # three rows' slots for two rows
  with pytest.raises(Exception, match="cache write: .* disagree"):
    jax.block_until_ready(cpu_kernels.write_cache(  # keys of 4 dims into a cache of 8
        keys, values, 0, jnp.zeros((2, 1, 1, 8)), jnp.zeros((2, 1, 1, 4)),
        jnp.zeros((2, 1), jnp.int32)))


def test_the_cpu_kernels_name_a_missing_compiler_and_are_built_once(tmp_path):
  with pytest.raises(RuntimeError, match="no-such-c++"):
    cpu_kernels.build(compiler=str(tmp_path / "no-such-c++"), cache_dir=tmp_path)
  first = cpu_kernels.build(cache_dir=tmp_path)
  stamp = first.stat().st_mtime_ns
  assert cpu_kernels.build(cache_dir=tmp_path) == first and first.stat().st_mtime_ns == stamp
  assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no partial build left


def test_rows_advance_independently_in_the_cache():
  # Row 0 has a 3-token prompt, row 1 a 6-token one (left-padded); then each appends a
  # different number of tokens at its own cursor. Each row must equal its own plain forward.
  params = _setup(DENSE)
  seqs = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20]]
  prompt = jnp.array([[0, 0, 0, 5, 6, 7], [12, 13, 14, 15, 16, 17]])
  pmask = prompt > 0
  out = _forward(DENSE, params, prompt, pmask, cache=KVCache.init(DENSE, 2, 12),
                 write_index=jnp.zeros(2, jnp.int32))
  new = jnp.array([[8, 9, 10, 11], [18, 19, 20, 0]])
  nmask = jnp.array([[True] * 4, [True, True, True, False]])
  out = _forward(DENSE, params, new, nmask, cache=out.cache, write_index=jnp.array([6, 6]))
  for row, seq in enumerate(seqs):
    alone = _forward(DENSE, params, jnp.array([seq])).logits[0]
    n_new = int(nmask[row].sum())
    np.testing.assert_allclose(out.logits[row, :n_new], alone[len(seq) - n_new:], atol=1e-5)


@pytest.mark.parametrize("config", [DENSE, QWEN3], ids=["dense", "qwen3"])
def test_left_padding_does_not_change_logits_of_real_tokens(config):
  params = _setup(config)
  tokens = jax.random.randint(jax.random.key(2), (1, 9), 1, config.vocab_size)
  ref = _forward(config, params, tokens).logits[0]
  for pad in (1, 4, 7):
    padded = jnp.concatenate([jnp.full((1, pad), 3), tokens], 1)  # pad ids are arbitrary
    mask = jnp.arange(pad + 9)[None] >= pad
    got = _forward(config, params, padded, mask).logits[0, pad:]
    np.testing.assert_allclose(got, ref, atol=1e-5)


def test_token_logprobs_equal_brute_force_log_softmax():
  params = _setup(DENSE)
  tokens = jnp.array([[0, 0, 4, 9, 2, 33], [7, 1, 5, 5, 60, 0]])
  mask = jnp.array([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]], bool)
  logits = _forward(DENSE, params, tokens, mask).logits
  want = np.zeros((2, 6), np.float32)
  for b in range(2):
    for t in range(1, 6):
      if mask[b, t] and mask[b, t - 1]:
        want[b, t] = jax.nn.log_softmax(logits[b, t - 1])[tokens[b, t]]
  np.testing.assert_allclose(token_logprobs(params, DENSE, tokens, mask), want, atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 3, 4, 100])
def test_chunked_logprobs_equal_unchunked(chunk):
  params = _setup(MOE)
  tokens = jax.random.randint(jax.random.key(3), (2, 11), 0, MOE.vocab_size)
  mask = jnp.ones((2, 11), bool).at[1, :3].set(False)
  full, ent = token_logprobs(params, MOE, tokens, mask, with_entropy=True)
  got, got_ent = token_logprobs(params, MOE, tokens, mask, chunk_size=chunk, with_entropy=True)
  np.testing.assert_allclose(got, full, atol=1e-6)
  np.testing.assert_allclose(got_ent, ent, atol=1e-6)


def test_chunked_logprob_gradients_equal_unchunked():
  params = _setup(DENSE)
  tokens = jax.random.randint(jax.random.key(4), (2, 10), 0, DENSE.vocab_size)
  mask = jnp.ones((2, 10), bool)
  loss = lambda p, c: token_logprobs(p, DENSE, tokens, mask, chunk_size=c).sum()
  g_full, g_chunk = jax.grad(loss)(params, None), jax.grad(loss)(params, 3)
  for a, b in zip(jax.tree.leaves(g_full), jax.tree.leaves(g_chunk)):
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_entropy_matches_definition():
  params = _setup(DENSE)
  tokens = jnp.array([[3, 4, 5]])
  _, ent = token_logprobs(params, DENSE, tokens, jnp.ones((1, 3), bool), with_entropy=True)
  p = jax.nn.softmax(_forward(DENSE, params, tokens).logits[0, 1])
  np.testing.assert_allclose(ent[0, 2], -jnp.sum(p * jnp.log(p)), atol=1e-5)


def test_the_entropy_metric_carries_no_gradient():
  params = _setup(DENSE)
  tokens = jnp.array([[3, 4, 5, 6]])
  mask = jnp.ones((1, 4), bool)

  def loss(p, entropy_weight, chunk):
    logp, ent = token_logprobs(p, DENSE, tokens, mask, chunk_size=chunk, with_entropy=True)
    return logp.sum() + entropy_weight * ent.sum()

  for chunk in (None, 2):
    plain, with_entropy = (jax.grad(loss)(params, w, chunk) for w in (0.0, 10.0))
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(with_entropy)):
      np.testing.assert_array_equal(a, b)
    assert float(loss(params, 1.0, chunk) - loss(params, 0.0, chunk)) > 0.5  # entropy is real


def test_moe_returns_router_choices_with_documented_shape():
  params = _setup(MOE)
  out = _forward(MOE, params, jnp.ones((3, 7), jnp.int32))
  assert out.routes.shape == (MOE.num_layers, 3, 7, MOE.num_experts_per_tok)
  assert out.routes.dtype == jnp.int32
  assert int(out.routes.min()) >= 0 and int(out.routes.max()) < MOE.num_experts
  # Top-k choices are distinct experts per token.
  r = np.asarray(out.routes)
  assert np.all(r[..., 0] != r[..., 1])


def test_routing_replay_with_recorded_choices_reproduces_outputs():
  params = _setup(MOE)
  tokens = jax.random.randint(jax.random.key(5), (2, 8), 0, MOE.vocab_size)
  first = _forward(MOE, params, tokens)
  replay = _forward(MOE, params, tokens, routes=first.routes)
  np.testing.assert_array_equal(replay.logits, first.logits)
  np.testing.assert_array_equal(replay.routes, first.routes)
  # Replaying other choices really changes the computation (the replay is not ignored).
  other = (first.routes + 1) % MOE.num_experts
  changed = _forward(MOE, params, tokens, routes=other)
  assert float(jnp.abs(changed.logits - first.logits).max()) > 1e-3


def test_routes_given_to_a_dense_model_raise():
  params = _setup(DENSE)
  with pytest.raises(ValueError, match="dense"):
    _forward(DENSE, params, jnp.ones((1, 2), jnp.int32),
             routes=jnp.zeros((2, 1, 2, 2), jnp.int32))


def test_every_parameter_has_logical_axes_of_its_rank():
  axes = param_axes(MOE)
  params = init_params(MOE, jax.random.key(0))
  flat_axes = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  flat_params = jax.tree.leaves(params)
  assert len(flat_axes) == len(flat_params)
  for spec, p in zip(flat_axes, flat_params):
    assert len(spec) == p.ndim and all(isinstance(a, str) for a in spec)
  assert axes["layers"]["moe"]["gate_kernel"] == jax.sharding.PartitionSpec(
      "layers", "expert", "embed", "mlp")
  assert axes["embedding"] == jax.sharding.PartitionSpec("vocab", "embed")


def test_untied_model_has_lm_head_and_tied_model_does_not():
  assert "lm_head" in init_params(DENSE, jax.random.key(0))
  assert "lm_head" not in init_params(QWEN3, jax.random.key(0))


def test_param_and_compute_dtypes_are_separate():
  config = DENSE.replace(param_dtype="float32", dtype="bfloat16")
  params = init_params(config, jax.random.key(0))
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
  out = _forward(config, params, jnp.ones((1, 4), jnp.int32))
  assert out.hidden.dtype == jnp.bfloat16 and out.logits.dtype == jnp.float32
  ref = _forward(DENSE, params, jnp.ones((1, 4), jnp.int32)).logits
  np.testing.assert_allclose(out.logits, ref, atol=0.05)
  bf16_params = init_params(DENSE.replace(param_dtype="bfloat16"), jax.random.key(0))
  assert all(p.dtype == jnp.bfloat16 for p in jax.tree.leaves(bf16_params))


def test_remat_gives_the_same_gradients():
  params = _setup(DENSE)
  tokens = jnp.array([[1, 2, 3, 4, 5]])
  mask = jnp.ones((1, 5), bool)
  grad = lambda c: jax.grad(lambda p: token_logprobs(p, c, tokens, mask).sum())(params)
  for a, b in zip(jax.tree.leaves(grad(DENSE)), jax.tree.leaves(grad(DENSE.replace(remat=True)))):
    np.testing.assert_allclose(a, b, atol=1e-6)


def _scan_unrolls(fn, *args) -> list:
  """The `unroll` of every `scan` over the model's layers in the program of `fn(*args)`."""
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "scan" and eqn.params["length"] == DENSE.num_layers:
        found.append(eqn.params["unroll"])
      for value in eqn.params.values():
        for sub in value if isinstance(value, (tuple, list)) else (value,):
          if hasattr(sub, "eqns") or hasattr(sub, "jaxpr"):
            walk(getattr(sub, "jaxpr", sub))

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


def test_an_unrolled_layer_scan_gives_the_same_gradients():
  params = _setup(DENSE)
  tokens = jnp.array([[1, 2, 3, 4, 5]])
  mask = jnp.ones((1, 5), bool)
  loss = lambda c: lambda p: token_logprobs(p, c, tokens, mask).sum()
  unrolled = DENSE.replace(scan_unroll=DENSE.num_layers)
  assert _scan_unrolls(loss(DENSE), params) == [1]
  assert _scan_unrolls(loss(unrolled), params) == [DENSE.num_layers]
  assert _scan_unrolls(loss(DENSE.replace(scan_unroll=5)), params) == [DENSE.num_layers]
  for a, b in zip(jax.tree.leaves(jax.grad(loss(DENSE))(params)),
                  jax.tree.leaves(jax.grad(loss(unrolled))(params))):
    assert np.abs(a).max() > 0
    np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("x_shape, kernel_shape, axes", [
    ((3, 8, 16), (16, 48), 1),       # x narrower than the output: x is transposed
    ((3, 8, 48), (48, 16), 1),       # the output narrower: its cotangent is transposed
    ((3, 8, 4, 8), (4, 8, 24), 2),   # two contracted axes (the output projection)
])
def test_dense_gradients_equal_einsum_and_run_as_row_major_products(x_shape, kernel_shape,
                                                                    axes):
  rng = np.random.default_rng(0)
  x, kernel = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in (x_shape, kernel_shape))
  weight = jnp.asarray(rng.standard_normal((*x_shape[:2], *kernel_shape[axes:])), jnp.float32)
  contracted = "ij"[:axes]
  spec = f"bt{contracted},{contracted}o->bto"
  loss = lambda f: lambda x, k: jnp.sum(jnp.sin(f(x, k)) * weight)
  ours = jax.grad(loss(lambda x, k: transformer.dense(x, k, axes)), argnums=(0, 1))(x, kernel)
  reference = jax.grad(loss(lambda x, k: jnp.einsum(spec, x, k)), argnums=(0, 1))(x, kernel)
  for a, b in zip(ours, reference):
    assert np.abs(b).max() > 0.1
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  compiled = jax.jit(jax.grad(loss(lambda x, k: transformer.dense(x, k, axes)), argnums=(0, 1))
                     ).lower(x, kernel).compile().as_text()
  if "__ynn_fusion" in compiled:  # XLA:CPU with YNNPACK: every product is one of its fusions
    entry = compiled[compiled.index("\nENTRY"):]
    assert " dot(" not in entry[:entry.index("\n}")]


@pytest.mark.parametrize("changes, field", [
    ({"num_heads": 5}, "num_heads"),
    ({"num_kv_heads": 3}, "num_kv_heads"),
    ({"head_dim": 7}, "head_dim"),
    ({"num_experts": 2, "num_experts_per_tok": 3}, "num_experts_per_tok"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"scan_unroll": 0}, "scan_unroll"),
    ({"dtype": "float64"}, "dtype"),
    ({"cache_dtype": "int8"}, "cache_dtype"),
    ({"rope_theta": -1.0}, "rope_theta"),
])
def test_inconsistent_config_raises_naming_the_field(changes, field):
  with pytest.raises(ValueError, match=field):
    ModelConfig(**{**dict(hidden_size=32, num_heads=4, num_kv_heads=2), **changes})


def test_init_params_matches_the_flax_init_in_structure_and_distribution():
  params = init_params(MOE, jax.random.key(0))
  flax_params = Transformer(MOE).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))
  flax_params = jax.tree.map(lambda x: x, nn.meta.unbox(flax_params["params"]))
  assert jax.tree.structure(params) == jax.tree.structure(flax_params)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(flax_params)):
    assert a.shape == b.shape and a.dtype == b.dtype
  np.testing.assert_array_equal(params["layers"]["attn"]["q_norm"]["scale"], 1.0)
  assert abs(float(jnp.std(params["layers"]["moe"]["up_kernel"])) - 0.02) < 0.002
  same = init_params(MOE, jax.random.key(0))["embedding"]
  other = init_params(MOE, jax.random.key(1))["embedding"]
  np.testing.assert_array_equal(params["embedding"], same)
  assert not np.array_equal(params["embedding"], other)


def _reference_attention(q, keys, values, query_slots, key_mask):
  """Plain softmax attention: `q: [B, T, kvh, g, d]`, keys/values `[B, kvh, S, d]`."""
  slots = jnp.arange(keys.shape[2])
  allowed = key_mask[:, None, :] & (slots[None, None, :] <= query_slots[:, :, None])
  scores = jnp.einsum("btkgd,bksd->bkgts", q, keys) / jnp.sqrt(q.shape[-1])
  scores = jnp.where(allowed[:, None, None], scores, -1e30)
  return jnp.einsum("bkgts,bksd->btkgd", jax.nn.softmax(scores, axis=-1), values)


def _tiled(q, keys, values, query_slots, key_mask, q_block, k_block):
  """`tiled_attention` of keys/values `[B, kvh, S, d]`, put in the cache's layout."""
  from pbsd_jax.models.attention.flash import tiled_attention
  return tiled_attention(q, jnp.swapaxes(keys, 2, 3)[None], values[None], 0, query_slots,
                         key_mask, q_block, k_block)


@pytest.mark.parametrize("case", ["training", "append"])
def test_tiled_attention_equals_plain_attention_in_value_and_gradient(case):
  """Tiles of 3 queries x 4 keys (a padded last query block; 11 or 13 key slots, so the last
  key block overlaps the one before): on every real query, the values and the gradients with
  respect to queries, keys and values equal plain softmax attention's. Rows are left-padded,
  right-padded, have a hole, or (append) write at their own cursor, one of them past the end
  of the buffer."""
  kq, kk, kv = jax.random.split(jax.random.key(3), 3)
  b, kvh, g, d = 4, 2, 2, 8
  if case == "training":
    t = size = 11
    query_slots = jnp.broadcast_to(jnp.arange(t), (b, t))
    key_mask = (jnp.ones((b, size), bool).at[1, :3].set(False).at[2, 7:].set(False)
                .at[3, 5].set(False))
  else:
    t, size = 5, 13
    query_slots = jnp.array([0, 4, 8, 10])[:, None] + jnp.arange(t)
    key_mask = jnp.arange(size)[None] < jnp.array([5, 9, 13, 13])[:, None]
    key_mask = key_mask.at[1, :2].set(False)  # a left-padded prompt
  q = jax.random.normal(kq, (b, t, kvh, g, d))
  keys, values = jax.random.normal(kk, (2, b, kvh, size, d))
  real = jnp.take_along_axis(key_mask, jnp.clip(query_slots, 0, size - 1), 1) & (
      query_slots < size)
  assert 3 < int(real.sum()) < b * t
  weights = jax.random.normal(jax.random.key(4), q.shape)

  def loss(fn, q, keys, values):
    out = fn(q, keys, values, query_slots, key_mask)
    return jnp.sum(jnp.where(real[..., None, None, None], jnp.sin(out * weights), 0.0))

  tiled = functools.partial(_tiled, q_block=3, k_block=4)
  real_rows = np.asarray(real)
  np.testing.assert_allclose(tiled(q, keys, values, query_slots, key_mask)[real_rows],
                             _reference_attention(q, keys, values, query_slots,
                                                  key_mask)[real_rows], rtol=1e-5, atol=1e-6)
  got = jax.grad(functools.partial(loss, tiled), argnums=(0, 1, 2))(q, keys, values)
  want = jax.grad(functools.partial(loss, _reference_attention), argnums=(0, 1, 2))(
      q, keys, values)
  for got_x, want_x in zip(got, want):
    assert float(jnp.max(jnp.abs(want_x))) > 1e-2
    np.testing.assert_allclose(got_x, want_x, rtol=1e-4, atol=1e-6)


def test_tiled_attention_skips_the_causal_future_and_padding():
  """The tiles it computes are exactly those holding a real key at or before a real query of
  some row (brute force over every query-key pair), and the skipped ones are never read:
  NaN in the keys and values of the unfilled end of the buffer does not reach the output."""
  from pbsd_jax.models.attention.flash import needed_tiles
  b, t, size = 2, 12, 16
  query_slots = jnp.broadcast_to(jnp.arange(t), (b, t))
  key_mask = (jnp.arange(size)[None] < jnp.array([[9], [11]])).at[1, :5].set(False)
  needed = np.asarray(needed_tiles(query_slots, key_mask, size, 3, 4))
  mask, qs = np.asarray(key_mask), np.asarray(query_slots)
  q_real = mask[:, :t]
  want = np.zeros((4, 4), bool)
  for row in range(b):
    for i in range(t):
      for s in range(size):
        if q_real[row, i] and mask[row, s] and s <= qs[row, i]:
          want[i // 3, s // 4] = True
  np.testing.assert_array_equal(needed, want)
  assert not want[0, 1] and not want[:, 3].any()  # the causal future; the buffer's empty end
  q = jax.random.normal(jax.random.key(0), (b, t, 1, 2, 4))
  keys, values = jax.random.normal(jax.random.key(1), (2, b, 1, size, 4))
  poison = lambda x: x.at[:, :, 12:].set(jnp.nan)
  out = _tiled(q, poison(keys), poison(values), query_slots, key_mask, 3, 4)
  np.testing.assert_allclose(out[np.asarray(q_real)], _reference_attention(
      q, keys, values, query_slots, key_mask)[np.asarray(q_real)], rtol=1e-5, atol=1e-6)


def test_model_in_small_tiles_equals_one_tile_in_logits_and_gradient(monkeypatch):
  """The whole model with attention tiles of 3 x 4 (left- and right-padded rows) against the
  same model in one tile: logits and the gradient of the tokens' log-likelihood."""
  params = _setup(QWEN3)
  tokens = jax.random.randint(jax.random.key(5), (3, 10), 0, QWEN3.vocab_size)
  mask = jnp.ones((3, 10), bool).at[1, :4].set(False).at[2, 6:].set(False)

  def run():  # traced afresh: the block sizes are read at trace time
    logp = lambda p: jnp.sum(token_logprobs.__wrapped__(p, QWEN3, tokens, mask))
    return (_forward.__wrapped__(QWEN3, params, tokens, mask).logits,
            jax.jit(jax.grad(logp))(params))

  logits, grads = run()
  monkeypatch.setattr(flash, "QUERY_BLOCK", 3)
  monkeypatch.setattr(flash, "KEY_BLOCK", 4)
  small_logits, small_grads = run()
  real = np.asarray(mask)
  np.testing.assert_allclose(small_logits[real], logits[real], rtol=1e-5, atol=1e-5)
  for got, want in zip(jax.tree.leaves(small_grads), jax.tree.leaves(grads)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kernel", ["dot_product", "splash"])
@pytest.mark.parametrize("config", [DENSE, QWEN3], ids=["gqa_2_groups", "mqa_head_dim_12"])
def test_the_attention_switch_gives_our_logits_gradients_and_prefill(config, kernel):
  """`attention="dot_product"` (`jax.nn.dot_product_attention`, XLA on CPU) and `"splash"`
  (the Pallas splash kernel, interpreted on CPU, for the forward without a cache and the
  prefill into an empty one) against ours: left-padded rows, grouped KV heads; the training
  forward, its gradient, and both prefills into the cache followed by our decode step."""
  params = _setup(config)
  library = config.replace(attention=kernel)
  tokens = jax.random.randint(jax.random.key(2), (3, 9), 0, config.vocab_size)
  mask = jnp.ones((3, 9), bool).at[1, :3].set(False).at[2, :5].set(False)
  ours, theirs = _forward(config, params, tokens, mask), _forward(library, params, tokens, mask)
  np.testing.assert_allclose(theirs.logits[mask], ours.logits[mask], atol=2e-5, rtol=0)
  weights = jax.random.normal(jax.random.key(5), tokens.shape)

  def loss(params, c):
    return jnp.sum(token_logprobs(params, c, tokens, mask) * weights)
  for a, b in zip(jax.tree.leaves(jax.grad(loss)(params, library)),
                  jax.tree.leaves(jax.grad(loss)(params, config))):
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)
  # Prefill (several queries: the switch), over the whole buffer or, into an empty cache,
  # among the new tokens only; then one cached decode step (always ours).
  logits = {}
  prefill = lambda c, p, empty: _forward(c, p, tokens[:, :8], mask[:, :8],
                                         cache=KVCache.init(c, 3, 12),
                                         write_index=jnp.zeros(3, jnp.int32), empty_cache=empty)
  for c in (config, library):
    for empty in (False, True):
      out = prefill(c, params, empty)
      step = _forward(c, params, tokens[:, 8:], cache=out.cache, write_index=jnp.full((3,), 8))
      logits[c.attention, empty] = (out.logits, step.logits)
  for key, value in logits.items():
    for a, b in zip(value, logits["ours", False]):
      np.testing.assert_allclose(a[:, -1], b[:, -1], atol=2e-5, rtol=0, err_msg=str(key))
  # For a TPU both kernels take the splash kernel into an empty cache, and neither over a
  # filled one (the whole buffer: XLA's attention).
  for empty in (False, True):
    calls = _custom_calls(lambda p: prefill(library, p, empty).logits, "tpu", params)
    assert calls == ({"tpu_custom_call"} if empty else set()), (empty, calls)
  assert np.abs(np.asarray(ours.logits[mask])).max() > 0.1  # the checked logits are not ~0
  lowered = lambda c: jax.jit(lambda p: Transformer(c).apply(
      {"params": p}, tokens, mask).logits).lower(params).as_text()
  assert lowered(library) != lowered(config)  # the switch runs another program on this CPU


def _custom_calls(f, platform: str, *args) -> set[str]:
  """The custom-call targets of `f` lowered for `platform` (no device of it needed)."""
  text = jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()
  return set(re.findall(r"custom_call @(\w+)", text))


@pytest.mark.parametrize("attention", ["ours", "splash", "dot_product"])
def test_kernels_follow_the_platform_a_program_is_lowered_for(attention):
  """The same traced sampling and training programs, lowered from this CPU host: for the CPU
  they call the CPU kernels (the cache write and decode attention), for a TPU none of them;
  with `splash` or `dot_product` the TPU program holds the Mosaic kernel (splash) and the CPU
  program interprets it or runs XLA's attention."""
  assert cpu_kernels.load() is not None, "the kernels did not build on this machine"
  model = ModelConfig(**SIZES["micro"], vocab_size=64, attention=attention, dtype="bfloat16")
  params = param_shapes(model)
  tokens = jax.ShapeDtypeStruct((2, 8), jnp.int32)
  mask = jax.ShapeDtypeStruct((2, 8), jnp.bool_)
  sample = lambda p, t, m: Sampler(model).generate(p, t, m, jax.random.key(0), 4)[0].tokens
  grad = jax.grad(lambda p, t, m: jnp.mean(
      Transformer(model).apply({"params": p}, t, m).logits.astype(jnp.float32)))
  cpu = {"PbsdWriteCacheBF16", "PbsdDecodeAttentionBF16"}
  mosaic = {"tpu_custom_call"} if attention != "ours" else set()
  assert _custom_calls(sample, "cpu", params, tokens, mask) == cpu
  assert _custom_calls(sample, "tpu", params, tokens, mask) == mosaic
  assert _custom_calls(grad, "cpu", params, tokens, mask) == set()
  assert _custom_calls(grad, "tpu", params, tokens, mask) == mosaic


def test_splash_on_a_mesh_runs_the_kernel_on_each_devices_block():
  """XLA cannot partition a Mosaic kernel: on a mesh, `splash_attention` runs it per device
  (`shard_map`) on the device's rows (data axes) and KV heads (`tensor`), with the output of
  one device running all of it (interpreted here)."""
  from pbsd_jax.models.attention.splash import splash_attention
  from pbsd_jax.parallel import sharding
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (4, 9, 2, 2, 16))
  k, v = (jax.random.normal(key, (4, 2, 9, 16)) for key in keys[1:])
  mask = jnp.ones((4, 9), bool).at[1, :3].set(False).at[3, :6].set(False)
  whole = splash_attention(q, k, v, mask, interpret=True)
  mesh = sharding.make_mesh(data=2, fsdp=1, tensor=2, devices=jax.devices()[:4])
  place = lambda x, spec: jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
  P = jax.sharding.PartitionSpec
  args = (place(q, P("data", None, "tensor")), place(k, P("data", "tensor")),
          place(v, P("data", "tensor")), place(mask, P("data")))
  run = lambda *a: splash_attention(*a, interpret=True)
  assert "shard_map" in str(jax.make_jaxpr(run)(*args))
  np.testing.assert_allclose(jax.jit(run)(*args), whole, rtol=1e-5, atol=1e-5)
  assert np.abs(np.asarray(whole)).max() > 0.1
