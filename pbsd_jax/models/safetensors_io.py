"""The safetensors checkpoint format, read and written with numpy alone.

A `.safetensors` file is an 8-byte little-endian header length, a JSON header (tensor name ->
dtype, shape and byte range in the data section, plus an optional `__metadata__`), then the raw
little-endian tensor bytes. A checkpoint is either one `model.safetensors`, or several
`model-0000i-of-0000N.safetensors` shards whose tensor -> file map is
`model.safetensors.index.json`.

Files are memory-mapped, so slicing a tensor reads only the pages it covers. numpy (+ `ml_dtypes`
for bfloat16, which the `safetensors` package cannot hand to numpy) is all this needs: neither
torch nor transformers.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Sequence

import ml_dtypes
import numpy as np

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_ST_DTYPES = {"F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
              "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype("<i8"),
              "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
              "U8": np.dtype("u1"), "BOOL": np.dtype("?")}
_ST_NAMES = {dtype: name for name, dtype in _ST_DTYPES.items()}


class SafetensorsFile:
  """One memory-mapped `.safetensors` file; slicing an `array` reads only the pages it needs."""

  def __init__(self, path: str):
    self.path = path
    with open(path, "rb") as f:
      header_size = int.from_bytes(f.read(8), "little")
      try:
        header = json.loads(f.read(header_size))
      except ValueError as e:
        raise ValueError(f"{path}: not a safetensors file (unreadable header: {e})") from None
    header.pop("__metadata__", None)
    self._entries = header
    self._data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_size) if any(
        e["data_offsets"][1] > e["data_offsets"][0] for e in header.values()) else None

  def names(self) -> list[str]:
    return list(self._entries)

  def __contains__(self, name: str) -> bool:
    return name in self._entries

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._entries[name]["shape"])

  def array(self, name: str) -> np.ndarray:
    """A lazy (memory-mapped) view of tensor `name`."""
    entry = self._entries[name]
    if entry["dtype"] not in _ST_DTYPES:
      raise ValueError(f"{self.path}: tensor {name} has unsupported dtype {entry['dtype']}")
    begin, end = entry["data_offsets"]
    if begin == end:
      return np.zeros(entry["shape"], _ST_DTYPES[entry["dtype"]])
    return self._data[begin:end].view(_ST_DTYPES[entry["dtype"]]).reshape(entry["shape"])


def write_safetensors(path: str, tensors: dict[str, np.ndarray]) -> None:
  """Writes `tensors` (name -> array) as one `.safetensors` file (format tag "pt")."""
  header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
  offset = 0
  for name, array in tensors.items():
    if array.dtype not in _ST_NAMES:
      raise ValueError(f"tensor {name}: dtype {array.dtype} cannot be written to safetensors")
    header[name] = {"dtype": _ST_NAMES[array.dtype], "shape": list(array.shape),
                    "data_offsets": [offset, offset + array.nbytes]}
    offset += array.nbytes
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
  with open(path, "wb") as f:
    f.write(len(blob).to_bytes(8, "little"))
    f.write(blob)
    for array in tensors.values():
      f.write(np.ascontiguousarray(array).tobytes())


class SafetensorsCheckpoint:
  """The tensors of a checkpoint directory, over one or many safetensors shards."""

  def __init__(self, path: str):
    self.path = path
    index_path, single_path = os.path.join(path, INDEX_FILE), os.path.join(path, SINGLE_FILE)
    if os.path.exists(index_path):
      with open(index_path) as f:
        weight_map = json.load(f).get("weight_map")
      if not isinstance(weight_map, dict):
        raise ValueError(f"{index_path}: missing the 'weight_map' object")
      files = {shard: SafetensorsFile(os.path.join(path, shard))
               for shard in sorted(set(weight_map.values()))}
      self._files = {tensor: files[shard] for tensor, shard in weight_map.items()}
    elif os.path.exists(single_path):
      single = SafetensorsFile(single_path)
      self._files = {name: single for name in single.names()}
    else:
      raise ValueError(f"{path}: neither {INDEX_FILE} nor {SINGLE_FILE} exists")

  def __contains__(self, name: str) -> bool:
    return name in self._files

  def array(self, name: str, expected_shape: Sequence[int]) -> np.ndarray:
    """Lazy view of tensor `name`; a missing tensor or a wrong shape is a ValueError."""
    if name not in self._files:
      raise ValueError(f"{self.path}: checkpoint is missing tensor {name} (expected shape "
                       f"{tuple(expected_shape)})")
    source = self._files[name]
    if name not in source:
      raise ValueError(f"tensor {name} is listed in {INDEX_FILE} but absent from "
                       f"{source.path} (expected shape {tuple(expected_shape)})")
    if source.shape(name) != tuple(expected_shape):
      raise ValueError(f"tensor {name} has shape {source.shape(name)}, expected "
                       f"{tuple(expected_shape)}")
    return source.array(name)


def parse_size(size: int | str) -> int:
  """Bytes of `size`: an int, or a string like '5GB' (10^9) or '5GiB' (2^30)."""
  if isinstance(size, int):
    return size
  match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B\s*", size.upper().replace("IB", "iB"))
  if not match:
    raise ValueError(f"max_shard_size={size!r}: expected bytes or e.g. '5GB', '500MiB'")
  base = 1024 if match.group(3) else 1000
  return int(float(match.group(1)) * base ** "_KMGT".index(match.group(2) or "_"))


def plan_shards(nbytes: Sequence[int], max_shard_size: int | str) -> list[range]:
  """Splits tensors of sizes `nbytes` (in file order) into consecutive shards.

  Each shard holds at most `max_shard_size` bytes (an int, or a string for `parse_size`), except
  that a tensor larger than that gets a shard of its own. No tensors make one empty shard.
  """
  limit = parse_size(max_shard_size)
  starts, size = [0], 0
  for i, n in enumerate(nbytes):
    if i > starts[-1] and size + n > limit:
      starts.append(i)
      size = 0
    size += n
  return [range(start, stop) for start, stop in zip(starts, starts[1:] + [len(nbytes)])]


def shard_file_names(num_shards: int) -> list[str]:
  """`[SINGLE_FILE]` for one shard, else `model-0000i-of-0000N.safetensors` (1-based)."""
  if num_shards == 1:
    return [SINGLE_FILE]
  return [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]


def write_index(path: str, weight_map: dict[str, str], total_size: int) -> None:
  """Writes `INDEX_FILE` in directory `path`: tensor name -> shard file, and total bytes."""
  with open(os.path.join(path, INDEX_FILE), "w") as f:
    json.dump({"metadata": {"total_size": total_size}, "weight_map": weight_map}, f, indent=2)
