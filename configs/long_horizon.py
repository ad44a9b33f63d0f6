"""A long-horizon variant of the embedded task: multi-hop chains where a turn's credit matters.

The demo's world gives 1-4 hop chains (oracle trajectories of 2-6 turns, mean 3.5), where a
useless search costs only a turn and PBSD has little credit to assign. Here:
- every question is an 8-hop chain (`data.splits.hop_weights`), with a hard OOD tier of 10;
- a larger world where nearly every name has confusable variants (`data.world`: 1,200
  people, 96 cities, `family_rate` 0.95), so a sloppy search finds a plausible wrong entity;
- SFT trajectories that make mistakes by design (`data.oracle`): at each hop a 10 % chance of
  searching a confusable neighbour, noticed 60 % of the time (one wasted turn) and otherwise
  followed (the trajectory walks from the wrong entity and answers wrong); at most one slip;
- a 10-turn budget (`env.max_turns`: 8 searches, the answer and one spare turn, so a missed
  hop costs nearly the episode) in a 1,024-slot buffer, and prompts of up to 96 tokens: an
  8-hop question is up to 38 tokens, and the teacher's prompt adds the answer block;
- SFT on all of 6,000 such trajectories for 1,200 steps (`sft`): greedy decoding then filters
  out most slips (93 % right, docs/results_long.md), so the room left for RL is under sampling,
  and RL samples its rollouts at the paper's temperature 1.0 (`rollout.temperature`; the demo
  samples at 0.5, where about nine rollouts in ten would solve).
Everything else is the demo's (configs/demo.py).

This is the third testbed tried (docs/results_long.md): on the first, chains of 4-8 hops in a
16-turn budget with up to three slips (`"--config.data.splits.hop_weights=(0,0,0,.2,.2,.2,.2,.2)"
--config.env.max_turns=16 --config.data.oracle.max_slips=3`), a missed hop cost one turn of 16
and perfect turn credit did not beat GRPO by more than the spread between seeds.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import demo  # noqa: E402


def get_config():
  config = demo.get_config()
  config.data.world.update(countries=16, cities_per_country=6, companies=120,
                           universities=40, people=1200, family_rate=0.95)
  config.data.splits.hop_weights = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0)
  config.data.splits.ood_hard_hops = 10
  config.data.oracle.update(detour_share=0.0, slip_rate=0.1, recover_rate=0.6, max_slips=1)
  config.data.splits.sft = 6000
  config.sft.update(steps=1200, max_examples=0)
  config.rollout.temperature = 1.0
  config.env.max_turns = 10
  config.env.buffer_size = 1024
  config.data.prompt_width = 96
  return config
