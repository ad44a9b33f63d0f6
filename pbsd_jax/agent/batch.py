"""Host-side builders of rollout inputs from question records (numpy, tokenizer-agnostic).

A record is a Search-R1 style dict with `question` and `golden_answers` (and, for oracle
trajectories, `actions`). Everything returned is numpy, ready to be put on device.
`prompt_region` is the one builder of the prompt region, the student's and, given verified
answers, the teacher's.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np

from pbsd_jax import protocol
from pbsd_jax.agent import gold_chain, privileged
from pbsd_jax.agent.tokenizer import Tokenizer

Encode = Callable[[str], list[int]]


def prompt_region(questions: Sequence[str], encode: Encode, width: int,
                  template: str = protocol.DEFAULT_PROMPT_TEMPLATE, *,
                  answers: Sequence[str] | None = None,
                  privileged_template: str = privileged.DEFAULT_PRIVILEGED_TEMPLATE,
                  chains: Sequence[str] | None = None,
                  chat: Callable[[str], str] | None = None) -> dict[str, np.ndarray]:
  """The prompt region of B questions (docs/design.md §3), left-padded with 0 to `width` = P.

  Args:
    questions: B question texts, rendered with `protocol.format_prompt(q, template)`.
    encode: the tokenizer, text -> ids.
    width: P, the prompt region width.
    template: the student prompt template.
    answers: B verified answers: also build the teacher's privileged prompts
      (`privileged.dual_prompts`), which must fit the same width.
    privileged_template: the privileged block of the teacher prompt.
    chains: B gold chains (`privileged.chain_text`), for a block that states them.
    chat: renders a user message as the model's prompt text (`Tokenizer.chat`: its chat template
      with the assistant's turn opened), or None for the plain prompt. The teacher's user
      message is the student's with the privileged block after it; the regions still share
      every trajectory column, since both are left-padded to P.

  Returns:
    `{"prompts": i32[B, P], "prompt_mask": bool[B, P]}`, plus `"teacher_prompt"` and
    `"teacher_prompt_mask"` (the same shapes) with `answers`.

  Raises:
    ValueError: `"record {i}: its prompt is {n} tokens, more than prompt_width={P}"` for the
      first student prompt that does not fit; a teacher prompt that does not fit is named too.
  """
  messages = [protocol.format_prompt(q, template) for q in questions]
  student = [encode(chat(m) if chat else m) for m in messages]
  for i, ids in enumerate(student):
    if len(ids) > width:
      raise ValueError(f"record {i}: its prompt is {len(ids)} tokens, more than "
                       f"prompt_width={width}")
  if answers is None:
    tokens, mask = privileged.left_pad(student, width, pad_id=0)
    return {"prompts": tokens, "prompt_mask": mask}
  if chat is None:
    tokens, mask, teacher, teacher_mask = privileged.dual_prompts(
        student, answers, encode, width, pad_id=0, template=privileged_template,
        chains=chains)
  else:
    tokens, mask = privileged.left_pad(student, width, pad_id=0)
    try:
      teacher, teacher_mask = privileged.left_pad(
          [encode(chat(m + privileged.privileged_block(a, privileged_template, c)))
           for m, a, c in zip(messages, answers, chains or [None] * len(answers))],
          width, pad_id=0)
    except ValueError as e:
      raise ValueError(f"teacher (privileged) {e}; raise data.prompt_width") from None
  return {"prompts": tokens, "prompt_mask": mask, "teacher_prompt": teacher,
          "teacher_prompt_mask": teacher_mask}


def teacher_inputs(records: Sequence[Mapping], template: str) -> dict:
  """`prompt_region`'s teacher arguments for `records`: each one's first gold answer, the
  privileged `template` and, where it states the gold chain, the records' chains."""
  return dict(answers=[r["golden_answers"][0] for r in records], privileged_template=template,
              chains=([privileged.chain_text(r) for r in records] if "{chain}" in template
                      else None))


def gold_batch(golden_answers: Sequence[Sequence[str]], encode: Encode,
               width: int, num: int | None = None) -> np.ndarray:
  """`i32[B, G, width]` tokenised gold answers, -1 padded, for the token-level reward.

  Each answer is encoded on its own; answers longer than `width` tokens are cut (and so can
  only match an equally cut answer): pick `width` above the longest answer. `G` is `num`
  (fixed, so every batch has one shape: one compilation, and the same shape on every
  process) or, by default, the most answers a row of this batch has.
  """
  most = max(1, max(len(g) for g in golden_answers))
  if num is not None and most > num:
    raise ValueError(f"a row has {most} golden answers, more than the {num} slots of the batch")
  num = most if num is None else num
  gold = np.full((len(golden_answers), num, width), -1, np.int32)
  for b, answers in enumerate(golden_answers):
    for g, text in enumerate(answers):
      ids = encode(text)[:width]
      gold[b, g, :len(ids)] = ids
  return gold


def gold_text_batch(golden_answers: Sequence[Sequence[str]], width: int,
                    num: int | None = None) -> np.ndarray:
  """`i32[B, G, width]` the gold answers' SQuAD-normalised UTF-8 bytes
  (`rewards.normalize_answer`), -1 padded: the gold of the in-graph reward where the protocol
  tags are several tokens (`token_text.answer_match`). Longer answers are cut (and then match
  nothing); `num` as in `gold_batch`."""
  from pbsd_jax.agent.env.rewards import normalize_answer
  encoded = [[normalize_answer(a).encode() for a in answers] for answers in golden_answers]
  return gold_batch(encoded, lambda text: list(text), width, num)


def reward_gold(golden_answers: Sequence[Sequence[str]], tokenizer: Tokenizer, width: int,
                num: int | None = None) -> np.ndarray:
  """The gold of the in-graph reward for `tokenizer`: the answers' token ids (`gold_batch`,
  `width` tokens), or where the protocol tags are several tokens (the tokenizer has their
  `text`) their normalised bytes, 8 per token of `width` (`gold_text_batch`)."""
  if tokenizer.text is not None:
    return gold_text_batch(golden_answers, 8 * width, num)
  return gold_batch(golden_answers, tokenizer.encode, width, num)


def question_batch(records: Sequence[Mapping], tokenizer: Tokenizer, *, prompt_width: int,
                   gold_width: int, template: str = protocol.DEFAULT_PROMPT_TEMPLATE,
                   teacher_template: str | None = None, gold_chains: bool = False
                   ) -> dict[str, np.ndarray]:
  """The rollout arrays of `records`, one row each: the prompt region (`prompt_region`; with
  `teacher_template`, the teacher's too, `teacher_inputs`), the gold answers (`reward_gold`)
  and, with `gold_chains`, the gold chain documents (`gold_chain.gold_doc_batch`) from which
  a rollout labels its turns."""
  teacher = {} if teacher_template is None else teacher_inputs(records, teacher_template)
  batch = prompt_region([r["question"] for r in records], tokenizer.encode, prompt_width,
                        template, **teacher, chat=tokenizer.chat)
  batch["gold"] = reward_gold([r["golden_answers"] for r in records], tokenizer, gold_width)
  if gold_chains:
    batch["gold_docs"] = gold_chain.gold_doc_batch(records, max(r["hops"] for r in records))
  return batch


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
