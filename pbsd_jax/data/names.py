"""Invented, deliberately confusable names for the synthetic world.

Names are built from syllables, so no pretrained model can know the entities without
searching. Some names come in *families*: a base name plus variants one character away
("Velora Quint", "Velora Quinn", "Valora Quint"), so that a sloppy query retrieves a
confusable neighbour instead of the entity asked about. Every full name is unique, and a
word of one base name never reappears in another base name, so the only near-duplicates are
the designed ones.
"""

from __future__ import annotations

import random

_ONSETS = ("b", "br", "c", "d", "dr", "f", "g", "gr", "h", "k", "l", "m", "n", "p", "r", "s",
           "st", "t", "tr", "v", "z", "th", "sh", "qu", "j", "w")
_VOWELS = ("a", "e", "i", "o", "u")
_FIRST_ENDINGS = ("", "", "n", "r", "l", "s")
_SURNAME_CODAS = ("nt", "nn", "rk", "l", "n", "ss", "th", "x", "rd", "m", "ck", "ld")
_PLACE_ENDINGS = ("mere", "ford", "holm", "ton", "wick", "dale", "port", "stead")
_COUNTRY_ENDINGS = ("ria", "via", "land", "mar", "stan", "nia", "dor")
_CONSONANTS = "bdfgklmnprstvz"


def _syllable(rng: random.Random) -> str:
  return rng.choice(_ONSETS) + rng.choice(_VOWELS)


def _first_name(rng: random.Random) -> str:
  return (_syllable(rng) + _syllable(rng) + rng.choice(_FIRST_ENDINGS)).capitalize()


def _surname(rng: random.Random) -> str:
  core = _syllable(rng) + rng.choice(_SURNAME_CODAS)
  if rng.random() < 0.3:
    core += rng.choice(_VOWELS) + rng.choice("nrls")
  return core.capitalize()


def _place_word(rng: random.Random) -> str:
  return (_syllable(rng) + rng.choice("nrl") + rng.choice(_PLACE_ENDINGS)).capitalize()


def _country_word(rng: random.Random) -> str:
  return (_syllable(rng) + _syllable(rng) + rng.choice(_COUNTRY_ENDINGS)).capitalize()


def _org_word(rng: random.Random) -> str:
  return (_syllable(rng) + rng.choice(_SURNAME_CODAS) + rng.choice(("", "o", "a"))).capitalize()


def vowel_variant(word: str, rng: random.Random) -> str:
  """`word` with one vowel replaced by a different vowel (character edit distance 1)."""
  # The "u" of "qu" is part of the consonant, not a vowel to swap.
  positions = [i for i, c in enumerate(word)
               if c.lower() in _VOWELS and not (i and word[i - 1].lower() == "q")]
  i = rng.choice(positions)
  new = rng.choice([v for v in _VOWELS if v != word[i].lower()])
  if word[i].isupper():
    new = new.upper()
  return word[:i] + new + word[i + 1:]


def ending_variant(word: str, rng: random.Random) -> str:
  """`word` with its last consonant replaced by another (character edit distance 1); a word
  without a replaceable consonant gets a vowel variant instead."""
  positions = [i for i, c in enumerate(word) if c in _CONSONANTS]
  if not positions:
    return vowel_variant(word, rng)
  i = positions[-1]
  new = rng.choice([c for c in _CONSONANTS if c != word[i]])
  return word[:i] + new + word[i + 1:]


class NameMaker:
  """Draws unique names of each kind; `families` records the designed confusable groups.

  A family is a tuple of full names at character edit distance 1 or 2 from each other.
  """

  def __init__(self, rng: random.Random):
    self._rng = rng
    self._names: set[str] = set()
    self._words: set[str] = set()

  def _fresh(self, draw) -> str:
    for _ in range(10_000):
      word = draw(self._rng)
      if word not in self._words:
        return word
    raise ValueError("name space exhausted: the world is too large for the syllable set")

  def _claim(self, name: str) -> bool:
    """Reserves `name` and its words; False if the name or a new word is already taken."""
    if name in self._names:
      return False
    self._names.add(name)
    self._words.update(name.split())
    return True

  def _family(self, base_words: list[str], num_variants: int, variable: list[int]) -> list[str]:
    """The base name plus up to `num_variants` variants, each changing one word in `variable`."""
    family = [" ".join(base_words)]
    self._claim(family[0])
    for _ in range(num_variants * 4):
      if len(family) > num_variants:
        break
      i = self._rng.choice(variable)
      change = self._rng.choice((vowel_variant, ending_variant))
      words = list(base_words)
      words[i] = change(words[i], self._rng)
      if words[i] in self._words and words[i] not in base_words:
        continue  # Would collide with a word of some other, unrelated name.
      if self._claim(" ".join(words)):
        family.append(" ".join(words))
    return family

  def people(self, n: int, family_rate: float) -> tuple[list[str], list[tuple[str, ...]]]:
    """`n` person names "First Last" and their confusable families (size >= 2 only)."""
    return self._draw(n, family_rate, lambda: [self._fresh(_first_name),
                                               self._fresh(_surname)], [0, 1])

  def cities(self, n: int, family_rate: float) -> tuple[list[str], list[tuple[str, ...]]]:
    """`n` one-word city names and their confusable families."""
    return self._draw(n, family_rate, lambda: [self._fresh(_place_word)], [0])

  def countries(self, n: int, family_rate: float) -> tuple[list[str], list[tuple[str, ...]]]:
    """`n` one-word country names and their confusable families."""
    return self._draw(n, family_rate, lambda: [self._fresh(_country_word)], [0])

  def organisations(self, n: int, suffixes: tuple[str, ...], family_rate: float
                   ) -> tuple[list[str], list[tuple[str, ...]]]:
    """`n` names "Word Suffix" (e.g. "Brannoc Labs") and their confusable families."""
    return self._draw(n, family_rate,
                      lambda: [self._fresh(_org_word), self._rng.choice(suffixes)], [0])

  def _draw(self, n, family_rate, base, variable):
    names: list[str] = []
    families: list[tuple[str, ...]] = []
    while len(names) < n:
      room = n - len(names)
      num_variants = 0
      if room > 1 and self._rng.random() < family_rate:
        num_variants = min(room - 1, self._rng.choice((1, 1, 2)))
      words = base()
      if " ".join(words) in self._names:
        continue
      family = self._family(words, num_variants, variable)
      names.extend(family)
      if len(family) > 1:
        families.append(tuple(family))
    return names, families


def edit_distance(a: str, b: str) -> int:
  """Levenshtein distance between two strings (insertions, deletions, substitutions)."""
  previous = list(range(len(b) + 1))
  for i, ca in enumerate(a, 1):
    current = [i]
    for j, cb in enumerate(b, 1):
      current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
    previous = current
  return previous[-1]
