"""The training loop: SFT stage, then RL stage, with checkpoints and metrics.

Each stage resumes from its own checkpoint directory (`<workdir>/ckpt_sft`, `<workdir>/ckpt_rl`):
the `TrainState` (params, optimiser state, step, PRNG key) and the data position. Batches are
a pure function of the seed and the step (`pbsd_jax.run.task`), so a run killed at any point and
restarted with the same command ends with exactly the parameters of an uninterrupted run.

One RL step is `rl_iteration`: the agent samples the batch, then the update learns from it.
`rl_step_fn` picks how: over a device index the whole step -- rollout, reward, dual
likelihood, credit, update -- is one `jax.jit` program (`make_rl_iteration`), with or without
frozen teacher parameters; with a host retriever the rollout is the host turn loop followed
by the jitted update (`learner.make_rl_step`).

Faults stay visible: each RL step logs its `searches` and `failed_searches`, and with a host
retriever that counts its calls (`HttpRetriever.metrics`) the step's `retrieval/calls`,
`retrieval/failed_calls`, `retrieval/retries` and `retrieval/latency_s`; the progress bar
shows the run's fault totals once non-zero. A run whose every update was skipped as
non-finite for `rl.max_skipped_steps` steps in a row stops with one line. So does a fault of
the storage, within the step it happens in: every write raises `storage.StorageError`
(checkpoints, metrics, rollout files), and before each step's writes `check_claimed` stops a
run whose workdir was deleted or unmounted.
"""

from __future__ import annotations

import os
import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from pbsd_jax.agent import privileged
from pbsd_jax.agent.rollout import Agent, Rollout
from pbsd_jax.data import storage
from pbsd_jax.eval.metric_log import MetricLog
from pbsd_jax.generate.sampling import Sampler
from pbsd_jax.models import ModelConfig, init_params, param_shardings
from pbsd_jax.parallel import sharding
from pbsd_jax.rl import learner, train_state
from pbsd_jax.run import checkpoint, run_config, workdir as workdir_lib
from pbsd_jax.run.run_config import RunSpec
from pbsd_jax.run.task import Task, corpus_sequences, rl_batch, rl_prompts, sft_sequences

def device_memory() -> int | None:
  """Bytes of memory of this host's first device, where the backend reports it (GPU, TPU);
  None on the CPU."""
  stats = jax.local_devices()[0].memory_stats()
  return None if not stats else stats.get("bytes_limit")


def program_bytes(compiled: Any) -> int:
  """What a compiled program holds per device: arguments, outputs not in donated arguments'
  buffers, temporaries and code (`memory_analysis()`)."""
  m = compiled.memory_analysis()
  return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
          + m.temp_size_in_bytes + m.generated_code_size_in_bytes)


def fitted(program: Any, args: tuple, name: str, fields: str, limit: int | None = None
           ) -> Callable:
  """`program` (jitted) compiled for `args` before it runs, refused in one line when
  it needs more than `limit` bytes per device (default: `device_memory()`), instead of an
  out-of-memory error mid-step. Returns the compiled program, called as `program` is; where
  the device reports no memory and no `limit` is given, `program` itself (nothing compiles
  twice).

  Raises:
    SystemExit: naming the program, its need, the device's memory and `fields`.
  """
  limit = device_memory() if limit is None else limit
  if limit is None:
    return program
  compiled = program.lower(*args).compile()
  need = program_bytes(compiled)
  if need > limit:
    raise SystemExit(
        f"FATAL: {name} needs {storage.size_text(need)} per device, more than the "
        f"{storage.size_text(limit)} of a {jax.local_devices()[0].device_kind}; fields that "
        f"change it: {fields} (scripts/aot_compile.py shows each program's memory)")
  return compiled


def fitted_at_first_call(program: Any, name: str, fields: str) -> Callable:
  """`program`, checked by `fitted` on the arguments of its first call (the run's own first
  batch), then run as the program `fitted` returned."""
  checked = []

  def call(*args):
    if not checked:
      checked.append(fitted(program, args, name, fields))
    return checked[0](*args)

  return call


# The fields that change each program's memory, named when it does not fit.
SFT_FIELDS = "sft.batch_size, env.buffer_size, model.remat, model.param_dtype, rl.chunk_size"
RL_FIELDS = ("rl.micro_batch_size, rl.chunk_size, model.remat, rollout.prompts_per_step, "
             "grpo.group_size, env.buffer_size, model.cache_dtype")


def _checkpointer(spec: RunSpec, workdir: str, name: str) -> checkpoint.Checkpointer:
  c = spec.checkpoint
  return checkpoint.Checkpointer(os.path.join(workdir, name),
                                 save_interval_steps=c.save_interval_steps,
                                 max_to_keep=c.max_to_keep, async_save=c.async_save,
                                 fingerprint=workdir_lib.fingerprint(spec.settings))


def _resume(ckpt: checkpoint.Checkpointer, state: train_state.TrainState, log: MetricLog,
            stage: str, force_resume: bool) -> train_state.TrainState:
  """The newest good checkpoint's state (or `state` for a fresh start); the stage's metric
  rows after the restored step are dropped, since the run writes them again."""
  try:
    restored = ckpt.restore_latest(state, check_fingerprint=not force_resume)
  except checkpoint.ConfigMismatchError as err:
    raise SystemExit(f"{err}; pass --force_resume to resume it anyway") from None
  state = state if restored is None else restored[0]
  log.drop_after(stage, int(state.step))
  return state


def initial_params(spec: RunSpec, mesh: Mesh) -> Any:
  """The run's starting parameters, created in their shardings on `mesh` (never whole on one
  device): the `init_dir` model's, read in the run's `param_dtype`, or a seeded random
  init."""
  model = spec.model
  shardings = param_shardings(model, mesh)
  if spec.model_source.init_dir:
    from pbsd_jax.run import policy_checkpoint
    params, _ = policy_checkpoint.restore_params(spec.model_source.init_dir, sharding=shardings,
                                                 dtype=model.jnp_param_dtype)
    return params
  return init_params(model, jax.random.key(spec.seed), shardings)


def fresh_state(params: Any, tx: optax.GradientTransformation, model: ModelConfig,
                 mesh: Mesh, seed: int) -> train_state.TrainState:
  """A step-0 state of `params`, built straight into its shardings on `mesh`."""
  return train_state.init_train_state(
      params, tx, jax.random.key(seed),
      shardings=train_state.train_state_shardings(model, tx, mesh))


def sft_stage(spec: RunSpec, task: Task, workdir: str, log: MetricLog, mesh: Mesh, *,
              progress: Callable = lambda it, **kw: it,
              force_resume: bool = False) -> train_state.TrainState:
  """`spec.sft.steps` updates of masked NLL on oracle trajectories, under `mesh`
  (resumable; with `force_resume`, also from checkpoints of another configuration). With
  `spec.eval.sft_every`, greedy validation accuracy is logged (stage `eval_sft`) every that
  many steps and at the end."""
  sft, model = spec.sft, spec.model
  steps, tx = sft.steps, sft.optimizer
  state = fresh_state(initial_params(spec, mesh), tx, model, mesh, spec.seed)
  with _checkpointer(spec, workdir, "ckpt_sft") as ckpt:
    state = _resume(ckpt, state, log, "sft", force_resume)
    log.drop_after("eval_sft", int(state.step))
    if int(state.step) >= steps:
      return state
    records = task.splits["sft"][:sft.max_examples or None]
    if len(records) < sft.batch_size:
      raise run_config.ConfigError(
          f"config.sft.steps={steps}: the SFT split has {len(records)} records, fewer than "
          f"sft.batch_size={sft.batch_size} (user trajectories: data.sft_files)")
    if sft.teacher_fraction and not all("golden_answers" in r for r in records):
      raise run_config.ConfigError(
          f"config.sft.teacher_fraction={sft.teacher_fraction}: the teacher prompt "
          "needs each SFT record's golden_answers")
    rows, teacher_rows, sequences = _local_sft_sequences(spec, task, records, mesh)
    knowledge = _local_corpus_rows(spec, task, sequences[0].shape[1], mesh)
    step_fn = fitted_at_first_call(learner.make_sft_step(model, tx, sft.plan, mesh=mesh),
                                   "the SFT step", SFT_FIELDS)
    with checkpoint.PreemptionGuard() as guard:
      for step in progress(range(int(state.step), steps), desc="sft", initial=int(state.step),
                           total=steps):
        batch = _sft_rows(sequences, rows[step], teacher_rows[step])
        if knowledge is not None:
          batch = _with_documents(batch, knowledge, step)
        batch = sharding.shard_process_local_batch(batch, mesh, sft.batch_size)
        state, metrics = step_fn(state, *batch)
        workdir_lib.check_claimed(workdir)
        log.write("sft", step + 1, metrics)
        ckpt.save(state, {"stage": "sft", "step": step + 1}, force=step + 1 == steps)
        _log_validation(spec, task, state.params, log, mesh, step + 1, "sft")
        if guard.save_if_requested(ckpt, state, {"stage": "sft", "step": step + 1}):
          raise SystemExit("preempted: saved the SFT state")
  return state


def _local_sft_sequences(spec: RunSpec, task: Task, records: list[dict], mesh: Mesh
                         ) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, ...]]:
  """This process's rows of every SFT step and their oracle sequences, replayed once.

  Step s draws `sft.batch_size` records seeded by `(seed, s)`, then (with
  `sft.teacher_fraction` > 0, from the same generator) which of its rows are trained on the
  teacher's privileged prompt; the process feeds its block of them (`process_batch_rows`).
  Only the records some step of this process feeds are replayed, and the sequences are padded
  to the longest over all processes, so every process's arrays have one width.

  Returns:
    `rows[s]` (indices into the sequences), `teacher_rows[s]` (bool, the rows on the teacher
    prompt) and the needed records' `(tokens, mask, action_mask)` (`sft_sequences`), with
    their teacher view `(tokens, mask)` (`privileged.teacher_sequence` of `rl_batch`'s
    privileged prompts) when some row needs it.
  """
  size, fraction = spec.sft.batch_size, spec.sft.teacher_fraction
  local = sharding.process_batch_rows(size, mesh)
  drawn, on_teacher = [], []
  for step in range(spec.sft.steps):
    rng = np.random.default_rng([spec.seed, step])
    drawn.append(rng.choice(len(records), size, replace=False)[local])
    on_teacher.append((rng.random(size) < fraction)[local] if fraction
                      else np.zeros(len(drawn[-1]), bool))
  drawn = np.stack(drawn)
  needed, rows = np.unique(drawn, return_inverse=True)
  needed_records = [records[i] for i in needed]
  sequences = sft_sequences(task, needed_records, spec.data, spec.model)
  width = sequences[0].shape[1]
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    width = int(np.max(multihost_utils.process_allgather(np.int32(width))))
  pad = ((0, 0), (0, width - sequences[0].shape[1]))
  sequences = tuple(np.pad(x, pad) for x in sequences)
  if fraction:
    region = rl_batch(task, spec.data, needed_records)
    sequences += tuple(np.asarray(x) for x in privileged.teacher_sequence(
        sequences[0], sequences[1], region["teacher_prompt"], region["teacher_prompt_mask"]))
  return rows.reshape(drawn.shape), np.stack(on_teacher), sequences


def _local_corpus_rows(spec: RunSpec, task: Task, width: int, mesh: Mesh
                       ) -> tuple[tuple[np.ndarray, ...], np.ndarray, np.ndarray] | None:
  """SFT's knowledge rows (`sft.corpus_fraction` > 0, else None): the corpus documents
  (`corpus_sequences`), and for every step which of this process's rows are documents and
  which document each is, drawn seeded by `(seed, step, 1)` (the trajectory rows' draws stay
  as they were)."""
  fraction = spec.sft.corpus_fraction
  if not fraction:
    return None
  documents = corpus_sequences(task, width)
  size, local = spec.sft.batch_size, sharding.process_batch_rows(spec.sft.batch_size, mesh)
  on_corpus, which = [], []
  for step in range(spec.sft.steps):
    rng = np.random.default_rng([spec.seed, step, 1])
    on_corpus.append((rng.random(size) < fraction)[local])
    which.append(rng.integers(len(documents[0]), size=size)[local])
  return documents, np.stack(on_corpus), np.stack(which)


def _with_documents(batch: tuple[np.ndarray, ...], knowledge: tuple, step: int
                    ) -> tuple[np.ndarray, ...]:
  """`batch` with step `step`'s knowledge rows replaced by their documents."""
  documents, on_corpus, which = knowledge
  rows = on_corpus[step][:, None]
  return tuple(np.where(rows, d[which[step]], x) for x, d in zip(batch, documents))


def _sft_rows(sequences: tuple[np.ndarray, ...], rows: np.ndarray, on_teacher: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """One SFT batch `(tokens, mask, loss_mask)`: `rows` of the sequences, the `on_teacher`
  rows in their teacher view (the same trajectory after the privileged prompt)."""
  tokens, mask, action = (x[rows] for x in sequences[:3])
  if on_teacher.any():
    teacher = on_teacher[:, None]
    tokens = np.where(teacher, sequences[3][rows], tokens)
    mask = np.where(teacher, sequences[4][rows], mask)
  return tokens, mask, action


def rl_iteration(agent: Agent, update: Callable, state: train_state.TrainState, batch: dict,
                 group_ids: jax.Array, teacher_params: Any = None,
                 golden_answers: Sequence[Sequence[str]] = ()
                 ) -> tuple[train_state.TrainState, Rollout, dict]:
  """One RL step: `agent` samples the batch (`Agent.rollout`), then `update` learns from it.

  Args:
    agent: samples the step's episodes from the current parameters.
    update: `(state, rollout, teacher_prompt, teacher_prompt_mask, teacher_params) ->
      (state, metrics)`, `learner.rl_step` or its jitted `learner.make_rl_step`.
    state: the train state; its PRNG key is split into the rollout's and the next state's.
    batch: `rl_batch`'s arrays (prompt regions, gold tokens).
    group_ids: `i32[B]` the prompt each row samples.
    teacher_params: frozen teacher parameters (OPSD), or None for the policy's own.
    golden_answers: the rows' gold answers as strings (a host retriever's reward).

  Returns:
    `(new state, rollout, metrics)`.
  """
  rng, sample = jax.random.split(state.rng)
  rollout = agent.rollout(state.params, sample, batch, group_ids, golden_answers)
  state, metrics = update(state.replace(rng=rng), rollout, batch["teacher_prompt"],
                          batch["teacher_prompt_mask"], teacher_params)
  return state, rollout, metrics


def make_rl_iteration(agent: Agent, model: ModelConfig, tx: optax.GradientTransformation,
                      algo: Any, plan: learner.UpdatePlan, mesh: Mesh | None = None
                      ) -> Callable:
  """One RL step of an in-graph agent as one XLA program: rollout -> reward -> evidence ->
  update.

  Returns `step(state, search, batch, group_ids, teacher_params=None) -> (state, rollout,
  metrics)`, jitted, where `search` is `(index, text)`: the agent's `DeviceIndex` and its
  tokenizer's `TokenText` (None where the tags are single tokens); they are arguments, not
  constants of the program. The state is donated; the frozen `teacher_params` are an
  argument, not donated, so the same copy serves every step. With a mesh the shardings are
  explicit: the state's from `train_state_shardings`, the batch, group ids and rollout rows
  over the data axes (each device samples its own rows), the index where it declares itself
  (`DeviceIndex.shardings`: the sparse index's postings spread over the devices), the text
  and the metrics replicated.
  """
  if not agent.in_graph:
    raise ValueError(f"a {type(agent.search).__name__} is searched from the host: its "
                     "rollout cannot be part of a jitted step (rl_step_fn)")
  micro = None if mesh is None else learner.micro_batch_sharding(mesh)

  def update(state, rollout, teacher_prompt, teacher_prompt_mask, teacher_params):
    return learner.rl_step(state, rollout, teacher_prompt, teacher_prompt_mask, teacher_params,
                           model=model, tx=tx, algo=algo, max_turns=agent.env.max_turns,
                           plan=plan, micro_sharding=micro)

  def step(state, search, batch, group_ids, teacher_params=None):
    index, text = search
    traced = dataclasses.replace(agent, search=index,
                                 tokenizer=dataclasses.replace(agent.tokenizer, text=text))
    return rl_iteration(traced, update, state, batch, group_ids, teacher_params)

  if mesh is None:
    return jax.jit(step, donate_argnums=0)
  state_sh = train_state.train_state_shardings(model, tx, mesh)
  rows, whole = sharding.batch_sharding(mesh), sharding.replicated(mesh)
  search_sh = (agent.search.shardings(mesh), whole)
  return learner.jit_with_optional_teacher(step, (state_sh, search_sh, rows, rows),
                                           state_sh.params, (state_sh, rows, whole))


def rl_step_fn(agent: Agent, model: ModelConfig, tx: optax.GradientTransformation, algo: Any,
               plan: learner.UpdatePlan, mesh: Mesh, teacher_params: Any = None) -> Callable:
  """The loop's RL step, `step(state, batch, group_ids, golden_answers) -> (state, rollout,
  metrics)`: one program (`make_rl_iteration`) for an in-graph agent, else the host rollout
  followed by the jitted update (`learner.make_rl_step`). At its first call that program (the
  host loop's update) is compiled and refused in one line when it does not fit the device
  (`fitted_at_first_call`)."""
  teacher = () if teacher_params is None else (teacher_params,)
  if agent.in_graph:
    program = fitted_at_first_call(make_rl_iteration(agent, model, tx, algo, plan, mesh),
                                   "the RL step", RL_FIELDS)
    search = (agent.search, agent.tokenizer.text)
    return lambda state, batch, group_ids, golden_answers: program(
        state, search, batch, group_ids, *teacher)
  update = fitted_at_first_call(
      learner.make_rl_step(model, tx, algo, agent.env.max_turns, plan, mesh=mesh),
      "the RL update", RL_FIELDS)
  # The host loop's arrays come back wherever its jitted pieces left them; the update takes
  # the rollout's rows where the batch's are.
  rows = sharding.batch_sharding(mesh)
  placed = lambda state, rollout, prompt, prompt_mask, _: update(
      state, jax.device_put(rollout, rows), prompt, prompt_mask, *teacher)
  return lambda state, batch, group_ids, golden_answers: rl_iteration(
      agent, placed, state, batch, group_ids, teacher_params, golden_answers)


def save_rollout(path: str, rollout: Rollout) -> None:
  """Writes a rollout's arrays (`Rollout` fields and its `mask`) to an `.npz` file: exactly
  the tokens the update trained on, with `action_mask` marking the trained-on ones. The file
  appears whole or not at all (`storage.replaced`). With several processes, each holding its
  rows, the rows are gathered (every process calls this) and process 0 writes them all."""
  fields = {f: getattr(rollout, f) for f in ("tokens", "action_mask", "turn_ids", "num_turns",
                                             "length", "prompt_length", "finished",
                                             "truncated", "group_ids", "sample_logp", "reward",
                                             "searches", "search_failures")}
  arrays = sharding.host_rows({"mask": rollout.mask, **fields})
  if jax.process_index() == 0:
    with storage.replaced(path, "wb") as f:
      np.savez(f, prompt_width=rollout.prompt_width, **arrays)


def retrieval_metrics(before: dict, after: dict) -> dict:
  """A step's `retrieval/<counter>`: how much each of a retriever's counters grew, summed
  over the processes (each asks its own retriever for its own rows)."""
  keys = sorted(after)
  grew = np.array([after[k] - before[k] for k in keys], np.float64)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    grew = multihost_utils.process_allgather(grew).sum(axis=0)
  return {f"retrieval/{k}": float(v) for k, v in zip(keys, grew)}


# Metrics that count faults, shown in the progress bar (as run totals) once non-zero.
_FAULTS = {"failed_searches": "failed_searches", "retrieval/retries": "retries",
           "skipped_updates": "skipped_updates"}


def _show_faults(bar: Any, faults: dict, metrics: dict) -> None:
  for key, name in _FAULTS.items():
    if key in metrics and float(metrics[key]):
      faults[name] = faults.get(name, 0) + int(metrics[key])
  if faults and hasattr(bar, "set_postfix"):
    bar.set_postfix(faults)


def _none_applied(metrics: dict, plan: learner.UpdatePlan) -> bool:
  """No update of the step was applied, and at least one was skipped as non-finite."""
  skipped, empty = float(metrics["skipped_updates"]), float(metrics["empty_updates"])
  return skipped > 0 and skipped + empty >= plan.epochs * plan.minibatches


def rl_inputs(task: Task, spec: RunSpec, step: int, mesh: Mesh
              ) -> tuple[list[dict], dict, jax.Array]:
  """RL step `step`'s records (all rows), and its batch and group ids as global arrays whose
  rows are sharded over the data axes of `mesh`; this process builds only its own rows."""
  records, group_ids = rl_prompts(task, spec, step)
  rows = sharding.process_batch_rows(len(records), mesh)
  batch, group_ids = sharding.shard_process_local_batch(
      (rl_batch(task, spec.data, records[rows]), group_ids[rows].astype(np.int32)), mesh,
      len(records))
  return records, batch, group_ids


def validation_accuracy(spec: RunSpec, task: Task, params: Any,
                        progress: Callable = lambda it, **kw: it, credit: bool = False,
                        mesh: Mesh | None = None) -> dict:
  """Greedy decoding on the first `spec.eval.num_examples` `rl_validation` questions:
  `evaluate.evaluate`'s statistics (the task's retrieval, the seed's key); with `credit` and
  an algorithm that computes turn evidence, its `credit` statistics too. With the `mesh`
  `params` live on, the rows are sharded over its data axes (`evaluate.evaluate`): every
  process of a run calls this and gets the same statistics."""
  from pbsd_jax.eval import evaluate
  records = task.splits["rl_validation"][:spec.eval.num_examples]
  return evaluate.evaluate(
      task.agent(Sampler(spec.model, temperature=0.0)), params, records,
      batch_size=min(50, len(records)), rng=jax.random.key(spec.seed),
      prompt_width=spec.data.prompt_width, gold_width=spec.data.gold_width,
      template=spec.data.template, progress=progress,
      credit_algo=spec.algorithm if credit else None,
      teacher_template=spec.data.teacher_template, mesh=mesh)


def _log_validation(spec: RunSpec, task: Task, params: Any, log: MetricLog, mesh: Mesh,
                    step: int, stage: str = "rl") -> None:
  """With `spec.eval.every` (RL) or `spec.eval.sft_every` (SFT), the validation row of
  `stage`'s step `step` (0: the start), logged as stage `eval` (RL) or `eval_sft`."""
  every, steps = ((spec.eval.every, spec.rl.steps) if stage == "rl"
                  else (spec.eval.sft_every, spec.sft.steps))
  if every and (step % every == 0 or step == steps):
    result = validation_accuracy(spec, task, params, mesh=mesh)
    log.write("eval" if stage == "rl" else "eval_sft", step,
              {k: result[k] for k in ("accuracy", "mean_turns", "mean_action_tokens")})


def rl_stage(spec: RunSpec, task: Task, params: Any, workdir: str, log: MetricLog, mesh: Mesh,
             *, progress: Callable = lambda it, **kw: it, on_step: Callable | None = None,
             force_resume: bool = False) -> train_state.TrainState:
  """`spec.rl.steps` RL steps of `spec.algorithm` starting from `params` (sharded on
  `mesh`), under `mesh` (resumable; with `force_resume`, also from checkpoints of another
  configuration). With `spec.eval.every`, greedy validation accuracy is logged (stage
  `eval`) at step 0, every that many steps and at the end."""
  algo, model, rl = spec.algorithm, spec.model, spec.rl
  steps, tx, plan = rl.steps, rl.optimizer, rl.plan
  agent = task.agent(spec.sampler("rollout"))
  # A host retriever's own counters (`HttpRetriever.metrics`: calls, retries, latency).
  counters = None if agent.in_graph else getattr(agent.search, "metrics", None)
  state = fresh_state(params, tx, model, mesh, spec.seed + 1)
  teacher_params = jax.tree.map(jnp.copy, params) if algo.distillation_beta is not None else None
  iteration = rl_step_fn(agent, model, tx, algo, plan, mesh, teacher_params)

  with _checkpointer(spec, workdir, "ckpt_rl") as ckpt, \
      checkpoint.PreemptionGuard() as guard:
    state = _resume(ckpt, state, log, "rl", force_resume)
    log.drop_after("eval", int(state.step))
    if int(state.step) == 0:
      _log_validation(spec, task, state.params, log, mesh, 0)
    bar = progress(range(int(state.step), steps), desc=algo.name,
                   initial=int(state.step), total=steps)
    faults, skipped_in_a_row = {}, 0
    for step in bar:
      records, batch, group_ids = rl_inputs(task, spec, step, mesh)
      before = counters() if counters else {}
      state, rollout, metrics = iteration(state, batch, group_ids,
                                          [r["golden_answers"] for r in records])
      if counters:
        metrics = {**metrics, **retrieval_metrics(before, counters())}
      workdir_lib.check_claimed(workdir)
      log.write("rl", step + 1, metrics)
      if rl.save_rollouts and (step + 1) % rl.save_rollouts == 0:
        save_rollout(os.path.join(workdir, "rollouts", f"rl_{step + 1}.npz"), rollout)
      _log_validation(spec, task, state.params, log, mesh, step + 1)
      _show_faults(bar, faults, metrics)
      if on_step is not None:
        on_step(step + 1, state, rollout, batch)
      data_state = {"stage": "rl", "step": step + 1}
      ckpt.save(state, data_state, force=step + 1 == steps)
      if guard.save_if_requested(ckpt, state, data_state):
        raise SystemExit("preempted: saved the RL state")
      skipped_in_a_row = skipped_in_a_row + 1 if _none_applied(metrics, plan) else 0
      if rl.max_skipped_steps and skipped_in_a_row >= rl.max_skipped_steps:
        # A skipped update leaves the parameters as they were: the checkpoints hold the
        # last parameters a finite update produced.
        raise SystemExit(
            f"stopped at RL step {step + 1}: every update of the last {skipped_in_a_row} "
            "steps was skipped (non-finite loss or gradient); the checkpoints keep the last "
            "finite parameters (config.rl.max_skipped_steps sets how many steps to allow)")
  return state
