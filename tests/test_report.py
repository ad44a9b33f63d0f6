"""The run report: metric plots and the per-turn credit page."""

import html
import json
import logging
import math

import jax.numpy as jnp
import numpy as np
import pytest

from pbsd_jax.agent.rollout import Rollout
from pbsd_jax.eval import report
from pbsd_jax.rl import algorithms

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _write_metrics(path, rows):
  with open(path, "w") as f:
    for row in rows:
      f.write(json.dumps(row) + "\n")


def test_plot_metrics_writes_one_valid_png_per_logged_metric(tmp_path, caplog):
  from matplotlib import image
  rows = [{"stage": "sft", "step": s, "loss": 1.0 / s} for s in (1, 2, 3)]
  rows += [{"stage": "rl", "step": s, "accuracy": 0.1 * s, "mean_turns": 2.0 + s,
            "mean_action_tokens": 30.0 - s, "credit/frac_evidence_pos": 0.5}
           for s in (1, 2, 3, 4)]
  rows += [{"stage": "eval", "step": 4, "accuracy": 0.35}]
  _write_metrics(tmp_path / "metrics.jsonl", rows)
  with caplog.at_level(logging.WARNING):
    paths = report.plot_metrics(str(tmp_path / "metrics.jsonl"), str(tmp_path / "plots"))
  # credit/mean_abs_evidence was never logged: skipped, with a note naming it.
  assert [p.rsplit("/", 1)[1] for p in paths] == [
      "accuracy.png", "mean_turns.png", "mean_action_tokens.png",
      "credit_frac_evidence_pos.png"]
  assert "credit/mean_abs_evidence" in caplog.text
  for path in paths:
    with open(path, "rb") as f:
      assert f.read(8) == PNG_SIGNATURE
    pixels = image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100


def test_plot_metrics_takes_a_list_of_keys_and_a_stage_filter(tmp_path):
  _write_metrics(tmp_path / "m.jsonl", [{"stage": "sft", "step": 1, "loss": 2.0},
                                        {"stage": "rl", "step": 1, "accuracy": 0.5}])
  paths = report.plot_metrics(str(tmp_path / "m.jsonl"), str(tmp_path), ["loss", "accuracy"],
                              stages=["rl"])
  assert [p.rsplit("/", 1)[1] for p in paths] == ["accuracy.png"]


def test_plot_metrics_names_the_line_without_a_step(tmp_path):
  _write_metrics(tmp_path / "m.jsonl", [{"stage": "rl", "step": 1}, {"stage": "rl"}])
  with pytest.raises(ValueError, match=r"m\.jsonl, line 2: .*integer 'step'"):
    report.plot_metrics(str(tmp_path / "m.jsonl"), str(tmp_path))


def _rollout(rows, prompt_width, width):
  """A `Rollout` from rows of `(prompt ids, [(turn or -1, ids), ...])`."""
  b = len(rows)
  tokens = np.zeros((b, width), np.int32)
  action = np.zeros((b, width), bool)
  turn_ids = np.full((b, width), -1, np.int32)
  length, prompt_length = np.zeros(b, np.int32), np.zeros(b, np.int32)
  for i, (prompt, segments) in enumerate(rows):
    tokens[i, prompt_width - len(prompt):prompt_width] = prompt
    prompt_length[i] = len(prompt)
    col = prompt_width
    for turn, ids in segments:
      tokens[i, col:col + len(ids)] = ids
      action[i, col:col + len(ids)] = turn >= 0
      turn_ids[i, col:col + len(ids)] = turn
      col += len(ids)
    length[i] = col
  zeros = jnp.zeros(b, jnp.int32)
  return Rollout(tokens=jnp.asarray(tokens), action_mask=jnp.asarray(action),
                 turn_ids=jnp.asarray(turn_ids), num_turns=jnp.asarray(turn_ids.max(1) + 1),
                 length=jnp.asarray(length), prompt_length=jnp.asarray(prompt_length),
                 finished=jnp.ones(b, bool), truncated=jnp.zeros(b, bool), group_ids=zeros,
                 sample_logp=jnp.zeros((b, width)), reward=jnp.asarray([1.0, 0.0][:b]),
                 searches=zeros, search_failures=zeros, prompt_width=prompt_width)


def test_credit_view_gives_hand_computed_evidence_deadband_and_weights():
  rollout = _rollout([([5, 6], [(0, [10, 11]), (-1, [20, 21]), (1, [12, 13])]),
                      ([7], [(0, [14, 15, 16])])], prompt_width=2, width=9)
  teacher = np.zeros((2, 9), np.float32)
  teacher[0, 2:4] = [0.2, 0.4]         # turn 0: s = 0.3
  teacher[0, 4:6] = 5.0                # observation tokens: never evidence
  teacher[0, 6:8] = [-0.002, -0.002]   # turn 1: s = -0.002, inside the deadband (eps- = 0.003)
  teacher[1, 2:5] = [-0.05] * 3        # row 1, turn 0: s = -0.05
  logp = jnp.stack([jnp.zeros((2, 9)), jnp.asarray(teacher)])
  # Rewards [1, 0], one group: A = +-0.5 / (std 0.7071 + 1e-6).
  view = report.credit_view(rollout, logp, algorithms.get("pbsd", group_size=2), max_turns=3)
  np.testing.assert_allclose(view[0].evidence, [0.3, -0.002, 0.0], atol=1e-6)
  np.testing.assert_allclose(view[0].filtered, [0.3, 0.0, 0.0], atol=1e-6)
  np.testing.assert_allclose(view[0].weights, [1 + 0.1 * math.tanh(3.0), 1.0, 1.0], atol=1e-6)
  # A < 0 flips the sign: an undermining turn of a failed trajectory is penalised more.
  np.testing.assert_allclose(view[1].weights, [1 + 0.1 * math.tanh(0.5), 1.0, 1.0], atol=1e-6)
  assert [(t, ids.tolist()) for t, ids in view[0].segments] == [
      (0, [10, 11]), (-1, [20, 21]), (1, [12, 13])]
  np.testing.assert_array_equal(view[0].prompt, [5, 6])
  np.testing.assert_array_equal(view[1].prompt, [7])
  assert view[0].reward == 1.0
  np.testing.assert_allclose(view[1].advantage, -0.5 / (math.sqrt(0.5) + 1e-6), rtol=1e-6)


def test_credit_view_shows_the_algorithms_own_settings():
  """The page is drawn with the algorithm object, so a delta of 1.0 changes the weights."""
  rollout = _rollout([([5], [(0, [10, 11])]), ([7], [(0, [14])])], prompt_width=1, width=4)
  teacher = np.zeros((2, 4), np.float32)
  teacher[0, 1:3] = 0.3
  logp = jnp.stack([jnp.zeros((2, 4)), jnp.asarray(teacher)])
  view = report.credit_view(rollout, logp, algorithms.get("pbsd", group_size=2, delta=1.0),
                            max_turns=1)
  np.testing.assert_allclose(view[0].weights, [1 + 0.1 * math.tanh(0.3)], atol=1e-6)


def test_credit_view_needs_an_algorithm_with_evidence():
  rollout = _rollout([([5], [(0, [10])]), ([7], [(0, [14])])], prompt_width=1, width=3)
  with pytest.raises(ValueError, match="grpo computes no teacher-student evidence"):
    report.credit_view(rollout, jnp.zeros((2, 2, 3)), algorithms.get("grpo", group_size=2),
                       max_turns=1)


def test_credit_view_rejects_turns_beyond_max_turns():
  rollout = _rollout([([5], [(0, [10]), (-1, [20]), (1, [12])])], prompt_width=1, width=4)
  with pytest.raises(ValueError, match="turn ids up to 1, beyond max_turns=1"):
    report.credit_view(rollout, jnp.zeros((2, 1, 4)), algorithms.get("pbsd", group_size=1,
                                                                     normalize_std=False),
                       max_turns=1)


def test_credit_html_shows_each_turn_weight_and_escapes_document_text(kg, tmp_path):
  encode = kg.encode
  document = "<information> Doc (Foo): a <answer> Zed </answer> inside a page </information>"
  row = (encode("Question: who is Foo?"),
         [(0, encode("<search> Foo </search>")), (-1, encode(document)),
          (1, encode("<answer> Bar </answer>"))])
  rollout = _rollout([row, row], prompt_width=16, width=60)  # rewards 1, 0: A_0 > 0
  logp = np.zeros((2, 2, 60), np.float32)
  logp[1, :, np.asarray(rollout.turn_ids[0]) == 0] = 0.05
  logp[1, :, np.asarray(rollout.turn_ids[0]) == 1] = -0.2
  view = report.credit_view(rollout, jnp.asarray(logp), algorithms.get("pbsd", group_size=2),
                            max_turns=4)
  path = report.credit_html(view, kg.decode, str(tmp_path / "report" / "credit.html"))
  page = open(path, encoding="utf-8").read()
  for k in range(2):
    assert f"w={view[0].weights[k]:.4f}" in page
  assert f"w={1 + 0.1 * math.tanh(0.5):.4f}" in page and f"w={1 - 0.1 * math.tanh(2):.4f}" in page
  # Tags decoded from the document and the actions are shown as text, never as markup.
  assert "<answer>" not in page and "<information>" not in page and "<search>" not in page
  assert "&lt;answer&gt;" in page and "&lt;information&gt;" in page
  # The observation is grey context, not a coloured turn.
  grey = page.split("class='context'>")[2].split("</span>")[0]
  assert "&lt;information&gt;" in grey and "Zed" in grey


def test_credit_page_labels_turns_and_shows_each_questions_teacher_prompt_once(kg, tmp_path):
  from pbsd_jax.agent import gold_chain
  encode = kg.encode
  row = (encode("Question: who is Foo?"),
         [(0, encode("<search> Foo </search>")), (-1, encode("<information> x </information>")),
          (1, encode("<search> Foo </search>")), (-1, encode("<information> x </information>")),
          (2, encode("<answer> Bar </answer>"))])
  rollout = _rollout([row, row], prompt_width=24, width=90)
  rollout = rollout.replace(turn_label=jnp.asarray([[gold_chain.USEFUL, gold_chain.REPEAT, gold_chain.UNLABELLED]] * 2))
  teacher = np.zeros((2, 24), np.int32)
  privileged = encode("Answer: Bar. Question: who is Foo?")
  teacher[:, 24 - len(privileged):] = privileged
  view = report.credit_view(rollout, jnp.zeros((2, 2, 90)), algorithms.get("pbsd", group_size=2),
                            max_turns=3, teacher_prompt=jnp.asarray(teacher),
                            teacher_prompt_mask=jnp.asarray(teacher != 0))
  assert view[0].labels == ("useful", "repeat", "")
  page = open(report.credit_html(view, kg.decode, str(tmp_path / "credit.html")),
              encoding="utf-8").read()
  assert page.count("Teacher prompt (privileged)") == 1
  assert page.count(html.escape(kg.decode(privileged))) == 1
  assert page.count(", useful</span>") == 2 and page.count(", repeat</span>") == 2
  assert ", </span>" not in page  # the answer turn has no label


def test_mixed_group_rows_prefers_groups_whose_outcomes_differ():
  rollout = _rollout([([5], [(0, [10])])] * 6, prompt_width=1, width=3)
  rollout = rollout.replace(group_ids=jnp.asarray([0, 0, 1, 1, 2, 2]),
                            reward=jnp.asarray([1.0, 1.0, 0.0, 1.0, 1.0, 0.0]))
  assert report.mixed_group_rows(rollout, 2) == [2, 3, 4, 5]
  assert report.mixed_group_rows(rollout, 3) == [2, 3, 4, 5, 0, 1]
