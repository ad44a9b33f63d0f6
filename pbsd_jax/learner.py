"""The learner: train state, AdamW, and the SFT and RL (PPO-style) update steps.

Data flow of one RL step (DESIGN.md §3), all traceable, so the lead can put a rollout in front
of it inside the same `jax.jit`:

    Rollout --policy_batch-->  PolicyBatch  --ppo_update-->  new TrainState, metrics
               (one fresh forward per condition with the pre-update parameters: the student
                half is also the PPO "old" log-probs; the algorithm turns it into advantages)

`ppo_update` runs `epochs` passes over the batch, each split into `minibatches` shuffled
mini-batches (one optimiser update each, `lax.scan`); a mini-batch's gradient is accumulated
over micro-batches of `micro_batch_size` rows (`lax.scan`), weighted so the sum equals the
mini-batch gradient (see `loss_weight`).

On-policy shortcut (`UpdatePlan.on_policy`: one epoch, one mini-batch, one micro-batch): the
parameters that score the "old" log-probs are the ones the single update differentiates, so
`policy_batch` skips the student pass and the update's own forward supplies it under
`stop_gradient` -- both as the PPO ratio's base and as `logp_student` of the advantages, which
`policy_loss` then computes (`PolicyBatch.pending`). The result is the same update; PBSD's only
extra pass is then the teacher forward. (TRL and Tunix do the same for one iteration.)

An update whose loss or gradient is not finite is not
applied -- parameters and optimiser state stay as they were -- and is counted in
`skipped_updates`. The learner never branches on an algorithm's name: it reads `algo.needs` and
`algo.distillation_beta` (the `pbsd_jax.algorithms` protocol). Rematerialisation is the model
config's `remat` switch.

Token layout and padding: DESIGN.md §3 (`pbsd_jax.rollout`); every per-token array is `[B, T]`
with the column of the token it scores (`likelihood.token_logprobs`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pbsd_jax import likelihood, privileged, sharding
from pbsd_jax.algorithms import AdvantageInputs
from pbsd_jax.models import ModelConfig, param_shapes

Array = jax.Array
SCHEDULES = ("constant", "cosine")


@struct.dataclass
class TrainState:
  """Everything a run needs to continue exactly (and what a checkpoint holds).

  Attributes:
    params: model parameters.
    opt_state: optimiser state of `tx` (its update count drives the learning-rate schedule).
    step: `i32[]` train steps taken (SFT steps or RL iterations; several optimiser updates
      may make up one RL iteration).
    rng: typed PRNG key; each step splits off what it consumes (mini-batch shuffles).
  """

  params: Any
  opt_state: Any
  step: Array
  rng: Array


def learning_rate_schedule(lr: float, warmup_steps: int = 0, total_steps: int | None = None,
                           schedule: str = "constant") -> Callable[[Array], Array]:
  """Learning rate of optimiser update `count` (0-based), an optax schedule.

  Linear warm-up: update `count < warmup_steps` uses `lr * (count + 1) / warmup_steps`, so
  the first update already moves (a warm-up from exactly 0 would waste it) and update
  `warmup_steps - 1` reaches `lr`. Then `'constant'` stays at `lr`; `'cosine'` decays as
  `lr * (1 + cos(pi * p)) / 2` with `p = (count - warmup_steps) / (total_steps - warmup_steps)`
  clipped to [0, 1], reaching 0 at `total_steps`.
  """
  if not lr > 0:
    raise ValueError(f"lr must be > 0, got {lr}")
  if warmup_steps < 0:
    raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
  if schedule not in SCHEDULES:
    raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
  if schedule == "cosine" and (total_steps is None or total_steps <= warmup_steps):
    raise ValueError(f"schedule='cosine' needs total_steps > warmup_steps={warmup_steps}, "
                     f"got total_steps={total_steps}")

  def rate(count):
    count = jnp.asarray(count, jnp.float32)
    warm = jnp.minimum(1.0, (count + 1.0) / max(warmup_steps, 1))
    if schedule == "constant":
      return lr * warm
    progress = jnp.clip((count - warmup_steps) / (total_steps - warmup_steps), 0.0, 1.0)
    return lr * jnp.where(count < warmup_steps, warm, 0.5 * (1.0 + jnp.cos(jnp.pi * progress)))

  return rate


def make_optimizer(lr: float, warmup_steps: int = 0, total_steps: int | None = None,
                   weight_decay: float = 0.0, b1: float = 0.9, b2: float = 0.999,
                   grad_clip: float | None = 1.0, schedule: str = "constant",
                   eps: float = 1e-8) -> optax.GradientTransformation:
  """AdamW with `learning_rate_schedule`, after clipping the gradient's global norm.

  Weight decay applies to every parameter (as `torch.optim.AdamW`). The current learning
  rate lives in the optimiser state (`optax.inject_hyperparams`); read it with
  `learning_rate`.

  Args:
    lr: peak learning rate.
    warmup_steps, total_steps, schedule: see `learning_rate_schedule`.
    weight_decay: decoupled weight decay (the paper: 0.1).
    b1, b2, eps: Adam moments' decay rates and denominator epsilon.
    grad_clip: maximum global gradient norm; None disables clipping.
  """
  rate = learning_rate_schedule(lr, warmup_steps, total_steps, schedule)
  if weight_decay < 0:
    raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
  for name, value in (("b1", b1), ("b2", b2)):
    if not 0.0 <= value < 1.0:
      raise ValueError(f"{name} must be in [0, 1), got {value}")
  if grad_clip is not None and not grad_clip > 0:
    raise ValueError(f"grad_clip must be > 0 (or None), got {grad_clip}")

  def adamw(learning_rate):
    clip = optax.identity() if grad_clip is None else optax.clip_by_global_norm(grad_clip)
    return optax.chain(clip, optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps,
                                         weight_decay=weight_decay))

  return optax.inject_hyperparams(adamw)(learning_rate=rate)


def learning_rate(opt_state: Any) -> Array:
  """`f32[]` the learning rate of the latest update of a `make_optimizer` state."""
  return opt_state.hyperparams["learning_rate"]


def init_train_state(params: Any, tx: optax.GradientTransformation, rng: Array,
                     shardings: TrainState | None = None) -> TrainState:
  """A fresh `TrainState` at step 0.

  Args:
    params: initial parameters.
    tx: the optimiser.
    rng: a PRNG key (typed, or raw `uint32[2]` key data).
    shardings: optional `train_state_shardings`; the state is then built by a jitted function
      whose outputs land directly in those shardings (the optimiser state is never
      materialised whole on one device).
  """
  if not jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
    rng = jax.random.wrap_key_data(rng)

  def build(params, rng):
    return TrainState(params=params, opt_state=tx.init(params), step=jnp.zeros((), jnp.int32),
                      rng=rng)

  if shardings is None:
    return build(params, rng)
  return jax.jit(build, out_shardings=shardings)(params, rng)


def train_state_shardings(config: ModelConfig, tx: optax.GradientTransformation, mesh: Mesh,
                          rules=sharding.RULES) -> TrainState:
  """`NamedSharding`s of a `TrainState` for `config` under `mesh` (from the one rules table)."""
  params = sharding.param_shardings(config, mesh, rules)
  opt_state = sharding.opt_state_shardings(tx, param_shapes(config), params, mesh)
  return TrainState(params=params, opt_state=opt_state, step=sharding.replicated(mesh),
                    rng=sharding.replicated(mesh))


@dataclasses.dataclass(frozen=True)
class UpdatePlan:
  """How one batch becomes optimiser updates (hashable: a static jit argument).

  Attributes:
    epochs: passes over the batch (PPO epochs).
    minibatches: optimiser updates per epoch; rows are shuffled into this many mini-batches.
    micro_batch_size: rows per forward/backward pass; a mini-batch's gradient is accumulated
      over its micro-batches. None: the whole mini-batch in one pass.
    chunk_size: LM-head chunk over the sequence (`likelihood.token_logprobs`); None: whole.
  """

  epochs: int = 1
  minibatches: int = 1
  micro_batch_size: int | None = None
  chunk_size: int | None = None

  def __post_init__(self):
    for name in ("epochs", "minibatches"):
      if getattr(self, name) < 1:
        raise ValueError(f"UpdatePlan.{name} must be >= 1, got {getattr(self, name)}")
    if self.micro_batch_size is not None and self.micro_batch_size < 1:
      raise ValueError(f"UpdatePlan.micro_batch_size must be >= 1, got "
                       f"{self.micro_batch_size}")
    if self.chunk_size is not None and self.chunk_size < 1:
      raise ValueError(f"UpdatePlan.chunk_size must be >= 1, got {self.chunk_size}")

  def on_policy(self, batch_size: int, batch_shards: int = 1) -> bool:
    """True when a batch makes exactly one optimiser update in one forward/backward pass.

    The log-probs under the pre-update parameters are then the update's own forward (module
    docstring), so no separate pass computes them.
    """
    return (self.epochs == self.minibatches == 1
            and self.micro_batches(batch_size, batch_shards)[0] == 1)

  def micro_batches(self, batch_size: int, batch_shards: int = 1) -> tuple[int, int]:
    """`(micro-batches per mini-batch, rows per micro-batch)` for a batch of `batch_size`.

    Raises:
      ValueError: rows that do not split evenly (into mini-batches, micro-batches, or over
        the `batch_shards` data-parallel devices); the message names the field.
    """
    if batch_size % self.minibatches:
      raise ValueError(f"batch of {batch_size} rows does not split into "
                       f"UpdatePlan.minibatches={self.minibatches}")
    rows = batch_size // self.minibatches
    micro = rows if self.micro_batch_size is None else self.micro_batch_size
    if rows % micro:
      raise ValueError(f"mini-batch of {rows} rows does not split into micro-batches of "
                       f"UpdatePlan.micro_batch_size={micro}")
    if micro % batch_shards:
      raise ValueError(f"micro-batch of {micro} rows does not split over the {batch_shards} "
                       "data-parallel devices of the mesh (data * fsdp)")
    return rows // micro, micro


@struct.dataclass
class PolicyBatch:
  """What the policy-gradient update trains on (all `[B, T]`, the rollout's columns).

  Attributes:
    tokens, mask: the student sequence (ordinary prompt) and its real tokens.
    teacher_tokens, teacher_mask: the same trajectory under the privileged prompt (used by
      distillation losses).
    action_mask: tokens the policy sampled (the entropy metric's tokens).
    loss_mask: tokens that enter the loss (the algorithm's; a subset of `action_mask`).
    advantages: `f32` token advantages, 0 off `loss_mask`.
    old_logp: `f32` pre-update log-probs of the student sequence (the PPO ratio's base).
    pending: on the on-policy path (module docstring), the algorithm's inputs still without
      `logp_student`; `loss_mask`, `advantages` and `old_logp` are then None and
      `policy_loss` computes them from its own forward.
    score_from: static first column the loss and the entropy metric read (the rollout's
      prompt width: action tokens lie in the trajectory), so the update's LM head skips the
      prompt region. 1 scores every column.
  """

  tokens: Array
  mask: Array
  teacher_tokens: Array
  teacher_mask: Array
  action_mask: Array
  loss_mask: Array | None = None
  advantages: Array | None = None
  old_logp: Array | None = None
  pending: AdvantageInputs | None = None
  score_from: int = struct.field(pytree_node=False, default=1)


def sft_loss(params: Any, config: ModelConfig, tokens: Array, mask: Array, loss_mask: Array,
             chunk_size: int | None = None) -> tuple[Array, tuple[Array, dict]]:
  """Masked NLL `-sum(logp * loss_mask) / sum(loss_mask)`, its weight and metrics.

  Returns `(loss, (weight, metrics))` as `accumulate_gradients` reads them: the weight is
  `sum(loss_mask)`, what the mean divides by; metrics hold `entropy`.

  Args:
    params: model parameters.
    config: the model config.
    tokens: `i32[B, T]`; mask: `bool[B, T]` real tokens.
    loss_mask: `bool[B, T]` tokens trained on (SFT: the action tokens only).
    chunk_size: LM-head chunk over the sequence.
  """
  logp, entropy = likelihood.token_logprobs(params, config, tokens, mask, chunk_size=chunk_size,
                                            with_entropy=True)
  m = loss_mask.astype(jnp.float32)
  count = jnp.maximum(jnp.sum(m), 1.0)
  return -jnp.sum(logp * m) / count, (jnp.sum(m), {
      "entropy": jnp.sum(jax.lax.stop_gradient(entropy) * m) / count})


def accumulate_gradients(loss_fn: Callable[[Any, Any], tuple[Array, tuple[Array, dict]]],
                         params: Any, micro_batches: Any) -> tuple[Array, Any, dict, Array]:
  """Loss, gradient and metrics of a mini-batch from its micro-batches (`lax.scan`).

  `loss_fn(params, micro)` returns `(loss, (weight, metrics))`: a scalar loss that is a mean
  over `weight` items of the micro-batch (loss tokens for a token mean, rows with loss tokens
  for a sequence mean; `loss_weight`) and a dict of scalar metrics. Micro-batch k counts with
  `weight_k / sum(weight)`, which makes the result the mini-batch's own mean.

  Args:
    loss_fn: `(params, micro) -> (loss, (weight, metrics))`.
    params: the parameters to differentiate.
    micro_batches: pytree of `[n_micro, micro, ...]` arrays.

  Returns:
    `(loss, grads, metrics, weight)`: the first three weighted means over micro-batches (0 if
    every weight is 0), then the total weight (0: the mini-batch has no loss item).
  """
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def body(acc, micro):
    (loss, (w, metrics)), grads = grad_fn(params, micro)
    # Zero-weight micro-batches are dropped with `where`, so a NaN there cannot leak in.
    scale = lambda x: jnp.where(w > 0, x * w, jnp.zeros_like(x))
    sums, total = acc
    sums = jax.tree.map(lambda a, x: a + scale(x), sums, (loss, grads, metrics))
    return (sums, total + w), None

  first = jax.tree.map(lambda x: x[0], micro_batches)
  (loss0, (_, metrics0)), grads0 = jax.eval_shape(grad_fn, params, first)
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (loss0, grads0, metrics0))
  (sums, total), _ = jax.lax.scan(body, (zeros, jnp.float32(0.0)), micro_batches)
  loss, grads, metrics = jax.tree.map(lambda x: x / jnp.maximum(total, 1e-12), sums)
  return loss, grads, metrics, total


def apply_update(params: Any, opt_state: Any, grads: Any, loss: Array,
                 tx: optax.GradientTransformation, has_tokens: Array | bool = True
                 ) -> tuple[Any, Any, dict]:
  """One optimiser update, or none when the loss or gradient is not finite.

  A mini-batch without any loss token (`has_tokens` False, e.g. every group dropped by DAPO
  dynamic sampling) is not applied either: AdamW would still move the parameters through its
  momentum and weight decay on a zero gradient.

  Returns:
    `(params, opt_state, metrics)` with `grad_norm` (before clipping), `skipped` (1.0 when the
    update was not applied because of a non-finite value) and `empty` (1.0 when it was not
    applied for want of loss tokens).
  """
  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  apply = finite & has_tokens
  # Non-finite gradients are zeroed before the optimiser sees them, so no NaN enters its
  # arithmetic; the result is then discarded in favour of the old state.
  safe = jax.tree.map(lambda g: jnp.where(finite, g, jnp.zeros_like(g)), grads)
  updates, new_opt_state = tx.update(safe, opt_state, params)
  new_params = optax.apply_updates(params, updates)
  keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(apply, n, o), new, old)
  return (keep(new_params, params), keep(new_opt_state, opt_state),
          {"grad_norm": grad_norm, "skipped": 1.0 - finite.astype(jnp.float32),
           "empty": finite.astype(jnp.float32) * (1.0 - jnp.asarray(has_tokens, jnp.float32))})


def _split_micro(tree: Any, n_micro: int, micro: int) -> Any:
  return jax.tree.map(lambda x: x.reshape(n_micro, micro, *x.shape[1:]), tree)


def _shards(micro_sharding: NamedSharding | None) -> int:
  """Devices a micro-batch's rows are split over (1 without a sharding)."""
  if micro_sharding is None:
    return 1
  rows = micro_sharding.spec[1] if len(micro_sharding.spec) > 1 else None
  rows = () if rows is None else (rows,) if isinstance(rows, str) else rows
  return math.prod(micro_sharding.mesh.shape[a] for a in rows)


def sft_step(state: TrainState, tokens: Array, mask: Array, loss_mask: Array, *,
             config: ModelConfig, tx: optax.GradientTransformation,
             plan: UpdatePlan = UpdatePlan(), micro_sharding: NamedSharding | None = None
             ) -> tuple[TrainState, dict]:
  """One SFT update: masked NLL on `loss_mask` (the action tokens), micro-batch accumulated.

  Args:
    state: the train state.
    tokens: `i32[B, T]`; mask: `bool[B, T]` real tokens; loss_mask: `bool[B, T]`.
    config: the model config.
    tx: the optimiser.
    plan: `micro_batch_size` and `chunk_size` are used (one update per call).
    micro_sharding: optional sharding of a `[n_micro, micro, ...]` block (see `ppo_update`).

  Returns:
    `(new state, metrics)`: `loss` (the pre-update NLL), `entropy`, `grad_norm`,
    `learning_rate`, `skipped_updates` and `empty_updates` (0 or 1, see `apply_update`).
  """
  n_micro, micro = plan.micro_batches(tokens.shape[0], _shards(micro_sharding))
  batch = _split_micro((tokens, mask, loss_mask), n_micro, micro)
  if micro_sharding is not None:
    batch = jax.lax.with_sharding_constraint(batch, micro_sharding)
  loss_fn = lambda p, b: sft_loss(p, config, *b, chunk_size=plan.chunk_size)
  loss, grads, metrics, weight = accumulate_gradients(loss_fn, state.params, batch)
  params, opt_state, update = apply_update(state.params, state.opt_state, grads, loss, tx,
                                           weight > 0)
  new_state = state.replace(params=params, opt_state=opt_state, step=state.step + 1)
  return new_state, {"loss": loss, **metrics, "grad_norm": update["grad_norm"],
                     "learning_rate": learning_rate(opt_state),
                     "skipped_updates": update["skipped"], "empty_updates": update["empty"]}


def loss_weight(aggregation: str, loss_mask: Array) -> Array:
  """`f32[]` what a policy loss over `loss_mask: bool[B, T]` is a mean over.

  `token-mean` divides by the loss tokens; the `seq-mean-*` modes by the rows that have loss
  tokens (`pbsd_jax.algorithms.policy_loss`). Weighting micro-batches by it makes the
  accumulated loss and gradient equal the mini-batch's exactly (`accumulate_gradients`).
  """
  if aggregation == "token-mean":
    return jnp.sum(loss_mask).astype(jnp.float32)
  return jnp.sum(jnp.any(loss_mask, axis=-1)).astype(jnp.float32)


def policy_loss(params: Any, batch: PolicyBatch, *, config: ModelConfig, algo: Any,
                chunk_size: int | None = None, teacher_params: Any = None
                ) -> tuple[Array, tuple[Array, dict]]:
  """The algorithm's loss of `batch` under `params`, its weight and metrics.

  Returns `(loss, (weight, metrics))` as `accumulate_gradients` reads them: `weight` is
  `loss_weight` of the loss mask; metrics hold the algorithm's loss metrics and `entropy`,
  the student's next-token entropy, token-mean over `action_mask`. A distillation algorithm
  (`algo.distillation_beta` set, OPSD) also gets the per-token divergence against
  `teacher_params` on the teacher sequence. On the on-policy path (`batch.pending`) the
  advantages are computed here from this forward's log-probs, and their metrics join the
  loss's.
  """
  logp, entropy = likelihood.token_logprobs(params, config, batch.tokens, batch.mask,
                                            chunk_size=chunk_size, with_entropy=True,
                                            score_from=batch.score_from)
  old_logp, advantages, loss_mask, metrics = (batch.old_logp, batch.advantages,
                                              batch.loss_mask, {})
  if batch.pending is not None:
    old_logp = jax.lax.stop_gradient(logp)
    advantages, loss_mask, metrics = algo.advantages(batch.pending.replace(
        logp_student=old_logp))
  divergence = None
  if algo.distillation_beta is not None:
    divergence = likelihood.token_divergence(
        params, teacher_params, config, batch.tokens, batch.mask, batch.teacher_tokens,
        batch.teacher_mask, beta=algo.distillation_beta, chunk_size=chunk_size)
  loss, loss_metrics = algo.loss(logp, old_logp, advantages, loss_mask, divergence=divergence)
  action = batch.action_mask.astype(jnp.float32)
  metrics = {**metrics, **loss_metrics,
             "entropy": jnp.sum(jax.lax.stop_gradient(entropy) * action)
             / jnp.maximum(jnp.sum(action), 1.0)}
  return loss, (loss_weight(algo.aggregation, loss_mask), metrics)


def ppo_update(state: TrainState, batch: PolicyBatch, *, config: ModelConfig,
               tx: optax.GradientTransformation, algo: Any, plan: UpdatePlan = UpdatePlan(),
               teacher_params: Any = None, micro_sharding: NamedSharding | None = None
               ) -> tuple[TrainState, dict]:
  """`plan.epochs x plan.minibatches` optimiser updates on one batch (module docstring).

  Args:
    state: the train state (its `rng` shuffles the rows of each epoch).
    batch: the `PolicyBatch`, B rows.
    config: the model config.
    tx: the optimiser.
    algo: a `pbsd_jax.algorithms` algorithm (its `loss`).
    plan: epochs, mini-batches, micro-batch size, LM-head chunk.
    teacher_params: frozen teacher parameters (required when `algo.distillation_beta` is set).
    micro_sharding: optional sharding of a `[n_micro, micro, ...]` block (rows over the data
      axes), so each device computes its own rows of every micro-batch.

  Returns:
    `(new state, metrics)`: the loss metrics (`loss`, `pg_clipfrac`, `entropy`, ...) and
    `grad_norm` averaged over the applied updates (over all when none was applied),
    `skipped_updates` and `empty_updates` (counts, see `apply_update`), `learning_rate`
    (after the last update).
  """
  if algo.distillation_beta is not None and teacher_params is None:
    raise ValueError(f"{algo.name} distils from frozen teacher parameters: pass "
                     "teacher_params (the initial parameters)")
  b = batch.tokens.shape[0]
  n_micro, micro = plan.micro_batches(b, _shards(micro_sharding))
  rng, shuffle_rng = jax.random.split(state.rng)
  if batch.pending is not None:
    if not plan.on_policy(b, _shards(micro_sharding)):
      raise ValueError(f"a PolicyBatch with pending advantages needs one update in one pass "
                       f"(UpdatePlan.on_policy), got {plan}")
    # One update on the whole batch, rows in order (the advantages are computed in the loss,
    # over whole groups); `update` takes the batch as it is and `order` only sets the scan's
    # length.
    order = jnp.arange(b).reshape(1, 1, b)
  else:
    orders = [jax.random.permutation(jax.random.fold_in(shuffle_rng, e), b)
              for e in range(plan.epochs)]
    # [updates, n_micro, micro] row indices: epoch-major, then mini-batch.
    order = jnp.stack(orders).reshape(plan.epochs * plan.minibatches, n_micro, micro)
  loss_fn = functools.partial(policy_loss, config=config, algo=algo,
                              chunk_size=plan.chunk_size, teacher_params=teacher_params)

  def update(carry, rows):
    params, opt_state = carry
    if batch.pending is None:
      micro_batches = jax.tree.map(lambda x: x[rows], batch)
    else:  # The whole batch as one micro-batch (the scalar `pending.step` has no rows).
      micro_batches = jax.tree.map(lambda x: x[None], batch)
    if micro_sharding is not None:  # Rows over the data axes (not the pending scalar step).
      micro_batches = jax.tree.map(
          lambda x: jax.lax.with_sharding_constraint(x, micro_sharding) if x.ndim > 1 else x,
          micro_batches)
    loss, grads, metrics, weight = accumulate_gradients(loss_fn, params, micro_batches)
    params, opt_state, info = apply_update(params, opt_state, grads, loss, tx, weight > 0)
    return (params, opt_state), {"loss": loss, **metrics, **info}

  (params, opt_state), per_update = jax.lax.scan(update, (state.params, state.opt_state),
                                                 order)
  skipped, empty = per_update.pop("skipped"), per_update.pop("empty")
  applied = (1.0 - skipped) * (1.0 - empty)
  weights = jnp.where(jnp.sum(applied) > 0, applied, jnp.ones_like(applied))
  mean = lambda x: jnp.sum(jnp.where(weights > 0, x, 0.0) * weights) / jnp.sum(weights)
  metrics = {k: mean(v) for k, v in per_update.items()}
  metrics.update(skipped_updates=jnp.sum(skipped), empty_updates=jnp.sum(empty),
                 learning_rate=learning_rate(opt_state))
  new_state = state.replace(params=params, opt_state=opt_state, step=state.step + 1, rng=rng)
  return new_state, metrics


def policy_batch(params: Any, rollout: Any, teacher_prompt: Array, teacher_prompt_mask: Array,
                 step: Array, *, config: ModelConfig, algo: Any, max_turns: int,
                 chunk_size: int | None = None, on_policy: bool = False
                 ) -> tuple[PolicyBatch, dict]:
  """The evidence pass: pre-update log-probs -> the algorithm's token advantages.

  One forward per condition with the current parameters, never the sampler's log-probs
  (DESIGN §2 "Non-replay evidence recomputation"): `dual_logprobs` when the algorithm reads
  the teacher log-probs (its student half is the PPO old log-probs), the student pass alone
  otherwise; plus `token_divergence` when the algorithm needs the divergence or entropy.
  Log-probs are scored from the rollout's prompt width on (the trajectory: every action token
  lies there), 0 before it.

  With `on_policy` (the plan makes one update in one pass, `UpdatePlan.on_policy`) the
  student pass is left to the update's own forward: the batch carries the advantage inputs
  as `pending` and the advantages' metrics come from `ppo_update`.

  Args:
    params: the pre-update parameters.
    rollout: a `pbsd_jax.rollout.Rollout` (tokens, action_mask, turn_ids, reward, mask).
    teacher_prompt: `i32[B, P]` left-padded privileged prompts (`privileged.dual_prompts`).
    teacher_prompt_mask: `bool[B, P]`.
    step: `i32[]` the train step (the algorithm's schedules).
    config: the model config.
    algo: a `pbsd_jax.algorithms` algorithm.
    max_turns: K, the rollout's static number of turn slots.
    chunk_size: LM-head chunk over the sequence.
    on_policy: leave the student log-probs to the update (see above).

  Returns:
    `(PolicyBatch, metrics)`: the algorithm's advantage metrics (none when `on_policy`) plus
    `accuracy` (mean reward), `mean_turns` and `mean_action_tokens` of the rollout.
  """
  tokens, mask = rollout.tokens, rollout.mask
  teacher_tokens, teacher_mask = privileged.teacher_sequence(tokens, mask, teacher_prompt,
                                                             teacher_prompt_mask)
  score = functools.partial(likelihood.token_logprobs, params, config, chunk_size=chunk_size,
                            score_from=rollout.prompt_width)
  logp_student = logp_teacher = divergence = entropy = None
  if "logp_teacher" in algo.needs and not on_policy:
    logp = likelihood.dual_logprobs(params, config, tokens, mask, teacher_tokens, teacher_mask,
                                    chunk_size=chunk_size, score_from=rollout.prompt_width)
    logp_student, logp_teacher = logp[0], logp[1]
  elif "logp_teacher" in algo.needs:
    logp_teacher = jax.lax.stop_gradient(score(teacher_tokens, teacher_mask))
  elif not on_policy:
    logp_student = jax.lax.stop_gradient(score(tokens, mask))
  if algo.needs & {"divergence", "entropy"}:
    divergence, entropy = jax.lax.stop_gradient(likelihood.token_divergence(
        params, params, config, tokens, mask, teacher_tokens, teacher_mask, beta=1.0,
        chunk_size=chunk_size, with_entropy=True))
  inputs = AdvantageInputs(rewards=rollout.reward, action_mask=rollout.action_mask,
                           turn_ids=rollout.turn_ids, step=step, max_turns=max_turns,
                           logp_student=logp_student, logp_teacher=logp_teacher,
                           divergence=divergence, entropy=entropy)
  batch = PolicyBatch(tokens=tokens, mask=mask, teacher_tokens=teacher_tokens,
                      teacher_mask=teacher_mask, action_mask=rollout.action_mask.astype(bool),
                      score_from=rollout.prompt_width)
  if on_policy:
    batch, metrics = batch.replace(pending=inputs), {}
  else:
    advantages, loss_mask, metrics = algo.advantages(inputs)
    batch = batch.replace(loss_mask=loss_mask, advantages=advantages, old_logp=logp_student)
  metrics = {**metrics, "accuracy": jnp.mean(rollout.reward.astype(jnp.float32)),
             "mean_turns": jnp.mean(rollout.num_turns.astype(jnp.float32)),
             "mean_action_tokens": jnp.mean(rollout.num_action_tokens.astype(jnp.float32))}
  return batch, metrics


def rl_step(state: TrainState, rollout: Any, teacher_prompt: Array, teacher_prompt_mask: Array,
            teacher_params: Any = None, *, config: ModelConfig, tx: optax.GradientTransformation,
            algo: Any, max_turns: int, plan: UpdatePlan = UpdatePlan(),
            micro_sharding: NamedSharding | None = None) -> tuple[TrainState, dict]:
  """One RL iteration on a rollout: `policy_batch` then `ppo_update` (traceable).

  Args: as `policy_batch` and `ppo_update`.

  Returns:
    `(new state, metrics)`: the union of both functions' metrics.
  """
  on_policy = plan.on_policy(rollout.tokens.shape[0], _shards(micro_sharding))
  batch, adv_metrics = policy_batch(state.params, rollout, teacher_prompt, teacher_prompt_mask,
                                    state.step, config=config, algo=algo, max_turns=max_turns,
                                    chunk_size=plan.chunk_size, on_policy=on_policy)
  state, metrics = ppo_update(state, batch, config=config, tx=tx, algo=algo, plan=plan,
                              teacher_params=teacher_params, micro_sharding=micro_sharding)
  return state, {**adv_metrics, **metrics}


def _micro_sharding(mesh: Mesh, rules) -> NamedSharding:
  rows = sharding.batch_sharding(mesh, rules).spec[0]
  return NamedSharding(mesh, PartitionSpec(None, rows))


def make_sft_step(config: ModelConfig, tx: optax.GradientTransformation,
                  plan: UpdatePlan = UpdatePlan(), mesh: Mesh | None = None,
                  rules=sharding.RULES) -> Callable:
  """`sft_step` jitted: `(state, tokens, mask, loss_mask) -> (state, metrics)`, state donated.

  With a mesh: explicit in/out shardings (state from `train_state_shardings`, batch rows over
  the data axes, metrics replicated).
  """
  fn = functools.partial(sft_step, config=config, tx=tx, plan=plan)
  if mesh is None:
    return jax.jit(fn, donate_argnums=0)
  fn = functools.partial(fn, micro_sharding=_micro_sharding(mesh, rules))
  state_sh, data = train_state_shardings(config, tx, mesh, rules), sharding.batch_sharding(
      mesh, rules)
  return jax.jit(fn, in_shardings=(state_sh, data, data, data),
                 out_shardings=(state_sh, sharding.replicated(mesh)), donate_argnums=0)


def make_rl_step(config: ModelConfig, tx: optax.GradientTransformation, algo: Any,
                 max_turns: int, plan: UpdatePlan = UpdatePlan(), mesh: Mesh | None = None,
                 rules=sharding.RULES) -> Callable:
  """`rl_step` jitted, state donated.

  Returns:
    `step(state, rollout, teacher_prompt, teacher_prompt_mask, teacher_params=None) ->
    (state, metrics)`. With a mesh, in/out shardings are explicit: state from
    `train_state_shardings`, rollout and prompts rows over the data axes, teacher params
    like the params, metrics replicated; each micro-batch is constrained to the data axes.
    The state's buffers are donated: pass OPSD's frozen `teacher_params` as a separate copy,
    never `state.params` itself.
  """
  fn = functools.partial(rl_step, config=config, tx=tx, algo=algo, max_turns=max_turns,
                         plan=plan)
  if mesh is None:
    with_teacher = jax.jit(fn, donate_argnums=0)
    without = jax.jit(lambda s, r, tp, tm: fn(s, r, tp, tm), donate_argnums=0)
  else:
    fn = functools.partial(fn, micro_sharding=_micro_sharding(mesh, rules))
    state_sh = train_state_shardings(config, tx, mesh, rules)
    data, out = sharding.batch_sharding(mesh, rules), (state_sh, sharding.replicated(mesh))
    with_teacher = jax.jit(fn, in_shardings=(state_sh, data, data, data, state_sh.params),
                           out_shardings=out, donate_argnums=0)
    without = jax.jit(lambda s, r, tp, tm: fn(s, r, tp, tm),
                      in_shardings=(state_sh, data, data, data), out_shardings=out,
                      donate_argnums=0)

  def step(state, rollout, teacher_prompt, teacher_prompt_mask, teacher_params=None):
    if teacher_params is None:
      return without(state, rollout, teacher_prompt, teacher_prompt_mask)
    return with_teacher(state, rollout, teacher_prompt, teacher_prompt_mask, teacher_params)

  return step
