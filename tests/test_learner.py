"""Learner: schedules, optimiser, SFT step, gradient accumulation, skipped updates, RL batch."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import multiprocess_worker as mw
from pbsd_jax.agent import privileged
from pbsd_jax.models import Transformer
from pbsd_jax.rl import algorithms, evidence, learner, likelihood, train_state
from pbsd_jax.rl.algorithms import AdvantageInputs


def test_warmup_then_constant_schedule_values():
  rate = train_state.learning_rate_schedule(2.0, warmup_steps=4)
  got = [float(rate(c)) for c in range(6)]
  np.testing.assert_allclose(got, [0.5, 1.0, 1.5, 2.0, 2.0, 2.0], rtol=1e-6)


def test_warmup_then_cosine_schedule_values():
  rate = train_state.learning_rate_schedule(1.0, warmup_steps=2, total_steps=6, schedule="cosine")
  got = [float(rate(c)) for c in range(8)]
  # After warm-up, p = (c - 2) / 4: cos decay 1, (1 + cos(pi/4))/2, 1/2, (1 - cos(pi/4))/2, 0.
  c = np.cos(np.pi / 4)
  np.testing.assert_allclose(got, [0.5, 1.0, 1.0, (1 + c) / 2, 0.5, (1 - c) / 2, 0.0, 0.0],
                             rtol=1e-6, atol=1e-7)


def test_optimizer_applies_the_warmup_rate_and_reports_it():
  tx = train_state.make_optimizer(lr=1.0, warmup_steps=4, grad_clip=None)
  params = {"w": jnp.zeros(3)}
  opt_state = tx.init(params)
  rates, first_update = [], None
  for _ in range(5):
    updates, opt_state = tx.update({"w": jnp.ones(3)}, opt_state, params)
    first_update = updates["w"] if first_update is None else first_update
    rates.append(float(train_state.learning_rate(opt_state)))
  np.testing.assert_allclose(rates, [0.25, 0.5, 0.75, 1.0, 1.0], rtol=1e-6)
  # Adam's first step is lr * g / (|g| + eps) ~= lr: the first update already moves.
  np.testing.assert_allclose(first_update, -0.25 * np.ones(3), rtol=1e-5)


def test_gradient_clipping_scales_the_gradient_to_the_max_norm():
  # Adam with b1 = b2 = 0 and eps = 1 maps g to g / (|g| + 1), so the update shows the
  # clipped gradient: [30, 40] (norm 50) clips to norm 1, i.e. [0.6, 0.8].
  tx = train_state.make_optimizer(lr=1.0, grad_clip=1.0, b1=0.0, b2=0.0, eps=1.0)
  params = {"w": jnp.zeros(2)}
  updates, _ = tx.update({"w": jnp.array([30.0, 40.0])}, tx.init(params), params)
  np.testing.assert_allclose(updates["w"], -np.array([0.6 / 1.6, 0.8 / 1.8]), rtol=1e-6)


@pytest.mark.parametrize("kwargs, field", [
    ({"lr": 0.0}, "lr"), ({"lr": 1.0, "warmup_steps": -1}, "warmup_steps"),
    ({"lr": 1.0, "schedule": "linear"}, "schedule"),
    ({"lr": 1.0, "schedule": "cosine", "warmup_steps": 5, "total_steps": 5}, "total_steps"),
    ({"lr": 1.0, "weight_decay": -0.1}, "weight_decay"), ({"lr": 1.0, "b2": 1.0}, "b2"),
    ({"lr": 1.0, "grad_clip": 0.0}, "grad_clip")])
def test_bad_optimizer_settings_name_the_field(kwargs, field):
  with pytest.raises(ValueError, match=field):
    train_state.make_optimizer(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    ({"epochs": 0}, "epochs"), ({"minibatches": 3}, "minibatches"),
    ({"micro_batch_size": 3}, "micro_batch_size"), ({"micro_batch_size": 2}, "data-parallel")])
def test_update_plan_that_does_not_split_the_batch_names_the_field(kwargs, field):
  with pytest.raises(ValueError, match=field):
    learner.UpdatePlan(**kwargs).micro_batches(16, batch_shards=4)


@functools.lru_cache(maxsize=None)
def _sft_setup():
  config = mw.make_config()
  tx = train_state.make_optimizer(lr=3e-3, warmup_steps=0)
  step = learner.make_sft_step(config, tx, learner.UpdatePlan(micro_batch_size=4, chunk_size=8))
  return config, tx, step


def _sft_batch():
  rollout, _, _ = mw.make_rollout(20)
  return (jnp.asarray(rollout.tokens), rollout.mask, jnp.asarray(rollout.action_mask))


def test_sft_loss_at_step_zero_is_the_masked_nll_of_action_tokens():
  config, tx, step = _sft_setup()
  state = mw.initial_state(tx)
  tokens, mask, action = _sft_batch()
  forward = jax.jit(lambda p, t, m: Transformer(config).apply({"params": p}, t, m).logits)
  logits = forward(state.params, tokens, mask)
  logsm = np.asarray(jax.nn.log_softmax(logits, axis=-1))
  tok, act = np.asarray(tokens), np.asarray(action)
  total, count = 0.0, 0
  for b in range(tok.shape[0]):
    for t in range(1, tok.shape[1]):
      if act[b, t]:  # every action token has a real predecessor (the prompt)
        total -= logsm[b, t - 1, tok[b, t]]
        count += 1
  _, metrics = step(state, tokens, mask, action)
  np.testing.assert_allclose(float(metrics["loss"]), total / count, rtol=1e-5)


def test_sft_loss_decreases_over_steps():
  _, tx, step = _sft_setup()
  state = mw.initial_state(tx)
  losses = []
  for _ in range(6):
    state, metrics = step(state, *_sft_batch())
    losses.append(float(metrics["loss"]))
  assert int(state.step) == 6
  assert np.all(np.diff(losses) < 0), losses
  assert losses[-1] < losses[0] - 0.1, losses


def _policy_batch(seed):
  """A PolicyBatch and Targets with non-trivial ratios and advantages (no model needed)."""
  rollout, teacher, teacher_mask = mw.make_rollout(seed)
  rs = np.random.RandomState(seed)
  action = jnp.asarray(rollout.action_mask)
  teacher_tokens, teacher_mask = privileged.teacher_sequence(
      jnp.asarray(rollout.tokens), rollout.mask, teacher, teacher_mask)
  old_logp = jnp.asarray(-4.0 + 0.2 * rs.randn(*action.shape), jnp.float32)
  inputs = AdvantageInputs(rewards=jnp.asarray(rollout.reward), action_mask=action,
                           turn_ids=jnp.asarray(rollout.turn_ids), step=jnp.int32(0),
                           max_turns=mw.MAX_TURNS, logp_student=old_logp)
  batch = evidence.PolicyBatch(
      tokens=jnp.asarray(rollout.tokens), mask=rollout.mask, teacher_tokens=teacher_tokens,
      teacher_mask=teacher_mask, action_mask=action, inputs=inputs)
  targets = learner.Targets(
      old_logp=old_logp, loss_mask=action,
      advantages=jnp.where(action, rs.randn(*action.shape), 0.0).astype(jnp.float32))
  return batch, targets


def test_gradient_accumulation_equals_the_full_batch_gradient():
  config = mw.make_config()
  algo = algorithms.get("grpo", group_size=4)
  params = mw.initial_params()
  batch = _policy_batch(3)
  loss_fn = lambda p, b: learner.policy_loss(p, *b, model=config, algo=algo, chunk_size=8)

  @jax.jit
  def both(params, batch):
    full_loss, full_grads = jax.value_and_grad(lambda p: loss_fn(p, batch)[0])(params)
    rows_only = (batch[0].replace(inputs=None), batch[1])
    micro = jax.tree.map(lambda x: x.reshape(4, 4, *x.shape[1:]), rows_only)
    loss, grads, _, _ = learner.accumulate_gradients(loss_fn, params, micro)
    return full_loss, full_grads, loss, grads

  full_loss, full_grads, loss, grads = both(params, batch)
  np.testing.assert_allclose(loss, full_loss, rtol=1e-5)
  for (path, g), f in zip(jax.tree_util.tree_leaves_with_path(grads),
                          jax.tree.leaves(full_grads)):
    np.testing.assert_allclose(g, f, rtol=1e-4, atol=1e-7, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("aggregation", algorithms.AGGREGATIONS)
def test_accumulation_weights_make_every_aggregation_exact(aggregation):
  algo = algorithms.get("grpo", group_size=4, aggregation=aggregation)
  rs = np.random.RandomState(0)
  x = jnp.asarray(rs.randn(8, 6), jnp.float32)
  # Rows with 0..6 loss tokens, one row with none: micro-batches hold unequal token counts.
  mask = jnp.asarray(np.arange(6)[None, :] < np.array([6, 1, 0, 3, 2, 5, 4, 1])[:, None])
  adv = jnp.asarray(rs.randn(8, 6), jnp.float32)
  batch = (x, mask, adv)

  def loss_fn(w, b):
    xb, mb, ab = b
    loss, weight, metrics = algo.loss(xb * w, jnp.zeros_like(xb), ab, mb)
    return loss, (weight, metrics)

  w = jnp.asarray(0.3 * rs.randn(6), jnp.float32)
  full_loss, full_grad = jax.value_and_grad(lambda w: loss_fn(w, batch)[0])(w)
  micro = jax.tree.map(lambda a: a.reshape(4, 2, 6), batch)
  loss, grad, _, weight = learner.accumulate_gradients(loss_fn, w, micro)
  assert float(weight) == float(algorithms.aggregate_loss(x, mask, aggregation)[1])
  np.testing.assert_allclose(loss, full_loss, rtol=1e-5)
  np.testing.assert_allclose(grad, full_grad, rtol=1e-5, atol=1e-7)


def test_nan_in_the_advantages_skips_every_update_and_keeps_the_state():
  tx, step = mw.reference_step()
  state = mw.initial_state(tx)
  before = jax.device_get((state.params, state.opt_state))
  rollout, teacher, teacher_mask = mw.make_rollout(10)
  # A NaN reward makes every row's group advantage (hence every mini-batch's loss) NaN.
  rollout = rollout.replace(reward=np.full_like(rollout.reward, np.nan))
  new, metrics = step(state, rollout, teacher, teacher_mask)
  plan = mw.make_plan()
  assert float(metrics["skipped_updates"]) == plan.epochs * plan.minibatches
  assert int(new.step) == 1
  after = jax.device_get((new.params, new.opt_state))
  for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before)):
    np.testing.assert_array_equal(a, b)


def test_apply_update_skips_a_non_finite_gradient_and_reports_it():
  tx = train_state.make_optimizer(lr=0.1)
  params = {"w": jnp.ones(2)}
  opt_state = tx.init(params)
  grads = {"w": jnp.array([1.0, jnp.inf])}
  new_params, new_opt, info = learner.apply_update(params, opt_state, grads, jnp.float32(0.5),
                                                   tx)
  assert float(info["skipped"]) == 1.0
  np.testing.assert_array_equal(new_params["w"], params["w"])
  assert int(new_opt.count) == 0
  new_params, new_opt, info = learner.apply_update(params, opt_state, {"w": jnp.ones(2)},
                                                   jnp.float32(0.5), tx)
  assert float(info["skipped"]) == 0.0 and int(new_opt.count) == 1
  np.testing.assert_allclose(info["grad_norm"], np.sqrt(2.0), rtol=1e-6)


def test_apply_update_skips_an_update_that_overflows_the_parameters():
  # A zero gradient is finite, but weight decay at lr=1e30 takes 1e10 past float32's range.
  tx = train_state.make_optimizer(lr=1e30, weight_decay=0.1, warmup_steps=0)
  params = {"w": jnp.full(2, 1e10)}
  opt_state = tx.init(params)
  new_params, new_opt, info = learner.apply_update(params, opt_state, {"w": jnp.zeros(2)},
                                                   jnp.float32(0.0), tx)
  assert float(info["skipped"]) == 1.0 and np.isfinite(float(info["grad_norm"]))
  np.testing.assert_array_equal(new_params["w"], params["w"])
  assert int(new_opt.count) == 0


def test_apply_update_without_loss_tokens_keeps_the_state():
  # AdamW would still move on a zero gradient (weight decay); a batch with nothing to learn
  # from must not.
  tx = train_state.make_optimizer(lr=0.1, weight_decay=0.5)
  params = {"w": jnp.ones(2)}
  opt_state = tx.init(params)
  new_params, new_opt, info = learner.apply_update(params, opt_state, {"w": jnp.zeros(2)},
                                                   jnp.float32(0.0), tx, has_tokens=False)
  np.testing.assert_array_equal(new_params["w"], params["w"])
  assert int(new_opt.count) == 0
  assert float(info["empty"]) == 1.0 and float(info["skipped"]) == 0.0


# (The student-only branch, for algorithms that read no teacher log-probs, runs in the OPSD
# end-to-end test below.)
@pytest.mark.parametrize("name", ["pbsd", "gear"])
def test_policy_batch_recomputes_evidence_with_current_params(name):
  config = mw.make_config()
  algo = algorithms.get(name, group_size=4)
  params = mw.initial_params()
  rollout, teacher, teacher_mask = mw.make_rollout(12)
  # The sampler's log-probs must never be used: make them garbage.
  rollout = rollout.replace(sample_logp=np.full_like(rollout.sample_logp, 123.0))
  batch = jax.jit(functools.partial(
      evidence.policy_batch, model=config, algo=algo, max_turns=mw.MAX_TURNS))(
          params, rollout, teacher, teacher_mask, jnp.int32(0))
  targets, _ = learner.policy_targets(algo, batch.inputs, batch.inputs.logp_student)
  metrics = evidence.rollout_metrics(rollout)

  @jax.jit
  def reference(params, rollout, teacher, teacher_mask):
    """The evidence pass written out with the likelihood functions and the algorithm."""
    tokens, mask = rollout.tokens, rollout.mask
    t_tokens, t_mask = privileged.teacher_sequence(tokens, mask, teacher, teacher_mask)
    # Scored from the prompt width on: every action token lies in the trajectory.
    score = functools.partial(likelihood.token_logprobs, params, config,
                              score_from=rollout.prompt_width)
    student = score(tokens, mask)
    divergence, entropy, _ = likelihood.token_divergence(params, params, config, tokens, mask,
                                                         t_tokens, t_mask)
    advantages, loss_mask, _ = algo.advantages(AdvantageInputs(
        rewards=rollout.reward, action_mask=rollout.action_mask, turn_ids=rollout.turn_ids,
        step=jnp.int32(0), max_turns=mw.MAX_TURNS, logp_student=student,
        logp_teacher=score(t_tokens, t_mask),
        divergence=divergence, entropy=entropy))
    return student, advantages, loss_mask, t_tokens

  student, advantages, loss_mask, t_tokens = reference(params, rollout, teacher, teacher_mask)
  np.testing.assert_allclose(batch.inputs.logp_student, student, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(targets.old_logp, student, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(targets.advantages, advantages, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(targets.loss_mask, loss_mask)
  np.testing.assert_array_equal(batch.teacher_tokens, t_tokens)
  np.testing.assert_allclose(metrics["accuracy"], np.mean(rollout.reward))
  np.testing.assert_allclose(metrics["mean_action_tokens"],
                             np.mean(np.sum(rollout.action_mask, axis=1)))


@pytest.mark.parametrize("name", ["grpo", "pbsd", "gear"])
def test_on_policy_step_equals_the_separate_old_logprob_pass(name):
  """One update in one pass: the update's own forward stands in for the student pass.

  Same parameters, optimiser state and metrics as running `policy_batch` (student pass) and
  then `ppo_update` on it; only the ratio's base is exact (1) instead of the recomputed old
  log-probs' last bits.
  """
  config = mw.make_config()
  algo = algorithms.get(name, group_size=4, **({"delta": 0.05} if name == "pbsd" else {}))
  tx = mw.make_tx()
  plan = learner.UpdatePlan(chunk_size=8)
  rollout, teacher, teacher_mask = mw.make_rollout(12)
  assert plan.on_policy(rollout.tokens.shape[0])

  @jax.jit
  def both(state, rollout, teacher, teacher_mask):
    fused, fused_metrics = learner.rl_step(state, rollout, teacher, teacher_mask, model=config,
                                           tx=tx, algo=algo, max_turns=mw.MAX_TURNS, plan=plan)
    batch = evidence.policy_batch(state.params, rollout, teacher, teacher_mask, state.step,
                                  model=config, algo=algo, max_turns=mw.MAX_TURNS,
                                  chunk_size=8)
    assert batch.inputs.logp_student is not None
    separate, metrics = learner.ppo_update(state, batch, model=config, tx=tx, algo=algo,
                                           plan=plan)
    return fused, fused_metrics, separate, {**evidence.rollout_metrics(rollout), **metrics}

  fused, fused_metrics, separate, metrics = both(mw.initial_state(tx), rollout, teacher,
                                                 teacher_mask)
  assert sorted(fused_metrics) == sorted(metrics)
  for key in metrics:
    np.testing.assert_allclose(fused_metrics[key], metrics[key], rtol=1e-4, atol=1e-6,
                               err_msg=key)
  for a, b in zip(jax.tree.leaves((fused.params, fused.opt_state, fused.rng)),
                  jax.tree.leaves((separate.params, separate.opt_state, separate.rng))):
    np.testing.assert_allclose(jax.random.key_data(a) if a.dtype == separate.rng.dtype else a,
                               jax.random.key_data(b) if b.dtype == separate.rng.dtype else b,
                               rtol=1e-5, atol=2e-6)
  # (PBSD's evidence differs in the last bits between the vmapped dual pass and the update's
  # forward; Adam's normalisation carries that to ~1e-6 of a 5e-4 step.) The update moved the parameters (a vacuous equality would not).
  before = mw.initial_params()
  assert max(float(jnp.max(jnp.abs(a - b))) for a, b in
             zip(jax.tree.leaves(fused.params), jax.tree.leaves(before))) > 1e-4


def test_an_update_without_the_student_pass_needs_an_on_policy_plan():
  config = mw.make_config()
  algo = algorithms.get("grpo", group_size=4)
  rollout, teacher, teacher_mask = mw.make_rollout(12)
  batch = evidence.policy_batch(mw.initial_params(), rollout, teacher, teacher_mask,
                                jnp.int32(0), model=config, algo=algo,
                                max_turns=mw.MAX_TURNS, score_student=False)
  assert batch.inputs.logp_student is None
  tx = mw.make_tx()
  with pytest.raises(ValueError, match="on_policy"):
    learner.ppo_update(mw.initial_state(tx), batch, model=config, tx=tx, algo=algo,
                       plan=learner.UpdatePlan(minibatches=2))
  with pytest.raises(ValueError, match="UpdatePlan.on_policy"):
    learner.on_policy_update(mw.initial_state(tx), batch, model=config, tx=tx, algo=algo,
                             plan=learner.UpdatePlan(minibatches=2))


def test_opsd_loss_vanishes_when_the_teacher_is_the_student():
  config = mw.make_config()
  algo = algorithms.get("opsd", group_size=4)
  params = mw.initial_params()
  batch, targets = _policy_batch(5)
  batch = batch.replace(teacher_tokens=batch.tokens, teacher_mask=batch.mask)
  loss, (_, metrics) = jax.jit(functools.partial(learner.policy_loss, model=config,
                                                 algo=algo))(params, batch, targets,
                                                             teacher_params=params)
  np.testing.assert_allclose(float(metrics["opsd/distill_loss"]), 0.0, atol=1e-6)
  np.testing.assert_allclose(float(loss), 0.0, atol=1e-6)


def test_opsd_steps_pull_the_student_towards_the_frozen_teacher():
  config = mw.make_config()
  tx = train_state.make_optimizer(lr=1e-3)
  algo = algorithms.get("opsd", group_size=4)
  step = learner.make_rl_step(config, tx, algo, mw.MAX_TURNS, learner.UpdatePlan(chunk_size=8))
  teacher_params = mw.initial_params()  # the frozen initial model, on the privileged prompt
  state = mw.initial_state(tx)
  rollout = mw.make_rollout(12)
  distill = []
  for _ in range(3):
    state, metrics = step(state, *rollout, teacher_params)
    distill.append(float(metrics["opsd/distill_loss"]))
  assert distill[0] > 0.0  # the privileged prompt changes the teacher's distributions
  assert distill[2] < distill[1] < distill[0], distill


def test_distillation_without_teacher_params_is_an_error():
  tx = mw.make_tx()
  with pytest.raises(ValueError, match="teacher_params"):
    learner.ppo_update(mw.initial_state(tx), _policy_batch(5)[0], model=mw.make_config(),
                       tx=tx, algo=algorithms.get("opsd", group_size=4))


@pytest.mark.parametrize("name", ["pbsd", "gear", "grpo"])
def test_the_evidence_pass_in_micro_batches_scores_what_the_whole_batch_does(name):
  """`policy_batch(micro_batch_size=4)` runs the scoring over 4 micro-batches of the 16 rows
  (`lax.map`, one micro-batch's activations and logits at a time); every score is the
  whole-batch pass's."""
  config = mw.make_config()
  algo = algorithms.get(name, group_size=4)
  rollout, teacher, teacher_mask = mw.make_rollout(12)
  params = mw.initial_params()
  score = jax.jit(lambda micro, params: evidence.policy_batch(
      params, rollout, teacher, teacher_mask, jnp.int32(0), model=config, algo=algo,
      max_turns=mw.MAX_TURNS, chunk_size=8, micro_batch_size=micro).inputs, static_argnums=0)
  whole, split = score(None, params), score(4, params)
  fields = [f for f in ("logp_student", "logp_teacher", "divergence", "entropy")
            if getattr(whole, f) is not None]
  assert fields == {"pbsd": ["logp_student", "logp_teacher"], "gear":
                    ["logp_student", "divergence", "entropy"], "grpo": ["logp_student"]}[name]
  for f in fields:
    np.testing.assert_allclose(getattr(split, f), getattr(whole, f), rtol=1e-5, atol=1e-6,
                               err_msg=f)
  # The rows differ from each other (a shuffled micro-batch would be caught).
  logp = np.asarray(whole.logp_student)
  assert np.abs(logp[:4] - logp[4:8]).max() > 1e-3
  assert rollout.tokens.shape[0] == 16
  with pytest.raises(ValueError, match="16 rows do not split into micro-batches of 5"):
    score(5, params)


def test_a_program_larger_than_the_device_is_refused_before_its_first_step():
  """`train.fitted` compiles the SFT step for its first batch and compares what it holds
  (`memory_analysis`) with the device's memory: over it, one line naming the program and
  the fields; within it, the compiled program, which steps as the jitted one does."""
  from pbsd_jax.run import train
  config, tx = mw.make_config(), mw.make_tx()
  step = learner.make_sft_step(config, tx, learner.UpdatePlan())
  rollout, _, _ = mw.make_rollout(12)
  args = (rollout.tokens, rollout.mask, rollout.action_mask.astype(bool))
  compiled = step.lower(mw.initial_state(tx), *args).compile()
  need = train.program_bytes(compiled)
  assert need > 0
  with pytest.raises(SystemExit, match=r"^FATAL: the SFT step needs .* per device, more than "
                     r"the 1\.0 KB of a cpu; fields that change it: sft\.batch_size"):
    train.fitted(step, (mw.initial_state(tx), *args), "the SFT step", train.SFT_FIELDS,
                 limit=1024)
  fitted = train.fitted(step, (mw.initial_state(tx), *args), "the SFT step",
                        train.SFT_FIELDS, limit=need)
  assert fitted is not step
  ours, _ = fitted(mw.initial_state(tx), *args)
  jitted, _ = step(mw.initial_state(tx), *args)
  for a, b in zip(jax.tree.leaves(ours.params), jax.tree.leaves(jitted.params)):
    np.testing.assert_array_equal(a, b)
  moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in
              zip(jax.tree.leaves(ours.params), jax.tree.leaves(mw.initial_params())))
  assert moved > 1e-5
  # Without a limit, on a device that reports no memory (the CPU), nothing is compiled.
  assert train.fitted(step, args, "the SFT step", train.SFT_FIELDS) is step
