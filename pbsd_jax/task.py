"""The task a run trains and evaluates on: data, vocabulary, environment, retriever, batches.

`prepare_task` reads (or makes) the dataset `config.data` names and builds the environment
and retrievers; `load_policy` adds a checkpoint's policy for evaluation. The batches are pure
functions of the records, the seed and the step: `rl_prompts` (which questions RL step k
samples, each repeated G times), `rl_batch` (their student and teacher prompt regions and
gold answer tokens) and `sft_sequences` (oracle trajectories replayed through the
environment). Nothing here trains: evaluation scripts import this module, not the loop.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import jax
import numpy as np

from pbsd_jax import run_config
from pbsd_jax.batch import forced_batch, gold_batch, prompt_region
from pbsd_jax.credit_quality import gold_doc_batch
from pbsd_jax.env import protocol
from pbsd_jax.env.agent_env import AgentEnv
from pbsd_jax.env.bm25 import BM25Index
from pbsd_jax.models import ModelConfig, init_params
from pbsd_jax.rollout import ingraph_rollout
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

  @functools.cached_property
  def rl_widths(self) -> tuple[int, int | None]:
    """`rl_train`'s most golden answers and most hops (None unless every record has a gold
    chain): the widths that give every RL batch one shape."""
    train = self.splits["rl_train"]
    hops = max(r["hops"] for r in train) if all("chain" in r for r in train) else None
    return max(len(r["golden_answers"]) for r in train), hops

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
  env = AgentEnv.from_vocab(vocab, ignore_ids=vocab_lib.whitespace_ids(vocab),
                            **{f: config.env[f] for f in run_config.ENV_FIELDS})
  splits = {name: read_records(os.path.join(data_dir, f"{name}.jsonl"))
            for name in ("rl_train", "rl_validation", "sft", "ood")}
  return Task(vocab, env, retriever, token_retriever.index, splits)


def load_policy(config, ckpt_dir: str, step: int | None, workdir: str, mesh: Any = None
                ) -> tuple[Task, ModelConfig, Any, int | None]:
  """The task and a checkpoint's policy, for evaluation: `(task, model, params, step)`.

  A missing checkpoint fails before any data is read. The model config is the checkpoint's
  `model_config.json` when there is one, else `config.model`. With a `mesh`, the params are
  read straight into their shardings on it (after `run_config.check_param_sharding`).
  """
  from pbsd_jax import policy_checkpoint, sharding
  policy_checkpoint.params_path(ckpt_dir, step)
  task = prepare_task(config, workdir)
  model = (policy_checkpoint.find_model_config(ckpt_dir)
           or run_config.build_model_config(config, task.vocab.vocab_size))
  shardings = None
  if mesh is not None:
    run_config.check_param_sharding(model, mesh)
    shardings = sharding.param_shardings(model, mesh)
  params, step = policy_checkpoint.restore_params(ckpt_dir, step, sharding=shardings)
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
  slots = max(len(r["golden_answers"]) for r in records)  # one gold shape for every chunk
  out = []
  for start in range(0, len(records), chunk):
    rows = records[start:start + chunk]
    rows = rows + [rows[-1]] * (chunk - len(rows))  # one shape, one compile
    region = prompt_region([r["question"] for r in rows], task.encode,
                           config.data.prompt_width,
                           protocol.PROMPT_TEMPLATES[config.data.prompt_template])
    forced, lengths = forced_batch([r["actions"] for r in rows], task.encode, env.max_turns,
                                   env.max_action_tokens)
    gold = gold_batch([r["golden_answers"] for r in rows], task.encode, config.data.gold_width,
                      slots)
    rollout = ingraph_rollout(sampler, env, params, region["prompts"], region["prompt_mask"],
                              jax.random.key(0), task.index, gold, None, forced, lengths)
    keep = min(chunk, len(records) - start)
    out.append(jax.tree.map(lambda x: np.asarray(x)[:keep],
                            (rollout.tokens, rollout.mask, rollout.action_mask)))
  tokens, mask, action = (np.concatenate(parts) for parts in zip(*out))
  width = int(np.max(np.where(mask, np.arange(mask.shape[1]), 0))) + 1
  return tokens[:, :width], mask[:, :width], action[:, :width]


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
  `records`; the teacher is told each record's first gold answer. Records with a gold chain
  (the embedded task) add its documents, `gold_docs` (`credit_quality.gold_doc_batch`), from
  which the rollout labels its turns."""
  region = prompt_region([r["question"] for r in records], task.encode,
                         config.data.prompt_width,
                         protocol.PROMPT_TEMPLATES[config.data.prompt_template],
                         answers=[r["golden_answers"][0] for r in records])
  slots, hops = task.rl_widths  # every step's batch has one shape
  batch = dict(**region, gold=gold_batch([r["golden_answers"] for r in records], task.encode,
                                         config.data.gold_width, slots))
  if hops is not None:
    batch["gold_docs"] = gold_doc_batch(records, hops)
  return batch
