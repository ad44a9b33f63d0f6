"""make_dataset / scripts/make_data.py: every file written, byte-identical for a seed."""

import json
import os
import subprocess
import sys

import pytest

from pbsd_jax.data import build, splits, world

_FILES = ("world.json", "corpus.jsonl", "rl_train.jsonl", "rl_validation.jsonl", "sft.jsonl",
          "ood.jsonl", "ood_pool.jsonl", "spm.model", "spm.vocab", "manifest.json")
_SMALL = dict(world_sizes=world.WorldSizes(people=120),
              split_sizes=splits.SplitSizes(sft=300, ood_per_tier=20, ood_pool=90))


def _read_all(directory):
  out = {}
  for name in _FILES:
    with open(os.path.join(directory, name), "rb") as f:
      out[name] = f.read()
  return out


@pytest.fixture(scope="module")
def first(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("first"))
  build.make_dataset(out, seed=0, **_SMALL)
  return out


def test_same_seed_gives_byte_identical_files_in_another_directory(first, tmp_path):
  build.make_dataset(str(tmp_path), seed=0, **_SMALL)
  assert _read_all(str(tmp_path)) == _read_all(first)


def test_different_seed_gives_a_different_world(first, tmp_path):
  build.make_dataset(str(tmp_path), seed=1, **_SMALL)
  again = _read_all(str(tmp_path))
  assert again["world.json"] != _read_all(first)["world.json"]


def test_manifest_records_arguments_and_counts(first):
  with open(os.path.join(first, "manifest.json")) as f:
    manifest = json.load(f)
  assert manifest["seed"] == 0 and manifest["world_sizes"]["people"] == 120
  assert manifest["counts"] == {"rl_train": 575, "rl_validation": 200, "sft": 300, "ood": 60,
                                "ood_pool": 90}
  with open(os.path.join(first, "corpus.jsonl")) as f:
    assert sum(1 for _ in f) == manifest["num_documents"]


def test_script_writes_the_same_bytes_as_the_library(first, tmp_path):
  # Another process has another string-hash seed: nothing may depend on set order.
  out = tmp_path / "data"
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  result = subprocess.run(
      [sys.executable, os.path.join(repo, "scripts", "make_data.py"), f"--out={out}",
       "--config.data.world.people=120", "--config.data.splits.sft=300",
       "--config.data.splits.ood_per_tier=20", "--config.data.splits.ood_pool=90",
       "--config.data.data_seed=0"],
      capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 0, result.stderr[-2000:]
  assert sorted(os.listdir(out)) == sorted(_FILES)
  assert _read_all(str(out)) == _read_all(first)
