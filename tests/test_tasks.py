"""seqio tasks: values loaded through the registry equal the files; bad files fail early,
naming the file, the line and the field."""

import json
import os
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import seqio

from pbsd_jax import protocol
from pbsd_jax.data import jsonl, records, tasks


@pytest.fixture(scope="module")
def vocab(kg):
  return kg.vocab


@pytest.fixture(scope="module")
def registered(kg):
  return tasks.register_tasks(os.path.dirname(kg.paths["spm_model"]), kg.vocab)


def _examples(name, split, limit=-1):
  task = seqio.get_mixture_or_task(name)
  dataset = task.get_dataset(split=split, shuffle=False, sequence_length=None)
  return list(dataset.take(limit).as_numpy_iterator())


def test_all_four_synthetic_tasks_are_registered(registered):
  assert set(registered) == {"pbsd_kg_rl_train", "pbsd_kg_rl_validation", "pbsd_kg_ood",
                             "pbsd_kg_sft"}
  assert registered["pbsd_kg_rl_train"].num_input_examples("train") == 575


def test_validation_task_yields_every_question_tokenised(registered, kg, vocab):
  rows = kg.records("rl_validation")
  examples = _examples("pbsd_kg_rl_validation", "validation")
  assert len(examples) == len(rows) == 200
  for ex, row in zip(examples, rows):
    assert ex["question"].decode() == row["question"]
    assert ex["inputs"].tolist() == vocab.encode(protocol.format_prompt(row["question"]))
    assert ex["targets"].tolist() == vocab.encode(row["golden_answers"][0])
    assert [a.decode() for a in ex["golden_answers"]] == row["golden_answers"]
    assert ex["hops"] == row["hops"] and ex["tier"] == b""


def test_ood_task_carries_the_tiers(registered, kg):
  rows = kg.records("ood")
  examples = _examples("pbsd_kg_ood", "test")
  assert [ex["tier"].decode() for ex in examples] == [r["tier"] for r in rows]
  assert {ex["tier"] for ex in examples} == {b"easy", b"medium", b"hard"}


def test_sft_task_carries_actions_and_gold_doc_ids(registered, kg):
  rows = kg.records("sft")[:50]
  examples = _examples("pbsd_kg_sft", "train", limit=50)
  for ex, row in zip(examples, rows):
    assert [a.decode() for a in ex["actions"]] == row["actions"]
    assert ex["gold_doc_ids"].tolist() == [-1 if d is None else d for d in row["gold_doc_ids"]]
    assert ex["detour_turns"].tolist() == row["detour_turns"]


def _write_jsonl(path, rows):
  with open(path, "w") as f:
    for row in rows:
      f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")


_GOOD = {"question": "Who founded Brala Dynamics?", "golden_answers": ["Mozar Jenos", "M. Jenos"]}


def test_user_jsonl_task_uses_the_search_r1_prompt(tmp_path, vocab):
  path = str(tmp_path / "user.jsonl")
  _write_jsonl(path, [_GOOD, {**_GOOD, "question": "Second?", "id": 7}])
  tasks.user_task("pbsd_test_user_jsonl", path, vocab, split="validation")
  examples = _examples("pbsd_test_user_jsonl", "validation")
  assert len(examples) == 2
  prompt = protocol.format_prompt(_GOOD["question"], protocol.SEARCH_R1_PROMPT_TEMPLATE)
  assert examples[0]["inputs_pretokenized"].decode() == prompt
  assert examples[0]["targets"].tolist() == vocab.encode("Mozar Jenos")
  assert [a.decode() for a in examples[0]["golden_answers"]] == _GOOD["golden_answers"]


def test_user_parquet_task(tmp_path, vocab):
  path = str(tmp_path / "user.parquet")
  pq.write_table(pa.Table.from_pylist([_GOOD, {**_GOOD, "question": "Second?"}]), path)
  tasks.user_task("pbsd_test_user_parquet", path, vocab)
  examples = _examples("pbsd_test_user_parquet", "train")
  assert [ex["question"].decode() for ex in examples] == [_GOOD["question"], "Second?"]


@pytest.mark.parametrize("bad_line, field", [
    ('{"question": "Q?", "golden_answers": ["A"]', "invalid JSON"),
    ({"golden_answers": ["A"]}, "field 'question': missing"),
    ({"question": "Q?"}, "field 'golden_answers': missing"),
    ({"question": "Q?", "golden_answers": "A"}, "field 'golden_answers': expected a non-empty"),
    ({"question": "Q?", "golden_answers": []}, "field 'golden_answers': expected a non-empty"),
    ({"question": "Q?", "golden_answers": ["A", ""]}, "field 'golden_answers'"),
    ({"question": 3, "golden_answers": ["A"]}, "field 'question': expected a non-empty string"),
    ('["Q?", ["A"]]', "expected a JSON object"),
])
def test_malformed_jsonl_names_file_line_and_field(tmp_path, vocab, bad_line, field):
  path = str(tmp_path / "bad.jsonl")
  _write_jsonl(path, [_GOOD, "", bad_line])  # The bad record is on line 3.
  with pytest.raises(ValueError) as error:
    tasks.user_task("pbsd_test_bad", path, vocab)
  assert str(error.value).startswith(f"{path}, line 3: ")
  assert field in str(error.value)


def test_malformed_parquet_names_file_row_and_field(tmp_path, vocab):
  path = str(tmp_path / "bad.parquet")
  pq.write_table(pa.Table.from_pylist([_GOOD, {**_GOOD, "golden_answers": []}]), path)
  with pytest.raises(ValueError, match=r"bad.parquet, row 2: field 'golden_answers'"):
    tasks.user_task("pbsd_test_bad", path, vocab)


def test_iter_jsonl_skips_blank_lines_but_counts_them(tmp_path):
  path = tmp_path / "rows.jsonl"
  path.write_text('{"a": 1}\n\n   \n[2]\n')
  assert list(jsonl.iter_jsonl(str(path))) == [(1, {"a": 1}), (4, [2])]
  path.write_text('{"a": 1}\n\n{"a": \n')
  with pytest.raises(ValueError, match=f"^{re.escape(str(path))}, line 3: invalid JSON: "):
    list(jsonl.iter_jsonl(str(path)))


def test_malformed_sft_record_names_the_field(tmp_path):
  row = {**_GOOD, "hops": 1, "tier": "", "actions": ["a", "b"],
         "gold_doc_ids": [3], "detour_turns": [False, False]}
  path = str(tmp_path / "sft.jsonl")
  _write_jsonl(path, [row])
  with pytest.raises(ValueError, match=r"line 1: field 'gold_doc_ids': has 1 entries for 2"):
    records.read_records(path, records.SFT_FIELDS)
  _write_jsonl(path, [{**row, "gold_doc_ids": [3, None], "hops": 0}])
  with pytest.raises(ValueError, match=r"line 1: field 'hops': expected a positive integer"):
    records.read_records(path, records.SFT_FIELDS)


def test_empty_and_unknown_files_are_rejected(tmp_path, vocab):
  empty = str(tmp_path / "empty.jsonl")
  _write_jsonl(empty, [])
  with pytest.raises(ValueError, match="empty.jsonl: no records"):
    tasks.user_task("pbsd_test_bad", empty, vocab)
  with pytest.raises(ValueError, match="unknown file type"):
    tasks.user_task("pbsd_test_bad", str(tmp_path / "data.csv"), vocab)


def test_missing_synthetic_file_fails_at_registration(tmp_path, vocab):
  with pytest.raises(FileNotFoundError, match="rl_train.jsonl"):
    tasks.register_tasks(str(tmp_path), vocab)
