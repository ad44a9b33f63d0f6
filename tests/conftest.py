"""Test setup: 8 fake CPU devices (set before JAX is imported) so sharding tests are real, and
the tests' XLA flags (script_env)."""

import os
import tempfile

from script_env import xla_flags  # imports no JAX

os.environ.setdefault("XLA_FLAGS", xla_flags(8))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# XLA's compiled programs persist on disk, shared by the workers and every subprocess they
# start (scripts, multi-process runs, notebook kernels): the many runs of one small config
# compile each program once. A cached executable is the program compiled before, so results
# are the same bits.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"pbsd_jax_tests_xla_cache_{os.getuid()}"))
# JAX stores only programs that took at least 1 s to compile by default; at the tests'
# code-generation flags (script_env) most of the repeated ones take 0.1-1 s.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
# A size limit makes JAX lock the cache (filelock) while a process reads or writes an entry.
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 << 30))

import dataclasses  # noqa: E402
import json  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _own_wandb_service():
  """A W&B run started in this worker leaves its service's address in `WANDB_SERVICE`, and a
  script the worker starts then would run its W&B run in this worker's service: one it kills
  would stay there, unflushed and "in use". Each process keeps its own."""
  os.environ.pop("WANDB_SERVICE", None)
  yield
  os.environ.pop("WANDB_SERVICE", None)


@dataclasses.dataclass
class KnowledgeGraph:
  """The embedded task, generated once per test session: paths, vocabulary, retriever."""
  paths: dict
  vocab: object
  world: object
  corpus: list
  retriever: object

  def encode(self, text):
    return list(self.vocab.encode(text))

  def decode(self, ids):
    return self.vocab.decode([int(i) for i in ids])

  @property
  def tokenizer(self):
    from pbsd_jax.agent.tokenizer import Tokenizer
    return Tokenizer(self.vocab)

  def agent(self, sampler, env, search=None):
    """The agent of `sampler` and `env` over the embedded task's device index (or `search`)."""
    from pbsd_jax.agent.rollout import Agent
    return Agent(sampler, env, self.tokenizer, self.retriever.index if search is None else search)

  def records(self, split):
    with open(self.paths[split]) as f:
      return [json.loads(line) for line in f]


@pytest.fixture(scope="session")
def kg(tmp_path_factory):
  from pbsd_jax.agent.env.token_retriever import TokenBM25Retriever
  from pbsd_jax.data import vocab as vocab_lib
  from pbsd_jax.data.build import make_dataset
  from pbsd_jax.data.world import load_world

  paths = make_dataset(str(tmp_path_factory.mktemp("kg")))
  vocab = vocab_lib.sentencepiece_vocabulary(paths["spm_model"])
  with open(paths["corpus"]) as f:
    corpus = [json.loads(line) for line in f]
  retriever = TokenBM25Retriever.from_texts(
      [d["contents"] for d in corpus], lambda s: list(vocab.encode(s)), vocab.vocab_size,
      ids=[d["id"] for d in corpus], ignore_ids=vocab_lib.non_term_ids(vocab))
  return KnowledgeGraph(paths, vocab, load_world(paths["world"]), corpus, retriever)


@pytest.fixture(scope="session")
def opsd_run(kg, tmp_path_factory):
  """A finished scripts/train.py run of test_train's small OPSD config (SFT checkpoints 2-4 and
  RL checkpoints 1-3 kept); treat it as read-only."""
  from test_train import OPSD, _train
  workdir = str(tmp_path_factory.mktemp("opsd_run"))
  _train(workdir, os.path.dirname(kg.paths["spm_model"]), *OPSD)
  return workdir


def pytest_configure(config):
  """Under xdist, tests marked `xdist_group(NAME)` run on one worker (sharing the module
  fixtures they would otherwise each build): `-n 2` means `--dist loadgroup`. The controller
  schedules by group; each worker must also tag the grouped tests' ids with their group,
  which xdist does only when `--dist loadgroup` was on the command line."""
  if getattr(config.option, "dist", "no") == "load":
    config.option.dist = "loadgroup"
  if hasattr(config, "workerinput"):
    config.option.loadgroup = True


COUNTS = ("faults_injected", "runs_resumed", "bytes_compared")


def pytest_terminal_summary(terminalreporter):
  """One line totalling what the fault-injection tests recorded (`record_property`)."""
  reports = [r for r in terminalreporter.stats.get("passed", []) if r.when == "call"]
  totals = {name: 0 for name in COUNTS}
  for report in reports:
    for name, value in report.user_properties:
      if name in totals:
        totals[name] += value
  if any(totals.values()):
    terminalreporter.write_line(
        f"fault injection: {totals['faults_injected']} faults injected, "
        f"{totals['runs_resumed']} runs resumed, {totals['bytes_compared']:,} bytes compared "
        "bitwise, nothing lost")
