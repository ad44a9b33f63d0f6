"""The synthetic world: determinism, functional relations, confusable names, documents."""

import random

import pytest

from pbsd_jax.data import corpus, names, world as world_lib


@pytest.fixture(scope="module")
def world():
  return world_lib.make_world(0)


def test_same_seed_gives_identical_world(world):
  assert world_lib.make_world(0).to_json() == world.to_json()


def test_different_seed_gives_different_names(world):
  other = world_lib.make_world(1)
  assert {e.name for e in other.entities} != {e.name for e in world.entities}


def test_world_has_four_entity_types_and_at_least_six_relations(world):
  assert {e.type for e in world.entities} == set(world_lib.ENTITY_TYPES)
  assert len(world_lib.RELATIONS) >= 6
  sizes = world_lib.WorldSizes()
  assert len(world.of_type("person")) == sizes.people
  assert len(world.of_type("city")) == sizes.countries * sizes.cities_per_country


def test_every_relation_is_a_total_function_into_its_tail_type(world):
  for name, relation in world_lib.RELATIONS.items():
    heads = world.of_type(relation.head)
    assert sorted(world.facts[name]) == heads
    for head in heads:
      assert world.entities[world.follow(head, name)].type == relation.tail


def test_relations_respect_organisation_categories_and_geography(world):
  for person in world.of_type("person"):
    assert world.entities[world.follow(person, "works_for")].attributes["category"] == "company"
    assert world.entities[world.follow(person, "studied_at")].attributes["category"] == (
        "university")
    spouse = world.follow(person, "spouse")
    assert spouse != person and world.follow(spouse, "spouse") == person
  for country in world.of_type("country"):
    assert world.follow(world.follow(country, "capital"), "located_in") == country
  mayors = [world.follow(c, "mayor") for c in world.of_type("city")]
  assert len(set(mayors)) == len(mayors)


def test_entity_names_are_unique(world):
  all_names = [e.name for e in world.entities]
  assert len(set(all_names)) == len(all_names)


def test_edit_distance_matches_hand_computed_values():
  assert names.edit_distance("kitten", "sitting") == 3
  assert names.edit_distance("Velora Quint", "Velora Quinn") == 1
  assert names.edit_distance("Velora Quint", "Valora Quinn") == 2
  assert names.edit_distance("", "abc") == 3
  assert names.edit_distance("abc", "abc") == 0


def test_confusable_families_are_one_or_two_edits_apart(world):
  assert len(world.families) >= 40
  for family in world.families:
    family_names = [world.entities[i].name for i in family]
    types = {world.entities[i].type for i in family}
    assert len(types) == 1
    for a in family_names:
      for b in family_names:
        if a != b:
          assert 1 <= names.edit_distance(a, b) <= 2, (a, b)


def test_every_entity_type_has_confusable_neighbours(world):
  types = {world.entities[f[0]].type for f in world.families}
  assert types == set(world_lib.ENTITY_TYPES)


def test_neighbours_are_the_rest_of_the_family(world):
  family = world.families[0]
  assert world.neighbours(family[0]) == family[1:]
  loners = [e.id for e in world.entities if not any(e.id in f for f in world.families)]
  assert world.neighbours(loners[0]) == ()


def test_variants_change_exactly_one_character():
  rng = random.Random(0)
  for word in ("Velora", "Quint", "Dunmere", "Talvoria", "Hewa"):
    for variant in (names.vowel_variant(word, rng), names.ending_variant(word, rng)):
      assert len(variant) == len(word)
      assert sum(a != b for a, b in zip(word, variant)) == 1


def test_world_json_round_trips(world):
  again = world_lib.World.from_json(world.to_json())
  assert again == world


def test_country_answers_include_the_official_alias(world):
  country = world.of_type("country")[0]
  name = world.entities[country].name
  assert world.answers(country) == [name, f"Republic of {name}"]


def test_each_document_starts_with_its_title_and_states_every_outgoing_fact(world):
  records = corpus.corpus_records(world)
  assert [r["id"] for r in records] == [str(i) for i in range(len(world.entities))]
  for entity, record in zip(world.entities, records):
    assert record["title"] == entity.name
    assert record["contents"].startswith(entity.name + "\n" + entity.name)
    for relation, table in world.facts.items():
      if entity.id in table:
        assert world.entities[table[entity.id]].name in record["contents"], (relation, record)


def test_odd_number_of_people_is_rejected():
  with pytest.raises(ValueError, match="WorldSizes.people"):
    world_lib.WorldSizes(people=31)


def test_inconsistent_facts_are_rejected(world):
  facts = {r: dict(t) for r, t in world.facts.items()}
  del facts["born_in"][world.of_type("person")[0]]
  with pytest.raises(ValueError, match="born_in"):
    world_lib.World(world.seed, world.entities, facts, world.families)
