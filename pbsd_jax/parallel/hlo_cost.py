"""FLOPs and bytes of a compiled program with each loop body counted as often as it runs.

XLA's `compiled.cost_analysis()` counts a while loop's body once, so a program whose work is
in loops (the layer scan, the micro-batch scan, a rollout's decode loop) reports a fraction
of what it does. `program_cost` reads the compiled (per-device, partitioned) HLO text and
counts the same quantities per computation, then weighs each computation by how many times
it runs:

- a loop whose condition compares its counter with a constant (`lax.scan`, `fori_loop`)
  runs that many times;
- a loop whose count depends on the data (`lax.while_loop`: the turn loop, the decode loop)
  runs as many times as `budgets` says for the innermost of its names found in the loop's
  op name (`jax.named_scope`), at most; a loop with neither counts once and is listed in
  `Cost.unknown_loops`.

FLOPs are XLA's conventions: `2 * output * contraction` for a dot or convolution, one per
element for elementwise arithmetic and reductions. Bytes are what each top-level instruction
(a fusion, a copy, a collective) reads and writes; a slice of a larger operand (a layer's
weights out of the stacked layers, a cache row) reads only the slice. With every loop
counted once the FLOPs track `cost_analysis()`'s `flops` within a few per cent; the bytes
are of the same order as its `bytes accessed`, not equal (docs/tpu.md;
`tests/test_aot.py`). The roofline time sums each computation's own
`max(flops / peak, bytes / bandwidth)` times its count, so a memory-bound decode step and a
compute-bound update each count at their own bound.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Mapping

_BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
          "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8,
          "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b(" + "|".join(sorted(_BYTES, key=len, reverse=True))
                    + r")\[([0-9,]*)\]")
_COMMENT = re.compile(r"/\*.*?\*/")
_HEADER = re.compile(r"^(ENTRY )?%?([^\s(]+) \(")
_NAME = re.compile(r"%([\w.\-]+)")
# Instructions that move no data of their own (views, bookkeeping, control).
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call",
         "conditional", "after-all", "opt-barrier", "partition-id", "replica-id",
         "copy-done", "slice-done", "all-gather-done", "all-reduce-done",
         "collective-permute-done", "async-done", "add-dependency"}
_ELEMENTWISE = {"add", "subtract", "multiply", "divide", "maximum", "minimum", "abs", "negate",
                "exponential", "log", "tanh", "sqrt", "rsqrt", "power", "logistic",
                "exponential-minus-one", "log-plus-one", "select", "compare", "clamp", "and",
                "or", "xor", "not", "sign", "floor", "ceil", "round-nearest-even",
                "remainder", "atan2", "sine", "cosine", "is-finite", "cbrt"}
_SLICING = {"slice", "dynamic-slice", "gather"}
# TPU custom calls that reserve or reinterpret a buffer without moving it.
_VIEWS = ("AllocateBuffer", "ConcatBitcast")


@dataclasses.dataclass
class _Instruction:
  name: str
  shape: str
  opcode: str
  operands: list[str]
  args: str
  attrs: str


@dataclasses.dataclass(frozen=True)
class Cost:
  """A program's per-device work, loops counted as often as they run.

  Attributes:
    flops: floating-point operations.
    bytes: bytes read and written by the top-level instructions.
    roofline_s: the sum over computations of `count * max(flops / peak, bytes / bw)` (0
      without a chip).
    loops: each loop's op name (or HLO name) and the count used.
    unknown_loops: loops whose count neither the HLO nor `budgets` gave (counted once).
  """

  flops: float
  bytes: float
  roofline_s: float
  loops: dict
  unknown_loops: tuple


def array_bytes(shape: str) -> int:
  """Bytes of every array in an HLO shape string (a tuple sums its elements)."""
  return sum(_BYTES[t] * math.prod(int(d) for d in dims.split(",") if d)
             for t, dims in _ARRAY.findall(shape))


def _tuple_elements(shape: str) -> list[str]:
  """The top-level elements of a tuple shape (a non-tuple: itself)."""
  if not shape.startswith("("):
    return [shape]
  parts, depth, start = [], 0, 1
  for i, ch in enumerate(shape):
    depth += {"(": 1, ")": -1, "{": 1, "}": -1, "[": 1, "]": -1}.get(ch, 0)
    if (ch == "," and depth == 1) or (ch == ")" and depth == 0):
      parts.append(shape[start:i].strip())
      start = i + 1
  return parts


def _elements(shape: str) -> int:
  return sum(math.prod(int(d) for d in dims.split(",") if d) for _, dims in _ARRAY.findall(shape))


def _dims(shape: str) -> list[int]:
  found = _ARRAY.search(shape)
  return [int(d) for d in found.group(2).split(",") if d] if found else []


def _balanced(text: str, start: int) -> int:
  """The index just after the parenthesis group opening at `text[start]`."""
  depth = 0
  for i in range(start, len(text)):
    depth += {"(": 1, ")": -1}.get(text[i], 0)
    if depth == 0:
      return i + 1
  raise ValueError(f"unbalanced HLO: {text[start:start + 80]!r}")


def _parse_instruction(line: str) -> _Instruction | None:
  line = line.strip()
  if line.startswith("ROOT "):
    line = line[5:]
  name, eq, rest = line.partition(" = ")
  if not eq or not name.startswith("%"):
    return None
  if rest.startswith("("):
    end = _balanced(rest, 0)
    shape, rest = rest[:end], rest[end:].lstrip()
  else:
    shape, _, rest = rest.partition(" ")
  opcode, paren, rest = rest.partition("(")
  end = _balanced("(" + rest, 0) - 1  # just after the closing parenthesis in `rest`
  args = rest[:end - 1]
  return _Instruction(name[1:], shape, opcode, _NAME.findall(args), args, rest[end:])


def parse(hlo: str) -> tuple[dict[str, list[_Instruction]], str]:
  """`({computation: instructions}, entry name)` of an HLO module's text."""
  computations, entry, current = {}, None, None
  for raw in hlo.splitlines():
    line = _COMMENT.sub("", raw)
    if current is None:
      header = _HEADER.match(line)
      if header and line.rstrip().endswith("{"):
        current = header.group(2)
        computations[current] = []
        if header.group(1):
          entry = current
      continue
    if line.startswith("}"):
      current = None
      continue
    instruction = _parse_instruction(line)
    if instruction is not None:
      computations[current].append(instruction)
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  return computations, entry


def _attr(attrs: str, key: str) -> str | None:
  found = re.search(rf"\b{key}=%?([\w.\-]+)", attrs)
  return found.group(1) if found else None


def _op_name(attrs: str) -> str:
  found = re.search(r'op_name="([^"]*)"', attrs)
  return found.group(1) if found else ""


def _dot_flops(ins: _Instruction, shapes: Mapping[str, str]) -> float:
  out = _elements(ins.shape)
  if ins.opcode == "dot":
    lhs = _dims(shapes.get(ins.operands[0], ""))
    found = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", ins.attrs)
    contracting = [int(d) for d in found.group(1).split(",") if d] if found else []
    return 2.0 * out * math.prod(lhs[d] for d in contracting if d < len(lhs))
  labels = re.search(r"dim_labels=([^_]+)_([^-]+)->(\w+)", ins.attrs)
  lhs = _dims(shapes.get(ins.operands[0], ""))
  rhs = _dims(shapes.get(ins.operands[1], "")) if len(ins.operands) > 1 else []
  if not labels or len(rhs) != len(labels.group(2)) or len(lhs) != len(labels.group(1)):
    return 2.0 * out
  lhs_labels, rhs_labels, out_labels = labels.groups()
  # Each output element sums over the kernel's input features and, per window dimension,
  # the taps that land on a real input element (XLA writes a batched dot as a convolution
  # whose dilated window sees one element per output: a batch, not a sum).
  taps = rhs[rhs_labels.index("i")]
  out_dims = _dims(ins.shape)
  window = _window(ins.attrs, len(rhs_labels) - 2)
  for d in range(len(rhs_labels) - 2):
    size, stride, pad, lhs_dilate, rhs_dilate = window[d]
    n, o = lhs[lhs_labels.index(str(d))], out_dims[out_labels.index(str(d))]
    real = (n - 1) * lhs_dilate + 1
    valid = sum(1 for j in range(o) for t in range(size)
                if 0 <= (p := j * stride + t * rhs_dilate - pad) < real and p % lhs_dilate == 0)
    taps *= valid / max(o, 1)
  return 2.0 * out * taps


def _window(attrs: str, rank: int) -> list[tuple[int, int, int, int, int]]:
  """Per window dimension `(size, stride, low padding, lhs dilation, rhs dilation)`."""
  found = re.search(r"window=\{([^}]*)\}", attrs)
  fields = dict(f.split("=", 1) for f in found.group(1).split()) if found else {}
  get = lambda key, default: ([int(x) for x in fields[key].split("x")] if key in fields
                              else [default] * rank)
  pads = ([int(p.split("_")[0]) for p in fields["pad"].split("x")] if "pad" in fields
          else [0] * rank)
  return list(zip(get("size", 1), get("stride", 1), pads, get("lhs_dilate", 1),
                  get("rhs_dilate", 1)))


class _Program:
  def __init__(self, hlo: str):
    self.computations, self.entry = parse(hlo)
    self.shapes = {c: {i.name: i.shape for i in ins} for c, ins in self.computations.items()}

  def flops(self, computation: str) -> float:
    """FLOPs of a computation's instructions, fused computations included."""
    total, shapes = 0.0, self.shapes[computation]
    for ins in self.computations[computation]:
      if ins.opcode in ("dot", "convolution"):
        total += _dot_flops(ins, shapes)
      elif ins.opcode in _ELEMENTWISE:
        total += _elements(ins.shape)
      elif ins.opcode == "reduce":
        total += sum(_elements(shapes.get(o, "")) for o in ins.operands[:len(ins.operands) // 2])
      elif ins.opcode == "fusion":
        total += self.flops(_attr(ins.attrs, "calls"))
    return total

  def _fusion_reads(self, ins: _Instruction, shapes: Mapping[str, str]) -> int:
    """Bytes a fusion reads: a parameter used only through slices reads the slices."""
    fused = self.computations[_attr(ins.attrs, "calls")]
    users: dict[str, list[_Instruction]] = {}
    for i in fused:
      for o in i.operands:
        users.setdefault(o, []).append(i)
    total = 0
    for param in (i for i in fused if i.opcode == "parameter"):
      use = users.get(param.name, [])
      if use and all(u.opcode in _SLICING and u.operands[0] == param.name for u in use):
        total += sum(array_bytes(u.shape) for u in use)
      elif use and all(u.opcode == "dynamic-update-slice" and u.operands[0] == param.name
                       for u in use):
        continue  # updated in place: only the update is written
      else:
        k = int(param.args)
        total += array_bytes(shapes.get(ins.operands[k], "")) if k < len(ins.operands) else 0
    return total

  def _written(self, ins: _Instruction, shapes: Mapping[str, str]) -> int:
    """Bytes an instruction writes: an in-place update (`dynamic-update-slice`, or a fusion
    rooted in one) writes its update only."""
    if ins.opcode == "fusion":
      called = _attr(ins.attrs, "calls")
      root = self.computations[called][-1]
      if root.opcode == "dynamic-update-slice":
        return array_bytes(self.shapes[called].get(root.operands[1], ""))
    if ins.opcode == "dynamic-update-slice":
      return array_bytes(shapes.get(ins.operands[1], ""))
    return array_bytes(ins.shape)

  def bytes(self, computation: str) -> float:
    """Bytes the computation's own top-level instructions read and write."""
    total, shapes = 0.0, self.shapes[computation]
    for ins in self.computations[computation]:
      if (ins.opcode in _FREE or ins.opcode.endswith("-done")
          or (ins.opcode == "custom-call" and any(v in ins.attrs for v in _VIEWS))):
        continue
      if ins.opcode.endswith("-start"):
        # `(operands, output, context)`: a slice reads what it writes.
        parts = _tuple_elements(ins.shape)
        written = array_bytes(parts[1]) if len(parts) > 1 else 0
        total += written + (written if ins.opcode == "slice-start" else array_bytes(parts[0]))
        continue
      if ins.opcode == "fusion":
        reads = self._fusion_reads(ins, shapes)
      elif ins.opcode in _SLICING:
        reads = array_bytes(ins.shape)
      elif ins.opcode == "dynamic-update-slice":
        reads = array_bytes(shapes.get(ins.operands[1], ""))
      else:
        reads = sum(array_bytes(shapes.get(o, "")) for o in ins.operands)
      total += reads + self._written(ins, shapes)
    return total

  def trip_count(self, ins: _Instruction) -> int | None:
    """A loop's count from its condition `counter < constant` (None: data-dependent)."""
    condition = self.computations.get(_attr(ins.attrs, "condition"), [])
    if not condition:
      return None
    root, shapes = condition[-1], {i.name: i for i in condition}
    if root.opcode != "compare" or len(root.operands) != 2:
      return None
    a, b = (shapes.get(o) for o in root.operands)
    direction = _attr(root.attrs, "direction")
    if a and b and b.opcode == "constant" and a.opcode == "get-tuple-element":
      const, op = b, {"LT": "LT", "LE": "LE"}.get(direction)
    elif a and b and a.opcode == "constant" and b.opcode == "get-tuple-element":
      const, op = a, {"GT": "LT", "GE": "LE"}.get(direction)
    else:
      return None
    if op is None or not re.fullmatch(r"-?\d+", const.args.strip()):
      return None
    return int(const.args) + (op == "LE")


def program_cost(hlo: str, budgets: Mapping[str, int] = (), peak_flops: float = 0.0,
                 bandwidth: float = 0.0, unit: bool = False) -> Cost:
  """The `Cost` of a compiled program's HLO text (`compiled.as_text()`).

  Args:
    hlo: the optimised HLO module.
    budgets: `{name: count}` for data-dependent loops, by a scope name in their op name
      (the innermost one named).
    peak_flops, bandwidth: the chip's, for the roofline time.
    unit: count every loop once (what `cost_analysis()` does).
  """
  program = _Program(hlo)
  budgets = dict(budgets)
  totals = {"flops": 0.0, "bytes": 0.0, "time": 0.0}
  loops, unknown = {}, []

  def visit(computation: str, count: float):
    flops, moved = program.flops(computation), program.bytes(computation)
    totals["flops"] += count * flops
    totals["bytes"] += count * moved
    if peak_flops and bandwidth:
      totals["time"] += count * max(flops / peak_flops, moved / bandwidth)
    for ins in program.computations[computation]:
      if ins.opcode == "while":
        trips = program.trip_count(ins)
        op_name = _op_name(ins.attrs) or ins.name
        if trips is None:
          # The innermost named scope: the one named last in the op name.
          scope = max((k for k in budgets if k in op_name), key=op_name.rfind, default=None)
          trips = None if scope is None else budgets[scope]
          if trips is None:
            unknown.append(op_name)
            trips = 1
        trips = 1 if unit else trips
        loops[op_name] = trips
        visit(_attr(ins.attrs, "body"), count * trips)
        visit(_attr(ins.attrs, "condition"), count * trips)
      elif ins.opcode == "call":
        visit(_attr(ins.attrs, "to_apply"), count)
      elif ins.opcode == "conditional":
        branches = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
        names = (_NAME.findall(branches.group(1)) if branches else
                 [_attr(ins.attrs, k) for k in ("true_computation", "false_computation")
                  if _attr(ins.attrs, k)])
        # The most expensive branch: an upper bound.
        costly = max(names, key=program.flops, default=None)
        if costly:
          visit(costly, count)

  visit(program.entry, 1.0)
  return Cost(flops=totals["flops"], bytes=totals["bytes"], roofline_s=totals["time"],
              loops=loops, unknown_loops=tuple(unknown))
