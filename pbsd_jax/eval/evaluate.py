"""Evaluation of a policy on question records: accuracy, pass@k, tiers, behaviour statistics.

The driver `evaluate` runs an agent's rollouts (`rollout.Agent.rollout`) over the records in
batches of one fixed shape -- the last batch is padded by repeating its own rows, which are
dropped afterwards -- so one compilation serves a whole split. Each question is sampled
`samples_per_question` = n times on consecutive rows; batch `i` samples with
`fold_in(rng, i)`. A trajectory is correct when its reward (exact match, 0 or 1) exceeds 1/2.

On a mesh (an in-graph agent), each batch is padded further to a multiple of the mesh's
data-parallel devices and its rows are sharded over them (`sharding.shard_host_batch`): every
process feeds and decodes only its own rows, as the RL step does. A row's random draws depend
on its index in the batch, not on the batch's width (`jax_threefry_partitionable`, JAX's
default), so the trajectories are the same on any number of devices and processes. The
per-trajectory outcomes are then gathered to every process (`sharding.host_rows`), so each
computes the same statistics.

The paper's two settings are greedy decoding (temperature 0) and nucleus sampling (temperature
1, top-p 0.95); `evaluate_policy` runs both. The statistics (`summarize`), pass@k (`pass_at_k`)
and the BC(300)-style difficulty split (`stratify`) are pure functions of per-trajectory
outcomes, so they are tested on hand-made rows.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import Mesh

from pbsd_jax import protocol
from pbsd_jax.agent import gold_chain, privileged
from pbsd_jax.agent.batch import question_batch
from pbsd_jax.agent.rollout import Agent
from pbsd_jax.models import ModelConfig
from pbsd_jax.parallel import sharding
from pbsd_jax.rl import credit_quality
from pbsd_jax.rl.evidence import policy_batch

DEFAULT_PASS_K = (1, 2, 4, 8, 16)
# Tier names: records with an empty `tier` are in-domain; stratify writes easy/medium/hard.
IN_DOMAIN = "in_domain"
TIERS = ("easy", "medium", "hard")
# Per-trajectory quantities `summarize` reads, each `[num_questions * n]`, question-major.
OUTCOME_FIELDS = ("reward", "num_turns", "num_action_tokens", "finished", "truncated")


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
  """Unbiased pass@k (Chen et al., 2021): `1 - C(n - c, k) / C(n, k)`.

  The probability that at least one of k samples drawn without replacement from n samples, c
  of them correct, is correct. Computed as `1 - prod_{i=n-c+1}^{n} (1 - k / i)`, which never
  forms the (huge) binomial coefficients.

  Args:
    num_samples: n >= 1.
    num_correct: c in [0, n].
    k: 1 <= k <= n.
  """
  _check_pass_at_k_args(num_samples, np.asarray([num_correct]), k)
  if num_samples - num_correct < k:
    return 1.0
  i = np.arange(num_samples - num_correct + 1, num_samples + 1, dtype=np.float64)
  return float(1.0 - np.prod(1.0 - k / i))


def pass_at_k_array(num_samples: int, num_correct: Sequence[int] | np.ndarray,
                    k: int) -> np.ndarray:
  """`pass_at_k` for every question at once: `f64[Q]` from solve counts `num_correct: [Q]`."""
  c = np.asarray(num_correct, np.int64)
  _check_pass_at_k_args(num_samples, c, k)
  i = np.arange(1, num_samples + 1, dtype=np.float64)[None, :]  # [1, n]
  # Factor i enters the product for i > n - c; where n - c < k the answer is 1 (some factor
  # would be <= 0 there, so those rows are overwritten rather than multiplied).
  factors = np.where(i > (num_samples - c)[:, None], 1.0 - k / i, 1.0)
  return np.where(num_samples - c < k, 1.0, 1.0 - np.prod(factors, axis=1))


def _check_pass_at_k_args(n: int, c: np.ndarray, k: int):
  if n < 1:
    raise ValueError(f"pass@k needs num_samples >= 1, got {n}")
  if not 1 <= k <= n:
    raise ValueError(f"pass@k needs 1 <= k <= num_samples={n}, got k={k}")
  if c.size and (c.min() < 0 or c.max() > n):
    raise ValueError(f"num_correct must be in [0, {n}], got values in [{c.min()}, {c.max()}]")


def tier_name(record: Mapping[str, Any]) -> str:
  """A record's tier: its `tier` field, or `IN_DOMAIN` when absent or empty."""
  return record.get("tier") or IN_DOMAIN


def head_per_tier(records: Sequence[Mapping], num: int | None) -> list:
  """The first `num` records (all for 0 or None), shared evenly across tiers.

  Records are taken round-robin over the tiers (`tier_name`), each tier in file order, so a
  file listed tier by tier (like `ood.jsonl`: easy, medium, hard) keeps every tier in a
  shorter evaluation. The result keeps the records' original order.
  """
  if not num or num >= len(records):
    return list(records)
  by_tier: dict[str, list[int]] = {}
  for i, record in enumerate(records):
    by_tier.setdefault(tier_name(record), []).append(i)
  queues = list(by_tier.values())
  chosen: list[int] = []
  for rank in itertools.count():
    chosen += [q[rank] for q in queues if rank < len(q)][:num - len(chosen)]
    if len(chosen) == num:
      return [records[i] for i in sorted(chosen)]


def _tier_order(names: Iterable[str]) -> list[str]:
  known = [IN_DOMAIN, *TIERS]
  names = set(names)
  return [t for t in known if t in names] + sorted(names - set(known))


def summarize(outcomes: Mapping[str, np.ndarray], tiers: Sequence[str],
              samples_per_question: int, pass_k: Sequence[int] = DEFAULT_PASS_K) -> dict:
  """Evaluation statistics from per-trajectory outcomes.

  Args:
    outcomes: the `OUTCOME_FIELDS`, each `[Q * n]` with question q's samples on rows
      `q * n ... q * n + n - 1`: `reward` (0/1), `num_turns`, `num_action_tokens` (generated
      tokens), `finished` and `truncated` (bool).
    tiers: Q tier names (`tier_name`).
    samples_per_question: n.
    pass_k: the k of pass@k; those above n are left out.

  Returns:
    A JSON-serialisable dict: `num_questions`, `samples_per_question`, `accuracy` (fraction of
    correct trajectories), `tier_accuracy` and `tier_questions` (per tier name), `mean_turns`,
    `mean_action_tokens`, `finished`, `truncated` (fractions of trajectories), `pass_at_k`
    (`{str(k): mean over questions}`) and `solve_counts` (correct samples per question).
  """
  n, q = samples_per_question, len(tiers)
  missing = [f for f in OUTCOME_FIELDS if f not in outcomes]
  if missing:
    raise ValueError(f"outcomes lack fields {missing}")
  arrays = {f: np.asarray(outcomes[f]) for f in OUTCOME_FIELDS}
  for field, value in arrays.items():
    if value.shape != (q * n,):
      raise ValueError(f"outcomes[{field!r}] has shape {value.shape}, expected ({q * n},) for "
                       f"{q} questions x {n} samples")
  correct = (arrays["reward"] > 0.5).reshape(q, n)
  counts = correct.sum(axis=1)
  tier_of = np.asarray(tiers, dtype=object)
  order = _tier_order(tiers)
  mean = lambda f: float(np.mean(arrays[f].astype(np.float64)))
  return {
      "num_questions": q,
      "samples_per_question": n,
      "accuracy": float(correct.mean()),
      "tier_accuracy": {t: float(correct[tier_of == t].mean()) for t in order},
      "tier_questions": {t: int(np.sum(tier_of == t)) for t in order},
      "mean_turns": mean("num_turns"),
      "mean_action_tokens": mean("num_action_tokens"),
      "finished": mean("finished"),
      "truncated": mean("truncated"),
      "pass_at_k": {str(k): float(pass_at_k_array(n, counts, k).mean())
                    for k in pass_k if k <= n},
      "solve_counts": [int(c) for c in counts],
  }


def evaluate(agent: Agent, params: Any, records: Sequence[Mapping], *, batch_size: int,
             rng: jax.Array, prompt_width: int, gold_width: int, samples_per_question: int = 1,
             pass_k: Sequence[int] = DEFAULT_PASS_K,
             template: str = protocol.DEFAULT_PROMPT_TEMPLATE,
             progress: Callable[..., Iterable] = lambda it, **kw: it,
             credit_algo: Any = None,
             teacher_template: str = privileged.DEFAULT_PRIVILEGED_TEMPLATE,
             mesh: Mesh | None = None) -> dict:
  """Rolls the policy out on `records` and returns `summarize`'s statistics.

  Args:
    agent: the sampler (temperature 0 is greedy), environment, tokenizer and search
      (`Agent.rollout`: in-graph over a device index, else the host turn loop, whose reward is
      text-level).
    params: policy parameters.
    records: Q question records (`question`, `golden_answers`, optional `tier`).
    batch_size: rollout rows per call (every call has this shape).
    rng: PRNG key; batch i uses `fold_in(rng, i)`.
    prompt_width: P, the prompt region width.
    gold_width: tokens per gold answer (`batch.gold_batch`).
    samples_per_question: n trajectories per question.
    pass_k: the k of pass@k (those above n are left out).
    template: the prompt template (`protocol.format_prompt`).
    progress: wraps the batch iterator (e.g. `tqdm.tqdm`); gets `desc` and `total`.
    credit_algo: the run's algorithm: when it computes turn evidence (PBSD, RLSD) and every
      record has a gold chain, each trajectory is also scored on its teacher prompt and the
      result gains `credit` (`credit_summary`, pooled over every labelled turn of the split).
    teacher_template: the teacher's privileged block (the run's `data.teacher_template`).
    mesh: the mesh `params` live on: an in-graph agent's rows are sharded over its data axes,
      on every process of a multi-process run, each of which calls this
      with the same arguments and gets the same result. None: the rows as host arrays.

  Returns:
    The dict of `summarize`; where every record has a gold chain, `horizon`
    (`gold_chain.horizon_summary`, and `tokens`: the mean trajectory tokens, observations
    included); and `credit`.
  """
  if batch_size < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}")
  if samples_per_question < 1:
    raise ValueError(f"samples_per_question must be >= 1, got {samples_per_question}")
  if not records:
    raise ValueError("no records to evaluate")
  # Encoded once for all records (so every batch has the same number of gold variants);
  # each batch takes its rows.
  chains = all("chain" in r for r in records)
  with_credit = credit_algo is not None and "logp_teacher" in credit_algo.needs and chains
  region = question_batch(records, agent.tokenizer, prompt_width=prompt_width,
                          gold_width=gold_width, template=template,
                          teacher_template=teacher_template if with_credit else None,
                          gold_chains=chains)
  rows = np.repeat(np.arange(len(records)), samples_per_question)
  num_batches = -(-len(rows) // batch_size)
  sharded = mesh is not None
  shards = sharding.num_batch_shards(mesh) if sharded else 1
  width = -(-batch_size // shards) * shards
  keys = ("prompts", "prompt_mask", "gold", "gold_docs") + (
      ("teacher_prompt", "teacher_prompt_mask") if with_credit else ())
  parts = []
  for i in progress(range(num_batches), desc="eval", total=num_batches):
    chunk = rows[i * batch_size:(i + 1) * batch_size]
    padded = np.resize(chunk, width)  # repeats the chunk's own rows: one shape
    batch = {k: region[k][padded] for k in keys if k in region}
    if sharded:
      batch = sharding.shard_host_batch(batch, mesh)
    out = agent.rollout(params, jax.random.fold_in(rng, i), batch,
                        golden_answers=[records[r]["golden_answers"] for r in padded])
    stats = {"reward": out.reward, "num_turns": out.num_turns,
             "num_action_tokens": out.num_action_tokens, "finished": out.finished,
             "truncated": out.truncated}
    if chains:
      stats["turn_kind"], stats["turn_doc"] = out.turn_kind, out.turn_doc
      stats["tokens"] = out.length - out.prompt_width
      stats["turn_label"], stats["turn_value"] = out.turn_label, out.turn_value
    if with_credit:
      stats["evidence"] = _turn_evidence(credit_algo, agent.sampler.model, agent.env.max_turns,
                                         params, out, batch["teacher_prompt"],
                                         batch["teacher_prompt_mask"])
    parts.append((len(chunk), sharding.host_rows(stats) if sharded else stats))
  fields = (OUTCOME_FIELDS
            + (("turn_kind", "turn_doc", "turn_label", "turn_value", "tokens") if chains else ())
            + (("evidence",) if with_credit else ()))
  outcomes = {f: np.concatenate([np.asarray(s[f])[:m] for m, s in parts]) for f in fields}
  result = summarize(outcomes, [tier_name(r) for r in records], samples_per_question, pass_k)
  if chains:
    result["horizon"] = gold_chain.horizon_summary(
        outcomes["turn_kind"], outcomes["turn_doc"], region["gold_docs"][rows],
        outcomes["reward"]) | {"tokens": float(np.mean(outcomes["tokens"]))}
  if with_credit:
    shown = gold_chain.answer_shown(jnp.asarray(outcomes["turn_doc"]),
                                    jnp.asarray(region["gold_docs"][rows]))
    result["credit"] = credit_summary(outcomes["turn_label"], outcomes["evidence"],
                                      outcomes["reward"] > 0.5, outcomes["turn_value"],
                                      np.asarray(shown))
  return result


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _turn_evidence(algo: Any, model: ModelConfig, max_turns: int, params: Any, rollout: Any,
                   teacher_prompt: jax.Array, teacher_prompt_mask: jax.Array) -> jax.Array:
  """`f32[B, K]` the algorithm's turn evidence `s` of a rollout: the training step's evidence
  pass (`evidence.policy_batch`), then `algo.turn_credit`."""
  inputs = policy_batch(params, rollout, teacher_prompt, teacher_prompt_mask, jnp.int32(0),
                        model=model, algo=algo, max_turns=max_turns).inputs
  return algo.turn_credit(jnp.zeros_like(rollout.reward), inputs).evidence


def credit_summary(turn_label: np.ndarray, evidence: np.ndarray, solved: np.ndarray,
                   turn_value: np.ndarray | None = None,
                   answer_shown: np.ndarray | None = None) -> dict:
  """Evidence statistics of evaluated trajectories (`[N, K]` labels and evidence, `[N]`
  solved): the ROC AUC of `s` for useful vs. other labelled turns (all, solved, failed
  trajectories; NaN where a class is empty), the share of labelled turns that are useful and
  their count, and over the labelled turns the fraction with `s > 0` and the mean `|s|`;
  with the turns' values (`[N, K]`, `gold_chain.turn_values`), the same AUCs for progress vs.
  culprit turns (`..._value`) and their shares; with `answer_shown` as well (`[N, K]`,
  `gold_chain.answer_shown`), that AUC over the turns taken with the answer in the context
  (`auc_evidence_value_answer_shown`) and without (`..._answer_hidden`), and the share of
  progress and culprit turns taken with it (`frac_answer_shown`)."""
  metrics = credit_quality.quality_metrics(
      jnp.asarray(turn_label), jnp.asarray(solved), evidence=jnp.asarray(evidence),
      turn_value=None if turn_value is None else jnp.asarray(turn_value))
  summary = {k.removeprefix("credit/"): float(v) for k, v in metrics.items()}
  summary["labelled_turns"] = int(summary["labelled_turns"])
  if turn_value is not None and answer_shown is not None:
    label = np.asarray(gold_chain.value_labels(jnp.asarray(turn_value)))
    ranked = (label == gold_chain.PROGRESS) | (label == gold_chain.CULPRIT)
    for name, keep in (("shown", answer_shown), ("hidden", ~answer_shown)):
      summary[f"auc_evidence_value_answer_{name}"] = float(credit_quality.roc_auc(
          jnp.asarray(evidence), jnp.asarray(label == gold_chain.PROGRESS),
          jnp.asarray(ranked & keep)))
    summary["frac_answer_shown"] = float(np.sum(ranked & answer_shown) / max(ranked.sum(), 1))
  labelled = turn_label != gold_chain.UNLABELLED
  n = max(int(labelled.sum()), 1)
  return {**summary, "frac_evidence_pos": float(np.sum(labelled & (evidence > 0)) / n),
          "mean_abs_evidence": float(np.sum(np.where(labelled, np.abs(evidence), 0.0)) / n)}


def evaluate_policy(agent: Agent, params: Any, records: Sequence[Mapping], *,
                    samples_per_question: int = 1, credit_algo: Any = None, **kw) -> dict:
  """The paper's two evaluations: `{"greedy": ..., "top_p": ...}`, each `evaluate`'s dict.

  The nucleus run samples with `agent.sampler` (the paper's setting: temperature 1.0, top-p
  0.95, no top-k) `samples_per_question` times and carries pass@k; the greedy run is the
  same sampler at temperature 0, which is deterministic, so it samples each question once.
  The two runs use independent keys split from `kw["rng"]`. Other arguments (`kw`) as in
  `evaluate`.
  """
  greedy_rng, sample_rng = jax.random.split(kw.pop("rng"))
  greedy = dataclasses.replace(agent.sampler, temperature=0.0)
  return {
      "greedy": evaluate(dataclasses.replace(agent, sampler=greedy), params, records,
                         rng=greedy_rng, samples_per_question=1, credit_algo=credit_algo, **kw),
      "top_p": evaluate(agent, params, records, rng=sample_rng,
                        samples_per_question=samples_per_question, credit_algo=credit_algo,
                        **kw),
  }


def stratify_tier(solve_count: int, num_samples: int) -> str:
  """`"easy"` if solved in all n samples, `"hard"` if in none, else `"medium"`."""
  if solve_count == num_samples:
    return "easy"
  return "hard" if solve_count == 0 else "medium"


def stratify(solve_counts: Sequence[int], num_samples: int, per_tier: int,
             seed: int) -> dict[str, list[int]]:
  """The paper's BC(300) split: difficulty tiers by solve rate, then a balanced sample.

  A question's tier is `stratify_tier` of its solve count: Easy if solved in all n samples,
  Hard if in none, otherwise Medium. From each tier `per_tier` questions are drawn without
  replacement by `numpy`'s generator seeded with `seed` (one generator, tiers drawn in the
  order easy, medium, hard).

  Args:
    solve_counts: `[Q]` correct samples per question.
    num_samples: n, samples per question.
    per_tier: questions drawn per tier.
    seed: the sampling seed.

  Returns:
    `{"easy": [...], "medium": [...], "hard": [...]}`: sorted question indices.

  Raises:
    ValueError: a count outside [0, n], or a tier with fewer than `per_tier` questions (the
      message gives every tier's size).
  """
  counts = np.asarray(solve_counts, np.int64)
  if num_samples < 1:
    raise ValueError(f"num_samples must be >= 1, got {num_samples}")
  if per_tier < 1:
    raise ValueError(f"per_tier must be >= 1, got {per_tier}")
  if counts.size and (counts.min() < 0 or counts.max() > num_samples):
    raise ValueError(f"solve counts must be in [0, {num_samples}], got values in "
                     f"[{counts.min()}, {counts.max()}]")
  tiers = [stratify_tier(int(c), num_samples) for c in counts]
  members = {t: np.asarray([i for i, ti in enumerate(tiers) if ti == t], np.int64)
             for t in TIERS}
  sizes = {t: len(m) for t, m in members.items()}
  short = [t for t, size in sizes.items() if size < per_tier]
  if short:
    raise ValueError(f"tier(s) {short} have fewer than per_tier={per_tier} questions "
                     f"(tier sizes {sizes}, n={num_samples} samples each)")
  gen = np.random.default_rng(seed)
  return {t: sorted(int(i) for i in gen.choice(m, per_tier, replace=False))
          for t, m in members.items()}


def stratified_subset(agent: Agent, params: Any, records: Sequence[Mapping], *,
                      num_samples: int, per_tier: int, seed: int, **kw) -> tuple[list, dict]:
  """The paper's BC(300) procedure on a pool: `num_samples` rollouts of every record by
  `agent` (`evaluate`, rng from `seed`), `stratify` by the solve counts, the drawn records.

  Args:
    agent, params, records: as in `evaluate`; `kw` its other arguments.
    num_samples: n, samples per question.
    per_tier: records drawn per tier.
    seed: the sampling key and the draw's seed.

  Returns:
    `(rows, summary)`: the drawn records tier by tier, each as it was with `tier` set (its
    previous `tier` kept as `kind`) and `solve_count` / `samples` added; and the pool's
    `accuracy` and every tier's size (`tier_sizes`).

  Raises:
    ValueError: a tier of the pool holds fewer than `per_tier` records (`stratify`).
  """
  result = evaluate(agent, params, records, rng=jax.random.key(seed),
                    samples_per_question=num_samples, pass_k=(), **kw)
  counts = result["solve_counts"]
  chosen = stratify(counts, num_samples, per_tier, seed)
  rows = [{**records[i], "kind": records[i].get("tier", ""), "tier": tier,
           "solve_count": int(counts[i]), "samples": num_samples}
          for tier, indices in chosen.items() for i in indices]
  sizes = {t: sum(stratify_tier(int(c), num_samples) == t for c in counts) for t in TIERS}
  return rows, {"accuracy": result["accuracy"], "tier_sizes": sizes}


def _percent(x: float) -> str:
  return f"{100.0 * x:.1f}%"


def format_table(results: Mapping[str, Mapping]) -> str:
  """A plain-text table of `evaluate` results, one column per run.

  Args:
    results: `{column name: evaluate's dict}`, e.g. what `evaluate_policy` returns (a single
      `evaluate` dict is shown as one column named "result").

  Returns:
    The table as lines of text: accuracy, per-tier accuracy (with question counts), pass@k,
    mean turns, generated tokens, finished and truncated fractions.
  """
  if "accuracy" in results:
    results = {"result": results}
  columns = list(results)
  tiers = _tier_order(t for r in results.values() for t in r["tier_accuracy"])
  ks = sorted({int(k) for r in results.values() for k in r["pass_at_k"]})
  lines: list[tuple[str, list[str]]] = [("questions x samples", [
      f"{r['num_questions']} x {r['samples_per_question']}" for r in results.values()])]
  lines.append(("accuracy", [_percent(r["accuracy"]) for r in results.values()]))
  for tier in tiers:
    lines.append((f"  {tier}", [
        f"{_percent(r['tier_accuracy'][tier])} ({r['tier_questions'][tier]})"
        if tier in r["tier_accuracy"] else "-" for r in results.values()]))
  for k in ks:
    lines.append((f"pass@{k}", [_percent(r["pass_at_k"][str(k)]) if str(k) in r["pass_at_k"]
                                else "-" for r in results.values()]))
  lines += [
      ("mean turns", [f"{r['mean_turns']:.2f}" for r in results.values()]),
      ("generated tokens", [f"{r['mean_action_tokens']:.1f}" for r in results.values()]),
      ("finished", [_percent(r["finished"]) for r in results.values()]),
      ("truncated", [_percent(r["truncated"]) for r in results.values()]),
  ]
  if any("credit" in r for r in results.values()):
    cell = lambda r, key, fmt: fmt(r["credit"].get(key, float("nan"))) if "credit" in r else "-"
    lines += [(label, [cell(r, key, fmt) for r in results.values()]) for label, key, fmt in (
        ("useful searches", "frac_useful", _percent),
        ("evidence AUC useful", "auc_evidence", "{:.3f}".format),
        ("  in solved", "auc_evidence_solved", "{:.3f}".format),
        ("  in failed", "auc_evidence_failed", "{:.3f}".format),
        ("teacher > student", "frac_evidence_pos", _percent),
        ("mean |evidence|", "mean_abs_evidence", "{:.3f}".format),
        ("progress turns", "frac_progress", _percent),
        ("evidence AUC progress", "auc_evidence_value", "{:.3f}".format),
        ("  answer in context", "auc_evidence_value_answer_shown", "{:.3f}".format),
        ("  answer not in context", "auc_evidence_value_answer_hidden", "{:.3f}".format))]
  label_width = max(len(label) for label, _ in lines)
  widths = [max(len(name), *(len(cells[j]) for _, cells in lines))
            for j, name in enumerate(columns)]
  row = lambda label, cells: "  ".join(
      [label.ljust(label_width)] + [c.rjust(w) for c, w in zip(cells, widths)])
  return "\n".join([row("", columns), row("-" * label_width, ["-" * w for w in widths])]
                   + [row(label, cells) for label, cells in lines])
