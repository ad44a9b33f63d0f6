"""Observation texts the environment writes: retrieved documents, notices, failures.

Retrieved text is data, not instructions. `escape_document` replaces the `<` that starts any
protocol tag (case-insensitively, e.g. `<answer>`, `</Search>`) by `&lt;`, so a document can
never open or close a protocol block; everything else is kept verbatim. Every text this module
returns is tag-free except for the `<information>` ... `</information>` wrapper it adds itself.

Document rendering (`format_document`) is per document and independent of the document's rank,
so the in-graph rollout can show the same tokens: build the `BM25Index` from
`encode(format_document(doc))` per document and concatenate the top-k rows between the
`<information>` and `</information>` tokens. `numbered=True` gives Search-R1's exact rendering
(`Doc 1(Title: <first line>) <rest>`), for models trained with Search-R1.
"""

from __future__ import annotations

import re
from typing import Sequence

from pbsd_jax import protocol
from pbsd_jax.agent.env.retriever import Document, RetrievalError

_TAG_START = re.compile(
    "<(?=" + "|".join(re.escape(tag[1:]) for tag in protocol.TAGS) + ")", re.IGNORECASE)

ESCAPED_LT = "&lt;"

# Tag-free on purpose: an observation never contains a protocol tag.
INVALID_ACTION_NOTICE = "\nInvalid action: search for a query or give the answer.\n"

NO_DOCUMENTS = "No documents found.\n"


def escape_document(text: str) -> str:
  """Neutralises protocol tags in retrieved text: the `<` of each becomes `&lt;`.

  The output contains no protocol tag in any letter case: a tag needs an unescaped `<` directly
  followed by its name, and every such `<` is replaced (tags cannot overlap: each has one `<`).
  Idempotent.
  """
  return _TAG_START.sub(ESCAPED_LT, text)


def format_document(doc: Document, rank: int | None = None) -> str:
  """One document as shown in an observation, escaped, ending with a newline.

  Args:
    doc: the document; its `contents` conventionally start with the title line.
    rank: None for the compact form `"<contents>\\n"`; a 1-based rank for Search-R1's form
      `"Doc <rank>(Title: <first line>) <other lines>\\n"`.
  """
  contents = escape_document(doc.contents.strip())
  if rank is None:
    return contents + "\n"
  title, _, text = contents.partition("\n")
  return f"Doc {rank}(Title: {title}) {text}\n"


def format_observation(docs: Sequence[Document], max_chars: int | None = None,
                       numbered: bool = False) -> str:
  """The observation for a search: `<information>` + the documents + `</information>`.

  Args:
    docs: the retrieved documents, best first.
    max_chars: truncate the documents' text (not the wrapper) to this many characters.
    numbered: Search-R1's numbered rendering instead of the compact one.
  """
  body = "".join(format_document(d, i + 1 if numbered else None) for i, d in enumerate(docs))
  body = body or NO_DOCUMENTS
  if max_chars is not None:
    body = body[:max_chars]
  return protocol.INFO_OPEN + body + protocol.INFO_CLOSE


def retrieval_failure_observation(error: RetrievalError | str) -> str:
  """The observation for a search whose retrieval failed, e.g. the service is down."""
  reason = error.reason if isinstance(error, RetrievalError) else str(error)
  return protocol.INFO_OPEN + escape_document(f"Search failed: {reason}.\n") + protocol.INFO_CLOSE
