"""The text protocol: action parsing, document escaping, observation texts (with fuzzing)."""

import hypothesis
import pytest
from hypothesis import strategies as st

from pbsd_jax import protocol
from pbsd_jax.agent.env.actions import Action, parse_action
from pbsd_jax.agent.env.observations import (INVALID_ACTION_NOTICE, escape_document,
                                             format_document, format_observation,
                                             retrieval_failure_observation)
from pbsd_jax.agent.env.retriever import Document, RetrievalError

# Strings built from protocol tags, their case variants and near-misses, and free text, so the
# fuzzer produces unclosed, nested, repeated and split tags far more often than random text.
PIECES = st.sampled_from(list(protocol.TAGS) + [
    "<SEARCH>", "</Answer>", "<", ">", "/", "search>", "<search", "answer", " ", "\n", "x",
    "Marrow City", "&lt;", "<<", "</", "<information", "think>"])
PROTOCOL_TEXT = st.lists(st.one_of(PIECES, st.text(max_size=5)), max_size=25).map("".join)


def tag_count(text):
  """Occurrences of protocol tags in `text`, in any letter case."""
  lowered = text.lower()
  return {tag: lowered.count(tag) for tag in protocol.TAGS}


@pytest.mark.parametrize("text, expected", [
    ("<think>need X</think><search>Velora Quint</search>", Action("search", "Velora Quint")),
    ("<search>  padded query \n</search>\n ", Action("search", "padded query")),
    ("<search>old</search> more <search>new</search>", Action("search", "new")),
    ("<search>outer <search>inner</search>", Action("search", "inner")),
    ("<think>done</think><answer> Marrow City </answer>", Action("answer", "Marrow City")),
    ("<search>q</search><answer>A</answer>", Action("answer", "A")),
    ("<answer></answer>", Action("answer", "")),
])
def test_turn_action_is_decided_by_its_final_closing_tag(text, expected):
  assert parse_action(text) == expected


@pytest.mark.parametrize("text, error", [
    ("<think>no action</think>", "does not end with"),
    ("<search>unclosed query", "does not end with"),
    ("<search>q</search> trailing words", "does not end with"),
    ("just text</search>", "without <search>"),
    ("<search>   </search>", "empty query"),
    ("<search>a</answer>b</search>", "protocol tag inside"),
    ("</answer>", "without <answer>"),
    ("", "does not end with"),
])
def test_malformed_turns_are_invalid_with_a_reason(text, error):
  action = parse_action(text)
  assert action.kind == "invalid" and action.content == ""
  assert error in action.error


def test_query_longer_than_limit_is_invalid():
  assert parse_action("<search>" + "q" * 20 + "</search>", max_query_chars=20).kind == "search"
  action = parse_action("<search>" + "q" * 21 + "</search>", max_query_chars=20)
  assert action.kind == "invalid" and "longer than 20" in action.error


@hypothesis.settings(max_examples=400, deadline=None)
@hypothesis.given(PROTOCOL_TEXT, st.integers(1, 30))
def test_parse_action_never_raises_and_returns_a_consistent_action(text, max_chars):
  action = parse_action(text, max_query_chars=max_chars)
  assert action.kind in ("search", "answer", "invalid")
  if action.kind == "search":
    assert text.rstrip().endswith(protocol.SEARCH_CLOSE)
    assert action.content and len(action.content) <= max_chars
    assert not any(tag in action.content for tag in protocol.TAGS)
  elif action.kind == "answer":
    assert text.rstrip().endswith(protocol.ANSWER_CLOSE)
  else:
    assert action.content == "" and action.error


def test_escape_document_neutralises_every_tag_and_keeps_other_text():
  text = "See <answer>Pell</answer> and <SEARCH>x</Search>; 3 < 4 > 2 <b>bold</b>"
  assert escape_document(text) == (
      "See &lt;answer>Pell&lt;/answer> and &lt;SEARCH>x&lt;/Search>; 3 < 4 > 2 <b>bold</b>")


@hypothesis.settings(max_examples=400, deadline=None)
@hypothesis.given(PROTOCOL_TEXT)
def test_escaped_text_never_contains_a_protocol_tag(text):
  escaped = escape_document(text)
  assert not any(tag_count(escaped).values())
  assert escape_document(escaped) == escaped


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(st.lists(PROTOCOL_TEXT, max_size=4), st.none() | st.integers(0, 40),
                  st.booleans())
def test_observation_has_only_its_own_information_wrapper(contents, max_chars, numbered):
  docs = [Document(str(i), c, 1.0) for i, c in enumerate(contents)]
  observation = format_observation(docs, max_chars=max_chars, numbered=numbered)
  assert observation.startswith(protocol.INFO_OPEN)
  assert observation.endswith(protocol.INFO_CLOSE)
  counts = tag_count(observation)
  assert counts.pop(protocol.INFO_OPEN) == 1 and counts.pop(protocol.INFO_CLOSE) == 1
  assert not any(counts.values())


def test_compact_observation_concatenates_per_document_renderings():
  docs = [Document("1", "Velora Quint\nBorn in Marrow City.", 2.0),
          Document("2", " Marrow City\nA city in <answer>Pell</answer>. ", 1.0)]
  assert format_observation(docs) == (
      "<information>Velora Quint\nBorn in Marrow City.\n"
      "Marrow City\nA city in &lt;answer>Pell&lt;/answer>.\n</information>")
  assert format_observation(docs) == (
      protocol.INFO_OPEN + format_document(docs[0]) + format_document(docs[1])
      + protocol.INFO_CLOSE)


def test_numbered_observation_follows_search_r1_rendering():
  docs = [Document("1", "Velora Quint\nBorn in Marrow City.\nA painter.", 2.0),
          Document("2", "Marrow City", 1.0)]
  assert format_observation(docs, numbered=True) == (
      "<information>Doc 1(Title: Velora Quint) Born in Marrow City.\nA painter.\n"
      "Doc 2(Title: Marrow City) \n</information>")


def test_observation_truncates_documents_but_keeps_the_closing_tag():
  docs = [Document("1", "abcdefghij", 1.0)]
  assert format_observation(docs, max_chars=4) == "<information>abcd</information>"


def test_empty_retrieval_says_so():
  assert format_observation([]) == "<information>No documents found.\n</information>"


def test_notices_contain_no_protocol_tag():
  failure = retrieval_failure_observation(
      RetrievalError("retrieval service unavailable (<search> refused)"))
  assert failure == ("<information>Search failed: retrieval service unavailable "
                     "(&lt;search> refused).\n</information>")
  assert not any(tag_count(INVALID_ACTION_NOTICE).values())
