"""Oracle trajectories: exact-title queries along the gold chain, detours, protocol form."""

import re

import pytest

from pbsd_jax.data import corpus, names, oracle, questions, splits as splits_lib, world as world_lib

_SEARCH = re.compile(r"^<think> (.+?) </think><search> (.+?) </search>$")
_ANSWER = re.compile(r"^<think> (.+?) </think><answer> (.+?) </answer>$")


@pytest.fixture(scope="module")
def world():
  return world_lib.make_world(0)


@pytest.fixture(scope="module")
def sft_questions(world):
  return splits_lib.make_splits(world, 0)["sft"]


@pytest.fixture(scope="module")
def trajectories(world, sft_questions):
  return oracle.oracle_trajectories(world, sft_questions, detour_share=0.15, seed=0)


def test_hand_written_two_hop_trajectory(world):
  person = world.of_type("person")[0]
  q = questions.make_question(world, person, ("works_for", "headquartered_in"))
  p, org, city = q.chain_names
  assert oracle.oracle_turns(world, q) == (
      oracle.Turn(f"<think> I need the employer of {p}. </think><search> {p} </search>", p,
                  q.chain[0]),
      oracle.Turn(f"<think> The employer is {org}. I need its headquarters. </think>"
                  f"<search> {org} </search>", org, q.chain[1]),
      oracle.Turn(f"<think> The headquarters is {city}. </think><answer> {city} </answer>",
                  None, None),
  )


def test_every_action_is_one_well_formed_protocol_turn(trajectories):
  for t in trajectories:
    *searches, answer = t.actions
    for action in searches:
      assert _SEARCH.match(action), action
    assert _ANSWER.match(answer), answer


def test_every_search_query_is_the_exact_title_of_its_gold_doc(world, trajectories):
  titles = [r["title"] for r in corpus.corpus_records(world)]
  checked = 0
  for t in trajectories:
    for turn in t.turns:
      if turn.gold_doc_id is not None:
        assert _SEARCH.match(turn.action).group(2) == turn.query == titles[turn.gold_doc_id]
        checked += 1
  assert checked > len(trajectories)


def test_correct_searches_walk_the_gold_chain_and_the_answer_is_gold(trajectories):
  for t in trajectories:
    good = [turn.gold_doc_id for turn in t.turns if turn.query is not None and not turn.detour]
    assert good == list(t.question.chain[:-1])
    assert _ANSWER.match(t.actions[-1]).group(2) == t.question.golden_answers[0]
    assert t.turns[-1].query is None and t.turns[-1].gold_doc_id is None


def test_detour_share_is_exactly_the_configured_share(trajectories):
  detoured = sum(any(turn.detour for turn in t.turns) for t in trajectories)
  assert detoured == round(0.15 * len(trajectories)) == 300
  assert all(sum(turn.detour for turn in t.turns) <= 1 for t in trajectories)


@pytest.mark.parametrize("share", [0.0, 1.0])
def test_detour_share_extremes(world, sft_questions, share):
  trajectories = oracle.oracle_trajectories(world, sft_questions[:200], share, seed=3)
  assert sum(any(turn.detour for turn in t.turns) for t in trajectories) == 200 * share


def test_both_detour_kinds_occur(trajectories):
  kinds = {("neighbour" if turn.gold_doc_id is not None else "question")
           for t in trajectories for turn in t.turns if turn.detour}
  assert kinds == {"neighbour", "question"}


def test_detour_is_followed_by_the_correct_query_for_the_same_entity(world, trajectories):
  for t in trajectories:
    for k, turn in enumerate(t.turns):
      if not turn.detour:
        continue
      recovery = t.turns[k + 1]
      assert not recovery.detour and recovery.gold_doc_id is not None
      target = world.entities[recovery.gold_doc_id].name
      if turn.gold_doc_id is None:  # A raw-question detour, only ever at the first turn.
        assert k == 0 and turn.query == t.question.question
      else:  # A confusable neighbour: one or two characters away from the right name.
        assert turn.gold_doc_id in world.neighbours(recovery.gold_doc_id)
        assert 1 <= names.edit_distance(turn.query, target) <= 2
        assert f"about {turn.query}, not {target}" in recovery.action


def test_each_thought_reports_the_fact_just_read(trajectories):
  for t in trajectories[:300]:
    if any(turn.detour for turn in t.turns):
      continue  # A detour's recovery turn talks about the detour instead.
    for k in range(1, len(t.turns)):
      noun = questions.RELATION_NOUNS[t.question.relations[k - 1]]
      assert f"The {noun} is {t.question.chain_names[k]}." in t.actions[k]


def test_bad_detour_is_rejected(world, sft_questions):
  q = next(q for q in sft_questions if q.hops >= 2)
  with pytest.raises(ValueError, match="turn 0"):
    oracle.oracle_turns(world, q, ("question", 1, -1))
  stranger = next(e.id for e in world.entities if e.id not in q.chain
                  and e.id not in world.neighbours(q.chain[0]))
  with pytest.raises(ValueError, match="not a confusable neighbour"):
    oracle.oracle_turns(world, q, ("neighbour", 0, stranger))


def test_sft_record_lists_are_parallel(trajectories):
  record = trajectories[0].to_record()
  assert len(record["actions"]) == len(record["gold_doc_ids"]) == len(record["detour_turns"])
  assert record["question"] == trajectories[0].question.question
