"""TRL `GRPOTrainer` step time on the reference shape (CPU, f32, no vLLM).

    benchmarks/.venv-peers/bin/python benchmarks/peers/trl_grpo.py --model DIR

Same batch as every system: 8 prompts x 8 generations per step (per_device_train_batch_size 64
completions, num_generations 8, one optimizer step per generation round), the 64-token reference
prompts, 128 new tokens (`min_new_tokens` = 128, so no row stops early), temperature 1 with no
top-k / top-p, beta 0.04 (reference log-probs computed, as in Tunix's default), AdamW, no
gradient checkpointing, `--threads` torch threads (default 2, OpenMP waiting passively), and a
trivial reward (the fraction of even token ids in a completion). A step is timed from
`on_step_begin` to `on_step_end` (generation, reference and policy log-probs, loss, backward and
optimizer step); 1 warm-up step, then the best of `--steps`.

TRL needs a Hugging Face tokenizer: `id_tokenizer` is a real one over the ids themselves (a
`tokenizers` WordLevel model whose words are the ids in decimal, as `<17>`), so prompts go in as
exactly the reference ids, with no special tokens added. Last stdout line: `RESULT {json}`.
"""

import argparse
import json
import os
import sys
import tempfile
import time

# Idle OpenMP threads sleep instead of spinning (read when torch loads libgomp, so before the
# import). On a machine shared with other work, spinning threads of 2 torch threads on 2 busy
# cores made generation ~5x slower than 1 thread; passive waiting removes that (JAX never spins).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import datasets  # noqa: E402
import tokenizers  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import reference  # noqa: E402  (benchmarks/reference.py)


def word(i: int) -> str:
  # Bracketed so that no special token's word is a substring of another word.
  return f"<{i}>"


def id_tokenizer() -> transformers.PreTrainedTokenizerFast:
  """Token id i <-> the word `<i>`, for every id of the reference vocabulary."""
  vocab = {word(i): i for i in range(reference.VOCAB)}
  model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=word(reference.PAD_ID)))
  model.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  return transformers.PreTrainedTokenizerFast(
      tokenizer_object=model, eos_token=word(reference.EOS_ID), pad_token=word(reference.PAD_ID),
      bos_token=word(reference.BOS_ID))


def even_fraction(completions, **_) -> list[float]:
  """The trivial reward: the fraction of even token ids in each completion."""
  return [sum(int(w.strip("<>")) % 2 == 0 for w in text.split()) / max(len(text.split()), 1)
          for text in completions]


class StepTimer(transformers.TrainerCallback):
  """Records the wall time of every optimizer step."""

  def __init__(self):
    self.seconds: list[float] = []

  def on_step_begin(self, args, state, control, **kwargs):
    self.start = time.perf_counter()

  def on_step_end(self, args, state, control, **kwargs):
    self.seconds.append(time.perf_counter() - self.start)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", required=True, help="reference dir (benchmarks/reference.py)")
  parser.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up")
  parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
  args = parser.parse_args()

  torch.set_num_threads(args.threads)
  tokenizer = id_tokenizer()
  texts = [tokenizer.decode(p) for p in reference.load_prompts(args.model)]
  assert [tokenizer(t)["input_ids"] for t in texts] == reference.load_prompts(args.model)
  steps = args.steps + 1
  dataset = datasets.Dataset.from_dict({"prompt": texts * steps})
  batch = reference.NUM_PROMPTS * reference.NUM_GENERATIONS
  with tempfile.TemporaryDirectory() as out:
    config = trl.GRPOConfig(
        output_dir=out, use_cpu=True, bf16=False, gradient_checkpointing=False,
        per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        num_generations=reference.NUM_GENERATIONS, max_completion_length=reference.NEW_TOKENS,
        temperature=reference.TEMPERATURE, top_p=1.0, top_k=0, beta=0.04,
        generation_kwargs={"min_new_tokens": reference.NEW_TOKENS}, shuffle_dataset=False,
        max_steps=steps, learning_rate=1e-5, logging_steps=1, report_to="none",
        save_strategy="no", dataloader_num_workers=0, seed=reference.SEED)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    timer = StepTimer()
    trainer = trl.GRPOTrainer(model=model, reward_funcs=even_fraction, args=config,
                              train_dataset=dataset, processing_class=tokenizer,
                              callbacks=[timer])
    trainer.train()
  assert len(timer.seconds) == steps, timer.seconds
  best = min(timer.seconds[1:])
  print(f"trl: GRPO step {best:.3f} s (best of {args.steps} after a warm-up step)")
  print("RESULT " + json.dumps({"system": "trl", "grpo_step_s": best, "version": trl.__version__}))


if __name__ == "__main__":
  main()
