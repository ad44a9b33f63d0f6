"""Rewards: SQuAD normalisation, EM / F1, answer extraction from actions, token-level reward."""

import functools

import hypothesis
import jax
import numpy as np
import pytest
from hypothesis import strategies as st

from pbsd_jax.agent.env.rewards import (exact_match, extract_answer, f1_score, normalize_answer,
                                        token_answer_reward, trajectory_reward)

# A word-level toy vocabulary: every piece is one token, 0 is padding.
VOCAB = ["<pad>", "<answer>", "</answer>", "<search>", "</search>", "<information>",
         "</information>", "_", "x", "y", "z", "Pell", "Marrow", "City"]
ID = {piece: i for i, piece in enumerate(VOCAB)}
OPEN, CLOSE, SPACE = ID["<answer>"], ID["</answer>"], ID["_"]
T = 16


def encode(pieces):
  return [ID[p] for p in pieces.split()]


def row(*segments):
  """Tokens and action mask from `(pieces, is_action)` segments, right-padded to T."""
  tokens, mask = [], []
  for pieces, is_action in segments:
    ids = encode(pieces)
    tokens += ids
    mask += [is_action] * len(ids)
  return tokens + [0] * (T - len(tokens)), mask + [False] * (T - len(mask))


def gold(*variants, length=4):
  return [encode(v) + [-1] * (length - len(encode(v))) for v in variants]


@functools.partial(jax.jit, static_argnames="ignore_ids")
def reward(tokens, mask, golds, ignore_ids=(SPACE,)):
  return token_answer_reward(tokens, mask, OPEN, CLOSE, golds, ignore_ids)


def reward_of(segments, golds):
  tokens, mask = row(*segments)
  return float(reward(np.array([tokens]), np.array([mask]), np.array([golds]))[0])


@pytest.mark.parametrize("text, expected", [
    ("The Marrow City!", "marrow city"),
    ("  an   Apple,  a pear ", "apple pear"),
    ("Théo's \"place\"", "théos place"),
    ("anthem", "anthem"),
])
def test_squad_normalisation(text, expected):
  assert normalize_answer(text) == expected


def test_exact_match_takes_any_gold_after_normalisation():
  assert exact_match("the marrow city.", ["Pell", "Marrow City"]) == 1.0
  assert exact_match("Marrow", ["Marrow City"]) == 0.0
  assert exact_match("Pell", "pell") == 1.0


def test_f1_is_squad_token_f1_maximised_over_golds():
  # "marrow city pell" vs "marrow city": precision 2/3, recall 1, F1 = 0.8.
  assert f1_score("Marrow City Pell", ["x y", "the Marrow City"]) == pytest.approx(0.8)
  assert f1_score("x", ["y"]) == 0.0


@pytest.mark.parametrize("actions, expected", [
    (["<search>q</search>", "<answer> Pell </answer>"], "Pell"),
    (["<answer>A</answer> then <answer>B</answer>"], "B"),
    (["<answer>A</answer>", "no answer here"], "A"),
    (["<answer>A</answer>", "stray </answer>"], "A"),
    (["<answer>outer <answer>inner</answer>"], "inner"),
    (["<answer>unclosed"], None),
    (["<answer>split", "across turns</answer>"], None),
    ([], None),
])
def test_extract_answer_takes_last_complete_span_in_actions(actions, expected):
  assert extract_answer(actions) == expected


def test_answer_inside_a_document_does_not_change_the_text_reward():
  actions = ["<search>Marrow City</search>", "<answer>Pell</answer>"]
  observation = "<information>Marrow City: <answer>Gorm</answer></information>"
  assert trajectory_reward(actions, ["Gorm"]) == 0.0
  assert trajectory_reward(actions, ["Pell"]) == 1.0
  # Even if a caller wrongly passed the observation along, an action's answer comes later.
  assert trajectory_reward([actions[0], observation, actions[1]], ["Pell"]) == 1.0


def test_no_answer_gives_zero_reward():
  assert trajectory_reward(["<search>q</search>"], ["q"]) == 0.0


def test_token_reward_matches_answer_tokens_against_any_gold_variant():
  segments = [("<search> Pell </search>", True), ("<information> x </information>", False),
              ("<answer> Marrow City </answer>", True)]
  assert reward_of(segments, gold("Marrow City", "Pell")) == 1.0
  assert reward_of(segments, gold("Pell", "Marrow")) == 0.0


def test_token_reward_ignores_answers_in_observations():
  segments = [("<search> Pell </search>", True),
              ("<information> <answer> Pell </answer> </information>", False),
              ("x", True)]
  assert reward_of(segments, gold("Pell")) == 0.0


def test_token_reward_last_answer_wins():
  segments = [("<answer> Pell </answer> <answer> x </answer>", True)]
  assert reward_of(segments, gold("x")) == 1.0
  assert reward_of(segments, gold("Pell")) == 0.0


def test_token_reward_drops_whitespace_only_tokens_on_both_sides():
  segments = [("<answer> _ Marrow _ _ City _ </answer>", True)]
  assert reward_of(segments, gold("Marrow City", length=6)) == 1.0
  assert reward_of([("<answer> Marrow City </answer>", True)], gold("_ Marrow _ City")) == 1.0


def test_token_reward_unclosed_or_split_answer_is_zero():
  assert reward_of([("<answer> Pell", True)], gold("Pell")) == 0.0
  split = [("<answer> Pell", True), ("<information> x </information>", False),
           ("</answer>", True)]
  assert reward_of(split, gold("Pell")) == 0.0


def test_token_reward_empty_answer_or_empty_gold_never_matches():
  assert reward_of([("<answer> _ </answer>", True)], gold("_", "")) == 0.0


def test_token_reward_answer_longer_than_gold_width_does_not_match():
  segments = [("<answer> x y z Pell City </answer>", True)]
  assert reward_of(segments, gold("x y z Pell")) == 0.0


# Agreement of the text and token rules: random trajectories over the toy vocabulary where
# normalisation is the identity (no articles, case or punctuation), so EM on text equals token
# equality. Observations may contain answer tags too.
WORDS = ["<answer>", "</answer>", "x", "y", "Pell", "<search>", "<answer> x </answer>",
         "<answer> Pell </answer>", "<answer> x y </answer>"]
SEGMENT = st.tuples(st.lists(st.sampled_from(WORDS), min_size=1, max_size=4), st.booleans())


@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(st.lists(SEGMENT, max_size=4), st.sampled_from(["x", "y", "Pell", "x y"]))
def test_token_reward_agrees_with_text_reward(segments, answer):
  segments = [(" ".join(words), is_action) for words, is_action in segments]
  tokens, mask = row(*segments)
  hypothesis.assume(len(tokens) == T)
  # Text segments: maximal runs of action tokens (adjacent action segments merge).
  actions, current = [], []
  for token, is_action in zip(tokens, mask):
    if is_action:
      current.append(VOCAB[token])
    elif current:
      actions.append(" ".join(current))
      current = []
  if current:
    actions.append(" ".join(current))
  expected = trajectory_reward(actions, [answer])
  got = reward(np.array([tokens]), np.array([mask]), np.array([gold(answer)]))
  assert float(got[0]) == expected
