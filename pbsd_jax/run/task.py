"""The task a run trains and evaluates on: data, vocabulary, environment, retriever, batches.

`prepare_task` reads (or makes) the dataset the spec names and builds the environment
and retrievers; `load_policy` adds a checkpoint's policy for evaluation. The batches are pure
functions of the records, the seed and the step: `rl_prompts` (which questions RL step k
samples, each repeated G times), `rl_batch` (their student and teacher prompt regions and
gold answer tokens) and `sft_sequences` (oracle trajectories replayed through the
environment). Nothing here trains: evaluation scripts import this module, not the loop.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import shutil
from typing import Any

import jax
import numpy as np

from pbsd_jax import protocol
from pbsd_jax.agent.batch import forced_batch, prompt_region, reward_gold, teacher_inputs
from pbsd_jax.agent.env.agent_env import AgentEnv
from pbsd_jax.agent.env.retriever import DeviceIndex, Retriever
from pbsd_jax.agent.env.sparse_bm25 import INDEX_FILE as SPARSE_INDEX_FILE, SparseBM25Index
from pbsd_jax.agent.gold_chain import gold_doc_batch
from pbsd_jax.agent.rollout import Agent, ingraph_rollout
from pbsd_jax.agent.tokenizer import Tokenizer
from pbsd_jax.generate.sampling import Sampler
from pbsd_jax.models import ModelConfig, init_params, param_shardings
from pbsd_jax.parallel import sharding
from pbsd_jax.run import policy_checkpoint, run_config
from pbsd_jax.run.run_config import DataSpec, RunSpec


_OBSERVATION = re.compile(re.escape(protocol.INFO_OPEN) + "(.*?)" + re.escape(protocol.INFO_CLOSE),
                          re.S)


@dataclasses.dataclass
class Task:
  """The task ready for the loop.

  Attributes:
    tokenizer: the policy's tokenizer: the embedded task's SentencePiece model (single-token
      tags), or the model's own (`config.model.init_dir`; tags of several tokens, and its
      chat template).
    env: the environment settings.
    search: what rollouts search (`config.env.retriever`): the device index (`ingraph`), or
      a host `Retriever`: the token BM25 behind a host call (`host`), a `bm25s` index, a
      dense index (`dense`) or a retrieval server.
    index: the token BM25 on the devices (`BM25Index`, or `SparseBM25Index`:
      `config.env.index`), which SFT's oracle replays search; None where there is none (a
      `bm25s`, dense or HTTP retriever over user data).
    splits: records by split: `rl_train`, `rl_validation`, `sft` (and `ood` in the embedded
      task).
    corpus: the corpus JSONL the token BM25 and SFT's knowledge rows read (`config.data.corpus`
      or the embedded task's), "" where there is none.
  """

  tokenizer: Tokenizer
  env: AgentEnv
  search: DeviceIndex | Retriever
  index: DeviceIndex | None
  splits: dict[str, list[dict]]
  corpus: str = ""

  @property
  def vocab(self) -> Any:
    return self.tokenizer.vocab

  def agent(self, sampler: Sampler) -> Agent:
    """The agent that samples with `sampler` on this task."""
    return Agent(sampler, self.env, self.tokenizer, self.search)

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


def _user_records(spec: RunSpec, field: str, vocab: Any) -> list[dict]:
  """The records of the files of `config.data.<field>`: questions through the
  seqio tasks of `data.tasks` (validated when registered), SFT trajectories
  (`records.TRAJECTORY_FIELDS`) read directly."""
  from pbsd_jax.data import records as records_lib, tasks
  records = []
  for i, path in enumerate(getattr(spec.data, field)):
    try:
      if field == "sft_files":
        records += records_lib.read_records(path, records_lib.TRAJECTORY_FIELDS)
      else:
        records += tasks.user_records(
            f"pbsd_user_{field}_{i}", path, vocab, spec.data.template)
    except (FileNotFoundError, ValueError) as err:
      raise run_config.ConfigError(f"config.data.{field}: {err}") from None
  return records


def _model_vocabulary(spec: RunSpec):
  """The tokenizer and chat template of `config.model.init_dir`, or `(None, None)` when the
  directory holds no tokenizer (a checkpoint of the embedded task's model)."""
  from pbsd_jax.data import vocab as vocab_lib
  from pbsd_jax.models.hf import chat_template
  init_dir = spec.model_source.init_dir
  directory = init_dir and policy_checkpoint.tokenizer_dir(init_dir)
  if not directory:
    return None, None
  try:
    vocab = vocab_lib.model_vocabulary(directory)
  except (FileNotFoundError, ValueError) as err:
    raise run_config.ConfigError(f"config.model.init_dir={init_dir!r}: {err}") from None
  if not spec.data.chat_template:
    return vocab, None
  try:
    chat_template.chat_template_source(directory)
  except ValueError as err:
    raise run_config.ConfigError(
        f"config.model.init_dir={init_dir!r}: {err}; set "
        "config.data.chat_template=False for a plain prompt") from None
  return vocab, lambda message: chat_template.apply_chat_template(
      directory, [{"role": "user", "content": message}], add_generation_prompt=True)


def save_tokenizer(spec: RunSpec, workdir: str) -> None:
  """Copies `config.model.init_dir`'s tokenizer files to `<workdir>/tokenizer/`, where
  `policy_checkpoint.tokenizer_dir` finds them for the run's own checkpoints
  (`<workdir>/ckpt_*`)."""
  init_dir = spec.model_source.init_dir
  source = init_dir and policy_checkpoint.tokenizer_dir(init_dir)
  target = os.path.join(workdir, "tokenizer")
  if not source or os.path.abspath(source) == os.path.abspath(target):
    return
  os.makedirs(target, exist_ok=True)
  for name in (*policy_checkpoint.TOKENIZER_FILES, *policy_checkpoint.TOKENIZER_CONFIG_FILES):
    if os.path.isfile(os.path.join(source, name)):
      shutil.copy2(os.path.join(source, name), os.path.join(target, name))


def _probe(retriever, url: str) -> None:
  """Fails in one line, at start-up, when the retrieval server does not answer."""
  from pbsd_jax.agent.env.http import HttpRetriever
  from pbsd_jax.agent.env.retriever import RetrievalError
  try:
    HttpRetriever(url, timeout_s=retriever.timeout_s, max_retries=0).retrieve(["probe"], 1)
  except RetrievalError as err:
    raise run_config.ConfigError(f"config.env.url={url!r}: the retrieval server does not "
                                 f"answer ({err.reason})") from None


def _check_manifest(spec: RunSpec, path: str) -> None:
  """A dataset made with other generator arguments than the `data` section's fails naming
  the first field that differs (the field would otherwise change nothing)."""
  with open(path) as f:
    made = json.load(f)
  args = spec.data.generator
  # Manifest key -> (config section, the arguments); a manifest older than a section holds
  # its defaults.
  made.setdefault("slips", dataclasses.asdict(type(args["slips"])()))
  sections = {
      "world_sizes": ("world", dataclasses.asdict(args["world_sizes"])),
      "split_sizes": ("splits", dataclasses.asdict(args["split_sizes"])),
      "slips": ("oracle", dataclasses.asdict(args["slips"])),
  }
  differing = [("data_seed", args["seed"], made["seed"]),
               ("oracle.detour_share", args["detour_share"], made["detour_share"])]
  for key, (section, want) in sections.items():
    got = made[key]
    differing += [(f"{section}.{field}", value, got.get(field)) for field, value in want.items()]
  for field, want, got in differing:
    if json.loads(json.dumps(want)) != got:
      raise run_config.ConfigError(
          f"config.data.{field}={want!r}: the dataset in {os.path.dirname(path)} "
          f"was made with {got!r} (make another data.dir, or set the field to match)")


def prepare_task(spec: RunSpec, workdir: str, mesh: Any = None, connect: bool = True) -> Task:
  """Reads the questions, the vocabulary and the corpus `spec` names and builds the
  tokenizer, the environment and the search.

  `mesh` (default: the run's, `spec.build_mesh()`) is where a sparse device index is split,
  one shard per device; it is placed there when those devices are this host's (not when they
  are a TPU topology compiled for ahead of time). `connect=False` leaves a retrieval server
  unprobed (nothing will query it).

  Questions: `config.data.train_files` / `eval_files` / `sft_files` (Search-R1 JSONL or parquet;
  SFT records hold trajectories), else the embedded dataset in `config.data.dir` (made there
  if missing). Vocabulary: `config.model.init_dir`'s tokenizer and chat template when it has
  them, else the embedded SentencePiece model. Search (`config.env.retriever`, `_search`): the
  token BM25 over the corpus (`ingraph` on the devices, `host` behind a host call;
  `config.data.corpus` or the embedded corpus), a `bm25s` index (`config.env.index_dir`, else
  built from the corpus), the dense index in `config.env.index_dir` (`dense`), or a retrieval
  server (`http`, probed here). Over user data no device index is built for `bm25s`, `dense`
  or `http`.

  Raises:
    run_config.ConfigError: naming the field, for anything that cannot run.
  """
  from pbsd_jax.data import vocab as vocab_lib  # seqio/TensorFlow: the data pipeline only
  from pbsd_jax.data.build import make_dataset
  from pbsd_jax.data.records import read_records
  from pbsd_jax.agent.env import token_text

  user_data = bool(spec.data.train_files)
  vocab, chat = _model_vocabulary(spec)
  if vocab is None and user_data:
    raise run_config.ConfigError(
        f"config.model.init_dir={spec.model_source.init_dir!r}: data.train_files needs a model "
        "with its tokenizer (a scripts/convert_hf.py output)")
  splits, corpus = {}, spec.data.corpus
  if user_data:
    splits = {split: _user_records(spec, field, vocab) if getattr(spec.data, field) else []
              for split, field in (("rl_train", "train_files"), ("rl_validation", "eval_files"),
                                   ("sft", "sft_files"))}
  else:
    data_dir = spec.data.dir or os.path.join(workdir, "data")
    manifest = os.path.join(data_dir, "manifest.json")
    if not os.path.exists(manifest):
      if not spec.data.make_if_missing:
        raise FileNotFoundError(f"config.data.dir={data_dir!r} holds no dataset "
                                "(manifest.json is missing); run scripts/make_data.py")
      make_dataset(data_dir, **spec.data.generator)
    else:
      _check_manifest(spec, manifest)
    splits = {name: read_records(os.path.join(data_dir, f"{name}.jsonl"))
              for name in ("rl_train", "rl_validation", "sft", "ood")}
    pool = os.path.join(data_dir, "ood_pool.jsonl")  # datasets made before it have none
    if os.path.exists(pool):
      splits["ood_pool"] = read_records(pool)
    corpus = corpus or os.path.join(data_dir, "corpus.jsonl")
    if vocab is None:
      vocab = vocab_lib.sentencepiece_vocabulary(os.path.join(data_dir, "spm.model"))
  env = AgentEnv.from_vocab(vocab, ignore_ids=vocab_lib.whitespace_ids(vocab),
                            **dataclasses.asdict(spec.env))
  text = (token_text.build(vocab_lib.token_bytes(vocab), (vocab.eos_id, vocab.pad_id))
          if env.text_tags else None)
  search, index = _search(spec, corpus, vocab, keep_index=not user_data,
                          mesh=mesh, connect=connect)
  task = Task(Tokenizer(vocab, text, chat), env, search, index, splits, corpus or "")
  _check_prompts(task, spec.data, user_data)
  return task


def _search(spec: RunSpec, corpus: str, vocab: Any, keep_index: bool, mesh: Any,
            connect: bool = True) -> tuple[DeviceIndex | Retriever, DeviceIndex | None]:
  """`(search, index)`: what the rollouts search (`config.env.retriever`) and the token BM25
  on the devices, built for the in-graph and host retrievers and, with `keep_index`, for any
  (the embedded task's SFT replays the oracle's searches in-graph).

  Raises:
    run_config.ConfigError: naming the field, for a corpus, index or server that cannot be
      used.
  """
  from pbsd_jax.agent.env.dense_retriever import DenseRetriever
  from pbsd_jax.agent.env.host_bm25 import HostBM25Retriever, read_corpus
  from pbsd_jax.agent.env.http import HttpRetriever
  from pbsd_jax.agent.env.token_retriever import TokenBM25Retriever
  retrieval = spec.retrieval
  kind, index = retrieval.retriever, None
  if kind in ("ingraph", "host", "bm25s") and not (corpus or retrieval.index_dir):
    raise run_config.ConfigError(f"config.env.retriever={kind!r} needs config.data.corpus "
                                 "(a corpus JSONL with 'id' and 'contents')")
  if kind == "dense":
    # Loaded first: its errors name env.index_dir, and come before the token index is built.
    try:
      search = DenseRetriever.load(retrieval.index_dir)
    except (FileNotFoundError, ValueError) as err:
      raise run_config.ConfigError(f"config.env.index_dir: {err}") from None
  try:
    if kind in ("ingraph", "host") or keep_index:
      ids, contents = read_corpus(corpus)
      index = _token_index(spec, ids, contents, vocab, mesh)
    if kind == "ingraph":
      return index, index
    if kind == "host":
      return TokenBM25Retriever(index, lambda t: list(vocab.encode(t)), contents, ids), index
    if kind == "bm25s":
      return (HostBM25Retriever.load(retrieval.index_dir) if retrieval.index_dir
              else HostBM25Retriever.from_jsonl(corpus)), index
    if kind == "dense":
      return search, index
    server = HttpRetriever(retrieval.url, timeout_s=retrieval.timeout_s,
                           max_retries=retrieval.max_retries)
    if connect:
      _probe(server, retrieval.url)
    return server, index
  except (FileNotFoundError, ValueError) as err:
    if isinstance(err, run_config.ConfigError):
      raise
    field = ("env.index_dir" if retrieval.index_dir and kind not in ("http", "dense")
             else "data.corpus")
    raise run_config.ConfigError(f"config.{field}: {err}") from None


def _token_index(spec: RunSpec, ids: list[str], contents: list[str], vocab: Any, mesh: Any
                 ) -> DeviceIndex:
  """The in-graph index of the corpus: `config.env.index_dir`'s sparse index
  (`scripts/build_index.py --tokenizer`) for the `ingraph` and `host` retrievers, else built
  here (`config.env.index`: dense, or sparse with a shard per device of `mesh`). A sparse
  index is placed shard by shard over the devices of `mesh` where they are this host's."""
  from pbsd_jax.agent.env.token_retriever import build_index
  from pbsd_jax.data import vocab as vocab_lib
  retrieval = spec.retrieval
  if mesh is None and (retrieval.index == "sparse" or retrieval.index_dir):
    mesh = spec.build_mesh()
  saved = os.path.join(retrieval.index_dir, SPARSE_INDEX_FILE)
  if retrieval.index_dir and retrieval.retriever in ("ingraph", "host"):
    index = SparseBM25Index.load(saved)
    if index.num_docs != len(contents):
      raise ValueError(f"{saved} indexes {index.num_docs} documents, the corpus has "
                       f"{len(contents)}")
  else:
    index = build_index(contents, lambda t: list(vocab.encode(t)), vocab.vocab_size, ids,
                        ignore_ids=vocab_lib.non_term_ids(vocab),
                        sparse_shards=mesh.size if retrieval.index == "sparse" else 0)
  if isinstance(index, SparseBM25Index) and set(mesh.devices.flat) <= set(jax.devices()):
    index = index.shard(mesh, sharding.MESH_AXES)
  return index


def _check_prompts(task: Task, data: DataSpec, user_data: bool) -> None:
  """Every training and validation question's student and teacher prompts fit
  `config.data.prompt_width`, checked once at start-up (the embedded task's questions grow
  with `data.splits.hop_weights`)."""
  # Each split and where its questions come from.
  sources = ({"rl_train": "data.train_files", "rl_validation": "data.eval_files"} if user_data
             else {split: f"data.dir's {split}" for split in ("rl_train", "rl_validation", "sft")})
  for split, source in sources.items():
    records = task.splits[split]
    for start in range(0, len(records), 1024):
      chunk = records[start:start + 1024]
      try:
        prompt_region([r["question"] for r in chunk], task.tokenizer.encode,
                      data.prompt_width, data.template,
                      **teacher_inputs(chunk, data.teacher_template), chat=task.tokenizer.chat)
      except ValueError as err:
        message = re.sub(r"(record|prompt) (\d+)",
                         lambda m: f"question {start + int(m.group(2))}", str(err))
        raise run_config.ConfigError(f"config.data.prompt_width={data.prompt_width}: "
                                     f"{source}: {message}") from None


def load_policy(spec: RunSpec, ckpt_dir: str, step: int | None, workdir: str,
                mesh: Any = None) -> tuple[Task, ModelConfig, Any, int | None]:
  """The task and a checkpoint's policy, for evaluation: `(task, model, params, step)`.

  A missing checkpoint fails before any data is read. The model config is the checkpoint's
  `model_config.json` when there is one, else the spec's. With a `mesh`, the params are
  read straight into their shardings on it (after `run_config.check_param_sharding`).
  """
  policy_checkpoint.params_path(ckpt_dir, step)
  task = prepare_task(spec, workdir)
  model = (policy_checkpoint.find_model_config(ckpt_dir)
           or spec.for_vocabulary(task.vocab.vocab_size).model)
  shardings = None
  if mesh is not None:
    run_config.check_param_sharding(model, mesh)
    shardings = param_shardings(model, mesh)
  params, step = policy_checkpoint.restore_params(ckpt_dir, step, sharding=shardings)
  return task, model, params, step


def _trajectory_tokens(trajectory: str, task: Task) -> tuple[list[int], list[bool]]:
  """A user trajectory as a rollout holds it: `(ids, trained)`. The text between
  observations is the policy's (trained on), each encoded on its own and cut after its last
  closing tag's trailing whitespace where an observation follows (a turn ends at the tag);
  each `<information>...</information>` observation is the environment's tags around its
  encoded body (never trained on)."""
  ids, trained, pos = [], [], 0
  open_ids, close_ids = task.env.tag_tokens("info_open"), task.env.tag_tokens("info_close")
  for match in _OBSERVATION.finditer(trajectory):
    action = task.tokenizer.encode(trajectory[pos:match.start()].rstrip())
    body = task.tokenizer.encode(match.group(1))
    ids += action + list(open_ids) + body + list(close_ids)
    trained += [True] * len(action) + [False] * (len(open_ids) + len(body) + len(close_ids))
    pos = match.end()
  action = task.tokenizer.encode(trajectory[pos:])
  return ids + action, trained + [True] * len(action)


def trajectory_sequences(task: Task, records: list[dict], data: DataSpec
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """User SFT trajectories (`question`, `trajectory`) in the rollout layout: `(tokens, mask,
  action_mask)`, the prompt region then the trajectory from column P, cropped to the longest.

  Raises:
    run_config.ConfigError: naming the record whose trajectory does not fit the buffer.
  """
  width = data.prompt_width
  region = prompt_region([r["question"] for r in records], task.tokenizer.encode, width,
                         data.template, chat=task.tokenizer.chat)
  rows = [_trajectory_tokens(r["trajectory"], task) for r in records]
  longest = max(len(ids) for ids, _ in rows)
  if width + longest > task.env.buffer_size:
    i = next(i for i, (ids, _) in enumerate(rows) if width + len(ids) > task.env.buffer_size)
    raise run_config.ConfigError(
        f"config.data.sft_files: record {i}'s trajectory is {len(rows[i][0])} tokens, more "
        f"than the {task.env.buffer_size - width} after the prompt in env.buffer_size")
  tokens = np.zeros((len(rows), width + longest), np.int32)
  mask = np.zeros(tokens.shape, bool)
  action = np.zeros(tokens.shape, bool)
  tokens[:, :width], mask[:, :width] = region["prompts"], region["prompt_mask"]
  for b, (ids, trained) in enumerate(rows):
    tokens[b, width:width + len(ids)] = ids
    mask[b, width:width + len(ids)] = True
    action[b, width:width + len(ids)] = trained
  return tokens, mask, action


def sft_sequences(task: Task, records: list[dict], data: DataSpec, model: ModelConfig,
                  chunk: int = 256) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """SFT sequences `(tokens, mask, action_mask)`, cropped to the longest (`[N, W]`): user
  trajectories as written (`trajectory_sequences`), or oracle trajectories replayed through
  the environment, whose observations are what it returns for the oracle's queries.
  """
  if all("trajectory" in r for r in records):
    return trajectory_sequences(task, records, data)
  env = task.env
  sampler = Sampler(model)
  params = init_params(model, jax.random.key(0))  # forced actions: the weights are unused
  slots = max(len(r["golden_answers"]) for r in records)  # one gold shape for every chunk
  out = []
  for start in range(0, len(records), chunk):
    rows = records[start:start + chunk]
    rows = rows + [rows[-1]] * (chunk - len(rows))  # one shape, one compile
    region = prompt_region([r["question"] for r in rows], task.tokenizer.encode,
                           data.prompt_width, data.template, chat=task.tokenizer.chat)
    try:
      forced, lengths = forced_batch([r["actions"] for r in rows], task.tokenizer.encode,
                                     env.max_turns, env.max_action_tokens)
    except ValueError as err:  # "row b[, turn k]: ..." of an oracle trajectory too long
      row, rest = re.match(r"row (\d+),? (.*)", str(err)).groups()
      field = "max_turns" if "max_turns" in rest else "max_action_tokens"
      raise run_config.ConfigError(
          f"config.env.{field}={getattr(env, field)}: the oracle trajectory of SFT question "
          f"{rows[int(row)]['question']!r}: {rest}") from None
    gold = reward_gold([r["golden_answers"] for r in rows], task.tokenizer, data.gold_width,
                       slots)
    rollout = ingraph_rollout(sampler, env, params, region["prompts"], region["prompt_mask"],
                              jax.random.key(0), task.index, gold, None, forced, lengths,
                              text=task.tokenizer.text)
    keep = min(chunk, len(records) - start)
    out.append(jax.tree.map(lambda x: np.asarray(x)[:keep],
                            (rollout.tokens, rollout.mask, rollout.action_mask)))
  tokens, mask, action = (np.concatenate(parts) for parts in zip(*out))
  width = int(np.max(np.where(mask, np.arange(mask.shape[1]), 0))) + 1
  return tokens[:, :width], mask[:, :width], action[:, :width]


def corpus_sequences(task: Task, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Every corpus document as SFT's knowledge rows `(tokens, mask, loss_mask)`, `[D, width]`:
  the document as an observation shows it (`format_document`) from column 0, cropped to
  `width`, every token after the first in the loss.

  Raises:
    run_config.ConfigError: the task has no corpus.
  """
  from pbsd_jax.agent.env.host_bm25 import read_corpus
  from pbsd_jax.agent.env.observations import format_document
  from pbsd_jax.agent.env.retriever import Document
  if not task.corpus:
    raise run_config.ConfigError("config.sft.corpus_fraction: the task has no corpus "
                                 "(config.data.corpus)")
  ids, contents = read_corpus(task.corpus)
  tokens = np.zeros((len(ids), width), np.int32)
  mask = np.zeros((len(ids), width), bool)
  for row, (doc_id, text) in enumerate(zip(ids, contents)):
    encoded = task.tokenizer.encode(format_document(Document(str(doc_id), text, 0.0)))[:width]
    tokens[row, :len(encoded)], mask[row, :len(encoded)] = encoded, True
  loss = mask.copy()
  loss[:, 0] = False  # the first token has no context to predict it from
  return tokens, mask, loss


def rl_prompts(task: Task, spec: RunSpec, step: int) -> tuple[list[dict], np.ndarray]:
  """The records of RL step `step`: a seeded pass over `rl_train`, each repeated G times."""
  records = task.splits["rl_train"]
  n, group, seed = spec.rl.prompts_per_step, spec.rl.group_size, spec.seed
  epoch, offset = divmod(step * n, len(records))
  order = np.random.default_rng([seed, epoch]).permutation(len(records))
  order = np.concatenate([order, np.random.default_rng([seed, epoch + 1]).permutation(
      len(records))])
  chosen = [records[i] for i in order[offset:offset + n]]
  return [r for r in chosen for _ in range(group)], np.repeat(np.arange(n), group)


def rl_batch(task: Task, data: DataSpec, records: list[dict]) -> dict[str, np.ndarray]:
  """Student and teacher prompt regions (`prompt_region`) and gold answer tokens for
  `records`; the teacher is told each record's first gold answer (and, with the `chain`
  block, its gold chain: `data.teacher_template`). Records with a gold chain
  (the embedded task) add its documents, `gold_docs` (`gold_chain.gold_doc_batch`), from
  which the rollout labels its turns."""
  region = prompt_region([r["question"] for r in records], task.tokenizer.encode,
                         data.prompt_width, data.template,
                         **teacher_inputs(records, data.teacher_template),
                         chat=task.tokenizer.chat)
  slots, hops = task.rl_widths  # every step's batch has one shape
  batch = dict(**region, gold=reward_gold([r["golden_answers"] for r in records],
                                          task.tokenizer, data.gold_width, slots))
  if hops is not None:
    batch["gold_docs"] = gold_doc_batch(records, hops)
  return batch
