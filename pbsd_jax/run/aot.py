"""A run's programs compiled ahead of time for a TPU topology, from any host.

`topology("v5e-16")` names the devices of a TPU slice that need not be attached (libtpu
compiles for them: `pip install -e .[tpu]`). `run_programs` builds, under the run's mesh on
those devices, every program the run executes -- the SFT step; the one-program RL step (with
frozen teacher parameters where the algorithm distils), or with a host retriever the turn
loop's start / act / observe programs and the update; evaluation's rollout -- on abstract
arguments (`jax.ShapeDtypeStruct`s carrying the run's shardings), so nothing is allocated.
`analyse` compiles one and reads the TPU compiler's own accounts: per-device memory
(`memory_analysis()`), FLOPs and bytes (`cost_analysis()`, every loop body once), and the
same counted with each loop as often as it runs (`hlo_cost`), whence a roofline time and the
MFU it implies on the chip. `memory_model.estimate` is what the program should need, from
the shapes alone; `scripts/aot_compile.py` prints both.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from pbsd_jax.agent import rollout as rollout_lib
from pbsd_jax.models import param_shapes
from pbsd_jax.models.attention.decode import DECODE_BLOCK
from pbsd_jax.models.attention.flash import tiling
from pbsd_jax.data.storage import size_text
from pbsd_jax.generate.sampling import Sampler
from pbsd_jax.parallel import chips, hlo_cost, sharding
from pbsd_jax.parallel.chips import Chip
from pbsd_jax.rl import learner, train_state
from pbsd_jax.run import memory_model, train
from pbsd_jax.run.run_config import RunSpec
from pbsd_jax.run.task import Task, rl_batch, rl_prompts

# TPU generations by the prefix of a slice's name (`v5e-16`).
CHIPS = chips.TPUS

# Chips per slice -> the physical topology libtpu names (2D torus for the lite chips, 3D else).
_SHAPES_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16",
              256: "16x16"}
_SHAPES_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
              256: "4x8x8", 512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16"}


def _quiet_libtpu() -> None:
  """libtpu looks for the TPU workers of the host it runs on, which a compiling host has
  none of; telling it that there is one quiets its start-up errors. It also locks the host's
  TPU for one process (`/tmp/libtpu_lockfile`): compiling uses no TPU, so several compiles
  may run at once."""
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")


def topology(name: str, num_slices: int = 1) -> tuple[list, Chip]:
  """The devices of TPU slice `name` and its chip.

  `name` is a Cloud TPU slice (`v5e-16`, `v6e-64`: chips; `v4-64`, `v5p-128`: TensorCores,
  two per chip) or libtpu's own topology name (`v5e:4x4`, `v5p:2x2x4`). `num_slices` > 1
  joins that many slices over the data-center network (multi-slice).

  Raises:
    ValueError: an unknown generation or size, or no libtpu installed (naming the extra).
  """
  generation, count, shape = _parse_topology(name)
  if generation not in CHIPS:
    raise ValueError(f"--topology={name!r}: unknown TPU generation {generation!r} "
                     f"(known: {sorted(CHIPS)})")
  cores = 2 if generation in ("v4", "v5p") else 1  # named by TensorCores, two per chip
  if shape is None:
    table = _SHAPES_3D if cores == 2 else _SHAPES_2D
    if count // cores not in table:
      raise ValueError(f"--topology={name!r}: no {generation} slice of {count} "
                       f"{'TensorCores' if cores == 2 else 'chips'} "
                       f"(sizes: {sorted(k * cores for k in table)})")
    shape = table[count // cores]
  from jax.experimental import topologies
  _quiet_libtpu()
  kwargs = {"chip_config_name": "megacore"} if cores == 2 else {}
  if math.prod(int(n) for n in shape.split("x")) < 4:  # a host of one chip
    kwargs["chips_per_host_bounds"] = (1, 1, 1)
  try:
    desc = topologies.get_topology_desc(platform="tpu", topology_name=f"{generation}:{shape}",
                                        num_slices=num_slices, **kwargs)
  except (RuntimeError, ValueError) as err:
    if "not installed" in str(err):
      raise ValueError("compiling for a TPU needs libtpu: pip install -e .[tpu] (jax[tpu] of "
                       "the installed jax)") from None
    raise ValueError(f"--topology={name!r}: {err}") from None
  return list(desc.devices), CHIPS[generation]


def _parse_topology(name: str) -> tuple[str, int, str | None]:
  named = re.fullmatch(r"(v\d+[a-z]*)-(\d+)", name)
  if named:
    return named.group(1), int(named.group(2)), None
  physical = re.fullmatch(r"(v\d+[a-z]*):(\d+(?:x\d+)+)", name)
  if physical:
    return physical.group(1), 0, physical.group(2)
  raise ValueError(f"--topology={name!r}: expected a slice like v5e-16 or v5p-128, or a "
                   "libtpu topology like v5e:4x4")


@dataclasses.dataclass(frozen=True)
class Program:
  """One program of a run, ready to compile.

  Attributes:
    name: what the run calls it (`sft_step`, `rl_step`, `rollout_act`, ...).
    lower: `() -> jax.stages.Lowered` on abstract arguments.
    budgets: the trip counts of its data-dependent loops, by scope name (`hlo_cost`): the
      most they can run.
    calls: how many times one step (of its stage) runs it (the host loop's per-turn
      programs: once per turn).
    fields: the config fields that change its memory.
    estimate: `memory_model.estimate`'s parts, bytes per device.
  """

  name: str
  lower: Callable[[], Any]
  budgets: dict
  calls: int
  fields: str
  estimate: dict


@dataclasses.dataclass(frozen=True)
class Report:
  """A compiled program's accounts, per device.

  Attributes:
    name: the program's name.
    memory: `argument`, `output`, `alias` (outputs in donated arguments' buffers), `temp`,
      `code` bytes, and `total` = argument + output - alias + temp + code.
    xla_flops, xla_bytes: `cost_analysis()`'s `flops` and `bytes accessed` (loop bodies
      counted once).
    cost: `hlo_cost.Cost` with each loop counted as it runs.
    seconds: the roofline time of `calls` calls on the chip.
    mfu: the share of the chip's peak those FLOPs use in that time.
    fits: whether `memory["total"]` is within the chip's HBM.
    unit_cost: `hlo_cost.Cost` with every loop counted once (what XLA's cost analysis
      counts).
    custom_calls: the custom-call targets the compiled program holds (its kernels).
  """

  name: str
  memory: dict
  xla_flops: float
  xla_bytes: float
  cost: hlo_cost.Cost
  seconds: float
  mfu: float
  fits: bool
  unit_cost: hlo_cost.Cost
  custom_calls: tuple
  program: Program

  def summary(self) -> dict:
    """The report as JSON values."""
    cost = lambda c: {"flops": c.flops, "bytes": c.bytes, "loops": c.loops,
                      "unknown_loops": list(c.unknown_loops)}
    return {"name": self.name, "memory": self.memory, "estimate": self.program.estimate,
            "xla_flops": self.xla_flops, "xla_bytes": self.xla_bytes,
            "cost": cost(self.cost), "unit_cost": cost(self.unit_cost),
            "roofline_s": self.seconds, "calls": self.program.calls, "mfu": self.mfu,
            "fits": self.fits, "custom_calls": list(self.custom_calls),
            "fields": self.program.fields}


def abstract(tree: Any, shardings: Any) -> Any:
  """`tree`'s arrays as `jax.ShapeDtypeStruct`s placed by `shardings` (a matching tree, or
  one sharding for every leaf)."""
  if isinstance(shardings, jax.sharding.Sharding):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype,
                                                       sharding=shardings), tree)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s),
                      tree, shardings)


def abstract_state(spec: RunSpec, tx: Any, mesh: Mesh) -> train_state.TrainState:
  """A step-0 `TrainState` of the spec's model and `tx` as abstract arrays in their shardings."""
  shapes = jax.eval_shape(lambda p, k: train_state.init_train_state(p, tx, k),
                          param_shapes(spec.model), jax.random.key(0))
  return abstract(shapes, train_state.train_state_shardings(spec.model, tx, mesh))


def _device_index(index: Any, mesh: Mesh) -> Any:
  """A device index as the run's step takes it on `mesh`: abstract, in its shardings (a
  sparse index's shards over the mesh's axes)."""
  if getattr(index, "shard_axes", None) is not None:
    index = index.replace(mesh=mesh, shard_axes=sharding.MESH_AXES)
  return abstract(index, index.shardings(mesh))


def run_programs(spec: RunSpec, task: Task, mesh: Mesh) -> list[Program]:
  """Every program `spec`'s run executes, under `mesh` (see the module docstring).

  The SFT step is built for sequences of the whole buffer (`env.buffer_size`), the widest an
  SFT batch can be; the RL step for `rollout.prompts_per_step x grpo.group_size` rows;
  evaluation, where the run evaluates (`eval.every`, `eval.sft_every`), for its batch of
  `min(50, eval.num_examples)` rows (an in-graph agent's padded to split over the data axes,
  as `evaluate.evaluate` pads them).
  """
  model, env, rl = spec.model, task.env, spec.rl
  rows, whole = sharding.batch_sharding(mesh), sharding.replicated(mesh)
  decode = _decode_budgets(env)
  out = []
  estimate = lambda kind, **kw: memory_model.estimate(spec, mesh, kind, **kw)

  if spec.sft.steps:
    tx = spec.sft.optimizer
    state = abstract_state(spec, tx, mesh)
    width, batch = env.buffer_size, spec.sft.batch_size
    tokens = jax.ShapeDtypeStruct((batch, width), jnp.int32, sharding=rows)
    flags = jax.ShapeDtypeStruct((batch, width), jnp.bool_, sharding=rows)
    step = learner.make_sft_step(model, tx, spec.sft.plan, mesh=mesh)
    out.append(Program("sft_step", functools.partial(step.lower, state, tokens, flags, flags),
                       {}, 1, "sft.batch_size, env.buffer_size, model.remat, model.param_dtype",
                       estimate("sft")))

  tx, algo, plan = rl.optimizer, spec.algorithm, rl.plan
  state = abstract_state(spec, tx, mesh)
  records, group_ids = rl_prompts(task, spec, 0)
  batch = abstract(rl_batch(task, spec.data, records), rows)
  group_ids = jax.ShapeDtypeStruct(group_ids.shape, jnp.int32, sharding=rows)
  teacher = state.params if algo.distillation_beta is not None else None
  agent = task.agent(spec.sampler("rollout"))
  update_fields = ("rl.micro_batch_size, rl.chunk_size, model.remat, rollout.prompts_per_step, "
                   "grpo.group_size, env.buffer_size")
  if agent.in_graph:
    search = (_device_index(agent.search, mesh),
              None if agent.tokenizer.text is None else abstract(agent.tokenizer.text, whole))
    step = train.make_rl_iteration(agent, model, tx, algo, plan, mesh)
    name = "rl_step" if teacher is None else "rl_step (frozen teacher)"
    out.append(Program(name, functools.partial(step.lower, state, search, batch, group_ids,
                                               teacher),
                       {"turn_loop": env.max_turns, **decode}, 1,
                       update_fields + ", model.cache_dtype", estimate("rl_step")))
  else:
    out += _host_loop(spec, task, agent, state.params, batch, rows, "rollout", estimate)
    update = learner.make_rl_step(model, tx, algo, env.max_turns, plan, mesh=mesh)
    # The host loop's rollout: the episode `_start` begins, finished.
    rollout = jax.eval_shape(
        lambda p, b, g: _labelled(rollout_lib._finish(
            rollout_lib._start(agent.sampler, env, p, b["prompts"], b["prompt_mask"]),
            b["prompt_mask"], g, jnp.zeros(g.shape, jnp.float32)), b),
        state.params, batch, group_ids)
    rollout = abstract(rollout, rows)
    out.append(Program(
        "rl_update" if teacher is None else "rl_update (frozen teacher)",
        functools.partial(update.lower, state, rollout, batch["teacher_prompt"],
                          batch["teacher_prompt_mask"], teacher), {}, 1, update_fields,
        estimate("rl_update")))

  if not (spec.eval.every or spec.eval.sft_every):
    return out  # the run never evaluates (scripts/evaluate.py's programs: its own batch)
  eval_rows = min(50, spec.eval.num_examples)
  sampler = Sampler(model, temperature=0.0)  # greedy, as `train.validation_accuracy`
  eval_agent = task.agent(sampler)
  shards = sharding.num_batch_shards(mesh)
  eval_rows = -(-eval_rows // shards) * shards
  eval_batch = {k: jax.ShapeDtypeStruct((eval_rows, *v.shape[1:]), v.dtype, sharding=rows)
                for k, v in batch.items() if k in ("prompts", "prompt_mask", "gold")}
  if eval_agent.in_graph:
    index, text = _device_index(eval_agent.search, mesh), eval_agent.tokenizer.text
    text = None if text is None else abstract(text, whole)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=whole)
    out.append(Program(
        "eval_rollout",
        functools.partial(rollout_lib.ingraph_rollout.lower, sampler, env, state.params,
                          eval_batch["prompts"], eval_batch["prompt_mask"], key, index,
                          eval_batch["gold"], text=text),
        {"turn_loop": env.max_turns, **decode}, 1, "eval.num_examples, env.buffer_size",
        estimate("eval", rows=eval_rows)))
  else:
    out += _host_loop(spec, task, eval_agent, state.params, eval_batch, rows, "eval",
                      lambda kind: estimate(kind, rows=eval_rows))
  return out


def _decode_budgets(env: Any) -> dict:
  """The decode loop runs at most its action budget per turn; each step's attention reads
  the cache's blocks up to the fullest row's slot, at most all of them."""
  return {"decode_loop": env.max_action_tokens,
          "decode_blocks": tiling(env.buffer_size, DECODE_BLOCK)[0]}


def _labelled(rollout: Any, batch: dict) -> Any:
  """`rollout` with its turns labelled where the batch has a gold chain (`Agent.rollout`)."""
  return rollout_lib.label_turns(rollout, batch["gold_docs"]) if "gold_docs" in batch else rollout


def _host_loop(spec: RunSpec, task: Task, agent: Any, params: Any, batch: dict,
               rows: jax.sharding.NamedSharding, prefix: str, estimate: Callable
               ) -> list[Program]:
  """The host turn loop's programs (`rollout._start`, `_act`, `_observe`) for `batch`, its
  rows placed by `rows` (over the data axes)."""
  sampler, env = agent.sampler, task.env
  text = agent.tokenizer.text
  b = batch["prompts"].shape[0]
  whole = sharding.replicated(rows.mesh)
  prompts = abstract(batch["prompts"], rows)
  prompt_mask = abstract(batch["prompt_mask"], rows)
  ep = jax.eval_shape(lambda p, x, m: rollout_lib._start(sampler, env, p, x, m), params,
                      prompts, prompt_mask)
  ep = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                   sharding=_rows_of(x, b, rows)), ep)
  key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=whole)
  turn = jax.ShapeDtypeStruct((), jnp.int32, sharding=whole)
  text = None if text is None else abstract(text, whole)
  kind = jax.ShapeDtypeStruct((b,), jnp.int32, sharding=rows)
  limit = (env.max_observation_tokens - len(env.tag_tokens("info_open"))
           - len(env.tag_tokens("info_close")))
  docs = jax.ShapeDtypeStruct((b, env.top_k, max(limit, 1)), jnp.int32, sharding=rows)
  lengths = jax.ShapeDtypeStruct((b, env.top_k), jnp.int32, sharding=rows)
  flags = jax.ShapeDtypeStruct((b,), jnp.bool_, sharding=rows)
  fields = "env.buffer_size, model.cache_dtype, " + (
      "rollout.prompts_per_step, grpo.group_size" if prefix == "rollout" else
      "eval.num_examples")
  return [
      Program(f"{prefix}_start", functools.partial(
          rollout_lib._start.lower, sampler, env, params, prompts, prompt_mask), {}, 1,
          fields, estimate("start")),
      Program(f"{prefix}_act", functools.partial(
          rollout_lib._act.lower, sampler, env, params, ep, key, turn, text=text),
          _decode_budgets(env), env.max_turns, fields, estimate("act")),
      Program(f"{prefix}_observe", functools.partial(
          rollout_lib._observe.lower, sampler, env, params, ep, kind, turn, docs, lengths,
          flags, kind), {}, env.max_turns, fields, estimate("observe")),
  ]


def _rows_of(x: Any, b: int, rows: jax.sharding.NamedSharding) -> jax.sharding.NamedSharding:
  """The sharding of an episode array in the host loop: its row axis (the first of size
  `b`: the KV cache's is the second, after its layers) over the data axes."""
  axis = next((i for i, n in enumerate(x.shape[:2]) if n == b), None)
  if axis is None or rows.spec == jax.sharding.PartitionSpec():
    return jax.sharding.NamedSharding(rows.mesh, jax.sharding.PartitionSpec())
  return jax.sharding.NamedSharding(rows.mesh, jax.sharding.PartitionSpec(*[None] * axis,
                                                                          rows.spec[0]))


def analyse(program: Program, chip: Chip) -> Report:
  """Compiles `program` and reads its accounts (`Report`).

  Raises:
    MemoryError: the TPU compiler itself refuses the program for want of HBM (its message
      names the need).
  """
  try:
    compiled = program.lower().compile()
  except Exception as err:  # XlaRuntimeError: the compiler's own out-of-memory refusal
    if "RESOURCE_EXHAUSTED" in str(err) or "exceeds" in str(err):
      raise MemoryError(str(err).splitlines()[0]) from None
    raise
  m = compiled.memory_analysis()
  memory = {"argument": m.argument_size_in_bytes, "output": m.output_size_in_bytes,
            "alias": m.alias_size_in_bytes, "temp": m.temp_size_in_bytes,
            "code": m.generated_code_size_in_bytes,
            # As the compiler reports it: not a part of the total (docs/tpu.md).
            "peak": getattr(m, "peak_memory_in_bytes", 0)}
  memory["total"] = train.program_bytes(compiled)
  xla = compiled.cost_analysis()
  xla = xla[0] if isinstance(xla, (list, tuple)) else xla
  hlo = compiled.as_text()
  cost = hlo_cost.program_cost(hlo, program.budgets, chip.peak_flops, chip.bandwidth)
  unit = hlo_cost.program_cost(hlo, unit=True)
  calls = tuple(sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo))))
  seconds = program.calls * cost.roofline_s
  mfu = program.calls * cost.flops / (seconds * chip.peak_flops) if seconds else 0.0
  return Report(program.name, memory, float(xla.get("flops", 0.0)),
                float(xla.get("bytes accessed", 0.0)), cost, seconds, mfu,
                memory["total"] <= chip.hbm, unit, calls, program)


def too_large(program: Program, chip: Chip, need: str) -> str:
  """The one line of a program that does not fit the chip; `need` says by how much (its
  total, or the compiler's own refusal)."""
  return (f"{program.name} does not fit a {chip.kind} chip ({size_text(chip.hbm)}): {need}; "
          f"fields that change it: {program.fields}")


def describe(report: Report, chip: Chip) -> str:
  """A program's accounts as a few lines of text."""
  m, c, e = report.memory, report.cost, report.program.estimate
  budgeted = {scope: n for scope, n in report.program.budgets.items()
              if any(scope in name for name in c.loops)}
  fixed = sum(1 for name, n in c.loops.items()
              if n > 1 and not any(scope in name for scope in budgeted))
  loops = ", ".join([f"{scope} x{n}" for scope, n in budgeted.items()]
                    + ([f"{fixed} counted loops"] if fixed else []))
  lines = [
      f"{report.name}: {size_text(m['total'])} of {size_text(chip.hbm)} HBM per chip "
      f"({100 * m['total'] / chip.hbm:.0f}%){'' if report.fits else '  DOES NOT FIT'}",
      f"  arguments {size_text(m['argument'])}, outputs {size_text(m['output'])} "
      f"(aliased {size_text(m['alias'])}), temporaries {size_text(m['temp'])}, "
      f"code {size_text(m['code'])}"
      + (f"; compiler's peak {size_text(m['peak'])}" if m.get("peak") else ""),
      f"  memory model: {size_text(e['total'])} "
      f"({', '.join(f'{k} {size_text(v)}' for k, v in e.items() if k != 'total' and v)})",
      f"  XLA cost analysis (loop bodies once): {report.xla_flops:.3g} FLOP, "
      f"{report.xla_bytes:.3g} B",
      f"  loops as they run{' (' + loops + ')' if loops else ''}: {c.flops:.3g} FLOP, "
      f"{c.bytes:.3g} B per call",
      f"  roofline on {chip.kind}: {report.seconds:.3g} s"
      f"{f' for {report.program.calls} calls' if report.program.calls > 1 else ''}, "
      f"MFU {100 * report.mfu:.1f}%"]
  if c.unknown_loops:
    lines.append(f"  loops without a known count (counted once): {len(c.unknown_loops)}")
  return "\n".join(lines)

