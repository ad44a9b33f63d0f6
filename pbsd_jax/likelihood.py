"""Token log-probabilities, computed in chunks over the sequence.

Alignment: `logp[b, t] = log p(tokens[b, t] | tokens[b, :t])`, so a column of log-probs lines up
with the column of the token it scores and `action_mask` applies directly. A row's real tokens
are contiguous (left padding, then real tokens, then right padding: the token layout of
DESIGN.md §3); the first real token of a row, and every padded slot, get log-prob 0.

With `chunk_size` set, the LM head runs on `chunk_size` positions at a time under
`jax.checkpoint`, so neither the forward nor the backward pass ever holds the `[B, T, V]` logits.
"""

from __future__ import annotations

from typing import Any, Callable

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
                         with_entropy: bool = False):
  """Per-token log-probs (and optionally next-token entropies) from final hidden states.

  Args:
    unembed: maps hidden `[B, C, D]` to `f32[B, C, V]` logits.
    hidden: `[B, T, D]` final hidden states.
    tokens: `i32[B, T]` the tokens to score.
    mask: `bool[B, T]` real tokens.
    chunk_size: positions per LM-head chunk (None: all at once).
    with_entropy: also return the entropy of the distribution that predicted each token.

  Returns:
    `logp: f32[B, T]` (and `entropy: f32[B, T]`), 0 on slots without a real predecessor.
  """
  def score(h, target):
    logits = unembed(h)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    logp = jnp.take_along_axis(logits, target[..., None], axis=-1)[..., 0] - log_z
    probs = jnp.exp(logits - log_z[..., None])
    entropy = log_z - jnp.sum(probs * logits, axis=-1)
    return logp, entropy

  # The distribution at slot t-1 predicts token t.
  logp, entropy = map_sequence_chunks(score, chunk_size, hidden[:, :-1], tokens[:, 1:])
  scored = mask[:, 1:] & mask[:, :-1]
  pad = lambda x: jnp.pad(jnp.where(scored, x, 0.0), [(0, 0), (1, 0)])
  return (pad(logp), pad(entropy)) if with_entropy else pad(logp)


def token_logprobs(params: Any, config: ModelConfig, tokens: Array, mask: Array, *,
                   chunk_size: int | None = None, routes: Array | None = None,
                   with_entropy: bool = False):
  """`f32[B, T]` log-probs of `tokens: i32[B, T]` under the model (see module docstring).

  Args:
    params: model parameters.
    config: the model config.
    tokens: `i32[B, T]`.
    mask: `bool[B, T]` real tokens (contiguous per row).
    chunk_size: LM-head chunk over the sequence; the result is identical to `None`.
    routes: MoE expert choices to replay, `i32[layers, B, T, k]`.
    with_entropy: also return next-token entropies `f32[B, T]`.
  """
  model = Transformer(config)
  variables = {"params": params}
  out = model.apply(variables, tokens, mask, routes=routes, compute_logits=False)
  unembed = lambda h: model.apply(variables, h, method=Transformer.unembed)
  return logprobs_from_hidden(unembed, out.hidden, tokens, mask, chunk_size, with_entropy)
