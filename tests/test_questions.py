"""Multi-hop questions and splits: verified answers, sizes, disjointness, OOD tiers."""

import collections
import re

import pytest

from pbsd_jax.data import questions, splits as splits_lib, world as world_lib


@pytest.fixture(scope="module")
def world():
  return world_lib.make_world(0)


@pytest.fixture(scope="module")
def splits(world):
  return splits_lib.make_splits(world, 0)


def _all(splits):
  return [q for split in splits.values() for q in split]


def test_render_nests_noun_phrases_innermost_first():
  text = questions.render("Velora Quint", ("works_for", "headquartered_in", "located_in"))
  assert text == "In which country is the headquarters of the employer of Velora Quint?"
  assert questions.render("Dunmere", ("mayor",)) == "Who is the mayor of Dunmere?"


def test_relation_path_counts_match_hand_count():
  # 1 hop: the 9 relations. 2 hops: person-valued (spouse, founded_by, mayor) x 4 person
  # relations - spouse.spouse = 11; city-valued (born_in, headquartered_in, capital) x 2
  # - capital.located_in = 5; org-valued 2 x 2 = 4; country-valued 1 x 1 = 1. Total 21.
  assert len(questions.relation_paths(1)) == 9
  assert len(questions.relation_paths(2)) == 21


def test_relation_paths_are_type_consistent():
  for path in questions.relation_paths(4):
    for a, b in zip(path, path[1:]):
      assert world_lib.RELATIONS[a].tail == world_lib.RELATIONS[b].head


def test_golden_answer_is_the_chain_end_rederived_from_the_world(world, splits):
  for q in _all(splits):
    chain = world.walk(q.chain[0], q.relations)
    assert chain == q.chain
    assert list(q.golden_answers) == world.answers(chain[-1])
    assert q.chain_names == tuple(world.entities[i].name for i in chain)
    assert q.question == questions.render(q.chain_names[0], q.relations)


def test_the_only_entity_named_in_a_question_is_the_chain_start(world, splits):
  # With unique names and functional relations, the text alone then determines the answer.
  patterns = [(e.id, re.compile(rf"(?<!\w){re.escape(e.name)}(?!\w)")) for e in world.entities]
  for q in _all(splits)[::6]:
    named = [i for i, pattern in patterns if pattern.search(q.question)]
    assert named == [q.chain[0]], q.question


def test_chains_never_revisit_an_entity(splits):
  for q in _all(splits):
    assert len(set(q.chain)) == len(q.chain)


def test_split_sizes_match_the_paper_and_config(splits):
  sizes = {name: len(split) for name, split in splits.items()}
  assert sizes == {"rl_train": 575, "rl_validation": 200, "sft": 2000, "ood": 300,
                   "ood_pool": 1500}


def test_no_question_appears_in_two_splits(splits):
  seen = {}
  for name, split in splits.items():
    for q in split:
      assert q.question not in seen, (q.question, seen.get(q.question), name)
      seen[q.question] = name


def test_in_domain_questions_have_one_to_four_hops_and_no_heldout_bigram(splits):
  heldout = set(splits_lib.SplitSizes().heldout_bigrams)
  for name in ("rl_train", "rl_validation", "sft"):
    hops = collections.Counter(q.hops for q in splits[name])
    assert set(hops) == {1, 2, 3, 4}, (name, hops)
    for q in splits[name]:
      assert q.tier == ""
      assert not heldout & set(zip(q.relations, q.relations[1:]))


def test_ood_tiers_are_balanced_and_follow_their_definition(splits):
  heldout = set(splits_lib.SplitSizes().heldout_bigrams)
  ood = splits["ood"]
  assert collections.Counter(q.tier for q in ood) == {"easy": 100, "medium": 100, "hard": 100}
  for q in ood:
    bigrams = set(zip(q.relations, q.relations[1:]))
    if q.tier == "easy":
      assert q.hops == 2 and q.relations in heldout
    elif q.tier == "medium":
      assert q.hops in (3, 4) and bigrams & heldout
    else:
      assert q.hops == 5


def test_the_stratification_pool_holds_a_third_of_each_harder_kind(world, splits):
  heldout = set(splits_lib.SplitSizes().heldout_bigrams)
  pool = splits["ood_pool"]
  assert collections.Counter(q.tier for q in pool) == {"long": 500, "unseen": 500,
                                                        "longest": 500}
  for q in pool:
    bigrams = set(zip(q.relations, q.relations[1:]))
    if q.tier == "long":
      assert q.hops in (3, 4) and not bigrams & heldout
    elif q.tier == "unseen":
      assert q.hops in (2, 3, 4) and bigrams & heldout
    else:
      assert q.hops == 5
  # Drawn last: the other splits are those of a world without a pool.
  without = splits_lib.make_splits(world, 0, splits_lib.SplitSizes(ood_pool=0))
  assert without["ood_pool"] == [] and all(
      [q.question for q in without[k]] == [q.question for q in splits[k]]
      for k in ("rl_train", "rl_validation", "sft", "ood"))
  # Sizes that are not a multiple of 3 give the remainder to the last kinds.
  assert collections.Counter(q.tier for q in splits_lib.make_splits(
      world, 0, splits_lib.SplitSizes(ood_pool=8))["ood_pool"]) == {
          "long": 2, "unseen": 3, "longest": 3}


def test_same_seed_gives_same_splits(world, splits):
  again = splits_lib.make_splits(world, 0)
  assert {k: [q.question for q in v] for k, v in again.items()} == {
      k: [q.question for q in v] for k, v in splits.items()}


def test_too_small_world_for_the_split_sizes_fails_clearly():
  tiny = world_lib.make_world(0, world_lib.WorldSizes(
      countries=2, cities_per_country=1, companies=1, universities=1, people=2))
  with pytest.raises(ValueError, match="could not draw"):
    splits_lib.make_splits(tiny, 0)


def test_hard_tier_must_be_longer_than_in_domain_chains():
  with pytest.raises(ValueError, match="ood_hard_hops"):
    splits_lib.SplitSizes(hop_weights=(1, 1, 1, 1), ood_hard_hops=4)


def test_heldout_bigram_must_compose():
  with pytest.raises(ValueError, match="cannot follow"):
    splits_lib.SplitSizes(heldout_bigrams=(("born_in", "works_for"),))


def test_long_horizon_splits_draw_the_configured_hops():
  """configs/long_horizon.py's shape at test size: 4-8 hops in domain, a 10-hop hard tier,
  the pool's long kind the two longest in-domain hop counts."""
  world = world_lib.make_world(0, world_lib.WorldSizes(
      countries=16, cities_per_country=6, companies=120, universities=40, people=1200,
      family_rate=0.95))
  sizes = splits_lib.SplitSizes(rl_train=60, rl_validation=20, sft=100, ood_per_tier=10,
                                ood_pool=30, hop_weights=(0, 0, 0, 1, 1, 1, 1, 1),
                                ood_hard_hops=10)
  got = splits_lib.make_splits(world, 0, sizes)
  in_domain = got["rl_train"] + got["rl_validation"] + got["sft"]
  assert {q.hops for q in in_domain} == {4, 5, 6, 7, 8}
  assert {q.hops for q in got["ood"] if q.tier == "hard"} == {10}
  assert {q.hops for q in got["ood_pool"] if q.tier == "long"} == {7, 8}
  assert {q.hops for q in got["ood_pool"] if q.tier == "longest"} == {10}
  for q in in_domain + got["ood"] + got["ood_pool"]:
    assert world.walk(q.chain[0], q.relations) == q.chain and len(set(q.chain)) == len(q.chain)
