r"""Difficulty tiers by a checkpoint's solve rate, and a balanced subset (the paper's BC(300)).

  python scripts/stratify.py --config=configs/pbsd.py --ckpt_dir=workdir/pbsd/ckpt_sft \
      --split=ood_pool --samples=5 --per_tier=100 --out=workdir/pbsd/bc300.jsonl

Every question is sampled `--samples` times (`--sampling`: as the agent trains,
`config.rollout`, as the paper ran its agent five times; or the top-p evaluation setting,
`config.eval`); a question solved in all samples is Easy, in none Hard, otherwise
Medium (`pbsd_jax.eval.evaluate.stratify`). `--per_tier` questions per tier are drawn with
`--seed` and written as JSONL -- each record as it was, with `tier` set (its generator kind kept
as `kind`) and `solve_count` / `samples` added -- ready for `scripts/evaluate.py --splits=<out>`
and `scripts/compare.py --ood=<out>` (`evaluate.stratified_subset`). The embedded task's pool
is the `ood_pool` split (`pbsd_jax.data.splits`: longer chains and unseen compositions), so the
tiers depend on the checkpoint, not on the generator. Checkpoint, data, config and
multi-host flags as in `scripts/evaluate.py`: each process rolls out its rows of every batch,
and process 0 writes the subset.
"""

import os

from absl import app
from absl import flags
from absl import logging

from pbsd_jax.run import cli

_CONFIG = cli.define_config("configs/pbsd.py", "Run configuration (data, environment, eval).")
_CKPT_DIR = flags.DEFINE_string("ckpt_dir", None, "Checkpoint directory of the policy.",
                                required=True)
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
_WORKDIR = flags.DEFINE_string("workdir", None,
                               "The run's workdir (default: the parent of --ckpt_dir).")
_DATA_DIR = flags.DEFINE_string("data_dir", None, "Dataset directory (overrides config).")
_SPLIT = flags.DEFINE_string("split", "ood_pool", "Split name or question file.")
_SAMPLES = flags.DEFINE_integer("samples", 5, "Samples per question (N).")
_PER_TIER = flags.DEFINE_integer("per_tier", 100, "Questions drawn per tier.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 64, "Rollout rows per call.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the sampling and of the subset draw.")
_SAMPLING = flags.DEFINE_enum("sampling", "rollout", ["rollout", "eval"],
                              "The samples: the agent as it trains (config.rollout) or the "
                              "top-p evaluation (config.eval).")
_OUT = flags.DEFINE_string("out", None,
                           "Output JSONL (default: <workdir>/stratified_<split>.jsonl).")
_DISTRIBUTED = cli.define_distributed()


def main(argv):
  del argv
  cli.initialize_distributed(_DISTRIBUTED)  # before anything touches a device
  import jax

  from pbsd_jax.data import jsonl
  from pbsd_jax.eval import evaluate
  from pbsd_jax.run import start

  logging.set_verbosity(logging.WARNING)
  config = _CONFIG.value
  ckpt_dir = os.path.abspath(_CKPT_DIR.value)
  workdir = _WORKDIR.value or os.path.dirname(ckpt_dir)
  if _DATA_DIR.value:
    config.data.dir = _DATA_DIR.value
  if _SAMPLES.value < 1 or _PER_TIER.value < 1:
    raise app.UsageError("--samples and --per_tier must be >= 1")
  try:
    loaded = start.start_evaluation(config, ckpt_dir, _STEP.value, workdir)
    spec, task, step = loaded.spec, loaded.task, loaded.step
    records = task.records(_SPLIT.value)
  except (FileNotFoundError, ValueError) as err:
    raise SystemExit(f"stratify: {err}") from None

  try:
    rows, summary = evaluate.stratified_subset(
        task.agent(spec.sampler(_SAMPLING.value)), loaded.params, records,
        num_samples=_SAMPLES.value, per_tier=_PER_TIER.value, seed=_SEED.value,
        batch_size=_BATCH_SIZE.value, prompt_width=spec.data.prompt_width,
        gold_width=spec.data.gold_width, template=spec.data.template,
        progress=cli.progress_bar(leave=False), mesh=loaded.mesh)
  except ValueError as err:
    raise SystemExit(f"stratify: {_SPLIT.value}: {err}") from None
  if jax.process_index() != 0:
    return
  out = _OUT.value or os.path.join(
      workdir, f"stratified_{os.path.splitext(os.path.basename(_SPLIT.value))[0]}.jsonl")
  jsonl.write_jsonl(out, rows)
  print(f"{_SPLIT.value}: {len(records)} questions x {_SAMPLES.value} samples from "
        f"{os.path.basename(ckpt_dir)}{'' if step is None else f' step {step}'}: "
        f"accuracy {100 * summary['accuracy']:.1f}%, tiers {summary['tier_sizes']}")
  print(f"wrote {len(rows)} questions ({_PER_TIER.value} per tier) to {out}")


if __name__ == "__main__":
  cli.run(main)
