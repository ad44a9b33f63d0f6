"""PBSD on a real model with the paper's recipe: Search-R1 data against a retrieval server.

The run a researcher launches on a pod, e.g. Qwen2.5-3B-Instruct:

  python scripts/convert_hf.py --hf_dir=/models/Qwen2.5-3B-Instruct --out=/ckpt/qwen3b
  python scripts/serve_retriever.py --index_dir=/data/wiki_bm25 --port=8000 &
  python scripts/train.py --config=configs/search_r1.py --workdir=/runs/pbsd_qwen3b \
      --config.model.init_dir=/ckpt/qwen3b \
      --config.data.train_files=/data/nq_train.parquet,/data/hotpotqa_train.parquet \
      --config.data.eval_files=/data/nq_test.parquet,/data/hotpotqa_dev.parquet \
      --config.env.url=http://HOST:8000/retrieve

The model's own tokenizer and chat template are used (`config.model.init_dir`); the protocol
tags are several tokens there, so turns end and are classified on their text. Paper values:
32 prompts x 8 trajectories per step, AdamW lr 3e-6 with 8 warm-up steps, rollout temperature 1
and top-p 1, evaluation top-p 0.95. The context and turn budgets are the fields of `env`
(the paper's largest runs hold 64K tokens and up to 300 turns). These defaults (8K tokens,
float32 master weights, bfloat16 compute) fit Qwen2.5-3B's training on a v5e-16 (12.6 of 16
GB per chip, compiled), v5p-32 or v4-64 slice (docs/tpu.md; `scripts/aot_compile.py
--topology=...` checks a slice before it is rented). No SFT by default: `sft.steps` with
`data.sft_files` (JSONL of `question` + `trajectory`) adds one.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import base  # noqa: E402


def get_config():
  config = base.get_config()
  config.algorithm = "pbsd"
  # float32 master weights, bfloat16 compute: at lr 3e-6 an Adam step moves a weight by
  # about 1e-4 of itself, under bfloat16's resolution (2^-8), so bfloat16 weights would
  # round most updates away.
  config.model.param_dtype = "float32"
  config.model.dtype = "bfloat16"
  config.model.remat = True
  config.data.prompt_template = "search_r1"
  config.data.prompt_width = 512
  config.data.gold_width = 32
  config.env.retriever = "http"
  config.env.url = "http://127.0.0.1:8000/retrieve"
  config.env.buffer_size = 8192
  config.env.max_turns = 8
  config.env.max_action_tokens = 512
  config.env.max_observation_tokens = 512
  config.env.max_query_tokens = 64
  config.env.top_k = 3
  config.rollout.prompts_per_step = 32
  config.grpo.group_size = 8
  config.rollout.temperature = 1.0
  config.rollout.top_p = 1.0
  config.eval.top_p = 0.95
  config.eval.temperature = 1.0
  config.optim.lr = 3e-6
  config.optim.warmup_steps = 8
  config.rl.steps = 200
  config.rl.minibatches = 4
  config.rl.micro_batch_size = 32
  config.rl.chunk_size = 1024
  config.eval.every = 0
  return config
