"""The per-batch arrays every advantage function reads (the token layout of docs/design.md §3).

Slots off the action tokens (prompt, observation, padding) have `action_mask` False and turn
id -1; per-token arrays are aligned like `pbsd_jax.rl.likelihood.token_logprobs` (column t scores
token t). Optional fields are None unless the algorithm lists them in its `needs`.
"""

from __future__ import annotations

import jax
from flax import struct

Array = jax.Array


@struct.dataclass
class AdvantageInputs:
  """What an algorithm's `advantages` may read.

  Attributes:
    rewards: `f32[B]` outcome rewards; groups are G consecutive rows.
    action_mask: `bool[B, T]` tokens the policy sampled.
    turn_ids: `i32[B, T]` k on the action tokens of turn k, -1 elsewhere.
    step: `i32[]` the optimiser step (schedules such as RLSD's lambda).
    max_turns: static K, the number of turn slots of the rollout.
    logp_student: `f32[B, T]` current-parameter log-probs on the ordinary prompt (the student
      half of `dual_logprobs`).
    logp_teacher: `f32[B, T]` the same on the privileged prompt (teacher half).
    divergence: `f32[B, T]` per-token `KL(student || teacher)` over the full vocabulary,
      current parameters, privileged teacher (`token_divergence(params, params, ..., beta=1)`).
    entropy: `f32[B, T]` student next-token entropy (same call, `with_entropy=True`).
    turn_value: `f32[B, K]` each turn's value (`gold_chain.turn_values`; NaN where
      unlabelled), from the rollout's gold chains.
  """

  rewards: Array
  action_mask: Array
  turn_ids: Array
  step: Array
  max_turns: int = struct.field(pytree_node=False)
  logp_student: Array | None = None
  logp_teacher: Array | None = None
  divergence: Array | None = None
  entropy: Array | None = None
  turn_value: Array | None = None

  @property
  def response_length(self) -> Array:
    """`i32[B]` generated (action) tokens per trajectory."""
    return self.action_mask.sum(axis=-1).astype("int32")
