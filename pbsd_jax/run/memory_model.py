"""What a run's program must hold per device, from the shapes alone.

The parts (bytes per device; `rows` are a device's rows: the batch over `data x fsdp`):

- `params`, `optimizer`, `teacher`: the train state's arrays in their shardings (exact: the
  shard shapes of `train_state_shardings`), OPSD's frozen copy of the parameters.
- `gathered`: FSDP gathers each layer's weights in the compute dtype before using them; a
  layer scan (an update, a prefill, an append, a decode step) holds about two layers' worth
  (the one computed, the next one's gather); the in-graph rollout's decode loop, which slices
  every layer once outside the loop, all of them.
- `gradients`: the micro-batch's gradient and the mini-batch's sum, float32, in the
  parameters' shardings (one of them on the one-pass plan).
- `kv_cache`: `rows x buffer x layers x 2 (keys, values) x kv heads / tensor x head dim` in
  the cache dtype: every row reserves the whole buffer; a TPU program holds
  `CACHE_BUFFERS[kind]` of them (loop carries, the scatter's relayouts).
- `logits`: the LM head's float32 logits over `chunk` positions (`rl.chunk_size`, the whole
  sequence when 0) and the vocabulary / tensor, three times in an update (the logits, their
  softmax, its gradient), twice per sequence in the evidence pass (the student's and the
  teacher's sequences are scored in the update's micro-batches).
- `activations`: per layer the saved input of `rows x length x hidden` in the compute dtype
  (remat), or everything the layer's backward reads (`6 hidden + 2 kv heads x head dim`
  values per token in the compute dtype, the MLP's `3 mlp` and the residual's `2 hidden` in
  float32: flash attention saves no scores); the layer being differentiated
  (its forward again) and three flash tiles of float32 scores (a query block by a key
  block, every head).
- Not modelled: the compiled code (tens of MB), collectives' buffers.

A program's need is its state plus the largest of its phases (rollout, evidence pass,
update): XLA reuses a phase's temporaries in the next. docs/tpu.md compares the model with
the TPU compiler's own figures on 30 programs, from `small` to Qwen3-8B, and names its gaps.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from pbsd_jax.models import param_shapes, param_shardings
from pbsd_jax.models.attention.flash import KEY_BLOCK, QUERY_BLOCK, tiling
from pbsd_jax.parallel import sharding
from pbsd_jax.rl import train_state


# Cache-sized buffers a TPU rollout program holds, measured (scripts/aot_compile.py, docs/tpu.md):
# a write of several tokens per row (the prompt's prefill, an observation's append) scatters
# into the cache through relayouts of it (its slots are its minor axis), 4 in all; a decode
# step holds the cache it was given (donated); the in-graph rollout, whose loops carry the
# cache through both, 6.
CACHE_BUFFERS = {"start": 4, "observe": 4, "act": 1, "rl_step": 6, "eval": 6}
# With a head dim of whole 128-lane tiles (Qwen2.5-3B, Qwen3-8B) every turn program of the
# host loop holds the cache and half of it again (1.5-1.6 cache-sized buffers, 8K to 64K).
CACHE_BUFFERS_WIDE_HEADS = {**CACHE_BUFFERS, "start": 1.5, "observe": 1.5, "act": 1.5}


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

  `rows`: the program's batch (default: the stage's), split over the data axes.
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

  kv = 2 * _split(model.num_kv_heads, tensor) * model.resolved_head_dim
  forward_per_token = (6 * hidden + kv + 3 * mlp) * compute  # what a layer's backward reads

  def tile(local: float, length: int) -> float:
    """One flash tile's float32 scores: a query block by a key block, every head."""
    return local * heads * min(QUERY_BLOCK, length) * tiling(length, KEY_BLOCK)[1] * 4

  def update(n: int, length: int, chunk: int | None, on_policy: bool) -> dict:
    local = _split(n, shards)
    # Without remat a layer keeps for its backward its forward's values, the MLP's
    # intermediates and the residual stream in float32 (as the compiled programs do).
    saved = (hidden * compute if model.remat
             else (6 * hidden + kv) * compute + 3 * mlp * 4 + 2 * hidden * 4)
    # Plus the layer being differentiated: its forward again and three flash tiles (scores,
    # probabilities, their gradient).
    return {
        "gathered": 2 * layer_weights * compute,
        "gradients": (1 if on_policy else 2) * _per_device(shapes, param_sh, jnp.float32),
        "activations": (local * length * (layers * saved + forward_per_token)
                        + 3 * tile(local, length)),
        "logits": local * min(chunk or length, length) * vocab * 4 * 3,
    }

  def evidence(n: int, sequences: int, chunk: int | None) -> dict:
    local = _split(n, shards) * sequences
    return {"gathered": 2 * layer_weights * compute,
            "activations": local * buffer * forward_per_token + tile(local, buffer),
            "logits": local * min(chunk or buffer, buffer) * vocab * 4 * 2}

  def rollout(n: int) -> dict:
    # The in-graph rollout's decode loop slices every layer's weights once, outside it: all
    # of them gathered; a prefill, an append and the host loop's decode step gather layer
    # by layer: two layers' worth.
    every_layer = kind in ("rl_step", "eval") and mesh.shape["fsdp"] > 1
    return {"gathered": (layers if every_layer else 2) * layer_weights * compute,
            "kv_cache": (CACHE_BUFFERS_WIDE_HEADS if model.resolved_head_dim % 128 == 0
                         else CACHE_BUFFERS)[kind] * kv_cache(n),
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
      phases.append(evidence(micro, sequences, plan.chunk_size))
    if kind == "rl_step":
      phases.append(rollout(n))
  else:
    n = rows or spec.rl.prompts_per_step * spec.rl.group_size
    phases = [rollout(n)]
  phase = max(phases, key=lambda p: sum(p.values()))
  parts = {**state, **phase}
  parts["total"] = sum(parts.values())
  return parts


def step_seconds(spec, mesh: Mesh, peak_flops: float, bandwidth: float) -> dict[str, float]:
  """A roofline of one RL step on `mesh`'s chips, from the shapes alone: `rollout`,
  `evidence` and `update` seconds (each `max(FLOPs / peak, bytes / bandwidth)` per device).

  - rollout: at most `max_turns x max_action_tokens` decode steps (every row using its whole
    budget); each computes `2 x params` FLOPs per row and reads the weights (whole: FSDP
    gathers them) and its rows' KV cache, half full on average; plus the observations'
    appends (`max_turns x max_observation_tokens` tokens per row, as a forward).
  - evidence: a forward (`2 x params` FLOPs per token, attention's `2 x 2 x layers x
    context x hidden` on top) over every row's buffer, once per sequence scored.
  - update: forward and backward (three forwards; four with remat) over every row's buffer,
    per epoch.
  Collectives are not counted (ICI is not the bound at these shapes; DCN across slices can
  be).
  """
  model, env, rl = spec.model, spec.env, spec.rl
  devices = mesh.size
  shards = sharding.num_batch_shards(mesh)
  rows = rl.prompts_per_step * rl.group_size
  n = sum(math.prod(s.shape) for s in jax.tree.leaves(param_shapes(model)))
  compute = jnp.dtype(model.jnp_dtype).itemsize
  cache_bytes = jnp.dtype(model.jnp_cache_dtype).itemsize
  buffer = env.buffer_size
  kv_per_token = (model.num_layers * 2 * model.num_kv_heads * model.resolved_head_dim
                  * cache_bytes)
  attention = lambda context: 2 * 2 * model.num_layers * context * model.hidden_size
  roof = lambda flops, moved: max(flops / peak_flops, moved / bandwidth)

  steps = env.max_turns * env.max_action_tokens
  local_rows = rows / shards
  decode = roof(local_rows * (2 * n + attention(buffer / 2)) / (devices / shards),
                n * compute + local_rows * buffer / 2 * kv_per_token)
  appended = rows * env.max_turns * env.max_observation_tokens
  rollout = steps * decode + roof(appended * (2 * n + attention(buffer / 2)) / devices,
                                  env.max_turns * n * compute)
  tokens = rows * buffer
  forward = tokens * (2 * n + attention(buffer / 2)) / devices
  algo, plan = spec.algorithm, rl.plan
  on_policy = plan.on_policy(rows, shards)
  sequences = (("logp_teacher" in algo.needs) + (not on_policy)
               + 2 * bool(algo.needs & {"divergence", "entropy"}))
  evidence = roof(sequences * forward, sequences * n * compute)
  passes = 4 if model.remat else 3
  update = roof(plan.epochs * passes * forward,
                plan.epochs * plan.minibatches * 3 * n * 4)
  return {"rollout": rollout, "evidence": evidence, "update": update}
