"""Host-side builders of rollout inputs from question records (numpy, tokenizer-agnostic).

A record is a Search-R1 style dict with `question` and `golden_answers` (and, for oracle
trajectories, `actions`). Everything returned is a numpy array ready to be put on device.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from pbsd_jax.env import protocol
from pbsd_jax.privileged import left_pad

Encode = Callable[[str], list[int]]


def prompt_batch(questions: Sequence[str], encode: Encode, width: int,
                 template: str = protocol.DEFAULT_PROMPT_TEMPLATE
                 ) -> tuple[np.ndarray, np.ndarray]:
  """Student prompts `i32[B, width]` left-padded with 0, and their `bool[B, width]` mask."""
  return left_pad([encode(protocol.format_prompt(q, template)) for q in questions], width,
                  pad_id=0)


def gold_batch(golden_answers: Sequence[Sequence[str]], encode: Encode,
               width: int) -> np.ndarray:
  """`i32[B, G, width]` tokenised gold answers, -1 padded, for the token-level reward.

  Each answer is encoded on its own; answers longer than `width` tokens are cut (and so can
  only match an equally cut answer): pick `width` above the longest answer.
  """
  num = max(1, max(len(g) for g in golden_answers))
  gold = np.full((len(golden_answers), num, width), -1, np.int32)
  for b, answers in enumerate(golden_answers):
    for g, text in enumerate(answers):
      ids = encode(text)[:width]
      gold[b, g, :len(ids)] = ids
  return gold


def forced_batch(action_lists: Sequence[Sequence[str]], encode: Encode, max_turns: int,
                 width: int) -> tuple[np.ndarray, np.ndarray]:
  """Actions to force, `i32[max_turns, B, width]` with lengths `i32[max_turns, B]`.

  Raises a ValueError naming the row and turn if an action does not fit.
  """
  forced = np.zeros((max_turns, len(action_lists), width), np.int32)
  lengths = np.zeros((max_turns, len(action_lists)), np.int32)
  for b, actions in enumerate(action_lists):
    if len(actions) > max_turns:
      raise ValueError(f"row {b} has {len(actions)} actions, more than max_turns={max_turns}")
    for k, action in enumerate(actions):
      ids = encode(action)
      if len(ids) > width:
        raise ValueError(f"row {b}, turn {k}: action is {len(ids)} tokens, more than {width}")
      forced[k, b, :len(ids)], lengths[k, b] = ids, len(ids)
  return forced, lengths
