"""Parsing one turn's action text into a search, an answer or an invalid action.

A turn ends when the policy writes `</search>`, `</answer>`, EOS or runs out of its per-turn
budget, so the decisive tag is the one the turn ends with:

- text ending (trailing whitespace aside) with `</search>`: a search whose query is the text
  between the last `<search>` before it and the closing tag, stripped. Invalid when there is no
  such `<search>`, when the query is empty, longer than `max_query_chars`, or contains a
  protocol tag (e.g. `<search>a</answer>b</search>`).
- text ending with `</answer>`: an answer whose content is the text between the last `<answer>`
  before it and the closing tag, stripped; invalid without such an `<answer>`. An empty answer
  is still an answer: it ends the episode and the reward judges it.
- anything else (no closing tag, text after the closing tag, EOS or budget cut): invalid.

Earlier tags in the turn (`<think>`, an abandoned `<search>`) do not matter. `parse_action`
never raises on a string. In-graph rollouts apply the same rules to token ids (the tags are
single tokens there; the query budget is then in tokens).
"""

from __future__ import annotations

import dataclasses

from pbsd_jax import protocol

# Queries beyond this are a degenerate generation, not a search.
DEFAULT_MAX_QUERY_CHARS = 512

SEARCH, ANSWER, INVALID = "search", "answer", "invalid"


@dataclasses.dataclass(frozen=True)
class Action:
  """A parsed action.

  Attributes:
    kind: "search", "answer" or "invalid".
    content: the query (search), the answer text (answer) or "" (invalid).
    error: why an invalid action is invalid ("" otherwise), for logs and metrics.
  """
  kind: str
  content: str = ""
  error: str = ""


def _contains_tag(text: str) -> bool:
  return any(tag in text for tag in protocol.TAGS)


def _span_before_close(text: str, open_tag: str, close_tag: str) -> str | None:
  """The text between the last `open_tag` and the closing tag `text` ends with, or None."""
  end = len(text) - len(close_tag)
  start = text.rfind(open_tag, 0, end)
  if start < 0:
    return None
  return text[start + len(open_tag):end]


def parse_action(text: str, max_query_chars: int = DEFAULT_MAX_QUERY_CHARS) -> Action:
  """Parses one turn's action text (rules in the module docstring).

  Args:
    text: the decoded action tokens of one turn (observations excluded).
    max_query_chars: the longest valid query, in characters after stripping.

  Returns:
    The `Action`; never raises for a `str` input.
  """
  if not isinstance(text, str):
    raise TypeError(f"parse_action expects a str, got {type(text).__name__}")
  body = text.rstrip()
  if body.endswith(protocol.SEARCH_CLOSE):
    query = _span_before_close(body, protocol.SEARCH_OPEN, protocol.SEARCH_CLOSE)
    if query is None:
      return Action(INVALID, error=f"{protocol.SEARCH_CLOSE} without {protocol.SEARCH_OPEN}")
    query = query.strip()
    if not query:
      return Action(INVALID, error="empty query")
    if len(query) > max_query_chars:
      return Action(INVALID, error=f"query longer than {max_query_chars} characters")
    if _contains_tag(query):
      return Action(INVALID, error="protocol tag inside the query")
    return Action(SEARCH, query)
  if body.endswith(protocol.ANSWER_CLOSE):
    answer = _span_before_close(body, protocol.ANSWER_OPEN, protocol.ANSWER_CLOSE)
    if answer is None:
      return Action(INVALID, error=f"{protocol.ANSWER_CLOSE} without {protocol.ANSWER_OPEN}")
    return Action(ANSWER, answer.strip())
  return Action(INVALID, error="the turn does not end with a closing search or answer tag")
