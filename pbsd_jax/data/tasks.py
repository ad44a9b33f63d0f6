"""seqio tasks over the question files.

Every task yields, per example:

    inputs            int32[L]   the tokenised student prompt, `format_prompt(question)`
    targets           int32[M]   the tokenised first golden answer (no EOS: it is compared
                                 with the answer span, not generated after the prompt)
    inputs_pretokenized, targets_pretokenized   the two strings
    question          str        the raw question
    golden_answers    str[A]     all acceptable answers

The synthetic tasks add `hops` (int32) and `tier` (str; "easy" / "medium" / "hard" in OOD,
"" elsewhere); the SFT task adds the oracle's `actions` (str[N]), `gold_doc_ids` (int32[N],
-1 where there is none) and `detour_turns` (bool[N]). Files are read and validated on the
host when a task is registered (`records.read_records`), so a malformed file fails then,
naming the file, line and field.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import seqio
import tensorflow as tf

from pbsd_jax import protocol
from pbsd_jax.data import records as records_lib

# task name -> (file in the data dir, its one split, the fields it carries)
SYNTHETIC_TASKS = {
    "pbsd_kg_rl_train": ("rl_train.jsonl", "train", records_lib.QUESTION_FIELDS),
    "pbsd_kg_rl_validation": ("rl_validation.jsonl", "validation",
                              records_lib.QUESTION_FIELDS),
    "pbsd_kg_ood": ("ood.jsonl", "test", records_lib.QUESTION_FIELDS),
    "pbsd_kg_sft": ("sft.jsonl", "train", records_lib.SFT_FIELDS),
}


def _tensors(records: list[dict[str, Any]], fields: Sequence[str], template: str
            ) -> dict[str, Any]:
  """Column tensors of the examples: scalars as 1-D tensors, lists as ragged tensors."""
  columns: dict[str, Any] = {
      "inputs": tf.constant([protocol.format_prompt(r["question"], template) for r in records]),
      "targets": tf.constant([r["golden_answers"][0] for r in records]),
      "question": tf.constant([r["question"] for r in records]),
      "golden_answers": tf.ragged.constant([r["golden_answers"] for r in records]),
  }
  if "hops" in fields:
    columns["hops"] = tf.constant([r["hops"] for r in records], tf.int32)
  if "tier" in fields:
    columns["tier"] = tf.constant([r["tier"] for r in records])
  if "actions" in fields:
    columns["actions"] = tf.ragged.constant([r["actions"] for r in records])
    columns["gold_doc_ids"] = tf.ragged.constant(
        [[-1 if d is None else d for d in r["gold_doc_ids"]] for r in records], tf.int32)
    columns["detour_turns"] = tf.ragged.constant([r["detour_turns"] for r in records], tf.bool)
  return columns


def _add_task(name: str, path: str, split: str, fields: Sequence[str],
              vocab: seqio.Vocabulary, template: str) -> seqio.Task:
  records = records_lib.read_records(path, fields)

  def dataset_fn(split: str, shuffle_files: bool, seed: int | None = None) -> tf.data.Dataset:
    del split, shuffle_files, seed  # One in-memory split; seqio shuffles examples itself.
    return tf.data.Dataset.from_tensor_slices(_tensors(records, fields, template))

  features = {"inputs": seqio.Feature(vocab, add_eos=False),
              "targets": seqio.Feature(vocab, add_eos=False)}
  # Re-registering replaces the task, so a notebook or a test can point it at new files.
  seqio.TaskRegistry.remove(name)
  return seqio.TaskRegistry.add(
      name,
      source=seqio.FunctionDataSource(dataset_fn, splits=(split,),
                                      num_input_examples={split: len(records)}),
      preprocessors=[seqio.preprocessors.tokenize],
      output_features=features)


def register_tasks(data_dir: str, vocab: seqio.Vocabulary,
                   template: str = protocol.DEFAULT_PROMPT_TEMPLATE) -> dict[str, seqio.Task]:
  """Registers the synthetic tasks over the files `make_dataset` wrote to `data_dir`.

  Returns `{name: task}` for `pbsd_kg_rl_train` (split "train"), `pbsd_kg_rl_validation`
  ("validation"), `pbsd_kg_ood` ("test") and `pbsd_kg_sft` ("train").
  """
  return {name: _add_task(name, os.path.join(data_dir, filename), split, fields, vocab,
                          template)
          for name, (filename, split, fields) in SYNTHETIC_TASKS.items()}


def user_task(name: str, path: str, vocab: seqio.Vocabulary, split: str = "train",
              template: str = protocol.SEARCH_R1_PROMPT_TEMPLATE) -> seqio.Task:
  """Registers a task over a user file in the Search-R1 format (`.jsonl` or `.parquet`
  with `question` and `golden_answers`). Other columns are ignored. The default prompt is
  Search-R1's instruction prompt, for pretrained models that must be told the protocol."""
  return _add_task(name, path, split, records_lib.SEARCH_R1_FIELDS, vocab, template)


def _text(value) -> str:
  return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def user_records(name: str, path: str, vocab: seqio.Vocabulary,
                 template: str = protocol.SEARCH_R1_PROMPT_TEMPLATE) -> list[dict[str, Any]]:
  """The questions of a user file, read back through its registered `user_task` (so the run
  reads what a seqio pipeline over the same name reads): `question` and `golden_answers`, in
  file order."""
  task = user_task(name, path, vocab, "train", template)
  rows = task.source.get_dataset("train", shuffle=False).as_numpy_iterator()
  return [{"question": _text(row["question"]),
           "golden_answers": [_text(a) for a in row["golden_answers"]]} for row in rows]
