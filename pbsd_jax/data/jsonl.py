"""Reading JSONL files line by line, with 1-based line numbers for error messages, and
writing them whole (under a temporary name, renamed into place once complete).

Shared by the question-record reader (`data/records.py`), the corpus reader
(`env/host_bm25.py`) and the metric-log reader (`report.py`); imports only `storage` of
the package.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Iterator

from pbsd_jax.data import storage


def iter_jsonl(path: str) -> Iterator[tuple[int, Any]]:
  """`(line_number, value)` for every non-blank line of a JSONL file, parsed.

  Line numbers are 1-based and count the skipped blank lines, so they match an editor's.

  Raises:
    ValueError: `"{path}, line {n}: invalid JSON: {reason}"` for a line that does not parse.
  """
  with open(path, encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        value = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}, line {n}: invalid JSON: {e.msg}") from None
      yield n, value


def write_jsonl(path: str, rows: Iterable[Any]) -> None:
  """Writes one JSON value per line (UTF-8, non-ASCII kept), creating the parent folder; the
  file appears whole or not at all (`storage.replaced`)."""
  with storage.replaced(path, encoding="utf-8") as f:
    for row in rows:
      f.write(json.dumps(row, ensure_ascii=False) + "\n")
