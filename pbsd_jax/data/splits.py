"""Question splits: RL train / validation, SFT, and out-of-domain tiers.

In-domain questions (RL train, RL validation, SFT) have 1..len(hop_weights) hops (at most
`MAX_HOPS`) and never
use a *held-out* relation bigram (two relations composed in a given order). Out-of-domain
questions are stratified by how far they leave that distribution:

    easy    2 hops, the path is itself a held-out bigram (an unseen composition, short)
    medium  3-4 hops containing a held-out bigram (an unseen composition in a long chain)
    hard    `ood_hard_hops` (default 5) hops, longer than any in-domain chain (any composition)

The stratification pool (`ood_pool`) holds harder questions for the paper's BC(300) procedure
(`scripts/stratify.py`, `scripts/compare.py`): a checkpoint's solve rate sorts them into
Easy / Medium / Hard, so its tiers depend on the checkpoint, not on the generator. A third each:

    long     the two longest in-domain hop counts (3-4 by default; unseen questions)
    unseen   2-4 hops containing a held-out bigram
    longest  `ood_hard_hops` hops

A question is identified by (start entity, relation path); no identity is used twice across
all splits, so no question text appears in two splits.
"""

from __future__ import annotations

import dataclasses
import random

from pbsd_jax.data import questions as questions_lib, world as world_lib

TIERS = ("easy", "medium", "hard")
MAX_HOPS = 12  # the longest chain the generator draws (relation paths grow ~2.5x per hop)
SPLITS = ("rl_train", "rl_validation", "sft", "ood", "ood_pool")
POOL_KINDS = ("long", "unseen", "longest")


@dataclasses.dataclass(frozen=True)
class SplitSizes:
  """Split sizes and the in-domain / out-of-domain boundary.

  Attributes:
    rl_train, rl_validation, sft: numbers of in-domain questions.
    ood_per_tier: out-of-domain questions per tier.
    ood_pool: questions in the stratification pool (a third of each kind, the last kinds
      taking the remainder).
    hop_weights: in-domain sampling weights of 1, 2, ... hops.
    heldout_bigrams: relation compositions (r_a then r_b) kept out of every in-domain path.
    ood_hard_hops: chain length of the hard tier; must exceed the longest in-domain chain.
  """
  rl_train: int = 575
  rl_validation: int = 200
  sft: int = 2000
  ood_per_tier: int = 100
  ood_pool: int = 1500
  hop_weights: tuple[float, ...] = (0.3, 0.3, 0.25, 0.15)
  heldout_bigrams: tuple[tuple[str, str], ...] = (
      ("spouse", "works_for"), ("founded_by", "born_in"), ("mayor", "studied_at"))
  ood_hard_hops: int = 5

  def __post_init__(self):
    for field in ("rl_train", "rl_validation", "sft", "ood_per_tier", "ood_pool"):
      if getattr(self, field) < 0:
        raise ValueError(f"SplitSizes.{field} must be >= 0, got {getattr(self, field)}")
    if not self.hop_weights or min(self.hop_weights) < 0 or sum(self.hop_weights) <= 0:
      raise ValueError(f"SplitSizes.hop_weights must be non-negative with a positive sum, "
                       f"got {self.hop_weights}")
    if self.ood_hard_hops > MAX_HOPS:
      raise ValueError(f"SplitSizes.ood_hard_hops={self.ood_hard_hops} is over {MAX_HOPS}")
    if self.ood_hard_hops <= len(self.hop_weights):
      raise ValueError(f"SplitSizes.ood_hard_hops={self.ood_hard_hops} must exceed the "
                       f"longest in-domain chain ({len(self.hop_weights)} hops)")
    if not self.heldout_bigrams:
      raise ValueError("SplitSizes.heldout_bigrams must not be empty (easy/medium OOD tiers "
                       "are built from them)")
    for a, b in self.heldout_bigrams:
      if a not in world_lib.RELATIONS or b not in world_lib.RELATIONS:
        raise ValueError(f"SplitSizes.heldout_bigrams: unknown relation in {(a, b)}")
      if world_lib.RELATIONS[a].tail != world_lib.RELATIONS[b].head:
        raise ValueError(f"SplitSizes.heldout_bigrams: {b!r} cannot follow {a!r}")


def _has_heldout(path: tuple[str, ...], heldout: frozenset) -> bool:
  return any(bigram in heldout for bigram in zip(path, path[1:]))


class _Sampler:
  """Draws questions uniformly over (start, path) instances, never reusing one."""

  def __init__(self, world: world_lib.World, rng: random.Random):
    self._world = world
    self._rng = rng
    self._heads = {t: world.of_type(t) for t in world_lib.ENTITY_TYPES}
    self.used: set[tuple[int, tuple[str, ...]]] = set()

  def draw(self, n: int, paths_by_hops: dict[int, list[tuple[str, ...]]],
           hop_weights: dict[int, float], tier: str, what: str
          ) -> list[questions_lib.Question]:
    hops_list = [h for h in hop_weights if hop_weights[h] > 0]
    for h in hops_list:
      if not paths_by_hops.get(h):
        raise ValueError(f"{what}: no relation path of {h} hops is allowed")
    # A path's weight is its number of start entities: uniform over (start, path) pairs.
    path_weights = {h: [len(self._heads[world_lib.RELATIONS[p[0]].head])
                        for p in paths_by_hops[h]] for h in hops_list}
    out: list[questions_lib.Question] = []
    misses = 0  # Consecutive draws that gave nothing new: many means the space is used up.
    while len(out) < n:
      misses += 1
      if misses > 20_000:
        raise ValueError(f"{what}: could not draw {n} distinct questions (got {len(out)}); "
                         f"the world is too small for the requested split sizes")
      h = self._rng.choices(hops_list, weights=[hop_weights[k] for k in hops_list])[0]
      path = self._rng.choices(paths_by_hops[h], weights=path_weights[h])[0]
      start = self._rng.choice(self._heads[world_lib.RELATIONS[path[0]].head])
      if (start, path) in self.used:
        continue
      question = questions_lib.make_question(self._world, start, path, tier)
      if question is None:
        continue
      self.used.add((start, path))
      out.append(question)
      misses = 0
    return out


def make_splits(world: world_lib.World, seed: int, sizes: SplitSizes = SplitSizes()
               ) -> dict[str, list[questions_lib.Question]]:
  """The splits of `SPLITS`, deterministic in `seed`.

  RL train, RL validation and SFT are one in-domain pool, shuffled and cut, so they share a
  hop distribution. OOD questions are listed tier by tier (easy, medium, hard), the
  stratification pool kind by kind (`POOL_KINDS`, each question's `tier`); it is drawn last,
  so the other splits do not depend on its size.
  """
  rng = random.Random(seed)
  heldout = frozenset(sizes.heldout_bigrams)
  max_hops = len(sizes.hop_weights)
  all_paths = {h: questions_lib.relation_paths(h)
               for h in sorted({*range(1, max_hops + 1), 2, 3, 4, sizes.ood_hard_hops})}
  in_domain = {h: [p for p in all_paths[h] if not _has_heldout(p, heldout)]
               for h in range(1, max_hops + 1)}
  sampler = _Sampler(world, rng)
  pool = sampler.draw(sizes.rl_train + sizes.rl_validation + sizes.sft, in_domain,
                      dict(enumerate(sizes.hop_weights, 1)), "", "in-domain splits")
  rng.shuffle(pool)
  cut1, cut2 = sizes.rl_train, sizes.rl_train + sizes.rl_validation
  splits = {"rl_train": pool[:cut1], "rl_validation": pool[cut1:cut2], "sft": pool[cut2:]}

  tier_paths = {
      "easy": {2: [p for p in all_paths[2] if p in heldout]},
      "medium": {h: [p for p in all_paths[h] if _has_heldout(p, heldout)] for h in (3, 4)},
      "hard": {sizes.ood_hard_hops: all_paths[sizes.ood_hard_hops]},
  }
  splits["ood"] = []
  for tier in TIERS:
    weights = {h: 1.0 for h in tier_paths[tier]}
    splits["ood"] += sampler.draw(sizes.ood_per_tier, tier_paths[tier], weights, tier,
                                  f"ood tier {tier!r}")
  longest = [h for h in in_domain if sizes.hop_weights[h - 1] > 0][-2:]
  kind_paths = {
      "long": {h: in_domain[h] for h in longest},
      "unseen": {h: [p for p in all_paths[h] if _has_heldout(p, heldout)] for h in (2, 3, 4)},
      "longest": tier_paths["hard"],
  }
  splits["ood_pool"] = []
  for i, kind in enumerate(POOL_KINDS):
    n = sizes.ood_pool // 3 + (i >= 3 - sizes.ood_pool % 3)
    splits["ood_pool"] += sampler.draw(n, kind_paths[kind], {h: 1.0 for h in kind_paths[kind]},
                                       kind, f"ood_pool kind {kind!r}")

  texts = [q.question for split in splits.values() for q in split]
  if len(set(texts)) != len(texts):
    raise AssertionError("a question text appears twice across splits")
  return splits
