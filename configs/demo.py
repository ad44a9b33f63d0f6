"""The embedded demo (`make demo`): PBSD after a short SFT on the synthetic knowledge graph,
sized for 2 CPU cores.

SFT is deliberately short: 600 steps of this recipe reach ~95% greedy validation accuracy (the
task saturates), which would leave RL nothing to improve; ~250 steps leave an imperfect agent.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import base  # noqa: E402


def get_config():
  config = base.get_config()
  config.algorithm = "pbsd"
  config.sft.steps = 250
  config.sft.batch_size = 32
  config.sft.lr = 3e-3
  config.sft.warmup_steps = 20
  config.optim.schedule = "cosine"
  config.optim.lr = 1e-4
  config.rollout.prompts_per_step = 8
  config.rl.steps = 40
  config.eval.num_examples = 200
  config.checkpoint.save_interval_steps = 10
  return config
