"""One encyclopedia-style document per entity, in the Search-R1 corpus format.

A document states its entity's *outgoing* facts (so reading the document of the i-th entity
of a chain gives the (i+1)-th) plus a filler sentence. It starts with its title, the entity's
exact name, and names the entity again in the first sentence, so a query that is exactly the
name ranks the entity's own document first under BM25. Corpus row `i` is entity `i`.
"""

from __future__ import annotations

from pbsd_jax.data import world as world_lib


def _article(word: str) -> str:
  """"a" or "an" for the words of our filler lists (none starts with a "you"-sounding u)."""
  return "an" if word[0] in "aeio" else "a"


def document_text(world: world_lib.World, entity_id: int) -> str:
  """The body of entity `entity_id`'s document (without the title line)."""
  e = world.entities[entity_id]
  a = e.attributes
  name_of = lambda relation: world.entities[world.follow(entity_id, relation)].name
  if e.type == world_lib.PERSON:
    p = a["pronoun"]
    job = a["occupation"]
    return (f"{e.name} is {_article(job)} {job} born in {name_of('born_in')} in {a['year']}. "
            f"{p} works for {name_of('works_for')} and studied at {name_of('studied_at')}. "
            f"{p} is married to {name_of('spouse')}. {p} enjoys {a['hobby']}.")
  if e.type == world_lib.ORGANISATION:
    if a["category"] == "company":
      kind, filler = f"{a['industry']} company", f"It employs about {a['employees']} people."
    else:
      kind, filler = "university", f"It is known for its {a['field']} programme."
    return (f"{e.name} is {_article(kind)} {kind} headquartered in "
            f"{name_of('headquartered_in')}. It was founded by {name_of('founded_by')} in "
            f"{a['year']}. {filler}")
  if e.type == world_lib.CITY:
    return (f"{e.name} is a city in {name_of('located_in')}. Its mayor is {name_of('mayor')}. "
            f"The city has about {a['population']} thousand inhabitants and is known for its "
            f"{a['feature']}.")
  if e.type == world_lib.COUNTRY:
    return (f"{e.name}, officially the {e.aliases[0]}, is a country whose capital is "
            f"{name_of('capital')}. It has about {a['population']} million inhabitants and its "
            f"main export is {a['export']}.")
  raise ValueError(f"entity {entity_id} has unknown type {e.type!r}")


def corpus_records(world: world_lib.World) -> list[dict[str, str]]:
  """The corpus: `[{"id": str(i), "title": name_i, "contents": name_i + "\\n" + text_i}]`.

  `id` is the row index as a string (Search-R1 convention); `contents` is title, newline,
  body, which is what Search-R1's retrieval server returns and its prompts show.
  """
  return [{"id": str(e.id), "title": e.name,
           "contents": f"{e.name}\n{document_text(world, e.id)}"} for e in world.entities]
