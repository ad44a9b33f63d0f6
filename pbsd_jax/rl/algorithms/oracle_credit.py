"""Oracle credit: PBSD's machinery with the world's turn values in place of its evidence.

An upper bound for turn-level credit on the embedded task: each turn's evidence is its value
(`gold_chain.turn_values`, the change it makes to the chance of success, computed from the
gold chain and the batch's own rollouts), deadbanded at the labels' tolerance and squashed by
PBSD's tanh into weights in `[1 - clip, 1 + clip]`. If perfect turn credit does not beat
GRPO, no credit method can on the task. It needs rollouts labelled against their gold chains
(the embedded task's questions).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from pbsd_jax.agent.gold_chain import VALUE_TOLERANCE
from pbsd_jax.rl import credit
from pbsd_jax.rl.algorithms.inputs import AdvantageInputs
from pbsd_jax.rl.algorithms.pbsd import PBSD

Array = jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class OracleCredit(PBSD):
  """`A_{i,t} = A_i * w_{i,t}`, `w = 1 + c tanh(sign(A_i) v~_{i,t} / delta)`, `v` the turn's
  value (`AdvantageInputs.turn_value`; 0 where unlabelled).

  Attributes: PBSD's; the deadband defaults to the value labels' tolerance (a neutral turn
  keeps weight 1), and `reduction` / `replay_routing` do not apply (values are per turn, and
  no evidence pass reads routes).
  """

  name: ClassVar[str] = "oracle_credit"
  needs: ClassVar[frozenset] = frozenset({"turn_value"})

  eps_pos: float = VALUE_TOLERANCE
  eps_neg: float = VALUE_TOLERANCE

  def validate(self):
    super().validate()
    if self.replay_routing:
      self._fail("replay_routing", self.replay_routing, "oracle credit reads no evidence pass")

  def _credit(self, outcome: Array, inputs: AdvantageInputs):
    value = jnp.nan_to_num(jax.lax.stop_gradient(inputs.turn_value), nan=0.0)
    return credit.credit_from_evidence(outcome, value, inputs.turn_ids, delta=self.delta,
                                       clip=self.clip, eps_pos=self.eps_pos,
                                       eps_neg=self.eps_neg, form=self.form)
