"""Stop strings on device: a turn ends where its text contains `</search>`, however the
tokenizer split it.

A real tokenizer writes `</search>` as `</`, `search`, `>`, or merges its end with what follows
(`>\n`), so no token sequence names it. Instead, each stop string's Knuth-Morris-Pratt
automaton runs over the bytes of the text; since a token always appends the same bytes, the
automaton's step over a whole token is a table, built once from the vocabulary:
`table[token, i, q]` is the state of string i after the token's bytes from state q, where
state q means "the text ends with the first q bytes of the string", and `len(string)` means
the string occurred (somewhere inside the token, or across tokens). Decoding carries one state
per row and string and looks the next one up per sampled token: exactly a decode-and-search of
the text, one gather per step, inside the loop.
"""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import numpy as np
from flax import struct

Array = jnp.ndarray


@struct.dataclass
class StopStrings:
  """A vocabulary's stop-string automata (see the module docstring).

  Attributes:
    table: `i32[V, n, L]` state after each token, from each state, for each string; L the
      longest string's byte length (states past a shorter string's length are unused).
    lengths: `i32[n]` each string's byte length: the state that means "occurred".
  """

  table: Array
  lengths: Array

  @property
  def num_strings(self) -> int:
    return self.lengths.shape[0]


def _automaton(pattern: bytes) -> np.ndarray:
  """`[len, 256]` KMP transitions: state q (q bytes matched) -> state after one byte."""
  delta = np.zeros((len(pattern), 256), np.int32)
  delta[0, pattern[0]] = 1
  fallback = 0  # the state after reading pattern[1:q]
  for q in range(1, len(pattern)):
    delta[q] = delta[fallback]
    delta[q, pattern[q]] = q + 1
    fallback = delta[fallback, pattern[q]]
  return delta


def build(token_bytes: Sequence[bytes], stops: Sequence[str | bytes]) -> StopStrings:
  """The automata of `stops` over a vocabulary whose token i appends `token_bytes[i]`."""
  patterns = [s.encode() if isinstance(s, str) else bytes(s) for s in stops]
  if not patterns or any(not p for p in patterns):
    raise ValueError(f"stop strings must be non-empty, got {list(stops)!r}")
  longest = max(len(p) for p in patterns)
  width = max(1, max(len(b) for b in token_bytes))
  data = np.zeros((len(token_bytes), width), np.int32)
  sizes = np.array([len(b) for b in token_bytes])
  for i, b in enumerate(token_bytes):
    data[i, :len(b)] = np.frombuffer(b, np.uint8)
  table = np.zeros((len(token_bytes), len(patterns), longest), np.int32)
  for i, pattern in enumerate(patterns):
    delta, done = _automaton(pattern), len(pattern)
    state = np.broadcast_to(np.arange(len(pattern)), (len(token_bytes), len(pattern))).copy()
    for j in range(width):
      live = (sizes > j)[:, None] & (state < done)
      step = delta[np.minimum(state, done - 1), data[:, j:j + 1]]
      state = np.where(live, step, state)
    table[:, i, :len(pattern)] = state
  return StopStrings(table=jnp.asarray(table), lengths=jnp.asarray([len(p) for p in patterns]))


def start_state(stops: StopStrings, batch: int) -> Array:
  """`i32[B, n]`: nothing of any string matched yet."""
  return jnp.zeros((batch, stops.num_strings), jnp.int32)


def advance(stops: StopStrings, state: Array, token: Array) -> tuple[Array, Array]:
  """`(state', occurred bool[B, n])` after each row appends `token: i32[B]`."""
  rows = stops.table[token]  # [B, n, L]
  at = jnp.minimum(state, rows.shape[-1] - 1)[..., None]
  new = jnp.take_along_axis(rows, at, axis=-1)[..., 0]
  new = jnp.where(state >= stops.lengths, state, new)  # an occurrence stays one
  return new, new == stops.lengths
