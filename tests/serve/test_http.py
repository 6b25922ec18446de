"""The HTTP layer in process, over a stand-in model (the model is not what is tested here): bad requests
get the right 4xx naming the field, a full queue 503, a late answer 504, a slow client stalls nobody, and
stop answers the request in flight while refusing new connections."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest

from elastic_qa.bench.serve import connect, request
from elastic_qa.serve.batcher import Batcher, Pair
from elastic_qa.serve.http import QAServer, ServeSettings
from elastic_qa.serve.schema import Limits

LIMITS = Limits(max_body_bytes=2000, max_questions=4, max_question_chars=50, max_context_chars=200)
LONG = timedelta(seconds=120)
ONE = {"question": "q", "context": "abc"}


class Model:
    """Answers with the first word of the context; holds each call while `go` is clear."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.go.set()
        self.entered = threading.Event()

    def __call__(self, pairs: list[Pair]) -> Sequence[dict[str, Any]]:
        self.entered.set()
        self.go.wait()
        return [{"answer": context.split()[0], "question": question} for question, context in pairs]


@contextmanager
def serving(
    model: Model,
    request_timeout: timedelta = LONG,
    socket_timeout: timedelta = LONG,
    queue_size: int = 8,
    max_connections: int = 16,
) -> Iterator[QAServer]:
    batcher = Batcher(model, max_batch=1, max_wait=timedelta(0), queue_size=queue_size)
    model_facts = {"source": "stand-in", "step": 0}
    settings = ServeSettings(LIMITS, request_timeout, socket_timeout, model_facts, max_connections, LONG)
    server = QAServer(("127.0.0.1", 0), batcher, settings)
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    try:
        yield server
    finally:
        model.go.set()
        if not server.stopping.is_set():
            server.stop()
        thread.join()


def ask(server: QAServer, method: str, path: str, body: Any = None) -> tuple[int, Any, dict[str, str]]:
    connection = connect(server.url, timeout=120)
    try:
        return request(connection, method, path, body)
    finally:
        connection.close()


def raw(server: QAServer, data: bytes) -> bytes:
    """Send bytes as they are; what the server answers until it closes the connection."""
    with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=120) as s:
        s.sendall(data)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
        return reply


QUESTIONS = [{"question": "q", "context": "c"}] * 3
BAD = [
    (b"not json", 400, "body: not JSON"),
    (b"[1, 2]", 400, "body: expected a JSON object, got a list"),
    ({"question": "q"}, 400, "context: missing"),
    ({"question": 1, "context": "c"}, 400, "question: expected a string, got a number"),
    ({"question": " ", "context": "c"}, 400, "question: empty"),
    ({"question": "q", "context": "c", "top_k": 3}, 400, "top_k: unknown field"),
    ({"questions": "q"}, 400, "questions: expected a list, got a string"),
    ({"questions": []}, 400, "questions: empty"),
    ({"questions": [*QUESTIONS, {"question": "q", "context": None}]}, 400,
     "questions[3].context: expected a string, got null"),
    ({"questions": [*QUESTIONS, ["q", "c"]]}, 400, "questions[3]: expected an object"),
    ({"questions": QUESTIONS * 2}, 413, "questions: 6 questions, at most 4 in one request"),
    ({"question": "q" * 51, "context": "c"}, 413, "question: 51 characters, at most 50"),
    ({"questions": [{"question": "q", "context": "c" * 201}]}, 413,
     "questions[0].context: 201 characters, at most 200"),
    (b" " * 2001, 413, "body: 2001 bytes, at most 2000"),
    (b" " * (1 << 20), 413, "body: 1048576 bytes, at most 2000"),  # read and dropped before the reply
]  # fmt: skip


@pytest.mark.parametrize(("body", "status", "message"), BAD, ids=[m for _, _, m in BAD])
def test_a_bad_body_gets_its_4xx_naming_the_field_and_the_server_goes_on(
    body: Any, status: int, message: str
) -> None:
    with serving(Model()) as server:
        got, reply, _ = ask(server, "POST", "/v1/answer", body)
        assert (got, reply) == (status, {"error": reply["error"]})
        assert reply["error"].startswith(message)
        assert ask(server, "POST", "/v1/answer", {"question": "q", "context": "rome is"})[:2] == (
            200,
            {"answer": "rome", "question": "q"},
        )


def test_paths_and_methods_404_405_and_a_body_without_length_411() -> None:
    with serving(Model()) as server:
        status, reply, _ = ask(server, "GET", "/v1/answers")
        assert status == 404 and reply["error"].startswith("/v1/answers: no such endpoint")
        status, reply, headers = ask(server, "GET", "/v1/answer")
        assert (status, headers["Allow"]) == (405, "POST") and "takes POST, not GET" in reply["error"]
        status, _, headers = ask(server, "DELETE", "/healthz")
        assert (status, headers["Allow"]) == (405, "GET, HEAD")
        unsized = raw(
            server,
            b"POST /v1/answer HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        )
        assert unsized.startswith(b"HTTP/1.1 411 ") and b"send a Content-Length" in unsized
        status, health, _ = ask(server, "GET", "/healthz")
        assert status == 200 and health["ready"] is True and health["source"] == "stand-in"
        status, page, headers = ask(server, "GET", "/")
        assert (
            "<script>" in page and "http" not in page.split("<script>")[1]
        )  # nothing fetched from elsewhere
        assert status == 200 and headers["Content-Type"].startswith("text/html")
        assert "default-src 'none'" in headers["Content-Security-Policy"]


def test_questions_are_answered_in_order_and_one_question_gets_one_object() -> None:
    with serving(Model()) as server:
        asked = [{"question": f"q{n}", "context": f"w{n} rest"} for n in range(4)]
        status, reply, _ = ask(server, "POST", "/v1/answer", {"questions": asked})
        assert (status, reply) == (
            200,
            {"answers": [{"answer": f"w{n}", "question": f"q{n}"} for n in range(4)]},
        )


def test_a_full_queue_gets_503_with_retry_after_and_a_late_answer_504() -> None:
    model = Model()
    model.go.clear()
    with serving(model, queue_size=1) as server:
        replies: dict[str, Any] = {}
        held = threading.Thread(target=lambda: replies.update(held=ask(server, "POST", "/v1/answer", ONE)))
        held.start()
        model.entered.wait()  # the model holds the first request ...
        queued = threading.Thread(
            target=lambda: replies.update(queued=ask(server, "POST", "/v1/answer", ONE))
        )
        queued.start()
        while server.batcher._queue.qsize() < 1:  # ... and the second fills the queue
            threading.Event().wait(0.01)
        status, reply, headers = ask(server, "POST", "/v1/answer", ONE)
        assert (status, headers.get("Retry-After")) == (503, "1") and reply["error"].startswith("busy:")
        model.go.set()
        held.join()
        queued.join()
        assert replies["held"][0] == replies["queued"][0] == 200
    model = Model()
    model.go.clear()
    with serving(model, request_timeout=timedelta(milliseconds=50)) as server:
        status, reply, _ = ask(server, "POST", "/v1/answer", ONE)
        assert (status, reply) == (504, {"error": "not answered within 0.05 s"})
        model.go.set()
        assert ask(server, "POST", "/v1/answer", ONE)[0] == 200


def test_a_slow_client_holds_only_its_own_connection_and_is_dropped_after_the_socket_timeout() -> None:
    with serving(Model(), socket_timeout=timedelta(milliseconds=300)) as server:
        slow = socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=120)
        slow.sendall(b'POST /v1/answer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{"question"')
        assert ask(server, "POST", "/v1/answer", {"question": "q", "context": "fast one"})[:2] == (
            200,
            {"answer": "fast", "question": "q"},
        )
        assert slow.recv(65536) == b""  # the server closed it: the body never came
        slow.close()


def test_connections_beyond_the_bound_get_503_and_a_freed_slot_serves_again() -> None:
    with serving(Model(), max_connections=2) as server:
        port = server.server_address[1]
        holders = [socket.create_connection(("127.0.0.1", port), timeout=120) for _ in range(2)]
        for holder in holders:  # a request line each: both connections surely have their thread now
            holder.sendall(b"POST /v1/answer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{")
        reply = raw(server, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 503") and b"2 connections are open" in reply, reply
        holders[0].close()
        # the slot comes back once that connection's thread has ended: wait on the event, not a clock
        while not (
            reply := raw(server, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        ).startswith(b"HTTP/1.1 200"):
            assert reply.startswith(b"HTTP/1.1 503"), reply
        holders[1].close()


def test_stop_answers_the_request_in_flight_closes_idle_connections_and_refuses_new_ones() -> None:
    model = Model()
    with serving(model) as server:
        idle = connect(server.url, timeout=120)
        assert request(idle, "POST", "/v1/answer", ONE)[0] == 200  # a keep-alive connection, now idle
        model.go.clear()
        model.entered.clear()
        replies: dict[str, Any] = {}
        flying = threading.Thread(target=lambda: replies.update(reply=ask(server, "POST", "/v1/answer", ONE)))
        flying.start()
        model.entered.wait()
        stopping = threading.Thread(target=server.stop)
        stopping.start()
        while True:  # until the listening socket is closed
            try:
                socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=120).close()
            except (
                ConnectionRefusedError,
                ConnectionResetError,
            ):  # reset: taken into the backlog, then closed
                break
            threading.Event().wait(0.01)
        assert idle.sock is not None and idle.sock.recv(1) == b""  # the idle connection was closed
        assert stopping.is_alive()  # still waiting for the request in flight
        model.go.set()
        flying.join()
        stopping.join()
        status, reply, headers = replies["reply"]
        assert (status, reply, headers["Connection"]) == (200, {"answer": "abc", "question": "q"}, "close")
        idle.close()


def test_stop_cuts_the_connections_still_open_after_its_bound_and_says_how_many() -> None:
    with serving(Model()) as server:  # every timeout 120 s: only the bound ends the request below
        slow = socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=120)
        # Its request has begun (sent before the stop, served even from the backlog) and never ends.
        slow.sendall(b"POST /v1/answer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{")
        assert server.stop_bound == timedelta(seconds=4 * 120)
        assert server.stop(timedelta(milliseconds=50)) == 1
        with contextlib.suppress(ConnectionResetError):  # a reset: shut down with its sent bytes unread
            assert slow.recv(1) == b""  # shut down: its thread ended, stop returned
        slow.close()


def test_an_answer_object_is_json_with_the_text_as_sent() -> None:
    with serving(Model()) as server:
        status, reply, _ = ask(server, "POST", "/v1/answer", {"question": "où ?", "context": "zürich <b>"})
        assert (status, reply) == (200, {"answer": "zürich", "question": "où ?"})
        assert json.dumps(reply)  # plain JSON values
