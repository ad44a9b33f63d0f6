"""The Search-R1 retrieval-server protocol: a server for any `Retriever`, and a client.

Protocol (Search-R1's `search_r1/search/retrieval_server.py`):

    POST /retrieve  {"queries": [str, ...], "topk": int (optional), "return_scores": bool}
    200 -> {"result": [[{"document": {"id": str, "contents": str}, "score": float}, ...], ...]}
           (without "return_scores": true, each inner list holds just the document objects)

Our server also answers `GET /health` with `{"status": "ok"}` and rejects a malformed request
with 400 and `{"error": "<what is wrong>"}` (404 for other paths, 500 if the retriever fails).

`HttpRetriever` is a `Retriever` client with a per-request timeout and bounded retries with
exponential backoff on connection errors, timeouts and 5xx answers. When the service stays down
it raises `RetrievalError` (never anything else), which the environment turns into an
observation, and counts the failed call in `metrics()` (with the calls, attempts, retries and
the time spent in calls, so a training loop can log what one step cost).
"""

from __future__ import annotations

import http.client
import http.server
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Callable, Sequence

from pbsd_jax.agent.env.retriever import Document, RetrievalError, Retriever, check_k

DEFAULT_TOPK = 3


class BadRequest(ValueError):
  """A request body that does not follow the protocol (answered with 400)."""


def parse_request(body: bytes, default_topk: int) -> tuple[list[str], int, bool]:
  """Validates a `/retrieve` request body.

  Returns:
    `(queries, topk, return_scores)`; a missing or null `topk` means `default_topk`.

  Raises:
    BadRequest: naming the offending field.
  """
  try:
    request = json.loads(body)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise BadRequest(f"the body is not valid JSON ({e})") from None
  if not isinstance(request, dict):
    raise BadRequest("the body must be a JSON object")
  queries = request.get("queries")
  if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
    raise BadRequest("field 'queries' must be a list of strings")
  topk = request.get("topk")
  topk = default_topk if topk is None else topk
  if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
    raise BadRequest(f"field 'topk' must be a positive integer, got {topk!r}")
  return_scores = request.get("return_scores", False)
  if not isinstance(return_scores, bool):
    raise BadRequest(f"field 'return_scores' must be a boolean, got {return_scores!r}")
  return queries, topk, return_scores


def format_response(results: list[list[Document]], return_scores: bool) -> dict[str, Any]:
  """The `/retrieve` response body for `results` (one list of documents per query)."""
  def document(doc: Document) -> dict[str, str]:
    return {"id": doc.id, "contents": doc.contents}

  if return_scores:
    return {"result": [[{"document": document(d), "score": d.score} for d in docs]
                       for docs in results]}
  return {"result": [[document(d) for d in docs] for docs in results]}


def _handler(retriever: Retriever, default_topk: int) -> type[http.server.BaseHTTPRequestHandler]:

  class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _reply(self, status: int, payload: dict[str, Any]) -> None:
      data = json.dumps(payload).encode("utf-8")
      self.send_response(status)
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(data)))
      self.end_headers()
      self.wfile.write(data)

    def do_GET(self):  # pylint: disable=invalid-name
      if self.path == "/health":
        self._reply(200, {"status": "ok"})
      else:
        self._reply(404, {"error": f"unknown path {self.path}"})

    def do_POST(self):  # pylint: disable=invalid-name
      length = int(self.headers.get("Content-Length") or 0)
      body = self.rfile.read(length)
      if self.path != "/retrieve":
        self._reply(404, {"error": f"unknown path {self.path}"})
        return
      try:
        queries, topk, return_scores = parse_request(body, default_topk)
      except BadRequest as e:
        self._reply(400, {"error": str(e)})
        return
      try:
        results = retriever.retrieve(queries, topk)
      except Exception as e:  # pylint: disable=broad-except
        # Any backend failure is the server's problem: 500, and the client may retry.
        self._reply(500, {"error": f"retrieval failed: {type(e).__name__}: {e}"})
        return
      self._reply(200, format_response(results, return_scores))

    def log_message(self, format, *args):  # pylint: disable=redefined-builtin
      del format, args  # Quiet: one line per request would flood training logs.

  return Handler


class RetrievalServer:
  """Serves a `Retriever` over the Search-R1 protocol from a background thread."""

  def __init__(self, retriever: Retriever, host: str = "127.0.0.1", port: int = 0,
               default_topk: int = DEFAULT_TOPK):
    """Configures the server; `port=0` picks a free port when `start` binds it."""
    self.retriever = retriever
    self.host = host
    self.requested_port = port
    self.default_topk = check_k(default_topk)
    self._server: http.server.ThreadingHTTPServer | None = None
    self._thread: threading.Thread | None = None

  @property
  def port(self) -> int:
    """The bound port (only while started)."""
    if self._server is None:
      raise RuntimeError("the server is not running")
    return self._server.server_address[1]

  @property
  def url(self) -> str:
    """The `/retrieve` endpoint URL (only while started)."""
    return f"http://{self.host}:{self.port}/retrieve"

  def start(self) -> "RetrievalServer":
    """Binds the port and starts serving in a daemon thread; returns self."""
    if self._server is not None:
      raise RuntimeError("the server is already running")
    server = http.server.ThreadingHTTPServer(
        (self.host, self.requested_port), _handler(self.retriever, self.default_topk))
    server.daemon_threads = True
    self._server = server
    # A short poll interval makes `stop` prompt (shutdown waits for the next poll).
    self._thread = threading.Thread(target=server.serve_forever, args=(0.05,),
                                    name="retrieval-server", daemon=True)
    self._thread.start()
    return self

  def serve_forever(self) -> None:
    """Serves (starting first if needed) until interrupted, then stops; for scripts."""
    if self._server is None:
      self.start()
    try:
      # A timed join keeps the main thread responsive to KeyboardInterrupt.
      while self._thread.is_alive():
        self._thread.join(timeout=1.0)
    finally:
      self.stop()

  def stop(self) -> None:
    """Stops serving and releases the port (no-op when not running)."""
    if self._server is None:
      return
    self._server.shutdown()
    self._server.server_close()
    self._thread.join()
    self._server, self._thread = None, None

  def __enter__(self) -> "RetrievalServer":
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()


class _Retryable(Exception):
  """An attempt failed in a way a later attempt may not (down, timeout, 5xx)."""


def _parse_documents(payload: Any, num_queries: int) -> list[list[Document]]:
  """Documents from a `return_scores=true` response body; RetrievalError if malformed."""
  result = payload.get("result") if isinstance(payload, dict) else None
  if not isinstance(result, list) or len(result) != num_queries:
    raise RetrievalError(f"malformed retrieval response: expected 'result' with "
                         f"{num_queries} lists")
  out = []
  for items in result:
    docs = []
    for item in items if isinstance(items, list) else [None]:
      doc = item.get("document") if isinstance(item, dict) else None
      if (not isinstance(doc, dict) or not isinstance(doc.get("contents"), str)
          or not isinstance(item.get("score"), (int, float))):
        raise RetrievalError("malformed retrieval response: expected items "
                             "{'document': {'id', 'contents'}, 'score'}")
      docs.append(Document(id=str(doc.get("id", "")), contents=doc["contents"],
                           score=float(item["score"])))
    out.append(docs)
  return out


class HttpRetriever:
  """`Retriever` client of a Search-R1 retrieval server, with timeouts and bounded retries.

  A call makes at most `1 + max_retries` attempts; before retry `i` (0-based) it sleeps
  `backoff_s * 2**i`. Retried: connection errors (a response cut short included), timeouts,
  5xx. Not retried (a retry cannot help): 4xx and malformed responses. A call that fails
  raises `RetrievalError` whose reason starts with "retrieval service unavailable" (retryable
  failures) or names the bad answer.
  """

  def __init__(self, url: str, timeout_s: float = 10.0, max_retries: int = 3,
               backoff_s: float = 0.5, sleep: Callable[[float], None] = time.sleep):
    """Configures the client.

    Args:
      url: the `/retrieve` endpoint, e.g. "http://127.0.0.1:8000/retrieve".
      timeout_s: per-attempt socket timeout.
      max_retries: retries after the first attempt.
      backoff_s: the first retry's delay (doubling after each).
      sleep: the delay function (tests pass one that records delays).
    """
    if not isinstance(url, str) or not url:
      raise ValueError(f"HttpRetriever.url must be a non-empty URL, got {url!r}")
    if timeout_s <= 0:
      raise ValueError(f"HttpRetriever.timeout_s must be > 0, got {timeout_s!r}")
    if max_retries < 0:
      raise ValueError(f"HttpRetriever.max_retries must be >= 0, got {max_retries!r}")
    if backoff_s < 0:
      raise ValueError(f"HttpRetriever.backoff_s must be >= 0, got {backoff_s!r}")
    self.url = url
    self.timeout_s = timeout_s
    self.max_retries = max_retries
    self.backoff_s = backoff_s
    self.sleep = sleep
    self._lock = threading.Lock()
    self._counts = {"calls": 0, "failed_calls": 0, "attempts": 0, "retries": 0,
                    "latency_s": 0.0}

  def metrics(self) -> dict[str, float]:
    """Counters since construction: calls, failed_calls, attempts, retries, and latency_s
    (seconds spent in `retrieve`, retries and back-off included)."""
    with self._lock:
      return dict(self._counts)

  def _count(self, name: str, amount: float = 1) -> None:
    with self._lock:
      self._counts[name] += amount

  def _attempt(self, data: bytes) -> Any:
    request = urllib.request.Request(self.url, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
    self._count("attempts")
    try:
      with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
        body = response.read()
    except urllib.error.HTTPError as e:
      detail = e.read().decode("utf-8", "replace")[:200]
      if e.code >= 500:
        raise _Retryable(f"HTTP {e.code}") from None
      raise RetrievalError(f"retrieval request rejected (HTTP {e.code}: {detail})") from None
    except urllib.error.URLError as e:
      raise _Retryable(str(e.reason)) from None
    except (socket.timeout, TimeoutError):
      raise _Retryable(f"timed out after {self.timeout_s}s") from None
    except (ConnectionError, OSError, http.client.HTTPException) as e:
      # HTTPException: e.g. IncompleteRead, the server closed the connection mid-response.
      raise _Retryable(f"{type(e).__name__}: {e}") from None
    try:
      return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
      raise RetrievalError("malformed retrieval response: not JSON") from None

  def retrieve(self, queries: Sequence[str], k: int) -> list[list[Document]]:
    """Top-k documents per query from the server; raises only `RetrievalError` on failure."""
    check_k(k)
    if not queries:
      return []
    self._count("calls")
    start = time.monotonic()
    try:
      return self._retrieve(queries, k)
    finally:
      self._count("latency_s", time.monotonic() - start)

  def _retrieve(self, queries: Sequence[str], k: int) -> list[list[Document]]:
    data = json.dumps({"queries": list(queries), "topk": k, "return_scores": True}).encode()
    attempts = 1 + self.max_retries
    for i in range(attempts):
      if i:
        self._count("retries")
        self.sleep(self.backoff_s * 2 ** (i - 1))
      try:
        return _parse_documents(self._attempt(data), len(queries))
      except RetrievalError:
        self._count("failed_calls")
        raise
      except _Retryable as e:
        last = str(e)
    self._count("failed_calls")
    raise RetrievalError(f"retrieval service unavailable ({last}; {attempts} attempts)")
