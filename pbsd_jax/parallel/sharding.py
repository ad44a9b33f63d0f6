"""The device mesh, the one logical-axis rules table, and the shardings derived from it.

Models speak logical axis names only (`pbsd_jax.models.transformer.param_axes`); `RULES` is the
single place that maps them to the axes of a mesh `('data', 'fsdp', 'tensor')`:

* `data`: pure data parallelism; parameters are replicated over it.
* `fsdp`: data parallelism whose parameters (and optimiser state) are also sharded over it
  (ZeRO-3: XLA all-gathers a weight where it is used).
* `tensor`: tensor (model) parallelism over heads, MLP width and vocabulary.

Resolution (as in t5x / maxtext / flax `logical_to_mesh_axes`): each dimension of a
`PartitionSpec` of logical names gets the mesh axes its rule names, minus mesh axes an earlier
dimension of the same array already took, minus mesh axes of size 1, and -- when the shape is
known -- minus the trailing mesh axes whose product would not divide the dimension (that
dimension is then replicated over them; `assert_params_sufficiently_sharded` is the guard that
notices when this replicates too much). A logical name missing from the rules is an error.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Sequence

import jax
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# The one table: logical axis -> mesh axis (a name, a tuple of names, or None = replicated).
RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),  # activations and rollouts: every data-parallel axis
    ("length", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("expert", None),  # experts are sharded through their embed / mlp dimensions
    ("layers", None),  # scanned layer stack; no pipeline stages
)

# Mesh axes over which parameters are meant to be sharded (the guard's targets).
PARAM_MESH_AXES = ("fsdp", "tensor")


def mesh_shape(data: int = 1, fsdp: int = -1, tensor: int = 1, *, num_devices: int
               ) -> dict[str, int]:
  """The `{'data', 'fsdp', 'tensor'}` sizes of a mesh over `num_devices` devices.

  One size may be -1: it takes whatever the other two leave.

  Raises:
    ValueError: a size < 1 (other than one -1), or a product that differs from the number of
      devices; the message names the fields and the device count.
  """
  sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
  free = [name for name, size in sizes.items() if size == -1]
  for name, size in sizes.items():
    if size != -1 and size < 1:
      raise ValueError(f"mesh.{name} must be >= 1 (or -1 for 'the rest'), got {size}")
  if len(free) > 1:
    raise ValueError(f"only one mesh size may be -1, got {free}")
  known = math.prod(size for size in sizes.values() if size != -1)
  if free:
    if num_devices % known:
      raise ValueError(f"mesh {_describe(sizes)}: the fixed sizes (product {known}) do not "
                       f"divide the {num_devices} available devices")
    sizes[free[0]] = num_devices // known
  if math.prod(sizes.values()) != num_devices:
    raise ValueError(f"mesh {_describe(sizes)} has {math.prod(sizes.values())} devices but "
                     f"{num_devices} are available")
  return sizes


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1,
              devices: Sequence[Any] | None = None) -> Mesh:
  """A `('data', 'fsdp', 'tensor')` mesh over `devices` (default: all devices, all processes).

  Sizes as `mesh_shape` (which raises for sizes that do not fit the devices). The mesh axes
  are `Auto` (GSPMD), so a jitted function with explicit in/out shardings is partitioned by
  XLA.
  """
  devices = list(jax.devices() if devices is None else devices)
  sizes = mesh_shape(data, fsdp, tensor, num_devices=len(devices))
  shape = tuple(sizes[name] for name in MESH_AXES)
  return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                       devices=devices)


def _describe(sizes: dict) -> str:
  return "(" + ", ".join(f"{name}={size}" for name, size in sizes.items()) + ")"


def _rule_axes(rules, name: str) -> tuple[str, ...]:
  for logical, mesh_axes in rules:
    if logical == name:
      if mesh_axes is None:
        return ()
      return (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
  raise ValueError(f"logical axis {name!r} has no rule; known: {[r[0] for r in rules]}")


def logical_to_mesh_spec(logical: PartitionSpec, mesh: Mesh, rules=RULES,
                         shape: Sequence[int] | None = None) -> PartitionSpec:
  """The mesh `PartitionSpec` of one array with logical axes `logical` (module docstring).

  Args:
    logical: one logical name (or None) per dimension.
    mesh: the device mesh.
    rules: the logical-axis table.
    shape: the array's shape; when given, mesh axes that do not divide a dimension are dropped.

  Returns:
    A `PartitionSpec` of mesh axis names (None: replicated dimension).
  """
  used: set[str] = set()
  out = []
  for dim, name in enumerate(logical):
    axes = () if name is None else _rule_axes(rules, name)
    axes = tuple(a for a in axes if a not in used and mesh.shape.get(a, 1) > 1)
    if shape is not None:
      while axes and shape[dim] % math.prod(mesh.shape[a] for a in axes):
        axes = axes[:-1]
    used.update(axes)
    out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return PartitionSpec(*out)


def logical_to_sharding(spec_tree: Any, mesh: Mesh, rules=RULES, shapes: Any = None) -> Any:
  """`NamedSharding`s for a pytree of logical `PartitionSpec`s.

  Args:
    spec_tree: pytree of logical `PartitionSpec`s (e.g. `param_axes(config)`).
    mesh: the device mesh.
    rules: the logical-axis table.
    shapes: optional pytree of the same structure whose leaves have `.shape`; enables the
      divisibility fallback of `logical_to_mesh_spec`.

  Returns:
    The same pytree with a `NamedSharding` at every leaf.
  """
  is_spec = lambda x: isinstance(x, PartitionSpec)
  if shapes is None:
    return jax.tree.map(lambda s: NamedSharding(mesh, logical_to_mesh_spec(s, mesh, rules)),
                        spec_tree, is_leaf=is_spec)
  return jax.tree.map(
      lambda s, x: NamedSharding(mesh, logical_to_mesh_spec(s, mesh, rules, x.shape)),
      spec_tree, shapes, is_leaf=is_spec)


def replicated(mesh: Mesh) -> NamedSharding:
  """A sharding that keeps a full copy on every device (scalars, PRNG keys, metrics)."""
  return NamedSharding(mesh, PartitionSpec())


def opt_state_shardings(tx: Any, params_abstract: Any, params_sharding: Any,
                        mesh: Mesh) -> Any:
  """Shardings of `tx.init(params)`: parameter-shaped leaves follow their parameter.

  Adam moments (and any other state the optimiser builds from the parameter pytree) take the
  parameter's sharding; everything else (step counts, injected hyperparameters) is replicated.

  Args:
    tx: an optax `GradientTransformation`.
    params_abstract: pytree of `ShapeDtypeStruct` (or arrays) of the parameters.
    params_sharding: pytree of `NamedSharding`, same structure.
    mesh: the device mesh.
  """
  state = jax.eval_shape(tx.init, params_abstract)
  return optax.tree_map_params(
      tx, lambda _, sharding: sharding, state, params_sharding,
      transform_non_params=lambda _: replicated(mesh),
      is_leaf=lambda x: isinstance(x, NamedSharding))


def batch_sharding(mesh: Mesh, rules=RULES) -> NamedSharding:
  """Sharding of any batch-major array `[B, ...]`: `B` over the rule of `batch`.

  The spec names the leading axis only, so one `NamedSharding` fits arrays of any rank >= 1
  (and can be given as a pytree prefix for a whole batch, e.g. a `Rollout`).
  """
  return NamedSharding(mesh, logical_to_mesh_spec(PartitionSpec("batch"), mesh, rules))


def constrain_rows(x: jax.Array, axis: int = 0, like: jax.Array | None = None,
                   rules=RULES) -> jax.Array:
  """`x` with its row axis (`axis`) over the data axes (the rule of `batch`) of the mesh it
  is traced on (`jax.typeof(x).sharding.mesh`, or `like`'s: an array made inside the
  program has none of its own); as it is off a mesh, or where its rows do not split over
  those axes.

  Inside the model: without it, XLA may keep an activation split over the embedding axis
  its weights are sharded on (`fsdp`) and every row on every device, all-reducing each
  matmul's partial sums, where FSDP means gathering a layer's weights and computing one's
  own rows.
  """
  mesh = jax.typeof(x if like is None else like).sharding.mesh
  if mesh.empty or x.ndim <= axis:
    return x
  axes = row_axes(mesh, x.shape[axis], rules)
  if axes is None:
    return x
  return jax.lax.with_sharding_constraint(
      x, NamedSharding(mesh, PartitionSpec(*[None] * axis, axes)))


def row_axes(mesh: Any, rows: int, rules=RULES) -> tuple[str, ...] | None:
  """The mesh axes (of a `Mesh` or the `AbstractMesh` a program is traced on) that `rows`
  rows split over: the rule of `batch`'s axes of size > 1; None where there are none or the
  rows do not divide over them."""
  axes = tuple(a for a in _rule_axes(rules, "batch") if mesh.shape.get(a, 1) > 1)
  if not axes or rows % math.prod(mesh.shape[a] for a in axes):
    return None
  return axes


def num_batch_shards(mesh: Mesh, rules=RULES) -> int:
  """How many ways `batch_sharding` splits the batch axis (its row count must divide)."""
  axes = batch_sharding(mesh, rules).spec[0]
  axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
  return math.prod(mesh.shape[a] for a in axes)


def process_batch_rows(global_batch: int, mesh: Mesh, rules=RULES) -> slice:
  """The rows `[start, stop)` of a global batch that this process feeds.

  Under `batch_sharding` every process owns one contiguous block of rows; it loads (or
  generates) those rows and passes them to `shard_process_local_batch`.
  """
  sharding = batch_sharding(mesh, rules)
  rows = [idx[0] for idx in sharding.addressable_devices_indices_map((global_batch,)).values()]
  start = min(r.start or 0 for r in rows)
  stop = max(global_batch if r.stop is None else r.stop for r in rows)
  return slice(start, stop)


def shard_process_local_batch(tree: Any, mesh: Mesh, global_batch: int, rules=RULES) -> Any:
  """Global batch-sharded `jax.Array`s from this process's rows (multi-host data loading).

  Args:
    tree: pytree of host arrays `[b_local, ...]`, the rows `process_batch_rows` names.
    mesh: the device mesh.
    global_batch: B, the rows summed over all processes.
    rules: the logical-axis table.

  Returns:
    The same pytree of `[B, ...]` global arrays with `batch_sharding`.
  """
  sharding = batch_sharding(mesh, rules)
  expected = process_batch_rows(global_batch, mesh, rules)

  def put(x):
    x = np.asarray(x)
    if x.shape[0] != expected.stop - expected.start:
      raise ValueError(f"process {jax.process_index()} must feed rows {expected.start}:"
                       f"{expected.stop} of the global batch ({expected.stop - expected.start}"
                       f" rows), got an array with {x.shape[0]} rows")
    return jax.make_array_from_process_local_data(sharding, x, (global_batch, *x.shape[1:]))

  return jax.tree.map(put, tree)


def shard_host_batch(tree: Any, mesh: Mesh, rules=RULES) -> Any:
  """`shard_process_local_batch` of a whole batch that every process holds alike (pytree of
  host arrays `[B, ...]`): each process feeds its own rows of it."""
  global_batch = np.shape(jax.tree.leaves(tree)[0])[0]
  rows = process_batch_rows(global_batch, mesh, rules)
  return shard_process_local_batch(jax.tree.map(lambda x: np.asarray(x)[rows], tree), mesh,
                                   global_batch, rules)


def process_local_rows(tree: Any, mesh: Mesh, rules=RULES) -> Any:
  """This process's rows (`process_batch_rows`) of each global array of `tree`, as numpy:
  the inverse of `shard_process_local_batch`, read from the process's own shards (no
  collective). An array whose rows are laid out otherwise is laid out as `batch_sharding`
  first, a program every process runs."""
  sharding = batch_sharding(mesh, rules)

  def get(x):
    if not x.sharding.is_equivalent_to(sharding, x.ndim):
      x = _laid_out(x, sharding)
    rows = process_batch_rows(x.shape[0], mesh, rules)
    out = np.empty((rows.stop - rows.start, *x.shape[1:]), x.dtype)
    for shard in x.addressable_shards:
      start, stop, _ = shard.index[0].indices(x.shape[0])
      out[(slice(start - rows.start, stop - rows.start), *shard.index[1:])] = shard.data
    return out

  return jax.tree.map(get, tree)


@functools.partial(jax.jit, static_argnums=1)
def _laid_out(x: jax.Array, sharding: NamedSharding) -> jax.Array:
  return jax.lax.with_sharding_constraint(x, sharding)


def host_rows(tree: Any) -> Any:
  """Numpy copies of the whole of every array of `tree`, on every process.

  The leaves are global `jax.Array`s (e.g. rows sharded by `shard_process_local_batch`). With
  several processes each holds only its rows, so they are all-gathered: a collective that
  every process must call, in the same order.
  """
  if jax.process_count() == 1:
    return jax.tree.map(np.asarray, tree)
  from jax.experimental import multihost_utils
  return multihost_utils.process_allgather(tree, tiled=True)


def assert_params_sufficiently_sharded(params: Any, mesh: Mesh, tolerance: float = 0.02):
  """Fails loudly when more than `tolerance` of the parameters are left unsharded.

  A parameter counts as unsharded when its sharding does not use every parameter mesh axis
  (`fsdp`, `tensor`) of size > 1 -- a rule that maps nothing to that axis, or a dimension the
  axis does not divide, silently replicates it. Norm scales and biases are expected to be
  replicated on some axis; they are a small fraction of a real model.

  Args:
    params: pytree whose leaves have `.shape` and `.sharding` (`jax.Array`s, or
      `jax.ShapeDtypeStruct(..., sharding=...)` to check before allocating).
    mesh: the device mesh.
    tolerance: largest allowed fraction of parameter elements left unsharded.

  Raises:
    ValueError: naming the largest offending parameters, their specs and the missing axes.
  """
  targets = {a for a in PARAM_MESH_AXES if mesh.shape.get(a, 1) > 1}
  if not targets:
    return
  total, unsharded, offenders = 0, 0, []
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    spec = getattr(getattr(leaf, "sharding", None), "spec", None)
    if spec is None:
      raise ValueError(f"parameter {jax.tree_util.keystr(path)} has no NamedSharding")
    used = set()
    for entry in spec:
      used.update(() if entry is None else (entry,) if isinstance(entry, str) else entry)
    size = math.prod(leaf.shape)
    total += size
    missing = sorted(targets - used)
    if missing:
      unsharded += size
      offenders.append((size, jax.tree_util.keystr(path), tuple(leaf.shape), spec, missing))
  if total and unsharded / total > tolerance:
    offenders.sort(key=lambda o: -o[0])
    worst = "; ".join(f"{name} {shape} spec={spec} not sharded over {missing}"
                      for _, name, shape, spec, missing in offenders[:3])
    raise ValueError(
        f"{unsharded / total:.1%} of parameter elements are not sharded over every parameter "
        f"mesh axis {sorted(targets)} (tolerance {tolerance:.1%}); largest: {worst}. Check "
        "the logical-axis rules and that the mesh sizes divide the model dimensions")
