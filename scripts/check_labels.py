r"""Check the turn values (`gold_chain.turn_values`) of a checkpoint's trajectories by Monte
Carlo: replay each trajectory's first turns and let the policy continue, with and without each
turn (`pbsd_jax/eval/label_check.py`).

  python scripts/check_labels.py --config=configs/long_horizon.py \
      --ckpt_dir=workdir/long/ckpt_sft --questions=32 --continuations=8

Needs the embedded task (gold chains) and the in-graph retriever. Prints how often the labels
(progress / culprit / neutral) and the Monte Carlo values agree, per label, and their
correlation; writes them with every turn's two values as JSON (`--out`).
"""

import json
import os

from absl import flags
from absl import logging

from pbsd_jax.data import storage
from pbsd_jax.run import cli

_CONFIG = cli.define_config("configs/long_horizon.py", "Run configuration (data, environment).")
_CKPT_DIR = flags.DEFINE_string("ckpt_dir", None, "Checkpoint directory of the policy.",
                                required=True)
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
_WORKDIR = flags.DEFINE_string("workdir", None,
                               "The run's workdir (default: the parent of --ckpt_dir).")
_SPLIT = flags.DEFINE_string("split", "rl_validation", "Split whose first questions are used.")
_QUESTIONS = flags.DEFINE_integer("questions", 32, "Trajectories (one per question).")
_CONTINUATIONS = flags.DEFINE_integer("continuations", 8, "Continuations per turn and side.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_OUT = flags.DEFINE_string("out", None, "JSON results (default: <workdir>/label_check.json).")


def main(argv):
  del argv
  import jax

  from pbsd_jax.agent.batch import question_batch
  from pbsd_jax.eval import label_check
  from pbsd_jax.run import start

  logging.set_verbosity(logging.WARNING)
  ckpt_dir = os.path.abspath(_CKPT_DIR.value)
  workdir = _WORKDIR.value or os.path.dirname(ckpt_dir)
  try:
    loaded = start.start_evaluation(_CONFIG.value, ckpt_dir, _STEP.value, workdir)
    spec, task, params, step = loaded.spec, loaded.task, loaded.params, loaded.step
    records = task.records(_SPLIT.value)[:_QUESTIONS.value]
    if not all("chain" in r for r in records):
      raise ValueError(f"{_SPLIT.value}: the Monte Carlo check needs questions with gold "
                       "chains (the embedded task)")
    agent = task.agent(spec.sampler("rollout"))
    batch = question_batch(records, agent.tokenizer, prompt_width=spec.data.prompt_width,
                           gold_width=spec.data.gold_width, template=spec.data.template,
                           gold_chains=True)
    rng = jax.random.key(_SEED.value)
    base = agent.rollout(params, jax.random.fold_in(rng, 0), batch)
    got = label_check.monte_carlo_values(agent, params, batch, base,
                                         continuations=_CONTINUATIONS.value,
                                         rng=jax.random.fold_in(rng, 1))
  except (FileNotFoundError, ValueError) as err:
    raise SystemExit(f"check_labels: {err}") from None
  summary = label_check.agreement(got["value"], got["mc"])
  print(f"{len(records)} trajectories of {os.path.basename(ckpt_dir)}"
        f"{'' if step is None else f' step {step}'}, {_CONTINUATIONS.value} continuations "
        f"per turn and side; solved {got['reward'].mean():.0%}")
  print(json.dumps(summary, indent=1))
  out = _OUT.value or os.path.join(workdir, "label_check.json")
  with storage.replaced(out) as f:
    json.dump({"checkpoint": ckpt_dir, "step": step, "continuations": _CONTINUATIONS.value,
               "summary": summary, "value": got["value"].tolist(), "mc": got["mc"].tolist(),
               "reward": got["reward"].tolist()}, f)
  print(f"wrote {out}")


if __name__ == "__main__":
  cli.run(main)
