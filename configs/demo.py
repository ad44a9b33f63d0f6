"""The embedded demo (`make demo`): PBSD after SFT on the synthetic knowledge graph, sized to
finish on 2 CPU cores."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import base  # noqa: E402


def get_config():
  config = base.get_config()
  config.algorithm = "pbsd"
  config.rollout.prompts_per_step = 8
  config.optim.lr = 1e-4
  config.sft.steps = 600
  config.rl.steps = 40
  config.eval.num_examples = 200
  config.checkpoint.save_interval_steps = 5
  return config
