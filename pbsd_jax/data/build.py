"""`make_dataset`: the whole embedded task written to one directory, deterministically.

    world.json           entities, facts, confusable families (`world.World.to_json`)
    corpus.jsonl         {"id", "title", "contents"}, row i = entity i (Search-R1 format)
    rl_train.jsonl       575 questions  {"question", "golden_answers", "hops", "tier",
    rl_validation.jsonl  200             "relations", "chain", "chain_names"}
    sft.jsonl            question fields + "actions", "gold_doc_ids", "detour_turns",
                         "derailed"
    ood.jsonl            question fields, tier in easy / medium / hard
    ood_pool.jsonl       question fields, tier in long / unseen / longest (the pool that
                         scripts/stratify.py sorts by a checkpoint's solve rate)
    spm.model, spm.vocab the SentencePiece vocabulary (protocol tags are single tokens)
    manifest.json        the arguments, the counts and the SFT trajectories' horizon
                         statistics (`oracle.horizon`)

Same arguments -> byte-identical files.
"""

from __future__ import annotations

import dataclasses
import json
import os

from pbsd_jax import protocol
from pbsd_jax.data import (corpus as corpus_lib, oracle as oracle_lib, splits as splits_lib,
                           vocab as vocab_lib, world as world_lib)
from pbsd_jax.data import storage
from pbsd_jax.data.jsonl import write_jsonl


def make_dataset(out_dir: str, seed: int = 0,
                 world_sizes: world_lib.WorldSizes = world_lib.WorldSizes(),
                 split_sizes: splits_lib.SplitSizes = splits_lib.SplitSizes(),
                 detour_share: float = oracle_lib.DETOUR_SHARE,
                 slips: oracle_lib.Slips = oracle_lib.Slips(),
                 vocab_size: int = 2048) -> dict[str, str]:
  """Generates the world, corpus, splits, oracle trajectories and vocabulary into `out_dir`.

  Args:
    out_dir: created if missing; existing files of the same names are overwritten.
    seed: the one seed everything derives from.
    world_sizes: entity counts.
    split_sizes: split sizes and the OOD boundary.
    detour_share: the share of SFT trajectories that take a detour (a sloppy first query).
    slips: the other trajectories' per-hop slips (none by default).
    vocab_size: SentencePiece target vocabulary size.

  Returns:
    `{name: path}` of the written files (keys: world, corpus, rl_train, rl_validation, sft,
    ood, ood_pool, spm_model, manifest).
  """
  os.makedirs(out_dir, exist_ok=True)
  world = world_lib.make_world(seed, world_sizes)
  corpus = corpus_lib.corpus_records(world)
  splits = splits_lib.make_splits(world, seed, split_sizes)
  trajectories = oracle_lib.oracle_trajectories(world, splits["sft"], detour_share, seed,
                                                slips)

  paths = {name: os.path.join(out_dir, f"{name}.jsonl") for name in splits_lib.SPLITS}
  paths["world"] = os.path.join(out_dir, "world.json")
  paths["corpus"] = os.path.join(out_dir, "corpus.jsonl")
  paths["manifest"] = os.path.join(out_dir, "manifest.json")
  with storage.replaced(paths["world"], encoding="utf-8") as f:
    json.dump(world.to_json(), f, ensure_ascii=False)
  write_jsonl(paths["corpus"], corpus)
  for name in ("rl_train", "rl_validation", "ood", "ood_pool"):
    write_jsonl(paths[name], [q.to_record() for q in splits[name]])
  write_jsonl(paths["sft"], [t.to_record() for t in trajectories])

  # The vocabulary sees what the policy reads and writes in training: documents, prompts
  # and oracle actions (evaluation questions are left out; their words are all in these).
  texts = ([d["contents"] for d in corpus]
           + [protocol.format_prompt(q.question) for q in splits["rl_train"] + splits["sft"]]
           + [a for t in trajectories for a in t.actions])
  paths["spm_model"] = vocab_lib.train_sentencepiece(
      texts, os.path.join(out_dir, "spm"), vocab_size)

  manifest = {"seed": seed, "world_sizes": dataclasses.asdict(world_sizes),
              "split_sizes": dataclasses.asdict(split_sizes), "detour_share": detour_share,
              "slips": dataclasses.asdict(slips), "vocab_size": vocab_size,
              "num_documents": len(corpus),
              "counts": {name: len(splits[name]) for name in splits_lib.SPLITS},
              "horizon": oracle_lib.horizon(trajectories)}
  with storage.replaced(paths["manifest"], encoding="utf-8") as f:  # last: the data is whole
    json.dump(manifest, f, indent=1)
  return paths
