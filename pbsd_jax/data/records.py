"""Reading question files with eager validation: JSONL or parquet, Search-R1 format.

A record needs `question` (a non-empty string) and `golden_answers` (a non-empty list of
non-empty strings); our files add `hops`, `tier` and, for SFT, `actions`, `gold_doc_ids`,
`detour_turns`. Every problem raises `ValueError("{file}, line {n}: field '{name}': ...")`
(1-based lines; "row" for parquet) before any tf.data pipeline is built, so a bad file fails
at start-up, not mid-run. JSONL lines come from `pbsd_jax.data.jsonl.iter_jsonl`; this module
imports neither TensorFlow nor JAX.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from pbsd_jax.data.jsonl import iter_jsonl

SEARCH_R1_FIELDS = ("question", "golden_answers")
QUESTION_FIELDS = SEARCH_R1_FIELDS + ("hops", "tier")
SFT_FIELDS = QUESTION_FIELDS + ("actions", "gold_doc_ids", "detour_turns")
# A user SFT file: a question and the whole trajectory text (actions and observations).
TRAJECTORY_FIELDS = ("question", "trajectory")


def _nonempty_str(v: Any) -> str | None:
  if not isinstance(v, str) or not v.strip():
    return f"expected a non-empty string, got {v!r}"
  return None


def _nonempty_str_list(v: Any) -> str | None:
  if (not isinstance(v, list) or not v
      or not all(isinstance(x, str) and x.strip() for x in v)):
    return f"expected a non-empty list of non-empty strings, got {v!r}"
  return None


def _positive_int(v: Any) -> str | None:
  if isinstance(v, bool) or not isinstance(v, int) or v < 1:
    return f"expected a positive integer, got {v!r}"
  return None


def _str(v: Any) -> str | None:
  return None if isinstance(v, str) else f"expected a string, got {v!r}"


def _doc_id_list(v: Any) -> str | None:
  if not isinstance(v, list) or not all(
      x is None or (isinstance(x, int) and not isinstance(x, bool) and x >= 0) for x in v):
    return f"expected a list of non-negative integers or nulls, got {v!r}"
  return None


def _bool_list(v: Any) -> str | None:
  if not isinstance(v, list) or not all(isinstance(x, bool) for x in v):
    return f"expected a list of booleans, got {v!r}"
  return None


_CHECKS: dict[str, Callable[[Any], str | None]] = {
    "question": _nonempty_str,
    "golden_answers": _nonempty_str_list,
    "hops": _positive_int,
    "tier": _str,
    "actions": _nonempty_str_list,
    "gold_doc_ids": _doc_id_list,
    "detour_turns": _bool_list,
    "trajectory": _nonempty_str,
}


def validate_record(record: Any, required: Sequence[str], where: str) -> dict[str, Any]:
  """Checks one record; `where` ("file, line n") prefixes every error message."""
  if not isinstance(record, dict):
    raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
  for field in required:
    if field not in record:
      raise ValueError(f"{where}: field {field!r}: missing")
    error = _CHECKS[field](record[field])
    if error:
      raise ValueError(f"{where}: field {field!r}: {error}")
  if "actions" in required:
    for field in ("gold_doc_ids", "detour_turns"):
      if len(record[field]) != len(record["actions"]):
        raise ValueError(f"{where}: field {field!r}: has {len(record[field])} entries for "
                         f"{len(record['actions'])} actions")
  return record


def _parquet_rows(path: str) -> list[Any]:
  import pyarrow.parquet as pq  # Only parquet users need pyarrow.
  return pq.read_table(path).to_pylist()


def read_records(path: str, required: Sequence[str] = SEARCH_R1_FIELDS) -> list[dict[str, Any]]:
  """All records of a `.jsonl` / `.json` (one object per line) or `.parquet` file, validated.

  Blank JSONL lines are skipped (but counted in line numbers). Raises `ValueError` naming the
  file, the 1-based line or row, and the field on any problem, including an empty file.
  """
  unknown = [f for f in required if f not in _CHECKS]
  if unknown:
    raise ValueError(f"no validation rule for fields {unknown}")
  records = []
  if path.endswith(".parquet"):
    for n, row in enumerate(_parquet_rows(path), 1):
      records.append(validate_record(row, required, f"{path}, row {n}"))
  elif path.endswith((".jsonl", ".json")):
    for n, record in iter_jsonl(path):
      records.append(validate_record(record, required, f"{path}, line {n}"))
  else:
    raise ValueError(f"{path}: unknown file type (want .jsonl or .parquet)")
  if not records:
    raise ValueError(f"{path}: no records")
  return records
