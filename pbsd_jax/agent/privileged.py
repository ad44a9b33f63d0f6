"""The privileged (teacher-only) prompt and the shared prompt region of docs/design.md §3.

PBSD's teacher is the same model on a prompt that also states the verified answer (DESIGN §2,
"Bayes rewrite"). The teacher prompt is the student prompt with a privileged block appended;
the block is encoded on its own, so the student prompt's token ids are a prefix of the
teacher's whatever the tokenizer. Both prompts are left-padded to the same width P, and the
teacher sequence reuses the trajectory columns of the rollout unchanged, so
`[student, teacher]` stack as `[2, B, T]` with every trajectory token in the same column.

Everything here is tokenizer-agnostic: text goes through an `encode: str -> list[int]`.
`batch.prompt_region` builds both regions from question texts with these functions.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

DEFAULT_PRIVILEGED_TEMPLATE = (
    "(Teacher-only) The verified answer is: {answer}. Reason and search as if you did not know "
    "it.\n")
# The privileged blocks a run may choose (`config.data.teacher_prompt`): the paper's (the
# answer), or the answer and the gold chain's entity names (`chain_text`: an upper bound on
# what the teacher can know, for the embedded task's questions).
TEMPLATES = {
    "answer": DEFAULT_PRIVILEGED_TEMPLATE,
    "chain": ("(Teacher-only) The verified answer is: {answer}. The facts lead through: "
              "{chain}. Reason and search as if you did not know them.\n"),
}


def chain_text(record) -> str:
  """A record's gold chain as the `chain` template states it: its entity names in order."""
  return " -> ".join(record["chain_names"])


def privileged_block(answer: str, template: str = DEFAULT_PRIVILEGED_TEMPLATE,
                     chain: str | None = None) -> str:
  """The privileged text for `answer`: `template` with its `{answer}` field filled, and its
  `{chain}` field, when it has one, with `chain`."""
  if "{answer}" not in template:
    raise ValueError(f"privileged template must contain an '{{answer}}' field: {template!r}")
  if not answer.strip():
    raise ValueError("the verified answer is empty; the teacher would be told nothing")
  if "{chain}" in template and not chain:
    raise ValueError("the privileged template states the gold chain, which this question "
                     "does not have")
  return template.format(answer=answer, chain=chain)


def privileged_prompt(student_prompt: Sequence[int], answer: str,
                      encode: Callable[[str], list[int]],
                      template: str = DEFAULT_PRIVILEGED_TEMPLATE,
                      chain: str | None = None) -> list[int]:
  """Teacher prompt ids: the student prompt ids followed by the encoded privileged block.

  Args:
    student_prompt: the unpadded student prompt token ids.
    answer: the verified answer `y*`.
    encode: the tokenizer, text -> token ids (no BOS/EOS added).
    template: the privileged block, with an `{answer}` field (and maybe a `{chain}` one).
    chain: the gold chain (`chain_text`), for a template that states it.

  Returns:
    The unpadded teacher prompt token ids.
  """
  return list(student_prompt) + list(encode(privileged_block(answer, template, chain)))


def left_pad(prompts: Sequence[Sequence[int]], width: int,
             pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """Left-pads token id lists to `width`.

  Args:
    prompts: B unpadded prompts.
    width: P, the prompt region width.
    pad_id: the id written on padded slots.

  Returns:
    `(i32[B, P] tokens, bool[B, P] mask)`, real tokens right-aligned.

  Raises:
    ValueError: naming the first prompt longer than `width`.
  """
  tokens = np.full((len(prompts), width), pad_id, np.int32)
  mask = np.zeros((len(prompts), width), bool)
  for row, prompt in enumerate(prompts):
    n = len(prompt)
    if n > width:
      raise ValueError(f"prompt {row} has {n} tokens, more than the prompt width {width}")
    if n:
      tokens[row, width - n:] = prompt
      mask[row, width - n:] = True
  return tokens, mask


def dual_prompts(student_prompts: Sequence[Sequence[int]], answers: Sequence[str],
                 encode: Callable[[str], list[int]], width: int, pad_id: int,
                 template: str = DEFAULT_PRIVILEGED_TEMPLATE,
                 chains: Sequence[str] | None = None):
  """Student and teacher prompt regions, both left-padded to the same width P.

  Args:
    student_prompts: B unpadded student prompts (token ids).
    answers: B verified answers.
    encode: the tokenizer, text -> token ids.
    width: P; must hold the longer, teacher prompts.
    pad_id: padding id.
    template: the privileged block.
    chains: B gold chains (`chain_text`), for a template that states them.

  Returns:
    `(student_tokens i32[B, P], student_mask bool[B, P], teacher_tokens i32[B, P],
    teacher_mask bool[B, P])`.
  """
  if len(student_prompts) != len(answers):
    raise ValueError(f"got {len(student_prompts)} prompts but {len(answers)} answers")
  chains = chains or [None] * len(answers)
  teacher = [privileged_prompt(p, a, encode, template, c)
             for p, a, c in zip(student_prompts, answers, chains)]
  try:
    teacher_tokens, teacher_mask = left_pad(teacher, width, pad_id)
  except ValueError as e:
    raise ValueError(f"teacher (privileged) {e}; raise the prompt width") from None
  return (*left_pad(student_prompts, width, pad_id), teacher_tokens, teacher_mask)


def teacher_sequence(tokens: Array, mask: Array, teacher_prompt: Array,
                     teacher_prompt_mask: Array) -> tuple[Array, Array]:
  """The teacher view of a rollout: its prompt region replaced by the privileged one.

  Args:
    tokens: `i32[B, T]` rollout tokens; the prompt region is the first P columns.
    mask: `bool[B, T]` real tokens.
    teacher_prompt: `i32[B, P]` left-padded teacher prompts (`dual_prompts`).
    teacher_prompt_mask: `bool[B, P]`.

  Returns:
    `(i32[B, T], bool[B, T])`: identical to the rollout from column P on.
  """
  width = teacher_prompt.shape[1]
  if width > tokens.shape[1]:
    raise ValueError(f"teacher prompt width {width} exceeds the sequence length "
                     f"{tokens.shape[1]}")
  return (jnp.concatenate([teacher_prompt.astype(tokens.dtype), tokens[:, width:]], axis=1),
          jnp.concatenate([teacher_prompt_mask.astype(bool), mask[:, width:].astype(bool)],
                          axis=1))
