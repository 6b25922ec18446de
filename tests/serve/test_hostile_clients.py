"""A real `elastic-qa serve` process on the tiny trained model against hostile or unlucky clients: SIGTERM
with requests in flight answers every one of them and exits 0; clients trickling bytes are cut at the read
timeout and their connection slots serve again; a lone surrogate, JSON nested 50,000 deep, a 5,000-digit
number or two Content-Lengths get a 400 naming what; bad request lines, HEAD and OPTIONS get JSON; a Host
header that does not name loopback gets 403 on a loopback server."""

from __future__ import annotations

import contextlib
import json
import select
import signal
import socket
import time
from pathlib import Path

import pytest

from elastic_qa.bench.serve import QUESTIONS, WAIT_S, ServerProcess, start_server
from tests.conftest import REPO

LOOPBACK = "127.0.0.1"


def port(server: ServerProcess) -> int:
    return int(server.url.rsplit(":", 1)[1].strip("/"))


def post(body: bytes, host: str = LOOPBACK, extra: str = "") -> bytes:
    head = f"POST /v1/answer HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(body)}\r\n{extra}"
    return head.encode() + b"Connection: close\r\n\r\n" + body


def exchange(server: ServerProcess, data: bytes) -> bytes:
    """Send bytes as they are; all the server answers until it closes the connection."""
    with socket.create_connection((LOOPBACK, port(server)), timeout=WAIT_S) as connection:
        connection.sendall(data)
        return read_all(connection)


def read_all(connection: socket.socket) -> bytes:
    reply = b""
    while chunk := connection.recv(1 << 16):
        reply += chunk
    return reply


def parsed(reply: bytes) -> tuple[int, dict[str, str], bytes]:
    """The status, headers (lower-case names) and body of one HTTP reply."""
    head, _, body = reply.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {
        name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)
    }
    return int(status_line.split()[1]), headers, body


def json_error(reply: bytes) -> tuple[int, str]:
    """The status and message of a JSON error reply (asserting that it is one)."""
    status, headers, body = parsed(reply)
    assert headers["content-type"] == "application/json", reply
    error = json.loads(body)
    assert set(error) == {"error"}, reply
    return status, error["error"]


def test_sigterm_answers_every_request_sent_before_it_and_exits_0(trained: Path, tmp_path: Path) -> None:
    stopping = start_server(str(trained), ["--request-timeout", "600s"], tmp_path / "stderr", cwd=REPO)
    body = json.dumps({"questions": [QUESTIONS[-1], *QUESTIONS[:3]]}).encode()  # several windows
    clients = []
    try:
        for _ in range(16):  # each connected and its whole request sent before the signal
            client = socket.create_connection((LOOPBACK, port(stopping)), timeout=WAIT_S)
            client.sendall(post(body))
            clients.append(client)
        stopping.process.send_signal(signal.SIGTERM)
        replies = [read_all(client) for client in clients]
        assert stopping.process.wait(timeout=WAIT_S) == 0
        assert stopping.process.stdout is not None
        assert "stopped (" in stopping.process.stdout.read()
    finally:
        for client in clients:
            client.close()
        stopping.stop()  # (when a check above failed)
    assert "Traceback" not in (tmp_path / "stderr").read_text()
    for reply in replies:
        status, _, answered = parsed(reply)
        assert status == 200, reply
        assert len(json.loads(answered)["answers"]) == 4


def test_clients_trickling_bytes_are_cut_at_the_read_timeout_and_their_slots_serve_again(
    trained: Path, tmp_path: Path
) -> None:
    # Only the read timeout can cut them: each byte comes long before the socket timeout.
    flags = ["--max-connections", "4", "--read-timeout", "1s", "--socket-timeout", "600s"]
    trickled = start_server(str(trained), flags, tmp_path / "stderr", cwd=REPO)
    slow = [socket.create_connection((LOOPBACK, port(trickled)), timeout=WAIT_S) for _ in range(4)]
    try:
        replies = {client: b"" for client in slow}
        starts = [b"GET /", b"POST /v1/answer HTTP/1.1\r\nX-", post(b"{" + b" " * 99)[:-99]]
        for client, start in zip(slow, [*starts, starts[-1]], strict=True):
            # A request line, a header, a body that never ends: a byte ("a", or a space) at a time.
            client.sendall(start)
        open_ = set(slow)
        give_up = time.monotonic() + WAIT_S
        while open_ and time.monotonic() < give_up:
            readable, _, _ = select.select(list(open_), [], [], 0.1)
            for client in readable:  # what the server sent, until it closes the connection
                chunk = client.recv(1 << 16)  # (a reset, the server closing with bytes unread, would raise)
                replies[client] += chunk
                if not chunk:
                    open_.discard(client)
                    client.close()
            if not readable:
                for client in open_:
                    with contextlib.suppress(OSError):  # closed: select sees it next time round
                        client.send(b" " if client in slow[2:] else b"a")
        assert not open_, f"{len(open_)} of 4 trickling connections still open"
        for reply in replies.values():  # each got its 408, however much it was still sending
            assert json_error(reply) == (408, "request: not received whole within 1 s of its first byte")
        # The slots come back once the connections' threads have ended: ask until one is free.
        asked = post(json.dumps(QUESTIONS[0]).encode())
        while (reply := exchange(trickled, asked)).startswith(b"HTTP/1.1 503 "):
            pass
        assert parsed(reply)[0] == 200, reply
    finally:
        for client in slow:
            client.close()
        assert trickled.stop() == 0
    assert "Traceback" not in (tmp_path / "stderr").read_text()


HOSTILE_BODIES = [
    (b'{"question": "where \\ud800 ?", "context": "rome"}',
     "question: character 6 is a lone surrogate ('\\ud800')"),
    (b'{"\\ud800": 1}', "\ud800: unknown field"),  # the name echoed as it came
    (b"[" * 50_000 + b"]" * 50_000, "body: JSON nested too deeply"),
    (b'{"question": "q", "context": ' + b"7" * 5000 + b"}", "context: expected a string, got a number"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "message"), HOSTILE_BODIES, ids=["surrogate", "key", "deep", "digits"])
def test_a_hostile_body_gets_a_400_naming_what_and_the_server_goes_on(
    server: ServerProcess, body: bytes, message: str
) -> None:
    status, error = json_error(exchange(server, post(body)))
    assert (status, error[: len(message)]) == (400, message)
    assert parsed(exchange(server, post(json.dumps(QUESTIONS[0]).encode())))[0] == 200


def test_two_content_lengths_get_a_400_whichever_comes_first(server: ServerProcess) -> None:
    body = json.dumps(QUESTIONS[0]).encode()
    for extra in (f"Content-Length: {len(body) - 1}\r\n", f"Content-Length: {len(body)}\r\n"):
        status, error = json_error(exchange(server, post(body, extra=extra)))
        assert status == 400 and error.startswith("Content-Length: given 2 times"), error


def test_transfer_encoding_beside_a_content_length_is_refused(server: ServerProcess) -> None:
    body = json.dumps(QUESTIONS[0]).encode()
    # The first header names no chunking; a proxy that reads the second frames the body as chunks.
    for codings in (["identity"], ["identity", "chunked"], ["chunked"]):
        extra = "".join(f"Transfer-Encoding: {coding}\r\n" for coding in codings)
        status, error = json_error(exchange(server, post(body, extra=extra)))
        assert (status, error) == (
            400,
            "Transfer-Encoding and Content-Length together: send one Content-Length",
        )


def test_bad_request_lines_unknown_methods_and_options_get_json_errors(server: ServerProcess) -> None:
    host = f"Host: {LOOPBACK}\r\n"
    headers = "X: y\r\n" * 101
    cases = [
        (b"GARBAGE\r\n\r\n", 400, "Bad request syntax"),
        (b"GET /healthz\r\n\r\n", 400, "'GET /healthz': no HTTP version"),
        (f"GET /healthz HTTP/9.9\r\n{host}\r\n".encode(), 505, "Invalid HTTP version"),
        (f"GET /{'a' * 70_000} HTTP/1.1\r\n\r\n".encode(), 414, "Request-URI Too Long"),
        (f"GET /healthz HTTP/1.1\r\n{host}{headers}\r\n".encode(), 431, "Too many headers"),
        (f"BREW /healthz HTTP/1.1\r\n{host}\r\n".encode(), 501, "Unsupported method ('BREW')"),
        (f"OPTIONS /v1/answer HTTP/1.1\r\n{host}\r\n".encode(), 405, "/v1/answer: takes POST, not OPTIONS"),
    ]
    for sent, want_status, want in cases:
        status, error = json_error(exchange(server, sent))
        assert (status, error[: len(want)]) == (want_status, want)


def test_head_gets_the_status_and_headers_of_get_without_a_body(server: ServerProcess) -> None:
    for path, want in (("/healthz", 200), ("/v1/answer", 405)):
        reply = exchange(
            server, f"HEAD {path} HTTP/1.1\r\nHost: {LOOPBACK}\r\nConnection: close\r\n\r\n".encode()
        )
        status, headers, body = parsed(reply)
        assert (status, headers["content-type"], body) == (want, "application/json", b"")
        assert int(headers["content-length"]) > 0


def test_a_get_with_a_body_is_answered_once_and_its_body_never_read_as_a_request(
    server: ServerProcess,
) -> None:
    smuggled = f"GET /nothing HTTP/1.1\r\nHost: {LOOPBACK}\r\n\r\n".encode()
    head = f"GET /healthz HTTP/1.1\r\nHost: {LOOPBACK}\r\nContent-Length: {len(smuggled)}\r\n\r\n"
    reply = exchange(server, head.encode() + smuggled)
    assert reply.count(b"HTTP/1.1 ") == 1 and parsed(reply)[:2][0] == 200, reply
    assert parsed(reply)[1]["connection"] == "close"


def test_a_host_header_that_does_not_name_loopback_gets_403(server: ServerProcess) -> None:
    healthz = "GET /healthz HTTP/1.1\r\n{}Connection: close\r\n\r\n"
    refused = ["Host: rebound.example\r\n", f"Host: rebound.example:{port(server)}\r\n", "",
               f"Host: {LOOPBACK}\r\nHost: rebound.example\r\n"]  # fmt: skip
    for host in refused:
        status, error = json_error(exchange(server, healthz.format(host).encode()))
        assert status == 403 and "answers only to a loopback host name" in error, (host, error)
    for host in (f"localhost:{port(server)}", "LOCALHOST", f"[::1]:{port(server)}", "127.0.0.2"):
        reply = exchange(server, healthz.format(f"Host: {host}\r\n").encode())
        assert parsed(reply)[0] == 200, (host, reply)
