"""Writes the embedded synthetic task (world, corpus, splits, SFT oracle trajectories,
SentencePiece vocabulary) to a directory, from a run config's `data` section.

  python scripts/make_data.py --out /tmp/pbsd_data [--config=configs/long_horizon.py]
      [--config.data.world.people=2000] [--config.data.oracle.slip_rate=0.2] [--vocab_size 2048]

Prints the files and the horizon statistics of the SFT trajectories (`oracle.horizon`).
"""

import json

from absl import flags

from pbsd_jax.data import build
from pbsd_jax.run import cli, run_config

_CONFIG = cli.define_config("configs/base.py")
_OUT = flags.DEFINE_string("out", None, "Output directory.", required=True)
_VOCAB_SIZE = flags.DEFINE_integer("vocab_size", 2048, "SentencePiece vocabulary size.")


def main(argv):
  del argv
  try:
    args = run_config.dataset_args(_CONFIG.value)
  except run_config.ConfigError as err:
    raise SystemExit(f"FATAL config error: {err}") from None
  paths = build.make_dataset(_OUT.value, **args, vocab_size=_VOCAB_SIZE.value)
  for name, path in sorted(paths.items()):
    print(f"{name:14s} {path}")
  with open(paths["manifest"]) as f:
    print("oracle trajectories:", json.dumps(json.load(f)["horizon"], indent=1))


if __name__ == "__main__":
  cli.run(main)
