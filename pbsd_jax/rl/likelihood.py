"""Token log-probabilities, computed in chunks over the sequence.

Alignment: `logp[b, t] = log p(tokens[b, t] | tokens[b, :t])`, so a column of log-probs lines up
with the column of the token it scores and `action_mask` applies directly. A row's real tokens
are contiguous (left padding, then real tokens, then right padding: the token layout of
docs/design.md §3); the first real token of a row, and every padded slot, get log-prob 0.

With `chunk_size` set, the LM head runs on `chunk_size` positions at a time under
`jax.checkpoint`, so neither the forward nor the backward pass ever holds the `[B, T, V]` logits.

`dual_logprobs` scores one trajectory under the student and the privileged-teacher prompts in
one batched pass (docs/design.md §2); `token_divergence` compares two models' full next-token
distributions chunk by chunk (OPSD, GEAR).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from pbsd_jax.models import ModelConfig, Transformer

Array = jax.Array


def map_sequence_chunks(fn: Callable[..., Any], chunk_size: int | None, *arrays: Array) -> Any:
  """Applies `fn` to chunks of `[B, T, ...]` arrays along T and concatenates the outputs.

  `fn` maps arrays `[B, C, ...]` to a pytree of `[B, C, ...]` arrays. T is padded up to a
  multiple of `chunk_size` (with zeros) and the padding is cut from the outputs. Each chunk is
  rematerialised in the backward pass, so only one chunk's intermediates are live at a time.
  `chunk_size=None` (or >= T) calls `fn` once on the whole arrays.
  """
  t = arrays[0].shape[1]
  if chunk_size is None or chunk_size >= t:
    return fn(*arrays)
  num = -(-t // chunk_size)
  pad = num * chunk_size - t

  def split(x):
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape(x.shape[0], num, chunk_size, *x.shape[2:])
    return jnp.moveaxis(x, 1, 0)

  out = jax.lax.map(lambda xs: jax.checkpoint(fn)(*xs), tuple(split(x) for x in arrays))

  def merge(y):
    y = jnp.moveaxis(y, 0, 1)
    return y.reshape(y.shape[0], num * chunk_size, *y.shape[3:])[:, :t]

  return jax.tree.map(merge, out)


def logprobs_from_hidden(unembed: Callable[[Array], Array], hidden: Array, tokens: Array,
                         mask: Array, chunk_size: int | None = None,
                         with_entropy: bool = False, score_from: int = 1):
  """Per-token log-probs (and optionally next-token entropies) from final hidden states.

  Args:
    unembed: maps hidden `[B, C, D]` to `f32[B, C, V]` logits.
    hidden: `[B, T, D]` final hidden states.
    tokens: `i32[B, T]` the tokens to score.
    mask: `bool[B, T]` real tokens.
    chunk_size: positions per LM-head chunk (None: all at once).
    with_entropy: also return the entropy of the distribution that predicted each token, a
      metric: it carries no gradient, so a backward pass through the log-probs does no work
      for it.
    score_from: static first column to score (>= 1); earlier columns get 0 and the LM head
      never runs on them (the learner passes the prompt width: it trains on trajectory
      tokens only).

  Returns:
    `logp: f32[B, T]` (and `entropy: f32[B, T]`), 0 on slots without a real predecessor.
  """
  def score(h, target):
    logits = unembed(h)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    logp = jnp.take_along_axis(logits, target[..., None], axis=-1)[..., 0] - log_z
    logits, log_z = jax.lax.stop_gradient((logits, log_z))
    entropy = log_z - jnp.sum(jnp.exp(logits - log_z[..., None]) * logits, axis=-1)
    return logp, entropy

  # The distribution at slot t-1 predicts token t.
  first = max(1, score_from)
  logp, entropy = map_sequence_chunks(score, chunk_size, hidden[:, first - 1:-1],
                                      tokens[:, first:])
  scored = mask[:, first:] & mask[:, first - 1:-1]
  pad = lambda x: jnp.pad(jnp.where(scored, x, 0.0), [(0, 0), (first, 0)])
  return (pad(logp), pad(entropy)) if with_entropy else pad(logp)


def token_logprobs(params: Any, model: ModelConfig, tokens: Array, mask: Array, *,
                   chunk_size: int | None = None, routes: Array | None = None,
                   with_entropy: bool = False, score_from: int = 1):
  """`f32[B, T]` log-probs of `tokens: i32[B, T]` under the model (see module docstring).

  Args:
    params: model parameters.
    model: the model config.
    tokens: `i32[B, T]`.
    mask: `bool[B, T]` real tokens (contiguous per row).
    chunk_size: LM-head chunk over the sequence; the result is identical to `None`.
    routes: MoE expert choices to replay, `i32[layers, B, T, k]`.
    with_entropy: also return next-token entropies `f32[B, T]`.
    score_from: static first column scored (see `logprobs_from_hidden`).
  """
  net = Transformer(model)
  variables = {"params": params}
  out = net.apply(variables, tokens, mask, routes=routes, compute_logits=False)
  unembed = lambda h: net.apply(variables, h, method=Transformer.unembed)
  return logprobs_from_hidden(unembed, out.hidden, tokens, mask, chunk_size, with_entropy,
                              score_from)


def dual_logprobs(params: Any, model: ModelConfig, student_tokens: Array, student_mask: Array,
                  teacher_tokens: Array, teacher_mask: Array, *, chunk_size: int | None = None,
                  routes: Array | None = None, score_from: int = 1) -> Array:
  """Student and teacher log-probs of the same trajectory, `f32[2, B, T]`, no gradient.

  DESIGN §2 "Non-replay evidence recomputation": one forward with the current parameters over
  both conditions as one batch of `2B` rows of `token_logprobs` (under a `vmap` the
  attention could not skip the tiles that no row needs). Index 0 is the student (ordinary
  prompt), index 1 the teacher (privileged prompt); the two sequences share every trajectory
  column (DESIGN §3), so `out[1] - out[0]` is the per-token evidence `l_{i,j}` on action tokens. The student half
  doubles as the "old" log-probs of the PPO ratio.

  Args:
    params: model parameters.
    model: the model config.
    student_tokens, student_mask: `i32[B, T]`, `bool[B, T]` the rollout.
    teacher_tokens, teacher_mask: the same with the privileged prompt region.
    chunk_size: LM-head chunk over the sequence (see `token_logprobs`).
    routes: MoE routes to replay (ablation only): `i32[layers, B, T, k]` for both conditions
      or `i32[2, layers, B, T, k]` per condition. None (default) routes afresh.
    score_from: static first column scored (see `logprobs_from_hidden`).

  Returns:
    `f32[2, B, T]` under `stop_gradient`.
  """
  if student_tokens.shape != teacher_tokens.shape:
    raise ValueError(f"student tokens {student_tokens.shape} and teacher tokens "
                     f"{teacher_tokens.shape} must have the same [B, T] shape")
  b, t = student_tokens.shape
  # Row 2i is row i's student, row 2i + 1 its teacher: a device's rows stay on the device.
  tokens = jnp.stack([student_tokens, teacher_tokens], 1).reshape(2 * b, t)
  mask = jnp.stack([student_mask, teacher_mask], 1).reshape(2 * b, t).astype(bool)
  if routes is not None:  # -> [layers, 2B, T, k]
    routes = (jnp.stack([routes, routes], 2) if routes.ndim == 4
              else jnp.moveaxis(routes, 0, 2))
    routes = routes.reshape(routes.shape[0], 2 * b, *routes.shape[3:])
  out = token_logprobs(params, model, tokens, mask, chunk_size=chunk_size, routes=routes,
                       score_from=score_from)
  return jax.lax.stop_gradient(jnp.swapaxes(out.reshape(b, 2, t), 0, 1))


def generalized_jsd(student_logits: Array, teacher_logits: Array, beta: float) -> Array:
  """Generalised Jensen-Shannon divergence over the full vocabulary, `f32[...]`.

  GKD convention (Agarwal et al., 2024) with P = teacher, Q = student, M = beta P + (1-beta) Q:
  `JSD(beta) = beta KL(P || M) + (1 - beta) KL(Q || M)` for 0 < beta < 1. That mixture value
  vanishes at both ends, so the endpoints are defined as the limits the gradients approach:
  `beta = 1` is the reverse KL `KL(student || teacher)` and `beta = 0` the forward KL
  `KL(teacher || student)` (DESIGN §2, OPSD).

  Args:
    student_logits: `f32[..., V]`.
    teacher_logits: `f32[..., V]`.
    beta: static float in [0, 1].
  """
  if not 0.0 <= beta <= 1.0:
    raise ValueError(f"beta must be in [0, 1], got {beta}")
  log_s = jax.nn.log_softmax(student_logits.astype(jnp.float32), axis=-1)
  log_t = jax.nn.log_softmax(teacher_logits.astype(jnp.float32), axis=-1)
  kl = lambda log_p, log_q: jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)
  if beta == 1.0:
    return kl(log_s, log_t)
  if beta == 0.0:
    return kl(log_t, log_s)
  log_m = jnp.logaddexp(log_t + jnp.log(beta), log_s + jnp.log1p(-beta))
  return beta * kl(log_t, log_m) + (1.0 - beta) * kl(log_s, log_m)


class DivergenceScores(NamedTuple):
  """What one student forward and one teacher forward give per token, all `f32[B, T]`.

  Attributes:
    divergence: `generalized_jsd` of the student's and the teacher's next-token
      distributions (differentiable in the student parameters).
    entropy: the student's next-token entropy.
    logp: the student's log-prob of the token (as `token_logprobs`).
  """

  divergence: Array
  entropy: Array
  logp: Array


def token_divergence(params: Any, teacher_params: Any, model: ModelConfig,
                     student_tokens: Array, student_mask: Array, teacher_tokens: Array,
                     teacher_mask: Array, *, beta: float = 1.0, chunk_size: int | None = None,
                     score_from: int = 1) -> DivergenceScores:
  """Per-token `generalized_jsd` between the student's and teacher's next-token distributions.

  The student is `params` on the student sequence (gradients flow); the teacher is
  `teacher_params` on the teacher sequence under `stop_gradient` (OPSD passes the frozen
  initial parameters, GEAR the current ones). The student's entropy and token log-probs come
  from the same forward, so a caller that also needs them runs no second student pass; the
  entropy carries no gradient (as in `logprobs_from_hidden`).
  Aligned like `token_logprobs`: column t holds the scores of the distributions that predict
  token t, 0 where either sequence has no real predecessor. The LM heads run `chunk_size`
  positions at a time, so the `[B, T, V]` logits of either model are never held whole.

  Args:
    params: student parameters.
    teacher_params: teacher parameters (may be `params` itself).
    model: the model config (shared).
    student_tokens, student_mask: `i32[B, T]`, `bool[B, T]`.
    teacher_tokens, teacher_mask: the same with the privileged prompt region.
    beta: see `generalized_jsd` (1 = reverse KL).
    chunk_size: positions per LM-head chunk (None: all at once).
    score_from: static first column scored (see `logprobs_from_hidden`).

  Returns:
    `DivergenceScores` (divergence, student entropy, student log-probs), each `f32[B, T]`.
  """
  net = Transformer(model)
  teacher_params = jax.lax.stop_gradient(teacher_params)
  hidden = lambda p, t, m: net.apply({"params": p}, t, m, compute_logits=False).hidden
  h_student = hidden(params, student_tokens, student_mask)
  h_teacher = hidden(teacher_params, teacher_tokens, teacher_mask)

  def score(hs, ht, target):
    logits_s = net.apply({"params": params}, hs, method=Transformer.unembed)
    logits_t = net.apply({"params": teacher_params}, ht, method=Transformer.unembed)
    div = generalized_jsd(logits_s, logits_t, beta)
    log_s = jax.nn.log_softmax(logits_s.astype(jnp.float32), axis=-1)
    logp = jnp.take_along_axis(log_s, target[..., None], axis=-1)[..., 0]
    log_s = jax.lax.stop_gradient(log_s)  # the entropy is a metric or a segment rule's input
    return div, -jnp.sum(jnp.exp(log_s) * log_s, axis=-1), logp

  first = max(1, score_from)
  scores = map_sequence_chunks(score, chunk_size, h_student[:, first - 1:-1],
                               h_teacher[:, first - 1:-1], student_tokens[:, first:])
  real = lambda m: m[:, first:] & m[:, first - 1:-1]
  scored = real(student_mask.astype(bool)) & real(teacher_mask.astype(bool))
  pad = lambda x: jnp.pad(jnp.where(scored, x, 0.0), [(0, 0), (first, 0)])
  return DivergenceScores(*(pad(x) for x in scores))
