"""Oracle trajectories: exact-title queries along the gold chain, detours, slips, protocol
form, horizon statistics."""

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
  assert oracle.oracle_turns(world, q)[0] == (
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


def _two_hop_with_neighbours(world):
  """A works_for / headquartered_in question whose person has a confusable neighbour whose
  employer's headquarters differ (a derailment then answers wrong)."""
  for person in world.of_type("person"):
    for other in world.neighbours(person):
      if (world.walk(other, ("works_for", "headquartered_in"))[-1]
          != world.walk(person, ("works_for", "headquartered_in"))[-1]):
        return questions.make_question(world, person, ("works_for", "headquartered_in")), other
  raise AssertionError("no such person")


def test_a_recovered_slip_costs_one_turn_and_keeps_the_chain(world):
  q, other = _two_hop_with_neighbours(world)
  p, org, city = q.chain_names
  wrong = world.entities[other].name
  turns, slips = oracle.oracle_turns(world, q, slip=lambda k, e: (other, True) if k == 0 else None)
  assert slips == ((0, True),)
  assert [t.action for t in turns] == [
      f"<think> I need the employer of {p}. </think><search> {wrong} </search>",
      f"<think> These results are about {wrong}, not {p}. </think><search> {p} </search>",
      f"<think> The employer is {org}. I need its headquarters. </think><search> {org} </search>",
      f"<think> The headquarters is {city}. </think><answer> {city} </answer>"]
  assert [t.detour for t in turns] == [True, False, False, False]
  assert [t.gold_doc_id for t in turns] == [other, q.chain[0], q.chain[1], None]


def test_a_derailed_trajectory_follows_the_neighbour_and_answers_wrong(world):
  q, other = _two_hop_with_neighbours(world)
  p = q.chain_names[0]
  wrong = world.entities[other].name
  _, org2, city2 = world.walk(other, q.relations)
  org_name, city_name = world.entities[org2].name, world.entities[city2].name
  turns, slips = oracle.oracle_turns(world, q, slip=lambda k, e: (other, False) if k == 0 else None)
  trajectory = oracle.Trajectory(q, turns, slips)
  assert trajectory.derailed and city_name not in q.golden_answers
  assert [t.action for t in turns] == [
      f"<think> I need the employer of {p}. </think><search> {wrong} </search>",
      f"<think> The employer is {org_name}. I need its headquarters. </think>"
      f"<search> {org_name} </search>",
      f"<think> The headquarters is {city_name}. </think><answer> {city_name} </answer>"]
  assert trajectory.to_record()["derailed"] is True


def test_slip_rates_and_the_cap_hold_over_many_trajectories():
  world = world_lib.make_world(1, world_lib.WorldSizes(family_rate=1.0))
  qs = splits_lib.make_splits(world, 1)["sft"]
  slips = oracle.Slips(slip_rate=0.3, recover_rate=0.5, max_slips=2)
  trajectories = oracle.oracle_trajectories(world, qs, detour_share=0.0, seed=1, slips=slips)
  eligible = taken = recovered = 0
  for t in trajectories:
    assert len(t.slips) <= 2 and [k for k, _ in t.slips] == sorted({k for k, _ in t.slips})
    # Replay the walk: each hop's entity is the one its (last) search names, and the answer
    # is the last searched entity's fact.
    searched = [turn.gold_doc_id for turn in t.turns[:-1]]
    slipped = dict(t.slips)
    entity, i = t.question.chain[0], 0
    for k, relation in enumerate(t.question.relations):
      cap_left = sum(1 for h in slipped if h < k) < 2
      eligible += bool(world.neighbours(entity)) and cap_left
      if k in slipped:
        taken += 1
        recovered += slipped[k]
        assert searched[i] in world.neighbours(entity)
        i += 1
        if not slipped[k]:
          entity = searched[i - 1]
      if k not in slipped or slipped[k]:
        assert searched[i] == entity
        i += 1
      entity = world.follow(entity, relation)
    answer = world.entities[entity].name
    assert t.actions[-1].endswith(f"<answer> {answer} </answer>")
    assert (answer in t.question.golden_answers) == (entity == t.question.chain[-1])
    assert t.derailed == (not all(slipped.values()))
  assert abs(taken / eligible - 0.3) < 0.03, (taken, eligible)
  assert abs(recovered / taken - 0.5) < 0.05, (recovered, taken)


def test_horizon_statistics_by_hand(world):
  q, other = _two_hop_with_neighbours(world)
  q1 = questions.make_question(world, world.of_type("person")[1], ("born_in",))
  trajectories = [
      oracle.Trajectory(q, *oracle.oracle_turns(world, q, slip=lambda k, e: (other, True)
                                                if k == 0 else None)),
      oracle.Trajectory(q, *oracle.oracle_turns(world, q, slip=lambda k, e: (other, False)
                                                if k == 0 else None)),
      oracle.Trajectory(q1, *oracle.oracle_turns(world, q1)),
  ]
  h = oracle.horizon(trajectories)
  # Turns 4, 3, 2; searches 3, 2, 1; hop 0 slipped in 2 of 3, hop 1 in 0 of 2.
  assert h["trajectories"] == 3 and h["hops"] == {1: 1, 2: 2}
  assert h["turns"] == {"mean": 3.0, "max": 4} and h["searches"] == {"mean": 2.0, "max": 3}
  assert h["slip_rate_by_hop"] == [2 / 3, 0.0]
  assert (h["slips"], h["recovered"]) == (2, 1)
  assert h["derailed"] == 1 / 3 and h["answers_right"] == 2 / 3 and h["detoured"] == 0.0


def test_the_default_oracle_does_not_slip(trajectories):
  assert all(not t.slips and not t.derailed for t in trajectories)
  assert oracle.horizon(trajectories)["answers_right"] == 1.0
