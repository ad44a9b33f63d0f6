"""Hugging Face `generate` throughput on the reference shape (new tokens per second).

    benchmarks/.venv-peers/bin/python benchmarks/peers/hf_generate.py --model DIR

Loads the reference checkpoint with `AutoModelForCausalLM` (f32, CPU, `--threads` torch threads,
default 2, OpenMP waiting passively) and samples 128 new tokens for 64 sequences (the 8 reference
prompts, each repeated 8 times) at temperature 1 with no top-k / top-p truncation;
`min_new_tokens` = `max_new_tokens` so every row makes all 128. One warm-up call, then the best
of 3 timed calls. Last stdout line: `RESULT {json}`.
"""

import argparse
import json
import os
import sys
import time

# Idle OpenMP threads sleep instead of spinning (read when torch loads libgomp, so before the
# import). On a machine shared with other work, spinning threads of 2 torch threads on 2 busy
# cores made generation ~5x slower than 1 thread; passive waiting removes that (JAX never spins).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import transformers  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import reference  # noqa: E402  (benchmarks/reference.py)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", required=True, help="reference dir (benchmarks/reference.py)")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
  args = parser.parse_args()

  torch.set_num_threads(args.threads)
  model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
  model.eval()
  prompts = torch.tensor(reference.load_prompts(args.model))
  input_ids = prompts.repeat_interleave(reference.NUM_GENERATIONS, dim=0)
  sample = dict(
      attention_mask=torch.ones_like(input_ids), do_sample=True,
      temperature=reference.TEMPERATURE, top_k=0, top_p=1.0,
      max_new_tokens=reference.NEW_TOKENS, min_new_tokens=reference.NEW_TOKENS,
      eos_token_id=reference.EOS_ID, pad_token_id=reference.PAD_ID)

  def generate_s() -> float:
    start = time.perf_counter()
    with torch.inference_mode():
      out = model.generate(input_ids, **sample)
    seconds = time.perf_counter() - start
    assert out.shape == (input_ids.shape[0], reference.PROMPT_LEN + reference.NEW_TOKENS), out.shape
    return seconds

  generate_s()  # warm-up
  best = min(generate_s() for _ in range(args.repeats))
  new_tokens = input_ids.shape[0] * reference.NEW_TOKENS
  print(f"hf generate: {new_tokens} new tokens in {best:.3f} s (best of {args.repeats})")
  print("RESULT " + json.dumps({"system": "hf", "generate_tok_s": new_tokens / best,
                                "version": transformers.__version__}))


if __name__ == "__main__":
  main()
