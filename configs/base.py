"""Base run configuration: the paper's defaults (docs/design.md §2) on the embedded task.

Load with `config_flags.DEFINE_config_file('config')` and override from the command line, e.g.
`--config=configs/pbsd.py --config.pbsd.delta=0.2 --config.rl.steps=50`.
`pbsd_jax.run.run_config.validate` checks a config at start-up and names the field it rejects.
The algorithm sections take their defaults from the algorithms themselves
(`run_config.algorithm_sections`); optional algorithm values use 0 for "off" (`grpo.dual_clip`,
`grpo.norm_len`, `grpo.overlong_max_len`) so every field has a type the command line can parse.
"""

import dataclasses

import ml_collections

from pbsd_jax.data import oracle, splits, world
from pbsd_jax.run import run_config


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.algorithm = "grpo"

  # Model: a size of pbsd_jax/models/sizes.py, or `init_dir`: start from a checkpoint directory
  # (scripts/convert_hf.py output or a train workdir's ckpt_*) with its model_config.json.
  # attention: "ours" or "dot_product" (the accelerator's kernel: cuDNN flash attention on GPU,
  # Pallas splash attention on TPU, XLA on CPU), or "splash" (the splash kernel anywhere).
  # remat, scan_unroll (layers per iteration of the layer scan) and attention say how the
  # layers are computed, also for an init_dir model, and may change on resume; so may
  # cache_dtype, the rollouts' KV cache dtype ("": the compute dtype; "bfloat16" under float32
  # compute halves the cache and what each decode step reads).
  c.model = ml_collections.ConfigDict(dict(name="tiny", init_dir="", param_dtype="float32",
                                           dtype="float32", cache_dtype="", remat=False,
                                           scan_unroll=1, attention="ours"))

  # Data: the embedded task, where `dir` holds make_data.py output (made there if missing and
  # `make_if_missing`); or user files (comma-separated, Search-R1 .jsonl/.parquet with
  # `question`, `golden_answers`): `train_files`, `eval_files`, and `sft_files` (JSONL of
  # `question` + `trajectory` text). `corpus`: a corpus JSONL (`id`, `contents`) for the
  # ingraph/host/bm25s retrievers (default: the embedded corpus). `chat_template`: render
  # prompts with the init_dir model's chat template. `teacher_prompt`: the teacher's
  # privileged block, "answer" (the paper's: the verified answer) or "chain" (the answer and
  # the gold chain's entity names; the embedded task only). The embedded task's generator
  # (pbsd_jax/data; a made `dir` must hold a dataset made with these):
  # - `world`: entity counts and `family_rate`, the share of names with confusable variants.
  # - `splits`: question counts per split, `hop_weights` (the in-domain sampling weights of 1,
  #   2, ... hops) and `ood_hard_hops` (the hard OOD tier's chain length).
  # - `oracle`: the SFT trajectories' mistakes: `detour_share` (the share that takes one
  #   sloppy search and recovers), `slip_rate` (per hop, the chance of searching a confusable
  #   neighbour; 0: never), `recover_rate` (the chance a slip is noticed; otherwise the
  #   trajectory follows the wrong entity and answers wrong), `max_slips` per trajectory.
  c.data = ml_collections.ConfigDict(dict(
      dir="", make_if_missing=True, data_seed=0,
      world=dataclasses.asdict(world.WorldSizes()),
      splits={k: v for k, v in dataclasses.asdict(splits.SplitSizes()).items()
              if k != "heldout_bigrams"},
      oracle=dict(detour_share=oracle.DETOUR_SHARE, **dataclasses.asdict(oracle.Slips())),
      prompt_width=72, gold_width=12, prompt_template="default", teacher_prompt="answer",
      train_files="",
      eval_files="", sft_files="", corpus="", chat_template=True))

  # Environment: `retriever` is "ingraph" (a device BM25 index, whole step in one jit), "host"
  # (the same index through the host turn loop), "bm25s" (a host bm25s index: `index_dir` from
  # scripts/build_index.py, else built from data.corpus), "dense" (Search-R1's dense retriever
  # on the host: the faiss index of sentence embeddings that scripts/build_index.py --encoder
  # saved in `index_dir`) or "http" (a Search-R1 retrieval server at `url`). The device index
  # is `index` "dense" (a [V, N] BM25 weight matrix: small corpora) or "sparse" (CSR
  # postings, one shard per device), or the sparse index that
  # `scripts/build_index.py --tokenizer` saved in `index_dir`.
  c.env = ml_collections.ConfigDict(dict(
      retriever="ingraph", url="", timeout_s=10.0, max_retries=3, index_dir="", index="dense",
      buffer_size=640, max_turns=7, max_action_tokens=48, max_observation_tokens=44,
      max_query_tokens=12, top_k=1))

  # Rollout (paper: 32 prompts x 8 trajectories, temperature 1, top-p 1).
  c.rollout = ml_collections.ConfigDict(dict(prompts_per_step=32, temperature=1.0, top_p=1.0,
                                             top_k=0))

  # Optimiser (paper: Adam(W), 8 warm-up steps, peak lr 3e-6, weight decay 0.1).
  c.optim = ml_collections.ConfigDict(dict(lr=3e-6, warmup_steps=8, weight_decay=0.1, b1=0.9,
                                           b2=0.999, grad_clip=1.0, schedule="constant"))

  # RL stage: PPO epochs x mini-batches per step; micro_batch_size 0 = the whole mini-batch;
  # chunk_size 0 = the LM head over the whole sequence at once; max_skipped_steps: stop the
  # run when this many steps in a row had every update skipped as non-finite (0: never stop);
  # save_rollouts: every this many steps, write the step's rollout (the trained-on tokens, masks,
  # rewards) to <workdir>/rollouts/rl_<step>.npz (0: never).
  c.rl = ml_collections.ConfigDict(dict(steps=112, epochs=1, minibatches=1,
                                        micro_batch_size=0, chunk_size=0, max_skipped_steps=5,
                                        save_rollouts=0))

  # SFT stage on oracle trajectories (0 steps: skip; max_examples 0: the whole SFT split).
  # teacher_fraction: the share of each batch's rows trained on the teacher's privileged
  # prompt instead of the student's (the same trajectory), so the teacher condition PBSD
  # scores with is one the model has read. corpus_fraction: the share of each batch's rows
  # that are corpus documents, language-modelled whole (a knowledge stage: the model holds
  # the world in its weights, as a pretrained one holds its). schedule: the SFT
  # learning-rate schedule (empty: optim.schedule).
  c.sft = ml_collections.ConfigDict(dict(steps=0, batch_size=32, lr=1e-3, warmup_steps=20,
                                         max_examples=0, teacher_fraction=0.0,
                                         corpus_fraction=0.0, schedule=""))

  # Evaluation (paper: top-p 0.95). every: greedy validation accuracy on `num_examples`
  # questions every this many RL steps (0: never), logged as the `eval` stage; sft_every: the
  # same every this many SFT steps, logged as the `eval_sft` stage (the SFT learning curve).
  c.eval = ml_collections.ConfigDict(dict(num_examples=200, temperature=1.0,
                                          top_p=0.95, pass_k=(1, 2, 4, 8, 16), every=0,
                                          sft_every=0))

  # Logging: metrics.jsonl and TensorBoard always; Weights & Biases where `wandb.project` is
  # set (name: the workdir's name when empty; mode "online" or "offline", uploaded later with
  # `wandb sync <workdir>/wandb/offline-run-*`). A resumed workdir resumes its W&B run.
  c.log = ml_collections.ConfigDict(dict(wandb=ml_collections.ConfigDict(dict(
      project="", entity="", name="", mode="online"))))

  # Mesh ('data', 'fsdp', 'tensor'); -1 takes the remaining devices.
  c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=-1, tensor=1))

  c.checkpoint = ml_collections.ConfigDict(dict(save_interval_steps=10, max_to_keep=3,
                                                async_save=True))

  # Algorithm hyperparameters (docs/design.md §2 defaults, from pbsd_jax.rl.algorithms): `grpo` is
  # shared by every algorithm; each other section holds its own.
  for name, section in run_config.algorithm_sections().items():
    c[name] = ml_collections.ConfigDict(section)
  return c
