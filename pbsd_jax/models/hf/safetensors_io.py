"""Checkpoint directories of safetensors files: one file, or shards listed in an index.

A checkpoint is either one `model.safetensors`, or several `model-0000i-of-0000N.safetensors`
shards whose tensor -> file map is `model.safetensors.index.json`.

Each file is read and written by the `safetensors` library, without torch:
`safe_open(..., framework="numpy")` memory-maps it and `get_slice` reads only the bytes a slice
covers; `safetensors.numpy.save_file` writes one. Checked with safetensors 0.8.0, bfloat16 goes
through these two bit-exactly both ways (files written by torch included), but only once
`ml_dtypes` is imported: the library asks numpy for a dtype named 'bfloat16', which `ml_dtypes`
registers, so this module imports it. (Not used here: `safetensors.numpy.load` of bytes, which
has no BF16 entry in 0.8.0.) `save_file` writes an array's memory as it lies, whatever its
strides, so `write_file` makes every array contiguous first.

What the library has no notion of is the directory: the index, the split into shards and their
file names, and load errors that name the tensor and the shape expected. That is the code here.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Sequence

import ml_dtypes  # pylint: disable=unused-import  # registers numpy's 'bfloat16' (see above)
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

LazyTensor = Any  # safetensors' slice handle: `[slices]` reads those bytes into numpy


class SafetensorsCheckpoint:
  """The tensors of a checkpoint directory, over one or many memory-mapped safetensors files."""

  def __init__(self, path: str):
    self.path = path
    index_path = os.path.join(path, INDEX_FILE)
    if os.path.exists(index_path):
      with open(index_path) as f:
        weight_map = json.load(f).get("weight_map")
      if not isinstance(weight_map, dict):
        raise ValueError(f"{index_path}: missing the 'weight_map' object")
    elif os.path.exists(os.path.join(path, SINGLE_FILE)):
      weight_map = None
    else:
      raise ValueError(f"{path}: neither {INDEX_FILE} nor {SINGLE_FILE} exists")
    file_names = [SINGLE_FILE] if weight_map is None else sorted(set(weight_map.values()))
    self._files = {name: safe_open(os.path.join(path, name), framework="numpy")
                   for name in file_names}
    self._names = {name: set(handle.keys()) for name, handle in self._files.items()}
    self._file_of = (dict.fromkeys(self._names[SINGLE_FILE], SINGLE_FILE) if weight_map is None
                     else weight_map)

  def __contains__(self, name: str) -> bool:
    return name in self._file_of

  def tensor(self, name: str, expected_shape: Sequence[int]) -> LazyTensor:
    """Tensor `name`, unread until sliced; a missing tensor or a wrong shape is a ValueError."""
    expected_shape = tuple(expected_shape)
    if name not in self._file_of:
      raise ValueError(f"{self.path}: checkpoint is missing tensor {name} (expected shape "
                       f"{expected_shape})")
    file_name = self._file_of[name]
    if name not in self._names[file_name]:
      raise ValueError(f"tensor {name} is listed in {INDEX_FILE} but absent from "
                       f"{os.path.join(self.path, file_name)} (expected shape {expected_shape})")
    tensor = self._files[file_name].get_slice(name)
    if tuple(tensor.get_shape()) != expected_shape:
      raise ValueError(f"tensor {name} has shape {tuple(tensor.get_shape())}, expected "
                       f"{expected_shape}")
    return tensor


def write_file(path: str, tensors: dict[str, np.ndarray]) -> None:
  """Writes `tensors` (name -> array) as one `.safetensors` file, tagged format "pt" as
  `transformers` writes its own."""
  save_file({name: np.ascontiguousarray(array) for name, array in tensors.items()}, path,
            metadata={"format": "pt"})


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
