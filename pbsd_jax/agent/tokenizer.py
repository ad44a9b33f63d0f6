"""The policy's tokenizer as the agent uses it: one object for encoding, decoding, the token
text of multi-token tags and the chat template."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from pbsd_jax.agent.env.token_text import TokenText


@dataclasses.dataclass(frozen=True, eq=False)
class Tokenizer:
  """Text <-> ids for prompts, observations and host retrieval, plus what the device needs to
  read text tags.

  Attributes:
    vocab: the vocabulary (a seqio vocabulary, or anything with `encode(str)` and
      `decode(list[int])`, `vocab_size`, `eos_id`).
    text: the vocabulary's `TokenText` (`token_text.build`) where the protocol tags are
      several tokens, else None (single-token tags, read by id).
    chat: renders a user message as the model's prompt (its chat template), or None for the
      plain prompt.
  """

  vocab: Any
  text: TokenText | None = None
  chat: Callable[[str], str] | None = None

  def encode(self, text: str) -> list[int]:
    return list(self.vocab.encode(text))

  def decode(self, ids: Sequence[int]) -> str:
    return self.vocab.decode([int(i) for i in ids])
