"""Writes the embedded synthetic task (world, corpus, splits, SFT oracle trajectories,
SentencePiece vocabulary) to a directory.

  python scripts/make_data.py --out /tmp/pbsd_data [--seed 0] [--vocab_size 2048]
      [--family_rate 0.4] [--detour_share 0.15] [--hop_weights 0.3,0.3,0.25,0.15]
"""

from absl import flags

from pbsd_jax.data import build, oracle, splits, world
from pbsd_jax.run import cli

_OUT = flags.DEFINE_string("out", None, "Output directory.", required=True)
_SEED = flags.DEFINE_integer("seed", 0, "The seed everything derives from.")
_VOCAB_SIZE = flags.DEFINE_integer("vocab_size", 2048, "SentencePiece vocabulary size.")
_DETOUR_SHARE = flags.DEFINE_float(
    "detour_share", oracle.DETOUR_SHARE, "Share of SFT trajectories with a sloppy first query.")
_FAMILY_RATE = flags.DEFINE_float(
    "family_rate", world.WorldSizes.family_rate, "Share of names with confusable variants.")
_HOP_WEIGHTS = flags.DEFINE_list(
    "hop_weights", [str(w) for w in splits.SplitSizes.hop_weights],
    "In-domain sampling weights of 1, 2, ... hops.")
_PEOPLE = flags.DEFINE_integer("people", world.WorldSizes.people, "Number of people.")
_SFT = flags.DEFINE_integer("sft", splits.SplitSizes.sft, "Number of SFT trajectories.")
_OOD_PER_TIER = flags.DEFINE_integer(
    "ood_per_tier", splits.SplitSizes.ood_per_tier, "OOD questions per tier.")
_OOD_POOL = flags.DEFINE_integer(
    "ood_pool", splits.SplitSizes.ood_pool, "Questions in the stratification pool.")


def main(argv):
  del argv
  paths = build.make_dataset(
      _OUT.value, seed=_SEED.value,
      world_sizes=world.WorldSizes(people=_PEOPLE.value, family_rate=_FAMILY_RATE.value),
      split_sizes=splits.SplitSizes(hop_weights=tuple(float(w) for w in _HOP_WEIGHTS.value),
                                    sft=_SFT.value, ood_per_tier=_OOD_PER_TIER.value,
                                    ood_pool=_OOD_POOL.value),
      detour_share=_DETOUR_SHARE.value, vocab_size=_VOCAB_SIZE.value)
  for name, path in sorted(paths.items()):
    print(f"{name:14s} {path}")


if __name__ == "__main__":
  cli.run(main)
