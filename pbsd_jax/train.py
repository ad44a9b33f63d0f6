"""The training loop: data -> SFT stage -> RL stage, with checkpoints and metrics.

Each stage resumes from its own checkpoint directory (`<workdir>/ckpt_sft`, `<workdir>/ckpt_rl`):
the `TrainState` (params, optimiser state, step, PRNG key) and the data position. Batches are
a pure function of the seed and the step, so a run killed at any point and restarted with the
same command ends with exactly the parameters of an uninterrupted run.

With the in-graph retriever one RL step -- rollout, reward, dual likelihood, credit, update --
is one `jax.jit` program (`make_rl_iteration`); with a host or HTTP retriever the rollout is a
host turn loop followed by the jitted update (`learner.make_rl_step`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pbsd_jax import checkpoint, learner, run_config, train_state
from pbsd_jax.batch import forced_batch, gold_batch, prompt_region
from pbsd_jax.env import protocol
from pbsd_jax.env.agent_env import AgentEnv
from pbsd_jax.env.bm25 import BM25Index
from pbsd_jax.models import ModelConfig, init_params
from pbsd_jax.rollout import host_rollout, ingraph_rollout
from pbsd_jax.sampling import Sampler


@dataclasses.dataclass
class Task:
  """The embedded task ready for the loop.

  Attributes:
    vocab: the seqio vocabulary (SentencePiece, single-token tags).
    env: the environment settings.
    retriever: a `Retriever` over the corpus (host compositions).
    index: the `BM25Index` behind it (in-graph composition).
    splits: records of `rl_train`, `rl_validation`, `sft`, `ood`.
  """

  vocab: Any
  env: AgentEnv
  retriever: Any
  index: BM25Index
  splits: dict[str, list[dict]]

  def encode(self, text: str) -> list[int]:
    return list(self.vocab.encode(text))

  def decode(self, ids) -> str:
    return self.vocab.decode([int(i) for i in ids])

  def records(self, name: str) -> list[dict]:
    """A split by name, or the questions of a Search-R1 `.jsonl` / `.parquet` file."""
    from pbsd_jax.data.records import read_records
    if name in self.splits:
      return self.splits[name]
    if name.endswith((".jsonl", ".json", ".parquet")):
      return read_records(name)
    raise ValueError(f"{name!r} is neither a split ({sorted(self.splits)}) nor a "
                     ".jsonl/.parquet file")


def prepare_task(config, workdir: str) -> Task:
  """Loads (or makes) the dataset named by `config.data` and builds the environment."""
  from pbsd_jax import vocab as vocab_lib  # seqio/TensorFlow: the data pipeline only
  from pbsd_jax.data.build import make_dataset
  from pbsd_jax.data.records import read_records
  from pbsd_jax.env.host_bm25 import read_corpus
  from pbsd_jax.env.http import HttpRetriever
  from pbsd_jax.env.token_retriever import TokenBM25Retriever

  data_dir = config.data.dir or os.path.join(workdir, "data")
  if not os.path.exists(os.path.join(data_dir, "manifest.json")):
    if not config.data.make_if_missing:
      raise FileNotFoundError(f"config.data.dir={data_dir!r} holds no dataset "
                              "(manifest.json is missing); run scripts/make_data.py")
    make_dataset(data_dir, seed=config.data.data_seed)
  vocab = vocab_lib.sentencepiece_vocabulary(os.path.join(data_dir, "spm.model"))
  encode = lambda text: list(vocab.encode(text))
  ids, contents = read_corpus(os.path.join(data_dir, "corpus.jsonl"))
  token_retriever = TokenBM25Retriever.from_texts(contents, encode, vocab.vocab_size, ids=ids,
                                                  ignore_ids=vocab_lib.non_term_ids(vocab))
  retriever = token_retriever
  if config.env.retriever == "http":
    retriever = HttpRetriever(config.env.url, timeout_s=config.env.timeout_s,
                              max_retries=config.env.max_retries)
  env_fields = ("buffer_size", "max_turns", "max_action_tokens", "max_observation_tokens",
                "max_query_tokens", "top_k")
  env = AgentEnv.from_vocab(vocab, ignore_ids=vocab_lib.whitespace_ids(vocab),
                            **{f: config.env[f] for f in env_fields})
  splits = {name: read_records(os.path.join(data_dir, f"{name}.jsonl"))
            for name in ("rl_train", "rl_validation", "sft", "ood")}
  return Task(vocab, env, retriever, token_retriever.index, splits)


def load_policy(config, ckpt_dir: str, step: int | None, workdir: str
                ) -> tuple[Task, ModelConfig, Any, int | None]:
  """The task and a checkpoint's policy, for evaluation: `(task, model, params, step)`.

  A missing checkpoint fails before any data is read. The model config is the checkpoint's
  `model_config.json` when there is one, else `config.model`.
  """
  from pbsd_jax import policy_checkpoint
  policy_checkpoint.params_path(ckpt_dir, step)
  task = prepare_task(config, workdir)
  model = (policy_checkpoint.find_model_config(ckpt_dir)
           or run_config.build_model_config(config, task.vocab.vocab_size))
  params, step = policy_checkpoint.restore_params(ckpt_dir, step)
  return task, model, params, step


def sft_sequences(task: Task, records: list[dict], config, model: ModelConfig,
                  chunk: int = 256) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Oracle trajectories replayed through the environment: `(tokens, mask, action_mask)`.

  The observations are what the real environment returns for the oracle's queries; arrays
  are cropped to the longest trajectory (`[N, W]`).
  """
  env = task.env
  sampler = Sampler(model)
  params = init_params(model, jax.random.key(0))  # forced actions: the weights are unused
  out = []
  for start in range(0, len(records), chunk):
    rows = records[start:start + chunk]
    rows = rows + [rows[-1]] * (chunk - len(rows))  # one shape, one compile
    region = prompt_region([r["question"] for r in rows], task.encode,
                           config.data.prompt_width,
                           protocol.PROMPT_TEMPLATES[config.data.prompt_template])
    forced, lengths = forced_batch([r["actions"] for r in rows], task.encode, env.max_turns,
                                   env.max_action_tokens)
    gold = gold_batch([r["golden_answers"] for r in rows], task.encode, config.data.gold_width)
    rollout = ingraph_rollout(sampler, env, params, region["prompts"], region["prompt_mask"],
                              jax.random.key(0), task.index, gold, None, forced, lengths)
    keep = min(chunk, len(records) - start)
    out.append(jax.tree.map(lambda x: np.asarray(x)[:keep],
                            (rollout.tokens, rollout.mask, rollout.action_mask)))
  tokens, mask, action = (np.concatenate(parts) for parts in zip(*out))
  width = int(np.max(np.where(mask, np.arange(mask.shape[1]), 0))) + 1
  return tokens[:, :width], mask[:, :width], action[:, :width]


class MetricLog:
  """Per-step scalars to `<workdir>/metrics.jsonl` and TensorBoard event files."""

  def __init__(self, workdir: str):
    from tensorboardX import SummaryWriter
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

  def write(self, stage: str, step: int, metrics: dict):
    row = {"stage": stage, "step": int(step),
           **{k: float(np.asarray(v)) for k, v in metrics.items()}}
    with open(self.path, "a") as f:
      f.write(json.dumps(row) + "\n")
    for k, v in row.items():
      if k not in ("stage", "step"):
        self._tb.add_scalar(f"{stage}/{k}", v, step)
    self._tb.flush()


def _optimizer(config, lr: float, warmup: int, steps: int) -> optax.GradientTransformation:
  o = config.optim
  return train_state.make_optimizer(lr, warmup, steps, o.weight_decay, o.b1, o.b2, o.grad_clip,
                                    o.schedule)


def _plan(config) -> learner.UpdatePlan:
  return learner.UpdatePlan(config.rl.epochs, config.rl.minibatches,
                            config.rl.micro_batch_size or None, config.rl.chunk_size or None)


def _resume(ckpt: checkpoint.Checkpointer,
            state: train_state.TrainState) -> train_state.TrainState:
  restored = ckpt.restore_or_none(state)
  return state if restored is None else restored[0]


def initial_params(config, model: ModelConfig) -> Any:
  """The run's starting parameters: `config.model.init_dir`'s, or a seeded random init."""
  if config.model.init_dir:
    from pbsd_jax import policy_checkpoint
    params, _ = policy_checkpoint.restore_params(config.model.init_dir)
    return params
  return init_params(model, jax.random.key(config.seed))


def sft_stage(config, task: Task, model: ModelConfig, workdir: str, log: MetricLog,
              progress: Callable = lambda it, **kw: it) -> train_state.TrainState:
  """`config.sft.steps` updates of masked NLL on oracle trajectories (resumable)."""
  steps = config.sft.steps
  tx = _optimizer(config, config.sft.lr, config.sft.warmup_steps, steps)
  state = train_state.init_train_state(initial_params(config, model), tx,
                                       jax.random.key(config.seed))
  with checkpoint.Checkpointer(os.path.join(workdir, "ckpt_sft"),
                               save_interval_steps=config.checkpoint.save_interval_steps,
                               max_to_keep=config.checkpoint.max_to_keep,
                               async_save=config.checkpoint.async_save) as ckpt:
    state = _resume(ckpt, state)
    if int(state.step) >= steps:
      return state
    records = task.splits["sft"][:config.sft.max_examples or None]
    tokens, mask, action = sft_sequences(task, records, config, model)
    step_fn = learner.make_sft_step(model, tx, learner.UpdatePlan(
        chunk_size=config.rl.chunk_size or None))
    with checkpoint.PreemptionGuard() as guard:
      for step in progress(range(int(state.step), steps), desc="sft", initial=int(state.step),
                           total=steps):
        rows = np.random.default_rng([config.seed, step]).choice(
            len(tokens), config.sft.batch_size, replace=False)
        state, metrics = step_fn(state, tokens[rows], mask[rows], action[rows])
        log.write("sft", step + 1, metrics)
        ckpt.save(state, {"stage": "sft", "step": step + 1}, force=step + 1 == steps)
        if guard.save_if_requested(ckpt, state, {"stage": "sft", "step": step + 1}):
          raise SystemExit("preempted: saved the SFT state")
  return state


def rl_prompts(task: Task, config, step: int) -> tuple[list[dict], np.ndarray]:
  """The records of RL step `step`: a seeded pass over `rl_train`, each repeated G times."""
  records = task.splits["rl_train"]
  n, group = config.rollout.prompts_per_step, config.grpo.group_size
  epoch, offset = divmod(step * n, len(records))
  order = np.random.default_rng([config.seed, epoch]).permutation(len(records))
  order = np.concatenate([order, np.random.default_rng([config.seed, epoch + 1]).permutation(
      len(records))])
  chosen = [records[i] for i in order[offset:offset + n]]
  return [r for r in chosen for _ in range(group)], np.repeat(np.arange(n), group)


def rl_batch(task: Task, config, records: list[dict]) -> dict[str, np.ndarray]:
  """Student and teacher prompt regions (`prompt_region`) and gold answer tokens for
  `records`; the teacher is told each record's first gold answer."""
  region = prompt_region([r["question"] for r in records], task.encode,
                         config.data.prompt_width,
                         protocol.PROMPT_TEMPLATES[config.data.prompt_template],
                         answers=[r["golden_answers"][0] for r in records])
  return dict(**region, gold=gold_batch([r["golden_answers"] for r in records], task.encode,
                                        config.data.gold_width))


def make_rl_iteration(sampler: Sampler, env: AgentEnv, model: ModelConfig,
                      tx: optax.GradientTransformation, algo: Any, plan: learner.UpdatePlan
                      ) -> Callable:
  """One RL step as one XLA program: in-graph rollout -> reward -> evidence -> update.

  Returns `step(state, index, batch, group_ids) -> (state, rollout, metrics)`, the state donated.
  """
  def iteration(state, index, batch, group_ids):
    rng, sample = jax.random.split(state.rng)
    rollout = ingraph_rollout(sampler, env, state.params, batch["prompts"],
                              batch["prompt_mask"], sample, index, batch["gold"], group_ids)
    state, metrics = learner.rl_step(state.replace(rng=rng), rollout, batch["teacher_prompt"],
                                     batch["teacher_prompt_mask"], config=model, tx=tx,
                                     algo=algo, max_turns=env.max_turns, plan=plan)
    return state, rollout, metrics

  return jax.jit(iteration, donate_argnums=0)


def rl_stage(config, task: Task, model: ModelConfig, params: Any, workdir: str,
             log: MetricLog, progress: Callable = lambda it, **kw: it,
             on_step: Callable | None = None) -> train_state.TrainState:
  """`config.rl.steps` RL steps of `config.algorithm` starting from `params` (resumable)."""
  algo = run_config.build_algorithm(config)
  steps = config.rl.steps
  tx = _optimizer(config, config.optim.lr, config.optim.warmup_steps, steps)
  sampler = Sampler(model, temperature=config.rollout.temperature, top_k=config.rollout.top_k,
                    top_p=config.rollout.top_p)
  plan = _plan(config)
  state = train_state.init_train_state(params, tx, jax.random.key(config.seed + 1))
  teacher_params = jax.tree.map(jnp.copy, params) if algo.distillation_beta is not None else None
  if config.env.retriever == "ingraph" and teacher_params is None:
    jitted = make_rl_iteration(sampler, task.env, model, tx, algo, plan)
    iteration = lambda state, index, batch, group_ids, records: jitted(state, index, batch,
                                                                       group_ids)
  else:
    update = learner.make_rl_step(model, tx, algo, task.env.max_turns, plan)

    def iteration(state, index, batch, group_ids, records):
      rng, sample = jax.random.split(state.rng)
      if config.env.retriever == "ingraph":
        rollout = ingraph_rollout(sampler, task.env, state.params, batch["prompts"],
                                  batch["prompt_mask"], sample, index, batch["gold"],
                                  group_ids)
      else:
        rollout = host_rollout(sampler, task.env, state.params, batch["prompts"],
                               batch["prompt_mask"], sample, task.retriever, task.encode,
                               task.decode, [r["golden_answers"] for r in records], group_ids)
      state, metrics = update(state.replace(rng=rng), rollout, batch["teacher_prompt"],
                              batch["teacher_prompt_mask"], teacher_params)
      return state, rollout, metrics

  with checkpoint.Checkpointer(os.path.join(workdir, "ckpt_rl"),
                               save_interval_steps=config.checkpoint.save_interval_steps,
                               max_to_keep=config.checkpoint.max_to_keep,
                               async_save=config.checkpoint.async_save) as ckpt, \
      checkpoint.PreemptionGuard() as guard:
    state = _resume(ckpt, state)
    for step in progress(range(int(state.step), steps), desc=config.algorithm,
                         initial=int(state.step), total=steps):
      records, group_ids = rl_prompts(task, config, step)
      batch = rl_batch(task, config, records)
      state, rollout, metrics = iteration(state, task.index, batch,
                                          jnp.asarray(group_ids, jnp.int32), records)
      log.write("rl", step + 1, metrics)
      if on_step is not None:
        on_step(step + 1, state, rollout, batch)
      data_state = {"stage": "rl", "step": step + 1}
      ckpt.save(state, data_state, force=step + 1 == steps)
      if guard.save_if_requested(ckpt, state, data_state):
        raise SystemExit("preempted: saved the RL state")
  return state
