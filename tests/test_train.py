"""The training script end to end (real subprocesses, real orbax checkpoints): one-jit RL
step, metrics, a converted checkpoint as the start. test_fault_injection kills and resumes
it."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from script_env import script_env

ROOT = os.path.join(os.path.dirname(__file__), "..")
SMALL = ["--config.model.name=micro", "--config.sft.steps=4", "--config.sft.batch_size=4",
         "--config.sft.max_examples=16", "--config.rl.steps=3",
         "--config.rollout.prompts_per_step=2", "--config.grpo.group_size=2",
         "--config.data.prompt_width=64", "--config.env.buffer_size=320",
         "--config.env.max_turns=7", "--config.env.max_action_tokens=48",
         "--config.checkpoint.save_interval_steps=1", "--config.checkpoint.async_save=False",
         "--config.optim.lr=1e-3", "--config.sft.schedule=constant"]
# OPSD: its distillation term has a gradient even when the small model earns no reward (it
# earns none after 4 SFT steps), so a replayed RL step really moves the parameters.
OPSD = ("--config.algorithm=opsd",)


def _train(workdir, data_dir, *extra, wait=True, devices=1):
  """scripts/train.py with the SMALL config as a subprocess seeing `devices` CPU devices."""
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "train.py"),
         f"--config={os.path.join(ROOT, 'configs', 'pbsd.py')}", f"--workdir={workdir}",
         f"--config.data.dir={data_dir}", *SMALL, *extra]
  proc = subprocess.Popen(cmd, env=script_env(devices), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  if wait:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
  return proc


def _metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _checkpoint(workdir, stage="rl", step=None):
  """A saved train state (the latest step by default), read straight from the orbax files
  onto this process's first device, whatever mesh saved it."""
  import jax
  import orbax.checkpoint as ocp
  from etils import epath
  if step is None:
    step = max(int(d) for d in os.listdir(os.path.join(workdir, f"ckpt_{stage}"))
               if d.isdigit())
  path = os.path.join(workdir, f"ckpt_{stage}", str(step), "state")
  metadata = ocp.PyTreeCheckpointHandler().metadata(epath.Path(path))
  tree = getattr(metadata, "tree", metadata)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
                        tree)
  return ocp.PyTreeCheckpointer().restore(path, args=ocp.args.PyTreeRestore(
      item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)))


def _final_params(workdir):
  """The latest RL checkpoint's step and params."""
  step = max(int(d) for d in os.listdir(os.path.join(workdir, "ckpt_rl")) if d.isdigit())
  return step, _checkpoint(workdir, step=step)["params"]


@pytest.fixture(scope="module")
def uninterrupted(kg, tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("full"))
  _train(workdir, os.path.dirname(kg.paths["spm_model"]))
  return workdir


def test_training_logs_every_metric_the_paper_tracks(uninterrupted):
  rows = _metrics(uninterrupted)
  assert [r["step"] for r in rows if r["stage"] == "sft"] == [1, 2, 3, 4]
  rl = [r for r in rows if r["stage"] == "rl"]
  assert [r["step"] for r in rl] == [1, 2, 3]
  for key in ("accuracy", "mean_turns", "mean_action_tokens", "credit/frac_evidence_pos",
              "credit/mean_abs_evidence", "credit/frac_deadband", "credit/weight_mean",
              "credit/weight_min", "credit/weight_max", "pg_clipfrac", "grad_norm", "entropy"):
    assert all(np.isfinite(r[key]) for r in rl), key
  assert all(0.9 - 1e-6 <= r["credit/weight_min"] <= r["credit/weight_max"] <= 1.1 + 1e-6
             for r in rl)
  sft = [r["loss"] for r in rows if r["stage"] == "sft"]
  assert sft[-1] < sft[0]
  assert os.listdir(os.path.join(uninterrupted, "tensorboard"))


def test_a_bad_config_ends_the_run_at_start_up_with_one_line(kg, tmp_path):
  proc = _train(str(tmp_path), os.path.dirname(kg.paths["spm_model"]),
                "--config.pbsd.delta=-1.0", wait=False)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode != 0
  assert "config.pbsd.delta" in out
  assert not os.path.exists(os.path.join(str(tmp_path), "ckpt_sft"))


def _one_step_both_ways(kg, algorithm):
  """One RL step of `algorithm` as one program (`make_rl_iteration`) and as two (the
  rollout, then `learner.make_rl_step`), from the same state and batch."""
  import jax
  import jax.numpy as jnp

  from pbsd_jax.agent.rollout import ingraph_rollout
  from pbsd_jax.generate.sampling import Sampler
  from pbsd_jax.models import init_params
  from pbsd_jax.rl import learner, train_state
  from pbsd_jax.run import task as task_lib, train
  from test_configs import load_spec

  spec = load_spec(algorithm, *SMALL)
  task = task_lib.prepare_task(spec, os.path.dirname(kg.paths["spm_model"]))
  spec = spec.for_vocabulary(task.vocab.vocab_size)
  model, algo, tx, plan = spec.model, spec.algorithm, spec.rl.optimizer, spec.rl.plan
  sampler = Sampler(model)
  iteration = train.make_rl_iteration(task.agent(sampler), model, tx, algo, plan)
  params = init_params(model, jax.random.key(0))
  teacher = jax.tree.map(jnp.copy, params) if algo.distillation_beta is not None else None
  state = train_state.init_train_state(params, tx, jax.random.key(1))
  separate = jax.tree.map(jnp.copy, state)  # the one program donates `state`
  records, group_ids = task_lib.rl_prompts(task, spec, 0)
  batch = task_lib.rl_batch(task, spec.data, records)
  group_ids = jnp.asarray(group_ids, jnp.int32)
  args = (state, (task.search, task.tokenizer.text), batch, group_ids, teacher)
  text = iteration.lower(*args).as_text()
  one = iteration(*args)

  rng, sample = jax.random.split(separate.rng)
  rollout = ingraph_rollout(sampler, task.env, separate.params, batch["prompts"],
                            batch["prompt_mask"], sample, task.index, batch["gold"], group_ids)
  update = learner.make_rl_step(model, tx, algo, task.env.max_turns, plan)
  two = (*update(separate.replace(rng=rng), rollout, batch["teacher_prompt"],
                 batch["teacher_prompt_mask"], teacher), rollout)
  return spec, text, one, two


def _assert_same_step(one, two, keys):
  import jax
  (state, rollout, metrics), (want_state, want_metrics, want_rollout) = one, two
  np.testing.assert_array_equal(rollout.tokens, want_rollout.tokens)
  np.testing.assert_array_equal(rollout.reward, want_rollout.reward)
  assert int(state.step) == int(want_state.step) == 1
  for key in keys:
    np.testing.assert_allclose(float(metrics[key]), float(want_metrics[key]), rtol=1e-4,
                               atol=1e-6, err_msg=key)
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(want_state.params)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_one_jitted_call_runs_rollout_reward_evidence_credit_and_update(kg):
  spec, text, one, two = _one_step_both_ways(kg, "pbsd")
  assert "while" in text  # the turn loop is inside the one program
  new_state, rollout, metrics = one
  assert int(new_state.step) == 1 and rollout.tokens.shape == (4, spec.env.buffer_size)
  np.testing.assert_array_equal(rollout.group_ids, [0, 0, 1, 1])
  assert float(metrics["accuracy"]) == float(np.mean(rollout.reward))
  # The one program computes what the rollout and the update compute apart.
  _assert_same_step(one, two, ("credit/frac_evidence_pos", "credit/mean_abs_evidence",
                               "grad_norm", "accuracy"))


def test_opsd_with_frozen_teacher_parameters_is_one_program_too(kg):
  _, text, one, two = _one_step_both_ways(kg, "opsd")
  assert "while" in text
  _assert_same_step(one, two, ("grad_norm", "accuracy"))


def test_a_converted_checkpoint_is_where_training_starts(kg, tmp_path):
  import jax

  from pbsd_jax.models import ModelConfig, init_params
  from pbsd_jax.run import policy_checkpoint, run_config, train
  from test_configs import load, load_spec

  model = ModelConfig(vocab_size=kg.vocab.vocab_size, hidden_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=1, mlp_dim=64)
  params = init_params(model, jax.random.key(7))
  policy_checkpoint.save_params(str(tmp_path), model, params)  # convert_hf's layout
  config = load("pbsd", f"--config.model.init_dir={tmp_path}")
  assert run_config.build_model_config(config, kg.vocab.vocab_size) == model
  mesh = run_config.build_mesh(config)  # the 8 fake devices: restored into shards
  got = train.initial_params(load_spec("pbsd", f"--config.model.init_dir={tmp_path}")
                             .for_vocabulary(kg.vocab.vocab_size), mesh)
  assert got["embedding"].sharding.mesh == mesh
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(run_config.ConfigError, match="model.init_dir"):
    run_config.build_model_config(config, kg.vocab.vocab_size + 1)


def test_sft_teacher_fraction_trains_those_rows_on_the_privileged_prompt(kg):
  """The same records are drawn with and without the option; the chosen rows carry the
  record's own privileged prompt before an unchanged trajectory and loss mask."""
  import jax

  from pbsd_jax.agent.batch import prompt_region
  from pbsd_jax.run import task as task_lib, train
  from test_configs import load_spec

  def sequences(fraction):
    spec = load_spec("demo", *SMALL, "--config.sft.steps=6",
                     f"--config.sft.teacher_fraction={fraction}")
    task = task_lib.prepare_task(spec, os.path.dirname(kg.paths["spm_model"]))
    spec = spec.for_vocabulary(task.vocab.vocab_size)
    records = task.splits["sft"][:spec.sft.max_examples]
    return spec, task, records, train._local_sft_sequences(
        spec, task, records, spec.build_mesh(jax.devices()[:1]))

  spec, task, records, (rows, on_teacher, seqs) = sequences(0.5)
  *_, (rows0, on_teacher0, seqs0) = sequences(0.0)
  np.testing.assert_array_equal(rows, rows0)
  assert not on_teacher0.any() and 0.2 < on_teacher.mean() < 0.8
  width, size = spec.data.prompt_width, spec.sft.batch_size
  for step in range(spec.sft.steps):
    drawn = np.random.default_rng([spec.seed, step]).choice(len(records), size,
                                                              replace=False)
    tokens, mask, action = train._sft_rows(seqs, rows[step], on_teacher[step])
    want = train._sft_rows(seqs0, rows0[step], on_teacher0[step])
    np.testing.assert_array_equal(tokens[:, width:], want[0][:, width:])
    np.testing.assert_array_equal(mask[:, width:], want[1][:, width:])
    np.testing.assert_array_equal(action, want[2])
    for j, i in enumerate(drawn):
      r = records[i]
      region = prompt_region([r["question"]], task.tokenizer.encode, width,
                             answers=[r["golden_answers"][0]])
      key = "teacher_prompt" if on_teacher[step][j] else "prompt"
      np.testing.assert_array_equal(tokens[j, :width], region[key if on_teacher[step][j]
                                                              else "prompts"][0])
      np.testing.assert_array_equal(mask[j, :width], region[f"{key}_mask"][0])


def test_replayed_routing_scores_the_same_rollout_under_the_sampler_routes(kg, tmp_path):
  # The evidence pass fails without the sampler's routes (`evidence.replayed_routes`), so a
  # finished step means the rollout recorded them and the learner read them;
  # tests/test_rollout.py checks what they change. The in-graph rollout searches the sparse
  # index here (`env.index`), also checked there.
  rows = {}
  for replay in (True, False):
    workdir = str(tmp_path / f"replay_{replay}")
    _train(workdir, os.path.dirname(kg.paths["spm_model"]), "--config.model.name=micro-moe",
           "--config.rl.steps=1", f"--config.pbsd.replay_routing={replay}",
           "--config.env.index=sparse")
    (rows[replay],) = [r for r in _metrics(workdir) if r["stage"] == "rl"]
  replayed, fresh = rows[True], rows[False]
  # One SFT checkpoint and seed: both sample the same rollout (recording routes changes no
  # draw) ...
  for key in ("accuracy", "mean_turns", "mean_action_tokens"):
    assert replayed[key] == fresh[key], key
  assert replayed["mean_action_tokens"] > 0
  # ... and score it differently: the teacher's pass on its own prompt routes the trajectory
  # tokens afresh, unless it takes the sampler's routes.
  assert replayed["credit/mean_abs_evidence"] > 0
  assert replayed["credit/mean_abs_evidence"] != fresh["credit/mean_abs_evidence"]


def test_an_oracle_trajectory_longer_than_the_turn_budget_fails_naming_the_field(kg):
  from pbsd_jax.run import run_config, task as task_lib
  from test_configs import load_spec

  spec = load_spec("demo", *SMALL, "--config.env.max_turns=3")
  task = task_lib.prepare_task(spec, os.path.dirname(kg.paths["spm_model"]))
  spec = spec.for_vocabulary(task.vocab.vocab_size)
  long = next(r for r in task.splits["sft"] if len(r["actions"]) > 3)
  with pytest.raises(run_config.ConfigError) as err:
    task_lib.sft_sequences(task, [long], spec.data, spec.model)
  assert str(err.value) == (
      f"config.env.max_turns=3: the oracle trajectory of SFT question {long['question']!r}: "
      f"has {len(long['actions'])} actions, more than max_turns=3")


def test_the_generator_fields_make_the_dataset_and_a_made_one_must_match(tmp_path):
  from pbsd_jax.data import world as world_lib
  from pbsd_jax.run import run_config, task as task_lib
  from test_configs import load_spec

  family = "--config.data.world.family_rate=1.0"
  hops = "--config.data.splits.hop_weights=(0.0,0.0,1.0)"
  task_lib.prepare_task(
      load_spec("pbsd", *SMALL, family, "--config.data.oracle.detour_share=0.5", hops),
      str(tmp_path))
  with open(tmp_path / "data" / "sft.jsonl") as f:
    sft = [json.loads(line) for line in f]
  assert {r["hops"] for r in sft} == {3}
  assert sum(any(r["detour_turns"]) for r in sft) == len(sft) // 2
  with open(tmp_path / "data" / "world.json") as f:
    families = json.load(f)["families"]
  default = world_lib.make_world(0).families
  assert sum(map(len, families)) > 1.5 * sum(map(len, default))
  with pytest.raises(run_config.ConfigError,
                     match=r"config\.data\.oracle\.detour_share=0\.15: .* was made with 0\.5"):
    task_lib.prepare_task(load_spec("pbsd", *SMALL, family, hops), str(tmp_path))
  with pytest.raises(run_config.ConfigError,
                     match=r"config\.data\.world\.people=200: .* was made with 320"):
    task_lib.prepare_task(load_spec("pbsd", *SMALL, family, hops, "--config.data.world.people=200",
                                    "--config.data.oracle.detour_share=0.5"), str(tmp_path))


def test_the_long_horizon_config_trains_at_test_size(tmp_path):
  """configs/long_horizon.py as shipped (its world, 8-hop chains, slips, 10 turns, 1,024
  slots, the demo's optimiser and update) with the micro model and few questions, trained with
  oracle credit (its RL step reads the rollouts' turn values) on two devices."""
  small = [f for f in SMALL if f.split("=")[0] not in (
      "--config.env.buffer_size", "--config.env.max_turns", "--config.optim.lr",
      "--config.sft.schedule", "--config.data.prompt_width")]
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "train.py"),
         f"--config={os.path.join(ROOT, 'configs', 'long_horizon.py')}",
         f"--workdir={tmp_path / 'run'}", f"--config.data.dir={tmp_path / 'data'}", *small,
         "--config.sft.warmup_steps=1", "--config.optim.warmup_steps=0",
         "--config.rl.steps=1", "--config.eval.every=0", "--config.algorithm=oracle_credit",
         "--config.data.splits.rl_train=32",
         "--config.data.splits.rl_validation=8", "--config.data.splits.sft=32",
         "--config.data.splits.ood_per_tier=4", "--config.data.splits.ood_pool=6"]
  # On a mesh of two devices: the rows, the turn values and oracle credit split over them.
  proc = subprocess.run(cmd, env=script_env(2), capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  with open(tmp_path / "data" / "manifest.json") as f:
    horizon = json.load(f)["horizon"]
  assert {int(h) for h, n in horizon["hops"].items() if n} == {8}
  assert horizon["turns"]["max"] > 7  # past the demo's budget
  with open(tmp_path / "data" / "sft.jsonl") as f:
    sft = [json.loads(line) for line in f]
  assert horizon["derailed"] == sum(r["derailed"] for r in sft) / len(sft)
  rl = [m for m in _metrics(tmp_path / "run") if m.get("stage") == "rl"]
  assert rl[-1]["step"] == 1
  assert 0 <= rl[-1]["credit/frac_deadband"] <= 1 and "credit/auc_evidence_value" in rl[-1]
  # The Monte Carlo check of the turn values, on the SFT checkpoint.
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "scripts", "check_labels.py"),
       f"--config={os.path.join(ROOT, 'configs', 'long_horizon.py')}",
       f"--ckpt_dir={tmp_path / 'run' / 'ckpt_sft'}", f"--config.data.dir={tmp_path / 'data'}",
       *cmd[5:], "--questions=4", "--continuations=2", f"--out={tmp_path / 'check.json'}"],
      env=script_env(), capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  with open(tmp_path / "check.json") as f:
    check = json.load(f)
  value, mc = (np.array(check[k], dtype=float) for k in ("value", "mc"))
  assert value.shape == (4, 10) and np.array_equal(np.isnan(value), np.isnan(mc))
  assert check["summary"]["turns"] == int((~np.isnan(value)).sum()) > 0


def test_embedded_questions_longer_than_the_prompt_width_fail_in_one_line(tmp_path):
  from pbsd_jax.run import run_config, task as task_lib
  from test_configs import load_spec
  spec = load_spec("long_horizon", "--config.model.name=micro", "--config.data.prompt_width=40",
                   "--config.data.splits.rl_train=32", "--config.data.splits.rl_validation=8",
                   "--config.data.splits.sft=32", "--config.data.splits.ood_per_tier=4",
                   "--config.data.splits.ood_pool=6")
  # The student's prompt of an 8-hop question fits 40 tokens; the teacher's does not.
  with pytest.raises(run_config.ConfigError,
                     match=r"^config\.data\.prompt_width=40: data\.dir's rl_train: teacher "
                           r"\(privileged\) question \d+ has \d+ tokens, more than the prompt "
                           r"width 40"):
    task_lib.prepare_task(spec, str(tmp_path))


def test_the_chain_teacher_prompt_reaches_the_rl_batch(kg, tmp_path):
  """`data.teacher_prompt=chain`: the teacher's prompt (RL's, and SFT's teacher rows, which
  read the same batch) states each question's answer and gold chain; the student's does not."""
  from pbsd_jax.agent import privileged
  from pbsd_jax.run import task as task_lib
  from test_configs import load_spec
  spec = load_spec("pbsd", *SMALL, "--config.data.teacher_prompt=chain",
                   "--config.data.prompt_width=160",
                   f"--config.data.dir={os.path.dirname(kg.paths['spm_model'])}")
  task = task_lib.prepare_task(spec, str(tmp_path))
  records = task.splits["rl_train"][:4]
  batch = task_lib.rl_batch(task, spec.data, records)
  for b, r in enumerate(records):
    student = task.tokenizer.decode(batch["prompts"][b][batch["prompt_mask"][b]])
    teacher = task.tokenizer.decode(batch["teacher_prompt"][b][batch["teacher_prompt_mask"][b]])
    assert " -> ".join(r["chain_names"]) in teacher and privileged.chain_text(r) not in student
    assert teacher.startswith(student)


def test_the_knowledge_stage_trains_on_corpus_documents(kg, tmp_path):
  """`sft.corpus_fraction`: that share of each SFT batch's rows are corpus documents, as an
  observation shows them, whole in the loss but their first token; the others stay the
  trajectories they were."""
  import jax
  from pbsd_jax.agent.env.observations import format_document
  from pbsd_jax.agent.env.retriever import Document
  from pbsd_jax.run import task as task_lib, train as train_lib
  from test_configs import load_spec
  data = f"--config.data.dir={os.path.dirname(kg.paths['spm_model'])}"
  spec = load_spec("pbsd", *SMALL, data, "--config.sft.corpus_fraction=0.5",
                   "--config.sft.steps=20")
  task = task_lib.prepare_task(spec, str(tmp_path / "w"))
  mesh = spec.build_mesh(jax.devices()[:1])
  documents, on_corpus, which = train_lib._local_corpus_rows(spec, task, 200, mesh)
  with open(task.corpus) as f:
    corpus = [json.loads(line) for line in f]
  for d in (0, 7):
    want = kg.encode(format_document(Document(str(corpus[d]["id"]), corpus[d]["contents"], 0.0)))
    np.testing.assert_array_equal(documents[0][d, :len(want)], want[:200])
    assert documents[1][d].sum() == min(len(want), 200) and not documents[2][d, 0]
  assert 0.35 < on_corpus.mean() < 0.65  # 20 steps x 4 rows at 0.5
  tokens = np.arange(4 * 200).reshape(4, 200)
  batch = (tokens, np.ones((4, 200), bool), np.ones((4, 200), bool))
  step = int(np.argmax(on_corpus.any(axis=1)))
  got = train_lib._with_documents(batch, (documents, on_corpus, which), step)
  for row in range(4):
    want = documents[0][which[step][row]] if on_corpus[step][row] else tokens[row]
    np.testing.assert_array_equal(got[0][row], want)
  # The run path: scripts/train.py with it, on a mesh of two devices.
  _train(str(tmp_path / "run"), os.path.dirname(kg.paths["spm_model"]),
         "--config.sft.corpus_fraction=0.5", "--config.rl.steps=0", devices=2)
  assert [m["step"] for m in _metrics(str(tmp_path / "run")) if m["stage"] == "sft"] == [1, 2, 3, 4]
