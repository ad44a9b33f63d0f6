"""A real model end to end, nothing mocked: a tiny Qwen2 written by `transformers`, a byte-level
BPE trained here by `tokenizers` (ChatML special tokens and chat template; the protocol tags are
several tokens each), converted by scripts/convert_hf.py; a retrieval server
(scripts/serve_retriever.py) on loopback over a real-text corpus; Search-R1 parquet questions and
JSONL SFT trajectories. scripts/train.py runs SFT and PBSD steps, is killed and resumes, and
scripts/evaluate.py evaluates the result through the same server."""

import json
import os
import re
import signal
import string
import subprocess
import sys
import time

import numpy as np
import pytest

from pbsd_jax import protocol
from script_env import script_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (title, text): the corpus; each question's answer is in one document.
DOCUMENTS = [
    ("Varnhollow", "Varnhollow is a river town in the northern hills. It was founded by Ditu "
                   "Ponn, a miller, in the year 1620."),
    ("Ditu Ponn", "Ditu Ponn was a miller and surveyor. Ponn was born in the coastal village "
                  "of Sel Marra."),
    ("Sel Marra", "Sel Marra is a fishing village on the western coast, known for its blue "
                  "boats and its lighthouse."),
    ("Orla Quist", "Orla Quist is a painter who lives in Brennack. Her teacher was the "
                   "sculptor Amon Tell."),
    ("Brennack", "Brennack is a mountain city built around a copper mine. Its river is the "
                 "Cold Ash."),
    ("Amon Tell", "Amon Tell was a sculptor from Varnhollow who carved the bridge lions."),
    ("Cold Ash", "The Cold Ash is a river that flows from the Brennack mine into the Grey "
                 "Lake."),
    ("Grey Lake", "The Grey Lake is the largest lake of the region, with an island monastery."),
]
QUESTIONS = [
    ("Who founded Varnhollow?", "Ditu Ponn", "Varnhollow founder"),
    ("Where was Ditu Ponn born?", "Sel Marra", "Ditu Ponn born"),
    ("What is Sel Marra known for?", "blue boats", "Sel Marra known"),
    ("Who taught Orla Quist?", "Amon Tell", "Orla Quist teacher"),
    ("What is the river of Brennack?", "Cold Ash", "Brennack river"),
    ("Where did Amon Tell come from?", "Varnhollow", "Amon Tell from"),
    ("Where does the Cold Ash flow to?", "Grey Lake", "Cold Ash flows"),
    ("What is on the island of the Grey Lake?", "monastery", "Grey Lake island"),
]
CHATML = ("{% for message in messages %}"
          "{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
          "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
          "'\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _contents(title, text):
  return f"{title}\n{text}"


def _trajectory(question, answer, query):
  """Search-R1 style: a search, the observation the server gives for it, the answer."""
  title, text = next(d for d in DOCUMENTS if d[0].split()[0] in query)
  return (f"<search> {query} </search>\n\n<information>{_contents(title, text)}\n"
          f"</information>\n\n<answer> {answer} </answer>")


def _write_tokenizer(path):
  """A byte-level BPE trained on the corpus and questions only, so no protocol tag is a token."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, trainers
  tokenizer = tokenizers.Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  texts = [_contents(*d) for d in DOCUMENTS] + [q for q, _, _ in QUESTIONS] + [
      "You are a helpful assistant.", "Question: I need to search. I found it."]
  tokenizer.train_from_iterator(texts * 4, trainers.BpeTrainer(
      vocab_size=500, special_tokens=SPECIALS, show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tokenizer.save(os.path.join(path, "tokenizer.json"))
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump({"tokenizer_class": "Qwen2TokenizerFast", "chat_template": CHATML,
               "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, f)
  return tokenizer


def _normalize(text):
  """SQuAD answer normalisation, written here independently of pbsd_jax.agent.env.rewards."""
  text = "".join(c for c in text.lower() if c not in set(string.punctuation))
  return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def _run(args, timeout=600, wait=True):
  proc = subprocess.Popen([sys.executable, *args], env=script_env(), cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  if wait:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-3000:]
    return out
  return proc


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  """The HF model (converted), the data files and a running retrieval server."""
  import pyarrow as pa
  import pyarrow.parquet as pq
  import torch
  import transformers
  root = tmp_path_factory.mktemp("real")
  hf_dir = root / "hf"
  hf_dir.mkdir()
  tokenizer = _write_tokenizer(str(hf_dir))
  for tag in protocol.TAGS:
    assert len(tokenizer.encode(tag).ids) > 1, tag
  im_end, eot = tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")
  torch.manual_seed(0)
  config = transformers.Qwen2Config(
      vocab_size=tokenizer.get_vocab_size() + 12, hidden_size=64, intermediate_size=128,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      max_position_embeddings=512, tie_word_embeddings=True, rms_norm_eps=1e-6,
      bos_token_id=None, eos_token_id=[im_end, eot], pad_token_id=eot)
  model = transformers.Qwen2ForCausalLM(config).eval()
  model.save_pretrained(str(hf_dir))
  model.generation_config.save_pretrained(str(hf_dir))
  ckpt = root / "ckpt"
  _run([os.path.join("scripts", "convert_hf.py"), f"--hf_dir={hf_dir}", f"--out={ckpt}"])

  corpus = root / "corpus.jsonl"
  with open(corpus, "w") as f:
    for i, (title, text) in enumerate(DOCUMENTS):
      f.write(json.dumps({"id": str(i), "contents": _contents(title, text)}) + "\n")
  questions = root / "train.parquet"
  pq.write_table(pa.table({"question": [q for q, _, _ in QUESTIONS],
                           "golden_answers": [[a] for _, a, _ in QUESTIONS],
                           "data_source": ["nq"] * len(QUESTIONS)}), str(questions))
  sft = root / "sft.jsonl"
  with open(sft, "w") as f:
    for q, a, query in QUESTIONS:
      f.write(json.dumps({"question": q, "golden_answers": [a],
                          "trajectory": _trajectory(q, a, query)}) + "\n")
  server = _run([os.path.join("scripts", "serve_retriever.py"), f"--corpus={corpus}",
                 "--port=0", "--topk=1"], wait=False)
  for line in server.stdout:  # log lines, then the address
    if match := re.search(r"Serving on (http://\S+)", line):
      break
  assert match, server.poll()
  yield dict(root=root, ckpt=str(ckpt), questions=str(questions), sft=str(sft),
             url=match.group(1), corpus=str(corpus))
  server.send_signal(signal.SIGTERM)
  server.wait(timeout=30)


def _flags(world, workdir, *extra):
  return [os.path.join("scripts", "train.py"), "--config=configs/search_r1.py",
          f"--workdir={workdir}", f"--config.model.init_dir={world['ckpt']}",
          f"--config.data.train_files={world['questions']}",
          f"--config.data.eval_files={world['questions']}",
          f"--config.data.sft_files={world['sft']}", f"--config.env.url={world['url']}",
          *SMALL, *extra]


# The recipe at test size: its dtypes, remat, optimiser and update plan (mini-batches,
# micro-batches, a chunked LM head) as shipped, at sizes that split the small batch.
SMALL = ["--config.data.prompt_template=default",
         "--config.data.prompt_width=112", "--config.data.gold_width=8",
         "--config.env.buffer_size=240", "--config.env.max_turns=3",
         "--config.env.max_action_tokens=32", "--config.env.max_observation_tokens=56",
         "--config.env.max_query_tokens=16", "--config.env.top_k=1",
         "--config.rollout.prompts_per_step=4", "--config.grpo.group_size=4",
         "--config.rollout.temperature=0.7", "--config.rl.micro_batch_size=2",
         "--config.rl.chunk_size=64",
         "--config.sft.steps=60", "--config.sft.batch_size=8", "--config.sft.lr=1e-2",
         "--config.sft.warmup_steps=5", "--config.sft.teacher_fraction=0.25",
         "--config.optim.lr=1e-4", "--config.optim.warmup_steps=0", "--config.rl.steps=3",
         "--config.rl.save_rollouts=1", "--config.checkpoint.save_interval_steps=1",
         "--config.eval.num_examples=8", "--config.eval.pass_k=1,2"]


def test_train_kill_resume_and_evaluate_a_converted_model_through_the_server(world, tmp_path):
  workdir = str(tmp_path / "run")
  # Killed once the first RL step is saved, then resumed by the same command.
  proc = _run(_flags(world, workdir), wait=False)
  deadline = time.time() + 600
  while not os.path.isdir(os.path.join(workdir, "ckpt_rl", "1", "state")):
    assert proc.poll() is None, proc.stdout.read()[-3000:]
    assert time.time() < deadline
    time.sleep(0.5)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  out = _run(_flags(world, workdir))
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  assert [r["step"] for r in rows if r["stage"] == "rl"] == [1, 2, 3], out[-2000:]

  _check_rollouts(workdir, (2, 3))
  # The SFT checkpoint seeds an in-graph run over the same corpus tokenised with the model's
  # tokenizer (found in the first run's <workdir>/tokenizer): one XLA program per step.
  ingraph = str(tmp_path / "ingraph")
  _run([os.path.join("scripts", "train.py"), "--config=configs/search_r1.py",
        f"--workdir={ingraph}", f"--config.model.init_dir={workdir}/ckpt_sft",
        f"--config.data.train_files={world['questions']}", "--config.env.retriever=ingraph",
        f"--config.data.corpus={world['corpus']}", *SMALL, "--config.sft.steps=0",
        "--config.rl.steps=1"])
  _check_rollouts(ingraph, (1,))

  out = _run([os.path.join("scripts", "evaluate.py"), "--config=configs/search_r1.py",
              f"--ckpt_dir={workdir}/ckpt_rl", f"--splits={world['questions']}",
              "--samples=2", "--num_examples=8", "--batch_size=16",
              f"--config.model.init_dir={world['ckpt']}",
              f"--config.data.train_files={world['questions']}",
              f"--config.env.url={world['url']}", *SMALL])
  with open(os.path.join(workdir, "eval_ckpt_rl_step3.json")) as f:
    result = json.load(f)["splits"][world["questions"]]
  assert result["greedy"]["num_questions"] == 8, out[-2000:]


def _check_rollouts(workdir, steps):
  """The saved rollouts of `steps`: trained on exactly the sampled tokens, observations the
  environment's, rewards the exact match recomputed from the decoded text (some right)."""
  from pbsd_jax.data import vocab as vocab_lib
  vocab = vocab_lib.model_vocabulary(os.path.join(workdir, "tokenizer"))
  assert vocab.eos_id == vocab.tokenizer.token_to_id("<|im_end|>")
  answers = {q: a for q, a, _ in QUESTIONS}
  rewarded = 0
  for step in steps:
    r = dict(np.load(os.path.join(workdir, "rollouts", f"rl_{step}.npz")))
    p = int(r["prompt_width"])
    for b in range(r["tokens"].shape[0]):
      tokens, trained = r["tokens"][b], r["action_mask"][b]
      real = r["mask"][b]
      # Trained on exactly the sampled tokens (each with its sampling log-prob), in the
      # trajectory; every other trajectory token is the environment's.
      assert not trained[:p].any() and not (trained & ~real).any()
      assert np.all(r["sample_logp"][b][trained] < 0)
      trajectory = slice(p, int(r["length"][b]))
      observations = vocab.decode(tokens[trajectory][~trained[trajectory]])
      assert protocol.SEARCH_CLOSE not in observations
      assert protocol.ANSWER_OPEN not in observations
      text = vocab.decode(tokens[trajectory])
      assert text.count(protocol.INFO_OPEN) == int(r["searches"][b])
      # The reward is the exact match of the last complete answer span of the actions,
      # recomputed from the decoded turns.
      prompt = vocab.tokenizer.decode(tokens[:p][real[:p]].tolist(), skip_special_tokens=False)
      question = prompt.split("Question: ")[1].split("\n")[0]
      spans = []
      for k in range(int(r["num_turns"][b])):
        turn = vocab.decode(tokens[r["turn_ids"][b] == k])
        close = turn.rfind(protocol.ANSWER_CLOSE)
        start = turn.rfind(protocol.ANSWER_OPEN, 0, max(close, 0))
        if close >= 0 and start >= 0:
          spans.append(turn[start + len(protocol.ANSWER_OPEN):close])
      want = float(bool(spans) and _normalize(spans[-1]) == _normalize(answers[question]))
      assert r["reward"][b] == want, (text, answers[question])
      rewarded += want
  assert rewarded > 0  # the check above compared some right answers


def _config(world, *extra):
  """configs/search_r1.py with `SMALL` and `extra` (`--config.a.b=value` strings) applied, the
  way the command line types them."""
  from pbsd_jax.run import cli
  config = cli.load_config_file(os.path.join(ROOT, "configs", "search_r1.py"))
  flags = [f"--config.model.init_dir={world['ckpt']}",
           f"--config.data.train_files={world['questions']}",
           f"--config.env.url={world['url']}", *SMALL, *extra]
  for flag in flags:
    path, value = flag.removeprefix("--config.").split("=", 1)
    *sections, field = path.split(".")
    node = config
    for name in sections:
      node = node[name]
    old = node[field]
    node[field] = (value == "True" if isinstance(old, bool) else
                   tuple(int(v) for v in value.split(",")) if isinstance(old, tuple) else
                   type(old)(value))
  return config


def test_a_bm25s_index_serves_host_rollouts_with_multi_token_tags(world, tmp_path):
  """scripts/build_index.py's index through `env.retriever=bm25s`: no device index; forced
  Search-R1 actions (tags of several tokens) are classified on their text, the observation is
  the index's top document between the tag tokens, only the actions are trained on, and the
  reward is the exact match of the answer."""
  import jax
  from pbsd_jax.agent.batch import forced_batch, prompt_region
  from pbsd_jax.agent.env.agent_env import KIND_ANSWER, KIND_SEARCH
  from pbsd_jax.agent.env.host_bm25 import HostBM25Retriever
  from pbsd_jax.agent.env.observations import format_document
  from pbsd_jax.agent.rollout import host_rollout
  from pbsd_jax.generate.sampling import Sampler
  from pbsd_jax.run import policy_checkpoint, run_config, task as task_lib
  index_dir = str(tmp_path / "index")
  _run([os.path.join("scripts", "build_index.py"), f"--corpus={world['corpus']}",
        f"--out={index_dir}"])
  config = _config(world, "--config.env.retriever=bm25s", f"--config.env.index_dir={index_dir}")
  task = task_lib.prepare_task(run_config.validate(config, 1), str(tmp_path))
  assert task.index is None and isinstance(task.search, HostBM25Retriever)
  assert task.env.text_tags and task.tokenizer.text is not None
  model = policy_checkpoint.find_model_config(world["ckpt"])
  params, _ = policy_checkpoint.restore_params(world["ckpt"])
  records = task.splits["rl_train"][:2]
  region = prompt_region([r["question"] for r in records], task.tokenizer.encode, 112,
                         chat=task.tokenizer.chat)
  plan = [["<search> Varnhollow founder </search>", "<answer> Ditu Ponn </answer>"],
          ["<search> Ditu Ponn born </search>", "<answer> Varnhollow </answer>"]]
  forced, lengths = forced_batch(plan, task.tokenizer.encode, task.env.max_turns,
                                 task.env.max_action_tokens)
  out = host_rollout(Sampler(model), task.env, params, region["prompts"],
                     region["prompt_mask"], jax.random.key(0), task.search, task.tokenizer,
                     [r["golden_answers"] for r in records], None, forced, lengths)
  np.testing.assert_array_equal(out.turn_kind[:, :2], [[KIND_SEARCH, KIND_ANSWER]] * 2)
  np.testing.assert_array_equal(out.reward, [1.0, 0.0])  # Ditu Ponn founded it; wrong place
  tokens, trained = np.asarray(out.tokens), np.asarray(out.action_mask)
  for b, actions_ in enumerate(plan):
    row = tokens[b, 112:int(out.length[b])].tolist()
    top = task.search.retrieve([actions_[0][9:-10]], 1)[0][0]
    observation = (list(task.env.tag_tokens("info_open"))
                   + task.tokenizer.encode(format_document(top))
                   + list(task.env.tag_tokens("info_close")))
    want = task.tokenizer.encode(actions_[0]) + observation + task.tokenizer.encode(actions_[1])
    assert row == want
    assert trained[b, 112:int(out.length[b])].tolist() == (
        [True] * len(task.tokenizer.encode(actions_[0])) + [False] * len(observation)
        + [True] * len(task.tokenizer.encode(actions_[1])))


@pytest.mark.parametrize("change, message", [
    (lambda w, t: [f"--config.model.init_dir={_without_tokenizer(w, t)}"],
     "needs a model with its tokenizer"),
    (lambda w, t: ["--config.env.url=http://127.0.0.1:9/retrieve"],
     "the retrieval server does not answer"),
    (lambda w, t: ["--config.data.prompt_width=30"],
     r"config.data.prompt_width=30: data.train_files: question 0: its prompt is \d+ tokens"),
    (lambda w, t: [f"--config.data.train_files={_bad_parquet(t)}"],
     r"config.data.train_files: .*bad.parquet, row 2: field 'golden_answers': expected a non-emp"),
    (lambda w, t: [f"--config.model.init_dir={_without_template(w, t)}"],
     "no chat template .* set config.data.chat_template=False"),
])
def test_bad_real_model_inputs_fail_in_one_line_naming_the_field(world, tmp_path, change,
                                                                 message):
  from pbsd_jax.run import run_config, task as task_lib
  config = _config(world, "--config.env.timeout_s=0.5", "--config.env.max_retries=0",
                   *change(world, tmp_path))
  with pytest.raises(run_config.ConfigError, match=message):
    task_lib.prepare_task(run_config.validate(config, 1), str(tmp_path))


def test_a_tokenizer_larger_than_the_embedding_is_refused(world, tmp_path):
  from pbsd_jax.data import vocab as vocab_lib
  from pbsd_jax.run import policy_checkpoint, run_config
  model = policy_checkpoint.find_model_config(world["ckpt"])
  small = tmp_path / "small"
  small.mkdir()
  policy_checkpoint.save_model_config(str(small), model.replace(vocab_size=100))
  vocab = vocab_lib.model_vocabulary(policy_checkpoint.tokenizer_dir(world["ckpt"]))
  with pytest.raises(run_config.ConfigError, match="embedding has 100 rows, fewer than the"):
    run_config.build_model_config(_config(world, f"--config.model.init_dir={small}"),
                                  vocab.vocab_size)
  # Without a tokenizer of its own, a model must have exactly the data vocabulary's ids.
  policy_checkpoint.save_model_config(str(small), model.replace(vocab_size=vocab.vocab_size + 8))
  with pytest.raises(run_config.ConfigError, match="holds no tokenizer, and the model's"):
    run_config.build_model_config(_config(world, f"--config.model.init_dir={small}"),
                                  vocab.vocab_size)
  assert run_config.build_model_config(
      _config(world), vocab.vocab_size).vocab_size == vocab.vocab_size + 12


def _bad_parquet(tmp_path):
  import pyarrow.parquet as pq
  import pyarrow as pa
  path = str(tmp_path / "bad.parquet")
  pq.write_table(pa.table({"question": ["a?", "b?"], "golden_answers": [["x"], []]}), path)
  return path


def _without_tokenizer(world, tmp_path):
  """The model's config alone: a model directory with no tokenizer."""
  import shutil
  target = tmp_path / "no_tokenizer"
  target.mkdir()
  shutil.copy(os.path.join(world["ckpt"], "model_config.json"), target)
  return str(target)


def _without_template(world, tmp_path):
  import shutil
  target = tmp_path / "no_template"
  shutil.copytree(world["ckpt"], target)
  config_file = target / "hf_assets" / "tokenizer_config.json"
  data = json.loads(config_file.read_text())
  del data["chat_template"]
  config_file.write_text(json.dumps(data))
  return str(target)


def test_the_model_vocabulary_reads_the_generation_config_and_sentencepiece_files(world, kg,
                                                                                 tmp_path):
  import shutil
  from pbsd_jax.data import vocab as vocab_lib
  from pbsd_jax.run import policy_checkpoint
  assets = policy_checkpoint.tokenizer_dir(world["ckpt"])
  # The tokenizer config names <|endoftext|>, the generation config lists <|im_end|> only: an
  # instruct model ends its turn with the latter.
  other = tmp_path / "other"
  shutil.copytree(assets, other)
  config = json.loads((other / "tokenizer_config.json").read_text())
  (other / "tokenizer_config.json").write_text(json.dumps({**config,
                                                           "eos_token": "<|endoftext|>"}))
  im_end = vocab_lib.HfTokenizerVocabulary(str(other / "tokenizer.json")).tokenizer.token_to_id(
      "<|im_end|>")
  (other / "generation_config.json").write_text(json.dumps({"eos_token_id": im_end}))
  assert vocab_lib.model_vocabulary(str(other)).eos_id == im_end
  # A SentencePiece `tokenizer.model` (Llama-2 style) is read as SentencePiece.
  spm = tmp_path / "spm"
  spm.mkdir()
  shutil.copy(kg.paths["spm_model"], spm / "tokenizer.model")
  assert policy_checkpoint.tokenizer_dir(str(spm)) == str(spm)
  vocab = vocab_lib.model_vocabulary(str(spm))
  assert vocab.encode("Question: who?") == kg.vocab.encode("Question: who?")


def test_chat_prompts_put_the_privileged_block_in_the_user_message(world, tmp_path):
  """Student and teacher prompts are the chat template's rendering of the user message (the
  teacher's with the privileged block appended), each left-padded to P."""
  from pbsd_jax.agent import privileged
  from pbsd_jax.agent.batch import prompt_region
  from pbsd_jax.models.hf import chat_template
  from pbsd_jax.run import run_config, task as task_lib
  task = task_lib.prepare_task(run_config.validate(_config(
      world, "--config.env.retriever=bm25s", f"--config.data.corpus={world['corpus']}"), 1),
      str(tmp_path))
  directory = os.path.join(world["ckpt"], "hf_assets")
  region = prompt_region(["Who founded Varnhollow?"], task.tokenizer.encode, 112,
                         answers=["Ditu Ponn"], chat=task.tokenizer.chat)
  message = protocol.format_prompt("Who founded Varnhollow?")
  for key, text in (("prompts", message),
                    ("teacher_prompt", message + privileged.privileged_block("Ditu Ponn"))):
    want = task.tokenizer.encode(chat_template.apply_chat_template(
        directory, [{"role": "user", "content": text}], add_generation_prompt=True))
    mask = region[f"{key}_mask" if key == "teacher_prompt" else "prompt_mask"][0]
    assert region[key][0][mask].tolist() == want and mask[-len(want):].all()
  assert vocab_decode(task, region["teacher_prompt"][0]).endswith("<|im_start|>assistant\n")


def vocab_decode(task, ids):
  return task.vocab.tokenizer.decode([int(i) for i in ids if i], skip_special_tokens=False)


def test_user_trajectories_train_on_the_actions_only(world, tmp_path):
  from pbsd_jax.run import run_config, task as task_lib
  spec = run_config.validate(_config(world, "--config.env.retriever=bm25s",
                                     f"--config.data.corpus={world['corpus']}",
                                     f"--config.data.sft_files={world['sft']}"), 1)
  task = task_lib.prepare_task(spec, str(tmp_path))
  tokens, mask, action = task_lib.trajectory_sequences(task, task.splits["sft"][:2], spec.data)
  for b, record in enumerate(task.splits["sft"][:2]):
    row, trained = tokens[b][mask[b]], action[b][mask[b]]
    text = record["trajectory"]
    observation = text[text.index(protocol.INFO_OPEN) + len(protocol.INFO_OPEN):
                       text.index(protocol.INFO_CLOSE)]
    search = text[:text.index(protocol.INFO_OPEN)].rstrip()
    answer = text[text.index(protocol.INFO_CLOSE) + len(protocol.INFO_CLOSE):]
    prompt = int(mask[b][:112].sum())
    observed = (list(task.env.tag_tokens("info_open")) + task.tokenizer.encode(observation)
                + list(task.env.tag_tokens("info_close")))
    encode = task.tokenizer.encode
    assert row[prompt:].tolist() == encode(search) + observed + encode(answer)
    assert trained.tolist() == ([False] * prompt + [True] * len(task.tokenizer.encode(search))
                                + [False] * len(observed) + [True] * len(encode(answer)))
