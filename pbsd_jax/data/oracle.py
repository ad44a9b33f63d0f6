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

Trajectories can also *slip* (`Slips`): at each hop, with probability `slip_rate`, the oracle
searches a confusable neighbour of the entity it is after. With probability `recover_rate` it
notices and searches the right name next; otherwise it *derails*: it reads the neighbour's
document as the entity's, follows the neighbour's fact, and every later hop walks from the
wrong entity, so the trajectory answers wrong (unless the two walks meet). SFT on such data
imitates a policy that makes mistakes, some recoverable, and leaves room for RL by design.

Only actions are stored. Observations are produced by the real environment when SFT
sequences are built. There is a space after each opening tag and before each closing tag, so
SentencePiece gives the first word of a query or an answer its word-initial piece, the same
piece it has in the corpus and in the gold answer.
"""

from __future__ import annotations

import dataclasses
import random
import re
from typing import Any, Callable

from pbsd_jax import protocol
from pbsd_jax.data import questions as questions_lib, world as world_lib

DETOUR_KINDS = ("neighbour", "question")
DETOUR_SHARE = 0.15  # the embedded task's default share of trajectories that take a detour
_ANSWER = re.compile(f"{re.escape(protocol.ANSWER_OPEN)} (.*) {re.escape(protocol.ANSWER_CLOSE)}")


@dataclasses.dataclass(frozen=True)
class Slips:
  """Per-hop slips of the oracle.

  Attributes:
    slip_rate: the chance, at each hop whose entity has a confusable neighbour, of searching
      a neighbour's name instead (0: never; the embedded task's default).
    recover_rate: the chance a slip is noticed and followed by the right search; otherwise
      the trajectory derails.
    max_slips: at most this many slips in one trajectory (the turn budget: each recovered
      slip costs a turn).
  """
  slip_rate: float = 0.0
  recover_rate: float = 0.5
  max_slips: int = 2

  def __post_init__(self):
    for field in ("slip_rate", "recover_rate"):
      if not 0.0 <= getattr(self, field) <= 1.0:
        raise ValueError(f"Slips.{field} must be in [0, 1], got {getattr(self, field)}")
    if self.max_slips < 0:
      raise ValueError(f"Slips.max_slips must be >= 0, got {self.max_slips}")


@dataclasses.dataclass(frozen=True)
class Turn:
  """One oracle action.

  Attributes:
    action: the action text, in the protocol.
    query: the search query, None on the answer turn.
    gold_doc_id: the document the query names exactly (BM25 top-1 expected): the chain
      entity's document, the neighbour's on a neighbour detour or a slip, the wrong walk's
      entity's after a derailment; None on the answer turn and on a raw-question detour.
    detour: True on the sloppy search turn of a detour or a slip.
  """
  action: str
  query: str | None
  gold_doc_id: int | None
  detour: bool = False


@dataclasses.dataclass(frozen=True)
class Trajectory:
  """An SFT example: a question, the oracle's turns and its slips, `(hop, recovered)`."""
  question: questions_lib.Question
  turns: tuple[Turn, ...]
  slips: tuple[tuple[int, bool], ...] = ()

  @property
  def derailed(self) -> bool:
    """A slip went unnoticed: the answer is the wrong walk's end."""
    return not all(recovered for _, recovered in self.slips)

  @property
  def actions(self) -> list[str]:
    return [t.action for t in self.turns]

  def to_record(self) -> dict[str, Any]:
    """The `sft.jsonl` record: the question's fields plus `actions`, `gold_doc_ids` (null
    where there is none), `detour_turns` and `derailed`."""
    return {**self.question.to_record(), "actions": self.actions,
            "gold_doc_ids": [t.gold_doc_id for t in self.turns],
            "detour_turns": [t.detour for t in self.turns], "derailed": self.derailed}


def search_action(thought: str, query: str) -> str:
  """`<think> thought </think><search> query </search>`."""
  return (f"{protocol.THINK_OPEN} {thought} {protocol.THINK_CLOSE}"
          f"{protocol.SEARCH_OPEN} {query} {protocol.SEARCH_CLOSE}")


def answer_action(thought: str, answer: str) -> str:
  """`<think> thought </think><answer> answer </answer>`."""
  return (f"{protocol.THINK_OPEN} {thought} {protocol.THINK_CLOSE}"
          f"{protocol.ANSWER_OPEN} {answer} {protocol.ANSWER_CLOSE}")


def _search_thought(question: questions_lib.Question, k: int, name: str) -> str:
  """What the oracle thinks before searching hop k's entity, named `name`: the fact just
  read and the next need."""
  need = questions_lib.RELATION_NOUNS[question.relations[k]]
  if k == 0:
    return f"I need the {need} of {name}."
  found = questions_lib.RELATION_NOUNS[question.relations[k - 1]]
  return f"The {found} is {name}. I need its {need}."


# A slip policy: given the hop and the entity the oracle is after, None (no slip) or the
# confusable neighbour it searches instead and whether it recovers.
SlipPolicy = Callable[[int, int], "tuple[int, bool] | None"]


def oracle_turns(world: world_lib.World, question: questions_lib.Question,
                 detour: tuple[str, int, int] | None = None,
                 slip: SlipPolicy | None = None
                 ) -> tuple[tuple[Turn, ...], tuple[tuple[int, bool], ...]]:
  """The oracle's turns for `question`, and its slips: `(hop, recovered)`.

  Args:
    world: the world the question was drawn from.
    question: the question.
    detour: None, or `(kind, k, neighbour_id)`: before search turn k, one sloppy search --
      kind "neighbour" queries entity `neighbour_id` (a confusable neighbour of `e_k`), kind
      "question" (k must be 0, neighbour_id is ignored) queries the raw question.
    slip: None, or called at each hop without a detour with `(k, entity)` (the entity the
      oracle is after): None, or `(neighbour, recovered)`: it searches `neighbour` (a
      confusable neighbour of `entity`) first; recovered, it searches `entity` next, else it
      derails to the neighbour (`Slips`). A neighbour detour is a recovered slip that is not
      counted as one.
  """
  turns: list[Turn] = []
  slips: list[tuple[int, bool]] = []
  entity = question.chain[0]
  for k in range(question.hops):
    name = world.entities[entity].name
    thought = _search_thought(question, k, name)
    neighbour = None  # (a confusable neighbour searched first, whether that is noticed)
    if detour is not None and detour[1] == k:
      kind, _, other = detour
      if kind == "neighbour":
        neighbour = (other, True)
      elif kind == "question" and k == 0:
        turns.append(Turn(search_action(thought, question.question), question.question, None,
                          detour=True))
        thought = f"I should search for {name} by name."
      else:
        raise ValueError(f"bad detour {detour!r}: kind must be one of {DETOUR_KINDS} and a "
                         f"question detour must be at turn 0")
    elif slip is not None:
      neighbour = slip(k, entity)
      if neighbour is not None:
        slips.append((k, neighbour[1]))
    if neighbour is not None:
      other, noticed = neighbour
      if other not in world.neighbours(entity):
        raise ValueError(f"entity {other} is not a confusable neighbour of {entity}")
      wrong = world.entities[other].name
      turns.append(Turn(search_action(thought, wrong), wrong, other, detour=True))
      thought = f"These results are about {wrong}, not {name}."
      if not noticed:
        entity = other  # derailed: the walk goes on from the neighbour
    if neighbour is None or neighbour[1]:
      turns.append(Turn(search_action(thought, name), name, entity))
    entity = world.follow(entity, question.relations[k])
  found = questions_lib.RELATION_NOUNS[question.relations[-1]]
  answer = world.entities[entity].name
  turns.append(Turn(answer_action(f"The {found} is {answer}.", answer), None, None))
  return tuple(turns), tuple(slips)


def oracle_trajectories(world: world_lib.World, questions: list[questions_lib.Question],
                        detour_share: float, seed: int, slips: Slips = Slips()
                        ) -> list[Trajectory]:
  """Oracle trajectories for `questions`; exactly `round(detour_share * len(questions))` of
  them take a detour (half neighbour, half raw question where a neighbour exists) and no
  slip; the others slip per `slips`."""
  if not 0.0 <= detour_share <= 1.0:
    raise ValueError(f"detour_share must be in [0, 1], got {detour_share}")
  rng = random.Random(seed)
  detoured = set(rng.sample(range(len(questions)), round(detour_share * len(questions))))
  trajectories = []
  for i, question in enumerate(questions):
    detour, slip = None, None
    if i in detoured:
      confusable = [k for k in range(question.hops) if world.neighbours(question.chain[k])]
      if confusable and rng.random() < 0.5:
        k = rng.choice(confusable)
        detour = ("neighbour", k, rng.choice(world.neighbours(question.chain[k])))
      else:
        detour = ("question", 0, -1)
    elif slips.slip_rate > 0:
      slip = _slip_policy(world, slips, random.Random(rng.random()))
    trajectories.append(Trajectory(question, *oracle_turns(world, question, detour, slip)))
  return trajectories


def _slip_policy(world: world_lib.World, slips: Slips, rng: random.Random) -> SlipPolicy:
  taken = []

  def slip(k: int, entity: int) -> tuple[int, bool] | None:
    del k
    neighbours = world.neighbours(entity)
    if not neighbours or len(taken) >= slips.max_slips or rng.random() >= slips.slip_rate:
      return None
    taken.append(entity)
    return rng.choice(neighbours), rng.random() < slips.recover_rate

  return slip


def horizon(trajectories: list[Trajectory]) -> dict[str, Any]:
  """The horizon statistics of oracle trajectories: turns and searches (mean, max), the
  share with a detour, slips per hop (the chance hop k slipped, of trajectories that reach
  it) and how they ended (recovered, derailed), and the share that answers right."""
  n = len(trajectories)
  turns = [len(t.turns) for t in trajectories]
  searches = [len(t.turns) - 1 for t in trajectories]
  hops = max(t.question.hops for t in trajectories)
  slipped = [0] * hops
  for t in trajectories:
    for k, _ in t.slips:
      slipped[k] += 1
  reach = [sum(t.question.hops > k for t in trajectories) for k in range(hops)]
  slips = [s for t in trajectories for s in t.slips]
  correct = sum(_ANSWER.search(t.actions[-1]).group(1) in t.question.golden_answers
                for t in trajectories)
  return {
      "trajectories": n,
      "hops": {h: sum(t.question.hops == h for t in trajectories) for h in range(1, hops + 1)},
      "turns": {"mean": sum(turns) / n, "max": max(turns)},
      "searches": {"mean": sum(searches) / n, "max": max(searches)},
      "detoured": sum(any(turn.detour for turn in t.turns) and not t.slips
                      for t in trajectories) / n,
      "slip_rate_by_hop": [s / r if r else 0.0 for s, r in zip(slipped, reach)],
      "slips": len(slips), "recovered": sum(r for _, r in slips),
      "derailed": sum(t.derailed for t in trajectories) / n,
      "answers_right": correct / n,
  }
