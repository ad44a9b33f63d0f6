"""What a run's program must hold per device, from the shapes alone.

The parts (bytes per device; `rows` are a device's rows: the batch over `data x fsdp`):

- `params`, `optimizer`, `teacher`: the train state's arrays in their shardings (exact: the
  shard shapes of `train_state_shardings`), OPSD's frozen copy of the parameters.
- `gathered`: FSDP gathers each layer's weights in the compute dtype before using them; a
  layer scan holds about two layers' worth (the one computed, the next one's gather); a
  rollout, whose decode loop slices every layer once outside the loop, all of them.
- `gradients`: the micro-batch's gradient and the mini-batch's sum, float32, in the
  parameters' shardings (one of them on the one-pass plan).
- `kv_cache`: `rows x buffer x layers x 2 (keys, values) x kv heads / tensor x head dim` in
  the cache dtype: every row reserves the whole buffer.
- `logits`: the LM head's float32 logits over `chunk` positions (`rl.chunk_size`) and the
  vocabulary / tensor, once (a chunk is rematerialised in the backward pass); over the whole
  sequence when there is no chunk, three times in an update (the logits, their softmax, its
  gradient); per sequence scored (the evidence pass scores the student's and the teacher's,
  over the whole batch at once).
- `activations`: per layer the saved input of `rows x length x hidden` in the compute dtype
  (remat), or everything the layer's backward reads (about `6 hidden + 2 kv heads x head dim
  + 3 mlp` values per token: flash attention saves no scores); plus one layer's worth being
  recomputed and one flash tile of float32 scores.

A program's need is its state plus the largest of its phases (rollout, evidence pass,
update): XLA reuses a phase's temporaries in the next. `tests/test_aot.py` holds the model
to the TPU compiler's own figures on small configurations, docs/tpu.md on large ones.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from pbsd_jax.models import param_shapes, param_shardings
from pbsd_jax.models.attention.flash import KEY_BLOCK, QUERY_BLOCK
from pbsd_jax.parallel import sharding
from pbsd_jax.rl import train_state


def _per_device(shapes, shardings, dtype=None) -> float:
  total = 0.0
  for shape, sh in zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings)):
    local = sh.shard_shape(shape.shape)
    total += math.prod(local) * jnp.dtype(dtype or shape.dtype).itemsize
  return total


def _split(n: int, ways: int) -> float:
  return n / ways if n % ways == 0 else n


def estimate(spec, mesh: Mesh, kind: str, rows: int | None = None) -> dict[str, float]:
  """The memory model's parts for a program of `kind` (`sft`, `rl_step`, `rl_update`,
  `eval`, or the host loop's `start`, `act`, `observe`) and their `total`, bytes per device.

  `rows`: the program's batch (default: the stage's).
  """
  model, env = spec.model, spec.env
  shards = sharding.num_batch_shards(mesh)
  tensor = mesh.shape["tensor"]
  shapes = param_shapes(model)
  param_sh = param_shardings(model, mesh)
  params = _per_device(shapes, param_sh)
  compute = jnp.dtype(model.jnp_dtype).itemsize
  cache_bytes = jnp.dtype(model.jnp_cache_dtype).itemsize
  layers, hidden, buffer = model.num_layers, model.hidden_size, env.buffer_size
  layer_weights = sum(math.prod(s.shape) for s in jax.tree.leaves(shapes["layers"])) / layers
  vocab = _split(model.vocab_size, tensor)
  mlp = _split(model.expert_mlp_dim * model.num_experts_per_tok if model.num_experts
               else model.mlp_dim, tensor)
  heads = _split(model.num_heads, tensor)

  def kv_cache(n: int) -> float:
    return (_split(n, shards) * buffer * layers * 2 * _split(model.num_kv_heads, tensor)
            * model.resolved_head_dim * cache_bytes)

  def update(n: int, length: int, chunk: int | None, on_policy: bool) -> dict:
    local = _split(n, shards)
    kv = 2 * _split(model.num_kv_heads, tensor) * model.resolved_head_dim
    per_token_layer = (6 * hidden + kv + 3 * mlp) * compute
    saved = (hidden * compute) if model.remat else per_token_layer
    tile = local * heads * min(QUERY_BLOCK, length) * min(KEY_BLOCK, length) * 4
    return {
        "gathered": 2 * layer_weights * compute,
        "gradients": (1 if on_policy else 2) * _per_device(shapes, param_sh, jnp.float32),
        "activations": local * length * (layers * saved + per_token_layer) + tile,
        "logits": local * min(chunk or length, length) * vocab * 4 * (1 if chunk else 3),
    }

  def evidence(n: int, sequences: int, chunk: int | None) -> dict:
    local = _split(n, shards) * sequences
    return {"gathered": 2 * layer_weights * compute,
            "activations": local * buffer * 2 * (4 * hidden + 2 * mlp) * compute,
            "logits": local * min(chunk or buffer, buffer) * vocab * 4 * 2}

  def rollout(n: int) -> dict:
    return {"gathered": layers * layer_weights * compute if mesh.shape["fsdp"] > 1 else 0,
            "kv_cache": kv_cache(n),
            "logits": _split(n, shards) * vocab * 4 * 3}

  state = {"params": params}
  if kind in ("sft", "rl_step", "rl_update"):
    stage = spec.sft if kind == "sft" else spec.rl
    tx = stage.optimizer
    opt = jax.eval_shape(tx.init, shapes)
    state["optimizer"] = _per_device(
        opt, train_state.train_state_shardings(model, tx, mesh).opt_state)
  if spec.algorithm.distillation_beta is not None and kind in ("rl_step", "rl_update"):
    state["teacher"] = params

  if kind == "sft":
    plan, n = spec.sft.plan, spec.sft.batch_size
    micro = plan.micro_batch_size or n
    phases = [update(micro, buffer, plan.chunk_size, micro == n)]
  elif kind in ("rl_step", "rl_update"):
    plan = spec.rl.plan
    n = spec.rl.prompts_per_step * spec.rl.group_size
    micro = plan.micro_batch_size or n // plan.minibatches
    on_policy = plan.on_policy(n, shards)
    teacher = "logp_teacher" in spec.algorithm.needs
    sequences = (1 if on_policy else 2) if teacher else (0 if on_policy else 1)
    phases = [update(micro, buffer, plan.chunk_size, on_policy)]
    if sequences:
      phases.append(evidence(n, sequences, plan.chunk_size))
    if kind == "rl_step":
      phases.append(rollout(n))
  else:
    n = rows or spec.rl.prompts_per_step * spec.rl.group_size
    phases = [rollout(n)]
  phase = max(phases, key=lambda p: sum(p.values()))
  parts = {**state, **phase}
  parts["total"] = sum(parts.values())
  return parts
