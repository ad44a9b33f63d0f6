"""Oracle trajectories for SFT: the actions of an agent that searches with good queries.

For a question with chain `(e_0, ..., e_h)` the oracle takes h search turns and one answer
turn. Search turn k queries the exact name of `e_k`, whose document (top-1 under BM25 for that
query) states the fact leading to `e_{k+1}`; the last turn answers `e_h`'s name:

    <think> I need the employer of Velora Quint. </think><search> Velora Quint </search>
    <think> The employer is Quint Dynamics. I need its headquarters. </think><search> ...
    <think> The country is Talvoria. </think><answer> Talvoria </answer>

A configurable share of trajectories takes a *detour* first: one extra search turn with a
sloppy query, either a confusable neighbour's name in place of `e_k` ("neighbour") or the raw
question at the first turn ("question"), followed by a recovery turn with the right query.

Only actions are stored. Observations are produced by the real environment when SFT
sequences are built. There is a space after each opening tag and before each closing tag, so
SentencePiece gives the first word of a query or an answer its word-initial piece, the same
piece it has in the corpus and in the gold answer.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from pbsd_jax import protocol
from pbsd_jax.data import questions as questions_lib, world as world_lib

DETOUR_KINDS = ("neighbour", "question")
DETOUR_SHARE = 0.15  # the embedded task's default share of trajectories that take a detour


@dataclasses.dataclass(frozen=True)
class Turn:
  """One oracle action.

  Attributes:
    action: the action text, in the protocol.
    query: the search query, None on the answer turn.
    gold_doc_id: the document the query names exactly (BM25 top-1 expected), i.e. the
      chain entity's document, or the neighbour's on a neighbour detour; None on the answer
      turn and on a raw-question detour.
    detour: True on the sloppy search turn of a detour.
  """
  action: str
  query: str | None
  gold_doc_id: int | None
  detour: bool = False


@dataclasses.dataclass(frozen=True)
class Trajectory:
  """An SFT example: a question and the oracle's turns."""
  question: questions_lib.Question
  turns: tuple[Turn, ...]

  @property
  def actions(self) -> list[str]:
    return [t.action for t in self.turns]

  def to_record(self) -> dict[str, Any]:
    """The `sft.jsonl` record: the question's fields plus `actions`, `gold_doc_ids` (null
    where there is none) and `detour_turns`."""
    return {**self.question.to_record(), "actions": self.actions,
            "gold_doc_ids": [t.gold_doc_id for t in self.turns],
            "detour_turns": [t.detour for t in self.turns]}


def search_action(thought: str, query: str) -> str:
  """`<think> thought </think><search> query </search>`."""
  return (f"{protocol.THINK_OPEN} {thought} {protocol.THINK_CLOSE}"
          f"{protocol.SEARCH_OPEN} {query} {protocol.SEARCH_CLOSE}")


def answer_action(thought: str, answer: str) -> str:
  """`<think> thought </think><answer> answer </answer>`."""
  return (f"{protocol.THINK_OPEN} {thought} {protocol.THINK_CLOSE}"
          f"{protocol.ANSWER_OPEN} {answer} {protocol.ANSWER_CLOSE}")


def _search_thought(question: questions_lib.Question, k: int) -> str:
  """What the oracle thinks before searching `e_k`: the fact just read and the next need."""
  need = questions_lib.RELATION_NOUNS[question.relations[k]]
  if k == 0:
    return f"I need the {need} of {question.chain_names[0]}."
  found = questions_lib.RELATION_NOUNS[question.relations[k - 1]]
  return f"The {found} is {question.chain_names[k]}. I need its {need}."


def oracle_turns(world: world_lib.World, question: questions_lib.Question,
                 detour: tuple[str, int, int] | None = None) -> tuple[Turn, ...]:
  """The oracle's turns for `question`.

  Args:
    world: the world the question was drawn from.
    question: the question.
    detour: None, or `(kind, k, neighbour_id)`: before search turn k, one sloppy search --
      kind "neighbour" queries entity `neighbour_id` (a confusable neighbour of `e_k`), kind
      "question" (k must be 0, neighbour_id is ignored) queries the raw question.
  """
  names, chain = question.chain_names, question.chain
  turns: list[Turn] = []
  for k in range(question.hops):
    thought = _search_thought(question, k)
    if detour is not None and detour[1] == k:
      kind, _, other = detour
      if kind == "neighbour":
        if other not in world.neighbours(chain[k]):
          raise ValueError(f"entity {other} is not a confusable neighbour of {chain[k]}")
        wrong = world.entities[other].name
        turns.append(Turn(search_action(thought, wrong), wrong, other, detour=True))
        thought = f"These results are about {wrong}, not {names[k]}."
      elif kind == "question" and k == 0:
        turns.append(Turn(search_action(thought, question.question), question.question, None,
                          detour=True))
        thought = f"I should search for {names[0]} by name."
      else:
        raise ValueError(f"bad detour {detour!r}: kind must be one of {DETOUR_KINDS} and a "
                         f"question detour must be at turn 0")
    turns.append(Turn(search_action(thought, names[k]), names[k], chain[k]))
  found = questions_lib.RELATION_NOUNS[question.relations[-1]]
  answer = question.golden_answers[0]
  turns.append(Turn(answer_action(f"The {found} is {answer}.", answer), None, None))
  return tuple(turns)


def oracle_trajectories(world: world_lib.World, questions: list[questions_lib.Question],
                        detour_share: float, seed: int) -> list[Trajectory]:
  """Oracle trajectories for `questions`; exactly `round(detour_share * len(questions))` of
  them take a detour (half neighbour, half raw question where a neighbour exists)."""
  if not 0.0 <= detour_share <= 1.0:
    raise ValueError(f"detour_share must be in [0, 1], got {detour_share}")
  rng = random.Random(seed)
  detoured = set(rng.sample(range(len(questions)), round(detour_share * len(questions))))
  trajectories = []
  for i, question in enumerate(questions):
    detour = None
    if i in detoured:
      confusable = [k for k in range(question.hops) if world.neighbours(question.chain[k])]
      if confusable and rng.random() < 0.5:
        k = rng.choice(confusable)
        detour = ("neighbour", k, rng.choice(world.neighbours(question.chain[k])))
      else:
        detour = ("question", 0, -1)
    trajectories.append(Trajectory(question, oracle_turns(world, question, detour)))
  return trajectories
