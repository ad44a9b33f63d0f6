"""The synthetic knowledge graph: a seeded, fictional, Wikipedia-like world.

Four entity types (person, city, country, organisation) and nine relations. Every relation is
a *function* of its head: each entity of the head type has exactly one tail, so any chain of
relations from a named entity has exactly one answer. Entity ids are 0..N-1 and double as the
row of the entity's document in the corpus.

    person        born_in -> city, works_for -> organisation (a company),
                  studied_at -> organisation (a university), spouse -> person
    organisation  headquartered_in -> city, founded_by -> person
    city          located_in -> country, mayor -> person
    country       capital -> city (one of its own cities)
"""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Any

from pbsd_jax.data import names as names_lib

PERSON, CITY, COUNTRY, ORGANISATION = "person", "city", "country", "organisation"
ENTITY_TYPES = (PERSON, CITY, COUNTRY, ORGANISATION)


@dataclasses.dataclass(frozen=True)
class Relation:
  """A functional relation from entities of type `head` to entities of type `tail`."""
  name: str
  head: str
  tail: str


RELATIONS: dict[str, Relation] = {r.name: r for r in (
    Relation("born_in", PERSON, CITY),
    Relation("works_for", PERSON, ORGANISATION),
    Relation("studied_at", PERSON, ORGANISATION),
    Relation("spouse", PERSON, PERSON),
    Relation("headquartered_in", ORGANISATION, CITY),
    Relation("founded_by", ORGANISATION, PERSON),
    Relation("located_in", CITY, COUNTRY),
    Relation("mayor", CITY, PERSON),
    Relation("capital", COUNTRY, CITY),
)}

_COMPANY_SUFFIXES = ("Labs", "Works", "Dynamics", "Holdings", "Foundry", "Systems")
_UNIVERSITY_SUFFIXES = ("Institute", "College", "Academy", "University")
_OCCUPATIONS = ("painter", "engineer", "historian", "botanist", "lawyer", "chemist",
                "architect", "journalist", "surgeon", "composer", "economist", "sailor")
_HOBBIES = ("chess", "rowing", "poetry", "gardening", "astronomy", "fencing", "pottery",
            "cycling", "birdwatching", "sailing")
_INDUSTRIES = ("shipping", "textile", "software", "mining", "glassware", "aviation",
               "publishing", "pharmaceutical", "railway", "brewing")
_FIELDS = ("medicine", "law", "mathematics", "music", "geology", "philosophy", "engineering")
_CITY_FEATURES = ("harbour", "old bridge", "clock tower", "markets", "canals", "cathedral",
                  "gardens", "lighthouse")
_EXPORTS = ("timber", "copper", "wool", "salt", "tea", "marble", "wine", "fish")


@dataclasses.dataclass(frozen=True)
class Entity:
  """One entity. `aliases` are other acceptable answer strings; `attributes` hold the
  filler facts of its document (occupation, pronoun, year, ...), never used by questions."""
  id: int
  type: str
  name: str
  aliases: tuple[str, ...] = ()
  attributes: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class WorldSizes:
  """How many entities of each kind; `family_rate` is the chance a base name gets
  confusable variants."""
  countries: int = 8
  cities_per_country: int = 4
  companies: int = 40
  universities: int = 16
  people: int = 320
  family_rate: float = 0.4

  def __post_init__(self):
    for field in ("countries", "cities_per_country", "companies", "universities", "people"):
      if getattr(self, field) < 1:
        raise ValueError(f"WorldSizes.{field} must be positive, got {getattr(self, field)}")
    if self.people % 2:
      raise ValueError(f"WorldSizes.people must be even (spouses come in pairs), "
                       f"got {self.people}")
    if self.people < self.countries * self.cities_per_country:
      raise ValueError("WorldSizes.people must be at least the number of cities "
                       "(every city has its own mayor)")
    if not 0.0 <= self.family_rate <= 1.0:
      raise ValueError(f"WorldSizes.family_rate must be in [0, 1], got {self.family_rate}")


@dataclasses.dataclass(frozen=True)
class World:
  """The knowledge graph.

  Attributes:
    seed: the generator seed.
    entities: entity `i` is `entities[i]` (its document is corpus row `i`).
    facts: `facts[relation][head_id] = tail_id` for every entity of the head type.
    families: groups of entity ids with confusable names (character edit distance <= 2).
  """
  seed: int
  entities: tuple[Entity, ...]
  facts: dict[str, dict[int, int]]
  families: tuple[tuple[int, ...], ...]

  def __post_init__(self):
    for relation, table in self.facts.items():
      spec = RELATIONS[relation]
      heads = set(self.of_type(spec.head))
      if set(table) != heads:
        raise ValueError(f"relation {relation!r} is not total on its {spec.head} heads")
      for head, tail in table.items():
        if self.entities[tail].type != spec.tail:
          raise ValueError(f"relation {relation!r} maps {head} to a {self.entities[tail].type}")
    names = [e.name for e in self.entities]
    if len(set(names)) != len(names):
      raise ValueError("entity names must be unique")

  def of_type(self, entity_type: str) -> list[int]:
    """Ids of all entities of `entity_type`, ascending."""
    return [e.id for e in self.entities if e.type == entity_type]

  def follow(self, head: int, relation: str) -> int:
    """The unique tail of `relation` from entity `head`."""
    table = self.facts[relation]
    if head not in table:
      raise ValueError(f"entity {head} ({self.entities[head].type}) has no {relation!r} fact")
    return table[head]

  def walk(self, start: int, relations: tuple[str, ...]) -> tuple[int, ...]:
    """The chain `(start, e_1, ..., e_h)` reached by following `relations` in order."""
    chain = [start]
    for relation in relations:
      chain.append(self.follow(chain[-1], relation))
    return tuple(chain)

  def neighbours(self, entity_id: int) -> tuple[int, ...]:
    """Other entities whose names are confusable with this one's (its family, minus itself)."""
    for family in self.families:
      if entity_id in family:
        return tuple(i for i in family if i != entity_id)
    return ()

  def answers(self, entity_id: int) -> list[str]:
    """Acceptable answer strings for an entity: its name, then its aliases."""
    entity = self.entities[entity_id]
    return [entity.name, *entity.aliases]

  def to_json(self) -> dict[str, Any]:
    """A JSON-serialisable dict (the `world.json` file); `from_json` inverts it."""
    return {
        "seed": self.seed,
        "entities": [{"id": e.id, "type": e.type, "name": e.name, "aliases": list(e.aliases),
                      "attributes": dict(sorted(e.attributes.items()))}
                     for e in self.entities],
        "facts": [{"head": head, "relation": relation, "tail": tail}
                  for relation in RELATIONS for head, tail in sorted(
                      self.facts[relation].items())],
        "families": [list(f) for f in self.families],
    }

  @classmethod
  def from_json(cls, data: dict[str, Any]) -> World:
    """Rebuilds a `World` from `to_json()` output."""
    entities = tuple(Entity(e["id"], e["type"], e["name"], tuple(e["aliases"]),
                            dict(e["attributes"])) for e in data["entities"])
    facts: dict[str, dict[int, int]] = {r: {} for r in RELATIONS}
    for fact in data["facts"]:
      facts[fact["relation"]][fact["head"]] = fact["tail"]
    return cls(data["seed"], entities, facts, tuple(tuple(f) for f in data["families"]))


def load_world(path: str) -> World:
  """Reads a `world.json` written by `make_dataset`."""
  with open(path) as f:
    return World.from_json(json.load(f))


def make_world(seed: int, sizes: WorldSizes = WorldSizes()) -> World:
  """Generates the world deterministically from `seed` (same seed -> identical world)."""
  rng = random.Random(seed)
  maker = names_lib.NameMaker(rng)
  num_cities = sizes.countries * sizes.cities_per_country
  country_names, country_families = maker.countries(sizes.countries, sizes.family_rate)
  city_names, city_families = maker.cities(num_cities, sizes.family_rate)
  company_names, company_families = maker.organisations(
      sizes.companies, _COMPANY_SUFFIXES, sizes.family_rate)
  university_names, university_families = maker.organisations(
      sizes.universities, _UNIVERSITY_SUFFIXES, sizes.family_rate)
  person_names, person_families = maker.people(sizes.people, sizes.family_rate)

  entities: list[Entity] = []

  def add(entity_type, name, aliases=(), **attributes):
    entities.append(Entity(len(entities), entity_type, name, aliases, attributes))
    return len(entities) - 1

  countries = [add(COUNTRY, n, (f"Republic of {n}",), export=rng.choice(_EXPORTS),
                   population=str(rng.randrange(2, 60)))
               for n in country_names]
  cities = [add(CITY, n, feature=rng.choice(_CITY_FEATURES),
                population=str(rng.randrange(20, 900)))
            for n in city_names]
  companies = [add(ORGANISATION, n, category="company", industry=rng.choice(_INDUSTRIES),
                   year=str(rng.randrange(1820, 2010)),
                   employees=str(rng.randrange(2, 90) * 100))
               for n in company_names]
  universities = [add(ORGANISATION, n, category="university", field=rng.choice(_FIELDS),
                      year=str(rng.randrange(1600, 1990)))
                  for n in university_names]
  people = [add(PERSON, n, pronoun=rng.choice(("He", "She")),
                occupation=rng.choice(_OCCUPATIONS), hobby=rng.choice(_HOBBIES),
                year=str(rng.randrange(1930, 2000)))
            for n in person_names]

  facts: dict[str, dict[int, int]] = {r: {} for r in RELATIONS}
  # Each country owns `cities_per_country` cities, in shuffled order; its capital is one.
  shuffled = rng.sample(cities, len(cities))
  for k, country in enumerate(countries):
    own = shuffled[k * sizes.cities_per_country:(k + 1) * sizes.cities_per_country]
    for city in own:
      facts["located_in"][city] = country
    facts["capital"][country] = rng.choice(own)
  for city, mayor in zip(cities, rng.sample(people, len(cities))):
    facts["mayor"][city] = mayor
  for org in companies + universities:
    facts["headquartered_in"][org] = rng.choice(cities)
    facts["founded_by"][org] = rng.choice(people)
  for person in people:
    facts["born_in"][person] = rng.choice(cities)
    facts["works_for"][person] = rng.choice(companies)
    facts["studied_at"][person] = rng.choice(universities)
  order = rng.sample(people, len(people))
  for a, b in zip(order[0::2], order[1::2]):
    facts["spouse"][a], facts["spouse"][b] = b, a

  id_of = {e.name: e.id for e in entities}
  families = tuple(tuple(id_of[n] for n in family) for family in
                   country_families + city_families + company_families +
                   university_families + person_families)
  return World(seed, tuple(entities), facts, families)
