"""The Search-R1 retrieval server and the HttpRetriever client, over real loopback sockets."""

import json
import socket
import urllib.error
import urllib.request

import pytest

from pbsd_jax.agent.env.host_bm25 import HostBM25Retriever
from pbsd_jax.agent.env.http import HttpRetriever, RetrievalServer
from pbsd_jax.agent.env.observations import retrieval_failure_observation
from pbsd_jax.agent.env.retriever import RetrievalError

CONTENTS = ["Velora Quint\nVelora Quint was born in Marrow City.",
            "Valora Quint\nValora Quint works for Ostrel Works.",
            "Marrow City\nMarrow City is the capital of Pell.",
            "Ostrel Works\nOstrel Works is headquartered in Marrow City."]


@pytest.fixture(scope="module")
def backend():
  return HostBM25Retriever.from_texts(CONTENTS, ids=["v", "w", "m", "o"])


@pytest.fixture
def server(backend):
  with RetrievalServer(backend, port=0, default_topk=2) as running:
    yield running


def post(url, body):
  """POSTs raw bytes; returns (status, decoded JSON body)."""
  request = urllib.request.Request(url, data=body, method="POST",
                                   headers={"Content-Type": "application/json"})
  try:
    with urllib.request.urlopen(request, timeout=5) as response:
      return response.status, json.loads(response.read())
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())


class FailingBackend:
  """A retriever whose backend is broken: every call raises."""

  def retrieve(self, queries, k):
    raise OSError("index file missing")


def _counts(client):
  """The client's counters without the time spent (which varies run to run)."""
  return {k: v for k, v in client.metrics().items() if k != "latency_s"}


class RecordedSleeps(list):
  """A `sleep` that records the requested delays instead of waiting."""

  def __call__(self, seconds):
    self.append(seconds)


def test_http_results_equal_the_in_process_retriever(server, backend):
  client = HttpRetriever(server.url)
  queries = ["Valora Quint", "capital of Pell", ""]
  assert client.retrieve(queries, k=3) == backend.retrieve(queries, k=3)
  assert _counts(client) == {"calls": 1, "failed_calls": 0, "attempts": 1, "retries": 0}


def test_response_follows_the_search_r1_format(server, backend):
  status, body = post(server.url, json.dumps(
      {"queries": ["Marrow City"], "topk": 2, "return_scores": True}).encode())
  expected = backend.retrieve(["Marrow City"], 2)[0]
  assert status == 200
  assert body == {"result": [[{"document": {"id": d.id, "contents": d.contents},
                               "score": pytest.approx(d.score)} for d in expected]]}
  status, body = post(server.url, json.dumps({"queries": ["Marrow City"], "topk": 2}).encode())
  assert body == {"result": [[{"id": d.id, "contents": d.contents} for d in expected]]}


def test_missing_topk_uses_the_server_default(server):
  _, body = post(server.url, json.dumps({"queries": ["Pell", "Quint"]}).encode())
  assert [len(docs) for docs in body["result"]] == [2, 2]


@pytest.mark.parametrize("body, field", [
    (b"{not json", "not valid JSON"),
    (b'["Pell"]', "JSON object"),
    (b'{"topk": 2}', "'queries'"),
    (b'{"queries": ["a", 3]}', "'queries'"),
    (b'{"queries": ["a"], "topk": 0}', "'topk'"),
    (b'{"queries": ["a"], "topk": "3"}', "'topk'"),
    (b'{"queries": ["a"], "return_scores": "yes"}', "'return_scores'"),
])
def test_malformed_request_gets_400_naming_the_problem(server, body, field):
  status, reply = post(server.url, body)
  assert status == 400
  assert field in reply["error"]


def test_unknown_path_gets_404_and_is_not_retried(server):
  sleeps = RecordedSleeps()
  client = HttpRetriever(server.url.replace("/retrieve", "/search"), max_retries=3, sleep=sleeps)
  with pytest.raises(RetrievalError, match="HTTP 404"):
    client.retrieve(["Pell"], 1)
  assert client.metrics()["attempts"] == 1 and sleeps == []


def test_backend_failure_gets_500_and_is_retried_then_reported():
  sleeps = RecordedSleeps()
  with RetrievalServer(FailingBackend()) as failing:
    client = HttpRetriever(failing.url, max_retries=2, backoff_s=0.5, sleep=sleeps)
    with pytest.raises(RetrievalError, match=r"unavailable \(HTTP 500; 3 attempts\)"):
      client.retrieve(["Pell"], 1)
  assert _counts(client) == {"calls": 1, "failed_calls": 1, "attempts": 3, "retries": 2}
  assert sleeps == [0.5, 1.0]


def test_stopped_service_fails_after_the_configured_retries_then_recovers(backend):
  server = RetrievalServer(backend, port=0).start()
  port = server.port
  sleeps = RecordedSleeps()
  client = HttpRetriever(server.url, timeout_s=2.0, max_retries=3, backoff_s=0.1, sleep=sleeps)
  assert client.retrieve(["Pell"], 1)[0][0].id == "m"
  server.stop()

  with pytest.raises(RetrievalError) as failure:
    client.retrieve(["Pell"], 1)
  assert failure.value.reason.startswith("retrieval service unavailable")
  assert _counts(client) == {"calls": 2, "failed_calls": 1, "attempts": 5, "retries": 3}
  assert sleeps == [0.1, 0.2, 0.4]
  assert retrieval_failure_observation(failure.value).startswith(
      "<information>Search failed: retrieval service unavailable (")

  with RetrievalServer(backend, port=port):
    assert client.retrieve(["Pell"], 1)[0][0].id == "m"
  assert client.metrics()["failed_calls"] == 1


def test_unresponsive_service_times_out_and_is_retried():
  # A socket that accepts connections but never answers.
  listener = socket.socket()
  listener.bind(("127.0.0.1", 0))
  listener.listen(4)
  try:
    client = HttpRetriever(f"http://127.0.0.1:{listener.getsockname()[1]}/retrieve",
                           timeout_s=0.2, max_retries=1, backoff_s=0.0)
    with pytest.raises(RetrievalError, match="timed out"):
      client.retrieve(["Pell"], 1)
    assert client.metrics()["attempts"] == 2
    # Two timed-out attempts: the call's time holds both waits.
    assert 0.4 <= client.metrics()["latency_s"] < 2.0
  finally:
    listener.close()


def test_no_queries_make_no_request():
  client = HttpRetriever("http://127.0.0.1:9/retrieve", max_retries=0)
  assert client.retrieve([], 3) == []
  assert client.metrics()["attempts"] == 0


@pytest.mark.parametrize("settings, message", [
    (dict(url=""), "HttpRetriever.url must be a non-empty URL, got ''"),
    (dict(timeout_s=0.0), "HttpRetriever.timeout_s must be > 0, got 0.0"),
    (dict(max_retries=-1), "HttpRetriever.max_retries must be >= 0, got -1"),
    (dict(backoff_s=-0.5), "HttpRetriever.backoff_s must be >= 0, got -0.5"),
])
def test_client_settings_that_cannot_run_name_their_field(settings, message):
  with pytest.raises(ValueError, match=f"^{message}$"):
    HttpRetriever(**{"url": "http://127.0.0.1:9/retrieve", **settings})
