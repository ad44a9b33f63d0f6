"""Jitted sampling: prefill, batched appends and a `lax.while_loop` decode with per-row cursors.

Token buffer: `DecodeState.tokens: i32[B, S]`, where column `s` is KV-cache slot `s`. A prompt
left-padded to width P occupies columns `[0, P)`; everything after is written contiguously
from each row's `cursor` (rows advance independently), and the rest is right padding. The
multi-turn rollout composes these three calls: `prefill` the prompts once, then per turn
`decode` an action and `append` the observation as one batched prefill.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct

from pbsd_jax.generate import stop_strings as stop_strings_lib
from pbsd_jax.models import KVCache, ModelConfig, Transformer
from pbsd_jax.parallel import sharding

Array = jax.Array

# Why a row's `decode` ended (`DecodeResult.stop_reason`).
RUNNING, STOP_BUDGET, STOP_EOS, STOP_SEQUENCE, STOP_BUFFER_FULL = 0, 1, 2, 3, 4


@struct.dataclass
class DecodeState:
  """Everything a decode needs to resume: the buffer, the cache and the next-token logits.

  Attributes:
    tokens: `i32[B, S]` token buffer; column s is cache slot s (0 where nothing was written).
    sampled: `bool[B, S]` True on slots holding a token the policy sampled.
    sample_logp: `f32[B, S]` the sampler's log-prob of each sampled token, 0 elsewhere.
    cache: the `KVCache` over the buffer (its `mask` marks real slots).
    cursor: `i32[B]` the next slot each row writes.
    logits: `f32[B, V]` next-token logits after the last real token of each row.
    routes: `i32[B, S, layers, k]` the experts each slot's token was routed to when it was
      written (-1 on empty slots), or None unless the sampler records routes.
  """

  tokens: Array
  sampled: Array
  sample_logp: Array
  cache: KVCache
  cursor: Array
  logits: Array
  routes: Array | None = None

  @property
  def mask(self) -> Array:
    """`bool[B, S]` slots holding a real token (prompt, sampled or appended)."""
    return self.cache.mask

  @property
  def buffer_size(self) -> int:
    return self.tokens.shape[1]


@struct.dataclass
class DecodeResult:
  """What one `decode` call did per row.

  Attributes:
    num_new: `i32[B]` tokens sampled in this call.
    stop_reason: `i32[B]` one of STOP_BUDGET, STOP_EOS, STOP_SEQUENCE, STOP_BUFFER_FULL, or
      RUNNING for rows that were inactive or hit `max_steps`.
    stop_index: `i32[B]` which stop matched (-1 if none): the stop sequences' indices, then
      the stop strings' (after the sequences).
  """

  num_new: Array
  stop_reason: Array
  stop_index: Array


@struct.dataclass
class DecodeCarry:
  """The carry of `Sampler.decode`'s `lax.while_loop`: one step samples one token per live row.

  Attributes:
    state: the `DecodeState` being extended.
    result: the `DecodeResult` so far; a row stops once its `stop_reason` leaves RUNNING.
    recent: `i32[B, L]` each row's last L tokens sampled in this call, L the longest stop
      sequence; -2 where nothing was sampled yet, so a stop never matches across calls.
    step: `i32[]` steps taken; step s draws with `fold_in(rng, s)`.
    string_state: `i32[B, n]` each row's automaton state per stop string
      (`stop_strings.advance`); `[B, 0]` without stop strings.

  The rows that sample in the call (`active`) are a constant of the loop, not carried.
  """

  state: DecodeState
  result: DecodeResult
  recent: Array
  step: Array
  string_state: Array


def stop_sequence_array(stops: list[list[int]], batch: int | None = None) -> Array:
  """Right-aligns stop sequences into `i32[n, L]` (or `[B, n, L]`), -1 padded on the left.

  A stop of length l matches when the last l sampled tokens equal it; -1 entries match
  anything, which is how shorter stops share the array with longer ones.
  """
  if not stops:
    raise ValueError("stop_sequence_array needs at least one stop sequence")
  if any(len(s) == 0 for s in stops):
    raise ValueError("stop sequences must be non-empty")
  width = max(len(s) for s in stops)
  arr = jnp.array([[-1] * (width - len(s)) + list(s) for s in stops], jnp.int32)
  return arr if batch is None else jnp.broadcast_to(arr, (batch, *arr.shape))


def categorical(rng: Array, logits: Array, block: int = 128) -> Array:
  """Samples `i32[B]` from `softmax(logits: f32[B, V])` in two exact stages: block, then token.

  The vocabulary is cut into blocks of `block` ids (the last padded with -inf); a block is
  drawn from the blocks' log-masses (`logsumexp`), then a token within it, so
  `P(token) = P(block) P(token | block)` exactly. This needs `V / block + block` random numbers
  per row instead of the V of `jax.random.categorical`; drawing those dominated a CPU decode
  step (a third of it at V=8192). -inf logits are never drawn.
  """
  return _categorical(rng, logits, block)[0]


def _blocks(logits: Array, block: int) -> Array:
  """`f32[B, V]` logits as `[B, ceil(V / block), block]`, the last block padded with -inf."""
  b, v = logits.shape
  num = -(-v // block)
  padded = jnp.pad(logits, [(0, 0), (0, num * block - v)], constant_values=-jnp.inf)
  return padded.reshape(b, num, block)


def greedy(logits: Array, block: int = 128) -> Array:
  """`jnp.argmax(logits, -1)` of `f32[B, V]` (the first of equal maxima), in two stages: the
  first block holding the maximum, then the first maximum within it. XLA:CPU runs an argmax as
  a scalar loop over (value, index) pairs, which over a whole vocabulary costs a good share of
  a decode step (docs/benchmarks.md has the timings)."""
  blocks = _blocks(logits, block)
  chosen = jnp.argmax(jnp.max(blocks, axis=-1), axis=-1)
  within = jnp.take_along_axis(blocks, chosen[:, None, None], axis=1)[:, 0]
  return (chosen * block + jnp.argmax(within, axis=-1)).astype(jnp.int32)


def _categorical(rng: Array, logits: Array, block: int = 128) -> tuple[Array, Array]:
  """`categorical`'s draw and the logits' `f32[B]` log-normaliser, from the blocks' masses."""
  blocks = _blocks(logits, block)
  outer, inner = jax.random.split(rng)
  masses = jax.nn.logsumexp(blocks, axis=-1)
  chosen = jax.random.categorical(outer, masses, axis=-1)
  within = jnp.take_along_axis(blocks, chosen[:, None, None], axis=1)[:, 0]
  token = chosen * block + jax.random.categorical(inner, within, axis=-1)
  return token.astype(jnp.int32), jax.nn.logsumexp(masses, axis=-1)


def sample_token(rng: Array, logits: Array, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0) -> tuple[Array, Array]:
  """Samples `i32[B]` tokens from `f32[B, V]` logits; also returns their `f32[B]` log-probs.

  temperature 0 is greedy. top_k=0 and top_p=1 disable those filters. The returned log-prob is
  under the temperature-scaled, unfiltered distribution (what the learner recomputes); it is
  for diagnostics only.
  """
  logits = logits.astype(jnp.float32)
  if temperature == 0.0:
    token = greedy(logits)
    return token, (jnp.take_along_axis(logits, token[:, None], -1)[:, 0]
                   - jax.nn.logsumexp(logits, axis=-1))
  scaled = logits / temperature
  filtered = scaled
  if top_k > 0:
    kth = jax.lax.top_k(scaled, top_k)[0][:, -1:]
    filtered = jnp.where(scaled < kth, -jnp.inf, filtered)
  if top_p < 1.0:
    order = jnp.argsort(-filtered, axis=-1)
    sorted_probs = jax.nn.softmax(jnp.take_along_axis(filtered, order, -1), axis=-1)
    # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass strictly
    # before it is below top_p (so the most likely token always stays).
    keep_sorted = (jnp.cumsum(sorted_probs, axis=-1) - sorted_probs) < top_p
    keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(
        keep_sorted)
    filtered = jnp.where(keep, filtered, -jnp.inf)
  token, log_z = _categorical(rng, filtered)
  if top_k > 0 or top_p < 1.0:  # the draw normalised the filtered logits, not these
    log_z = jax.nn.logsumexp(scaled, axis=-1)
  return token, jnp.take_along_axis(scaled, token[:, None], -1)[:, 0] - log_z


def append_chunk(n: int) -> int:
  """Columns per prefill of an `n`-column `Sampler.append`: `n` up to 16, else a quarter of
  `n` rounded up (`n = 50`: 13)."""
  return n if n <= 16 else -(-n // 4)


@dataclasses.dataclass(frozen=True)
class Sampler:
  """The sampling loop's static settings; hashable, so its methods jit with `self` static.

  Attributes:
    model: the model config.
    temperature: softmax temperature (0 = greedy).
    top_k: keep the k most likely tokens (0 = off).
    top_p: nucleus mass (1.0 = off).
    record_routes: keep every written token's MoE routes in `DecodeState.routes` (for
      evidence under replayed routing, an ablation).

  The end-of-sequence id is not a sampling setting: it belongs to the vocabulary and the
  environment (`AgentEnv.eos_id`), and reaches `decode` / `generate` as their `eos_id`.
  """

  model: ModelConfig
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  record_routes: bool = False

  def __post_init__(self):
    if self.record_routes and not self.model.is_moe:
      raise ValueError("Sampler.record_routes needs an MoE model (num_experts > 0)")
    if self.temperature < 0:
      raise ValueError(f"Sampler.temperature must be >= 0, got {self.temperature}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"Sampler.top_p must be in (0, 1], got {self.top_p}")
    if self.top_k < 0 or self.top_k > self.model.vocab_size:
      raise ValueError(f"Sampler.top_k must be in [0, vocab_size={self.model.vocab_size}], "
                       f"got {self.top_k}")

  def _forward(self, params, tokens, mask, cache, write_index, compute_logits=True,
               empty_cache=False):
    return Transformer(self.model).apply({"params": params}, tokens, mask, cache=cache,
                                         write_index=write_index, compute_logits=compute_logits,
                                         empty_cache=empty_cache)

  def _record(self, routes: Array | None, rows: Array, slots: Array, out) -> Array | None:
    """`routes` with the forward's `out.routes` (`[layers, B, n, k]`) written at
    `[rows, slots]` (`[B, n]`, out-of-range slots dropped); None when not recording."""
    if routes is None:
      return None
    return routes.at[rows, slots].set(jnp.moveaxis(out.routes, 0, 2), mode="drop")

  def _unembed(self, params, hidden):
    """`f32[B, V]` logits of hidden states `[B, D]`: prefill and append need one position per
    row, so the LM head runs on that position only (not on every prompt token)."""
    return Transformer(self.model).apply({"params": params}, hidden,
                                         method=Transformer.unembed)

  @functools.partial(jax.jit, static_argnums=(0, 4))
  def prefill(self, params, tokens: Array, mask: Array, buffer_size: int) -> DecodeState:
    """Starts a buffer of `buffer_size` slots from prompts `i32[B, P]` left-padded (`mask`).

    Every row's cursor starts at P; the next-token logits are those after column P-1.
    """
    b, p = tokens.shape
    if buffer_size < p:
      raise ValueError(f"buffer_size={buffer_size} is smaller than the prompt width {p}")
    cache = KVCache.init(self.model, b, buffer_size)
    # Each device holds its own rows' cache, as it holds their prompts (the arrays made here
    # have no placement of their own: XLA could keep every row on every device).
    cache = jax.tree.map(lambda x: sharding.constrain_rows(x, int(x.ndim == 5), like=tokens),
                         cache)
    out = self._forward(params, tokens, mask, cache, jnp.zeros((b,), jnp.int32),
                        compute_logits=False, empty_cache=True)
    buf = jnp.zeros((b, buffer_size), jnp.int32).at[:, :p].set(jnp.where(mask, tokens, 0))
    routes = None
    if self.record_routes:
      empty = jnp.full((b, buffer_size, self.model.num_layers, self.model.num_experts_per_tok),
                       -1, jnp.int32)
      routes = self._record(empty, jnp.arange(b)[:, None],
                            jnp.where(mask, jnp.arange(p)[None, :], buffer_size), out)
    return DecodeState(tokens=buf, sampled=jnp.zeros((b, buffer_size), bool),
                       sample_logp=jnp.zeros((b, buffer_size), jnp.float32), cache=out.cache,
                       cursor=jnp.full((b,), p, jnp.int32),
                       logits=self._unembed(params, out.hidden[:, -1]), routes=routes)

  @functools.partial(jax.jit, static_argnums=(0,), static_argnames=("as_actions",))
  def append(self, params, state: DecodeState, tokens: Array, lengths: Array, *,
             as_actions: bool = False) -> DecodeState:
    """Writes `tokens[b, :lengths[b]]` (`i32[B, n]`) at each row's cursor, in prefills.

    Rows with length 0 are untouched. Tokens that would pass the end of the buffer are
    dropped, so callers truncate observations to the room they have. `as_actions=True` marks
    the tokens as the policy's (forced actions, e.g. replaying an oracle); their
    `sample_logp` stays 0.

    The prefill runs in chunks of `append_chunk(n)` columns, as many as the longest row fills
    (a `fori_loop` with a traced trip count, which keeps the cache in place), so an append of
    short observations (a notice) costs what they fill, not the `n` columns a batch of
    documents may need.
    """
    b, n = tokens.shape
    lengths = jnp.minimum(lengths.astype(jnp.int32),
                          jnp.minimum(n, state.buffer_size - state.cursor))
    chunk = append_chunk(n)
    tokens = jnp.pad(tokens, [(0, 0), (0, -n % chunk)])

    def one_chunk(i, state):
      start = i * chunk
      return self._append(params, state, jax.lax.dynamic_slice_in_dim(tokens, start, chunk, 1),
                          jnp.clip(lengths - start, 0, chunk), as_actions)

    return jax.lax.fori_loop(0, (jnp.max(lengths) + chunk - 1) // chunk, one_chunk, state)

  def _append(self, params, state: DecodeState, tokens: Array, lengths: Array,
              as_actions: bool) -> DecodeState:
    """One prefill of `append`: `tokens[b, :lengths[b]]` at each row's cursor."""
    b, n = tokens.shape
    mask = jnp.arange(n)[None, :] < lengths[:, None]
    out = self._forward(params, tokens, mask, state.cache, state.cursor, compute_logits=False)
    rows, cols = jnp.arange(b)[:, None], state.cursor[:, None] + jnp.arange(n)[None, :]
    cols = jnp.where(mask, cols, state.buffer_size)  # out of range: dropped
    buf = state.tokens.at[rows, cols].set(tokens, mode="drop")
    last = self._unembed(params, jnp.take_along_axis(
        out.hidden, jnp.maximum(lengths - 1, 0)[:, None, None], 1)[:, 0])
    sampled = state.sampled.at[rows, cols].set(as_actions, mode="drop")
    return state.replace(tokens=buf, sampled=sampled, cache=out.cache,
                         routes=self._record(state.routes, rows, cols, out),
                         cursor=state.cursor + lengths,
                         logits=jnp.where((lengths > 0)[:, None], last, state.logits))

  @functools.partial(jax.jit, static_argnums=(0,), static_argnames=("max_steps", "eos_id"))
  def decode(self, params, state: DecodeState, rng: Array, budget: Array,
             stop_sequences: Array | None = None, active: Array | None = None,
             stop_strings: stop_strings_lib.StopStrings | None = None, *, max_steps: int,
             eos_id: int | None = None) -> tuple[DecodeState, DecodeResult]:
    """Samples until every active row stops (or `max_steps` steps), one token per step.

    Args:
      params: model parameters.
      state: the state to continue from.
      rng: PRNG key; the same key gives the same tokens.
      budget: `i32[B]` most tokens each row may sample in this call.
      stop_sequences: `i32[n, L]` or per-row `i32[B, n, L]` from `stop_sequence_array`; a
        row stops right after the last token of a matching stop.
      active: `bool[B]` rows that sample (default all).
      stop_strings: a row stops right after the token that completes one of these strings in
        the text sampled in this call, however the vocabulary splits it (`stop_strings.build`).
      max_steps: static bound on the loop (a budget larger than it is cut to it).
      eos_id: a row stops right after sampling this id (None: no end-of-sequence stop).

    Returns:
      The new state and a `DecodeResult`.
    """
    b = state.tokens.shape[0]
    active = jnp.ones((b,), bool) if active is None else active.astype(bool)
    if stop_sequences is None:  # none, or one all-wildcard sequence that never stops
      stop_sequences = jnp.full((b, 1 if stop_strings is None else 0, 1), -1, jnp.int32)
    elif stop_sequences.ndim == 2:
      stop_sequences = jnp.broadcast_to(stop_sequences, (b, *stop_sequences.shape))
    start = DecodeCarry(
        state=state,
        result=DecodeResult(num_new=jnp.zeros((b,), jnp.int32),
                            stop_reason=jnp.where(active & (budget <= 0), STOP_BUDGET, RUNNING),
                            stop_index=jnp.full((b,), -1, jnp.int32)),
        recent=jnp.full((b, stop_sequences.shape[-1]), -2, jnp.int32), step=jnp.int32(0),
        string_state=(jnp.zeros((b, 0), jnp.int32) if stop_strings is None else
                      stop_strings_lib.start_state(stop_strings, b)))

    def live(carry: DecodeCarry) -> Array:
      """`bool[B]` rows that sample at this step: active and not stopped."""
      return active & (carry.result.stop_reason == RUNNING)

    def running(carry: DecodeCarry) -> Array:
      return (carry.step < max_steps) & jnp.any(live(carry))

    # Each layer's weights are sliced out of the stacked `params["layers"]` once, here, and
    # stacked again in the loop, where XLA folds a layer's slice of that stack to the slice
    # made here (or the stack of all slices to the stacked array). Sliced in the loop, every
    # step copied every layer's weights out (XLA:CPU's matmuls take whole buffers).
    layers = [jax.tree.map(lambda x: x[i], params["layers"]) for i in range(self.model.num_layers)]

    def body(carry: DecodeCarry) -> DecodeCarry:
      step_params = {**params, "layers": jax.tree.map(lambda *xs: jnp.stack(xs), *layers)}
      st, res, live_rows = carry.state, carry.result, live(carry)
      token, logp = sample_token(jax.random.fold_in(rng, carry.step), st.logits,
                                 self.temperature, self.top_k, self.top_p)
      out = self._forward(step_params, token[:, None], live_rows[:, None], st.cache, st.cursor)
      rows = jnp.arange(b)
      slot = jnp.where(live_rows, st.cursor, st.buffer_size)  # out of range: dropped
      st = st.replace(
          tokens=st.tokens.at[rows, slot].set(token, mode="drop"),
          sampled=st.sampled.at[rows, slot].set(True, mode="drop"),
          sample_logp=st.sample_logp.at[rows, slot].set(logp, mode="drop"),
          cache=out.cache, cursor=st.cursor + live_rows,
          routes=self._record(st.routes, rows[:, None], slot[:, None], out),
          logits=jnp.where(live_rows[:, None], out.logits[:, 0], st.logits))
      recent = jnp.where(live_rows[:, None],
                         jnp.concatenate([carry.recent[:, 1:], token[:, None]], 1), carry.recent)
      matches = jnp.all((stop_sequences == -1) | (stop_sequences == recent[:, None, :]), -1)
      matches &= jnp.any(stop_sequences != -1, axis=-1)
      string_state = carry.string_state
      if stop_strings is not None:
        advanced, occurred = stop_strings_lib.advance(stop_strings, string_state, token)
        string_state = jnp.where(live_rows[:, None], advanced, string_state)
        matches = jnp.concatenate([matches, occurred], axis=-1)
      num_new = res.num_new + live_rows
      is_eos = (token == eos_id) if eos_id is not None else jnp.zeros((b,), bool)
      reason = jnp.select(
          [is_eos, jnp.any(matches, -1), num_new >= budget, st.cursor >= st.buffer_size],
          [STOP_EOS, STOP_SEQUENCE, STOP_BUDGET, STOP_BUFFER_FULL], RUNNING)
      res = DecodeResult(
          num_new=num_new,
          stop_reason=jnp.where(live_rows, reason, res.stop_reason),
          stop_index=jnp.where(live_rows & jnp.any(matches, -1), jnp.argmax(matches, -1),
                               res.stop_index))
      return carry.replace(state=st, result=res, recent=recent, step=carry.step + 1,
                           string_state=string_state)

    with jax.named_scope("decode_loop"):  # its trip count's name (`hlo_cost`)
      end = jax.lax.while_loop(running, body, start)
    return end.state, end.result

  def generate(self, params, tokens: Array, mask: Array, rng: Array, max_new_tokens: int,
               stop_sequences: Array | None = None, budget: Array | None = None,
               eos_id: int | None = None,
               stop_strings: stop_strings_lib.StopStrings | None = None
               ) -> tuple[DecodeState, DecodeResult]:
    """Prefill + one decode: continues left-padded prompts `i32[B, P]` by up to
    `max_new_tokens` tokens (per-row `budget: i32[B]` may lower it)."""
    b, p = tokens.shape
    state = self.prefill(params, tokens, mask, p + max_new_tokens)
    if budget is None:
      budget = jnp.full((b,), max_new_tokens, jnp.int32)
    return self.decode(params, state, rng, budget, stop_sequences, stop_strings=stop_strings,
                       max_steps=max_new_tokens, eos_id=eos_id)
