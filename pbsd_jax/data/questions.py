"""Multi-hop questions: relation paths, their English rendering, and the verified answer.

A question is a start entity named in the text plus a path of relations `(r_1, ..., r_h)`;
the gold chain is `(e_0, ..., e_h)` with `e_k = r_k(e_{k-1})`, and the answer is `e_h`. Since
every relation is a function and every name is unique, the answer is unique. The text nests
noun phrases, innermost first:

    ("works_for", "headquartered_in", "located_in") from "Velora Quint" ->
    "In which country is the headquarters of the employer of Velora Quint?"
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pbsd_jax.data import world as world_lib

# The question asked about the last relation; `{x}` is the name or nested noun phrase.
QUESTION_TEMPLATES = {
    "born_in": "Where was {x} born?",
    "works_for": "Which organisation does {x} work for?",
    "studied_at": "Where did {x} study?",
    "spouse": "Who is married to {x}?",
    "headquartered_in": "In which city is {x} headquartered?",
    "founded_by": "Who founded {x}?",
    "located_in": "In which country is {x}?",
    "mayor": "Who is the mayor of {x}?",
    "capital": "What is the capital of {x}?",
}
# Short nouns naming the tail of each relation; the noun phrase is "the {noun} of {x}".
RELATION_NOUNS = {
    "born_in": "birthplace",
    "works_for": "employer",
    "studied_at": "alma mater",
    "spouse": "spouse",
    "headquartered_in": "headquarters",
    "founded_by": "founder",
    "located_in": "country",
    "mayor": "mayor",
    "capital": "capital",
}
# Compositions that always return to where they started; never asked.
_IDENTITY_BIGRAMS = frozenset({("spouse", "spouse"), ("capital", "located_in")})


@dataclasses.dataclass(frozen=True)
class Question:
  """A verified multi-hop question.

  Attributes:
    question: the question text.
    golden_answers: acceptable answers, the answer entity's name first, then its aliases.
    relations: the relation path `(r_1, ..., r_h)`.
    chain: entity ids `(e_0, ..., e_h)`; `e_0` is named in the text, `e_h` is the answer.
    chain_names: the names of `chain`.
    tier: "easy" / "medium" / "hard" for out-of-domain questions, "" otherwise.
  """
  question: str
  golden_answers: tuple[str, ...]
  relations: tuple[str, ...]
  chain: tuple[int, ...]
  chain_names: tuple[str, ...]
  tier: str = ""

  @property
  def hops(self) -> int:
    return len(self.relations)

  def to_record(self) -> dict[str, Any]:
    """The JSONL record (Search-R1 fields `question`, `golden_answers` plus ours)."""
    return {"question": self.question, "golden_answers": list(self.golden_answers),
            "hops": self.hops, "tier": self.tier, "relations": list(self.relations),
            "chain": list(self.chain), "chain_names": list(self.chain_names)}


def relation_paths(hops: int) -> list[tuple[str, ...]]:
  """All type-consistent relation paths of length `hops`, in a fixed order.

  Paths that contain a composition returning to its start (spouse of spouse, country of
  capital) are left out.
  """
  paths = [(r,) for r in world_lib.RELATIONS]
  for _ in range(hops - 1):
    paths = [p + (r,) for p in paths for r, spec in world_lib.RELATIONS.items()
             if spec.head == world_lib.RELATIONS[p[-1]].tail
             and (p[-1], r) not in _IDENTITY_BIGRAMS]
  return paths


def render(start_name: str, relations: tuple[str, ...]) -> str:
  """The question text for `relations` applied to the entity named `start_name`."""
  phrase = start_name
  for relation in relations[:-1]:
    phrase = f"the {RELATION_NOUNS[relation]} of {phrase}"
  return QUESTION_TEMPLATES[relations[-1]].format(x=phrase)


def make_question(world: world_lib.World, start: int, relations: tuple[str, ...],
                  tier: str = "") -> Question | None:
  """The question from entity `start` along `relations`; None if the chain revisits an
  entity (such a question would be trivial or circular)."""
  if world.entities[start].type != world_lib.RELATIONS[relations[0]].head:
    raise ValueError(f"relation {relations[0]!r} does not apply to a "
                     f"{world.entities[start].type}")
  chain = world.walk(start, relations)
  if len(set(chain)) != len(chain):
    return None
  names = tuple(world.entities[i].name for i in chain)
  return Question(render(names[0], relations), tuple(world.answers(chain[-1])), relations,
                  chain, names, tier)
