"""The reference shape every system is benchmarked on, and its one checkpoint.

    python benchmarks/reference.py --out DIR

writes, with `transformers` (`save_pretrained`, seed 0, f32), a `Qwen3ForCausalLM` of the reference
shape into DIR (`config.json` + `model.safetensors`) and `DIR/prompts.json`,
`{"prompts": [[64 ints] x 8]}`: seeded random token ids in [10, 8192), the same 8 prompts for
every system. Qwen3 is the family that Tunix 0.1.7 (`tunix.models.qwen3.params`), transformers
and `pbsd_jax.models.hf.load` all read from safetensors with tied embeddings.

No tokenizer: every system is fed token ids. `EOS_ID` (0) lies below the prompt range and every
system is told to generate exactly `NEW_TOKENS` per sequence (HF `min_new_tokens`, Tunix and TRL
ignore EOS for the budget they are given, ours runs with no stops), so no run stops early.
"""

import argparse
import json
import os

# The GRPO batch: 8 prompts x 8 generations, 64-token prompts, 128 new tokens, temperature 1.
NUM_PROMPTS = 8
NUM_GENERATIONS = 8
PROMPT_LEN = 64
NEW_TOKENS = 128
TEMPERATURE = 1.0
# Token ids: prompts are drawn from [FIRST_PROMPT_ID, VOCAB); ids below are specials.
PAD_ID, EOS_ID, BOS_ID = 1, 0, 2
FIRST_PROMPT_ID = 10
SEED = 0

ARCHITECTURE = "Qwen3ForCausalLM"
VOCAB = 8192
SHAPE = dict(
    vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, intermediate_size=1024, tie_word_embeddings=True,
    rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=1024, hidden_act="silu",
    attention_bias=False, use_sliding_window=False,
    eos_token_id=EOS_ID, pad_token_id=PAD_ID, bos_token_id=BOS_ID)

PROMPTS_FILE = "prompts.json"


def prompts(seed: int = SEED) -> list[list[int]]:
  """The 8 reference prompts: `PROMPT_LEN` seeded random ids in [FIRST_PROMPT_ID, VOCAB)."""
  import numpy as np
  rng = np.random.default_rng(seed)
  return rng.integers(FIRST_PROMPT_ID, VOCAB, (NUM_PROMPTS, PROMPT_LEN)).tolist()


def load_prompts(model_dir: str) -> list[list[int]]:
  """The prompts written next to the checkpoint in `model_dir`."""
  with open(os.path.join(model_dir, PROMPTS_FILE)) as f:
    return json.load(f)["prompts"]


def write(out: str) -> int:
  """Writes the reference checkpoint and prompts into `out`; returns the parameter count."""
  import torch
  import transformers
  torch.manual_seed(SEED)
  config = transformers.Qwen3Config(**SHAPE)
  model = transformers.Qwen3ForCausalLM(config).to(torch.float32)
  model.save_pretrained(out)
  with open(os.path.join(out, PROMPTS_FILE), "w") as f:
    json.dump({"prompts": prompts()}, f)
  return sum(p.numel() for p in model.parameters())


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, help="directory for the checkpoint and prompts")
  args = parser.parse_args()
  count = write(args.out)
  print(f"wrote {ARCHITECTURE} ({count:,} params) and {PROMPTS_FILE} to {args.out}")


if __name__ == "__main__":
  main()
