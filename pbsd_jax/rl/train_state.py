"""The train state and its optimiser: AdamW with warm-up and schedule, init, shardings.

A `TrainState` is what a run needs to continue exactly and what a checkpoint holds; the
learning rate lives in the optimiser state (`learning_rate`). With a mesh, the state is built
directly in the shardings of the one logical-axis table (`train_state_shardings`).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import Mesh

from pbsd_jax.models import ModelConfig, param_shapes, param_shardings
from pbsd_jax.parallel import sharding

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


def train_state_shardings(model: ModelConfig, tx: optax.GradientTransformation, mesh: Mesh,
                          rules=sharding.RULES) -> TrainState:
  """`NamedSharding`s of a `TrainState` for `model` under `mesh` (from the one rules table)."""
  params = param_shardings(model, mesh, rules)
  opt_state = sharding.opt_state_shardings(tx, param_shapes(model), params, mesh)
  return TrainState(params=params, opt_state=opt_state, step=sharding.replicated(mesh),
                    rng=sharding.replicated(mesh))
