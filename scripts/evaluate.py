r"""Evaluate a policy checkpoint: greedy and top-p accuracy, pass@k, per-tier accuracy.

  python scripts/evaluate.py --config=configs/pbsd.py --ckpt_dir=workdir/pbsd/ckpt_rl \
      --splits=rl_validation,ood --samples=16

`--ckpt_dir` is a train-loop checkpoint directory (`<workdir>/ckpt_sft` or `ckpt_rl`; the
latest finished step unless `--step`) or a `scripts/convert_hf.py` output directory. The model
config is its `model_config.json` (or the workdir's), else the one `--config` names. Data and
environment settings come from `--config` (the run's configuration), the data from
`--data_dir` or `config.data.dir` or `<workdir>/data`. Each split is a split name of the
embedded task or a `.jsonl` / `.parquet` file of questions (e.g. the output of
`scripts/stratify.py`, whose `tier` field gives per-tier accuracy). When `--config`'s algorithm
computes turn evidence (PBSD, RLSD) and the questions carry their gold chains (the embedded
task), each trajectory is also scored on its teacher prompt: `credit` gives the ROC AUC of the
evidence for useful vs. other searches (`evaluate.credit_summary`). Results are written as
JSON (`--out`) and printed as tables.

Multi-host: the same command on every host, with the process flags of `scripts/train.py`
(docs/cluster.md); each process rolls out its rows of every batch, and process 0 prints and
writes the results.
"""

import json
import os

from absl import flags
from absl import logging

from pbsd_jax.data import storage
from pbsd_jax.run import cli

_CONFIG = cli.define_config("configs/pbsd.py", "Run configuration (data, environment, eval).")
_CKPT_DIR = flags.DEFINE_string("ckpt_dir", None, "Checkpoint directory to evaluate.",
                                required=True)
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
_WORKDIR = flags.DEFINE_string("workdir", None,
                               "The run's workdir (default: the parent of --ckpt_dir).")
_DATA_DIR = flags.DEFINE_string("data_dir", None, "Dataset directory (overrides config).")
_SPLITS = flags.DEFINE_list("splits", ["rl_validation", "ood"],
                            "Split names or question files to evaluate.")
_SAMPLES = flags.DEFINE_integer("samples", None,
                                "Top-p samples per question (default: the largest "
                                "config.eval.pass_k).")
_NUM_EXAMPLES = flags.DEFINE_integer("num_examples", None,
                                     "First N questions of each split, shared evenly "
                                     "across tiers (default: config.eval.num_examples; 0: "
                                     "all).")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 64, "Rollout rows per call.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_OUT = flags.DEFINE_string("out", None, "JSON results (default: <workdir>/eval_<ckpt>.json).")
_DISTRIBUTED = cli.define_distributed()


def main(argv):
  del argv
  cli.initialize_distributed(_DISTRIBUTED)  # before anything touches a device
  import jax

  from pbsd_jax.eval import evaluate
  from pbsd_jax.run import start

  logging.set_verbosity(logging.WARNING)
  config = _CONFIG.value
  ckpt_dir = os.path.abspath(_CKPT_DIR.value)
  workdir = _WORKDIR.value or os.path.dirname(ckpt_dir)
  if _DATA_DIR.value:
    config.data.dir = _DATA_DIR.value
  try:
    loaded = start.start_evaluation(config, ckpt_dir, _STEP.value, workdir)
    spec, task, params, step = loaded.spec, loaded.task, loaded.params, loaded.step
    num_examples = (spec.eval.num_examples if _NUM_EXAMPLES.value is None
                    else _NUM_EXAMPLES.value)
    splits = {name: evaluate.head_per_tier(task.records(name), num_examples)
              for name in _SPLITS.value}
  except (FileNotFoundError, ValueError) as err:
    raise SystemExit(f"evaluate: {err}") from None

  samples = _SAMPLES.value or max(spec.eval.pass_k)
  sampling = spec.eval_sampling
  results = {"checkpoint": ckpt_dir, "step": step, "samples_per_question": samples,
             "temperature": sampling.temperature, "top_p": sampling.top_p, "splits": {}}
  rng = jax.random.key(_SEED.value)
  first = jax.process_index() == 0
  say = print if first else (lambda *a: None)
  for i, (name, records) in enumerate(splits.items()):
    got = evaluate.evaluate_policy(
        task.agent(spec.sampler("eval")), params, records, batch_size=_BATCH_SIZE.value,
        rng=jax.random.fold_in(rng, i), prompt_width=spec.data.prompt_width,
        gold_width=spec.data.gold_width, template=spec.data.template,
        samples_per_question=samples, pass_k=spec.eval.pass_k,
        progress=cli.progress_bar(leave=False), credit_algo=spec.algorithm,
        teacher_template=spec.data.teacher_template, mesh=loaded.mesh)
    results["splits"][name] = got
    say(f"\n{name} ({len(records)} questions), {os.path.basename(ckpt_dir)}"
        f"{'' if step is None else f' step {step}'}")
    say(evaluate.format_table(got))
  suffix = "" if step is None else f"_step{step}"
  out = _OUT.value or os.path.join(workdir, f"eval_{os.path.basename(ckpt_dir)}{suffix}.json")
  if first:
    with storage.replaced(out) as f:
      json.dump(results, f, indent=2)
  say(f"\nwrote {out}")


if __name__ == "__main__":
  cli.run(main)
