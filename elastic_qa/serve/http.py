"""The HTTP side of `elastic-qa serve`: the standard library's ThreadingHTTPServer, one thread a connection.

    POST /v1/answer   questions -> answers (serve/schema.py); 400/413 bad body, 503 queue full or stopping,
                      504 not answered within the request timeout
    GET  /healthz     the model (source, step, kind), ready, the batching settings and counts
    GET  /            the page to ask from (serve/page.py)

Request threads only read, check and wait: the model runs on the batcher's one thread, so a slow client
holds its own connection's thread, never the model. Every read has a timeout (a client that stops sending
is dropped), and a request must arrive whole within the read timeout of its first byte (a client that
trickles bytes gets 408 and is dropped). Every error is JSON, the standard library's own refusals included.
Bound to loopback, the server answers only requests whose Host header names loopback. `stop` stops
accepting, serves the connections the kernel had already taken, ends idle keep-alive connections, answers
every request that had begun (joining their threads within a bound that the timeouts imply), and then stops
the model thread.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import queue
import select
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from elastic_qa.network import is_loopback, names_loopback
from elastic_qa.serve.batcher import Batcher, Busy, Stopped, TimedOut
from elastic_qa.serve.page import PAGE, PAGE_POLICY
from elastic_qa.serve.schema import BadRequest, Limits, parse_questions

REFUSAL_S = 1.0  # the most time a refused connection is given to take its 503 and close
DRAINED_BYTES = 16 << 20  # an oversized body up to this size is read (and dropped) before the 413
ROUTES = {"/": "GET", "/healthz": "GET", "/v1/answer": "POST"}
ALLOW = {"GET": "GET, HEAD", "POST": "POST"}  # the Allow header of a 405


@dataclass(frozen=True)
class ServeSettings:
    """How requests are served (the `elastic-qa serve` flags)."""

    limits: Limits
    request_timeout: timedelta  # a request waiting longer for its answers gets 504
    socket_timeout: timedelta  # a client silent this long (mid-request or idle keep-alive) is dropped
    model: dict[str, Any]  # what /healthz says of the model: source, step, kind, null_threshold
    max_connections: int = 128  # open connections (one thread each); beyond: 503 and closed at once
    read_timeout: timedelta = timedelta(seconds=30)  # a request not arrived whole by then after its first
    # byte gets 408 and is dropped, however steadily it trickles


class QAServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer that answers through a Batcher and stops gracefully (see the module doc)."""

    # Daemons, so that no connection can hold the process's exit; stop joins them itself, with a bound
    # (the library's server_close joins only threads that are not daemons, and without a bound).
    daemon_threads = True

    def __init__(self, address: tuple[str, int], batcher: Batcher, settings: ServeSettings) -> None:
        self.batcher = batcher
        self.settings = settings
        self.stopping = threading.Event()
        self.model_stuck = False  # set by stop(): the model thread outlived its bound
        # Readable once stop begins: wakes the connections waiting for a next request (_Reads).
        self.stop_signal, self._stop_write = os.pipe()
        self._slots = threading.BoundedSemaphore(settings.max_connections)
        self._lock = threading.Lock()  # guards _connections
        self._connections: dict[threading.Thread, socket.socket] = {}  # each open one's thread and socket
        self._refused: queue.Queue[socket.socket | None] = queue.Queue(maxsize=64)
        self._refuser = threading.Thread(target=self._refuse, name="refuser", daemon=True)
        self._refuser.start()
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.request_queue_size = settings.max_connections  # the listen backlog (the library's is 5)
        super().__init__(address, Handler)
        # A page elsewhere can reach a loopback server by DNS rebinding: it sends its own name as Host.
        self.loopback_only = is_loopback(str(self.server_address[0]))

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        host = host.decode() if isinstance(host, bytes) else host
        return f"http://{f'[{host}]' if ':' in host else host}:{port}/"

    def process_request(self, request: Any, client_address: Any) -> None:
        """A thread for the connection while fewer than max_connections are open; else 503 and close:
        clients that open connections and hold them (idle or trickling bytes) cannot grow threads without
        bound."""
        if not self._slots.acquire(blocking=False):
            try:
                self._refused.put_nowait(request)  # answered by the refuser thread, off the accept loop
            except queue.Full:
                self.shutdown_request(request)
            return
        thread = threading.Thread(
            target=self.process_request_thread, args=(request, client_address), daemon=True
        )
        with self._lock:
            self._connections[thread] = request
        try:
            thread.start()
        except BaseException:
            with self._lock:
                self._connections.pop(thread)
            self._slots.release()  # no thread started: the slot is not taken
            raise

    def _refuse(self) -> None:
        """503 to each connection beyond the bound: the reply, our end closed for writing, then what the
        client sent read (briefly) before closing, so that unread bytes do not turn the close into a reset
        that would lose the reply."""
        while (request := self._refused.get()) is not None:
            body = json.dumps({"error": f"busy: {self.settings.max_connections} connections are open"})
            reply = (
                "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n{body}"
            )
            with contextlib.suppress(OSError):
                request.settimeout(REFUSAL_S)
                request.sendall(reply.encode())
            _linger(request)
            request.close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that resets its connection is no error of the server's: no traceback on stderr."""
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._connections.pop(threading.current_thread(), None)
            self._slots.release()

    @property
    def stop_bound(self) -> timedelta:
        """The longest a request that had begun can still take once stop is called: the rest of its read,
        its wait for the model, and the two writes of its reply (headers, body), each under its timeout."""
        settings = self.settings
        return settings.read_timeout + settings.request_timeout + 2 * settings.socket_timeout

    def stop(self, bound: timedelta | None = None) -> int:
        """Stop accepting, answer every request that had begun, stop the model thread; the number of
        connections cut because they were still open after `bound` (default: stop_bound, which every
        timeout keeps them within). Call from a thread other than the one running serve_forever."""
        self.stopping.set()
        os.write(self._stop_write, b"x")  # connections between requests end; one mid-request is read whole
        self.shutdown()  # serve_forever returns: nothing more is accepted ...
        self._serve_backlog()  # ... but connections the kernel had already taken are served, not reset
        self.server_close()  # closes the listening socket
        cut = self._join_connections(self.stop_bound if bound is None else bound)
        self._refused.put(None)
        self._refuser.join()
        # Every request is answered or given up by now; a model call that still runs past a request's whole
        # timeout is stuck, and the process exits without it (said by the command).
        self.model_stuck = not self.batcher.close(self.settings.request_timeout)
        os.close(self.stop_signal)
        os.close(self._stop_write)
        return cut

    def _join_connections(self, bound: timedelta) -> int:
        """Wait up to `bound` for every connection's thread; shut down the sockets of those still running
        (their reads and writes fail at once, so they end) and return how many there were."""
        deadline = time.monotonic() + bound.total_seconds()
        with self._lock:
            threads = list(self._connections)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            late = [(thread, request) for thread, request in self._connections.items() if thread in threads]
        for _, request in late:
            with contextlib.suppress(OSError):
                request.shutdown(socket.SHUT_RDWR)
        return len(late)

    def _serve_backlog(self) -> None:
        """Take the connections waiting in the listen backlog (their clients sent their requests before the
        stop); each gets a thread, or a 503 beyond max_connections."""
        self.socket.setblocking(False)
        for _ in range(self.request_queue_size):
            try:
                request, client_address = self.socket.accept()
            except OSError:  # BlockingIOError: the backlog is empty
                return
            self.process_request(request, client_address)


def _linger(connection: socket.socket) -> None:
    """Our end closed for writing, then what the client still sends read (for up to REFUSAL_S) until it
    closes: bytes left unread would turn our close into a reset, which makes the client's kernel drop the
    reply it had not read yet."""
    with contextlib.suppress(OSError):
        connection.shutdown(socket.SHUT_WR)
        until = time.monotonic() + REFUSAL_S
        while (left := until - time.monotonic()) > 0:
            connection.settimeout(left)
            if not connection.recv(1 << 16):
                return


class RequestTooSlow(Exception):
    """A request did not arrive whole within the read timeout of its first byte (408)."""


class _Reads(io.RawIOBase):
    """A connection's reads, under the handler's buffered rfile. Between requests: wait up to the socket
    timeout for a first byte, or until the server stops (then the stream ends, unless the client had sent
    something). From a request's first byte on: each read bounded by the socket timeout and by what is left
    of the read timeout, so that a client trickling bytes cannot hold its connection for ever."""

    def __init__(self, connection: socket.socket, server: QAServer) -> None:
        super().__init__()
        self._connection = connection
        self._stop_signal = server.stop_signal
        self._silence_s = server.settings.socket_timeout.total_seconds()
        self._whole_s = server.settings.read_timeout.total_seconds()
        self.deadline: float | None = None  # of the request being read; None between requests

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self.deadline is None:
            poller = select.poll()
            poller.register(self._connection, select.POLLIN)
            poller.register(self._stop_signal, select.POLLIN)
            ready = {fd for fd, _ in poller.poll(self._silence_s * 1000)}
            if not ready:
                raise TimeoutError(f"no request within {self._silence_s:g} s")
            if self._connection.fileno() not in ready:
                return 0  # the server stops, and nothing came on this connection: it ends
            self._connection.settimeout(self._silence_s)
            got = self._connection.recv_into(buffer)
            self.deadline = time.monotonic() + self._whole_s
            return got
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise self._too_slow()
        self._connection.settimeout(min(left, self._silence_s))
        try:
            return self._connection.recv_into(buffer)
        except TimeoutError:
            if left < self._silence_s:
                raise self._too_slow() from None
            raise  # silent for the socket timeout: dropped without a reply

    def _too_slow(self) -> RequestTooSlow:
        return RequestTooSlow(f"request: not received whole within {self._whole_s:g} s of its first byte")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: a client's connection serves many requests
    # Headers and body go out in two writes; with Nagle's algorithm the second waits for the client's
    # delayed ACK of the first (40 ms on Linux): every answer took 40 ms more.
    disable_nagle_algorithm = True
    server_version = "elastic-qa-serve"
    server: QAServer

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the library's socket file: reads go through _Reads instead
        self._reads = _Reads(self.connection, self.server)
        self.rfile = io.BufferedReader(self._reads)

    def handle_one_request(self) -> None:
        self._reads.deadline = None  # between requests: the next one's clock starts at its first byte
        try:
            super().handle_one_request()
        except RequestTooSlow as err:
            self.close_connection = True
            # The request line may be partial: none of it is echoed (nor logged, which needs a requestline).
            self.command, self.request_version, self.requestline = "", self.protocol_version, ""
            self._error(408, str(err))
            _linger(self.connection)  # it may still be trickling: without this, the 408 would be lost
        if self.server.stopping.is_set():
            self.close_connection = True

    def parse_request(self) -> bool:
        """The library's checks of the request line and headers, then: a version, and a loopback Host when
        the server listens on loopback."""
        if not super().parse_request():
            return False
        if self.request_version == "HTTP/0.9":  # a request line without a version: no headers either
            self.send_error(400, f"{self.requestline!r}: no HTTP version (HTTP/1.0 or HTTP/1.1)")
            return False
        hosts = self.headers.get_all("Host") or []
        if self.server.loopback_only and not (len(hosts) == 1 and names_loopback(hosts[0])):
            self.close_connection = True  # a body it may have sent is not read: the stream is lost
            said = repr(hosts[0]) if len(hosts) == 1 else f"{len(hosts)} headers"
            self._error(403, f"Host: {said}: this server answers only to a loopback host name")
            return False
        return True

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The library's own refusals (a bad request line, a header too long, a method without do_) as
        JSON, as every error."""
        self.close_connection = True
        if self.request_version == "HTTP/0.9":  # its reply would have no status line
            self.request_version = self.protocol_version
        self._error(code, message or HTTPStatus(code).phrase)

    def log_message(self, format: str, *args: Any) -> None:
        """No line per request (a load would flood stderr); errors reach the client as JSON."""

    # ---- routing ---------------------------------------------------------------------------------------
    def do_GET(self) -> None:
        path = self._route("GET")
        if path == "/":
            self._send(
                200, PAGE.encode(), "text/html; charset=utf-8", {"Content-Security-Policy": PAGE_POLICY}
            )
        elif path == "/healthz":
            ready = not self.server.stopping.is_set()
            stats = self.server.batcher.stats
            batching = {"max_batch": self.server.batcher.max_batch, "batches": stats.batches,
                        "questions": stats.questions, "largest_batch": stats.largest}  # fmt: skip
            self._json(200 if ready else 503, {"ready": ready, **self.server.settings.model, **batching})

    def do_HEAD(self) -> None:  # GET's status and headers; _send leaves the body out
        self.do_GET()

    def do_POST(self) -> None:
        if self._route("POST") == "/v1/answer":
            self._answer()

    def do_PUT(self) -> None:
        self._route("PUT")

    def do_DELETE(self) -> None:
        self._route("DELETE")

    def do_PATCH(self) -> None:
        self._route("PATCH")

    def do_OPTIONS(self) -> None:
        self._route("OPTIONS")

    def _route(self, method: str) -> str | None:
        """The path when `method` is what it takes; otherwise 404 or 405 is sent and None returned."""
        path = urlsplit(self.path).path
        allowed = ROUTES.get(path)
        if allowed != method or (method != "POST" and self._has_body()):
            self.close_connection = True  # a body it may have sent is not read: the stream is lost
        if allowed is None:
            self._error(404, f"{path}: no such endpoint (POST /v1/answer, GET /healthz, GET /)")
        elif allowed != method:
            self._error(405, f"{path}: takes {allowed}, not {self.command}", {"Allow": ALLOW[allowed]})
        else:
            return path
        return None

    def _has_body(self) -> bool:
        return self.headers.get("Content-Length", "0").strip() != "0" or "Transfer-Encoding" in self.headers

    # ---- POST /v1/answer -------------------------------------------------------------------------------
    def _answer(self) -> None:
        settings = self.server.settings
        try:
            body = self._body(settings.limits)
        except BadRequest as err:
            self.close_connection = True  # the body was not read, or not all of it: the stream is lost
            self._error(err.status, str(err))
            return
        try:
            pairs, single = parse_questions(body, settings.limits)
        except BadRequest as err:
            self._error(err.status, str(err))
            return
        try:
            answers = self.server.batcher.submit(pairs, settings.request_timeout)
        except Busy as err:
            self._error(503, f"busy: {err}; retry later", {"Retry-After": "1"})
        except Stopped as err:
            self._error(503, str(err))
        except TimedOut as err:
            self._error(504, str(err))
        except Exception as err:  # noqa: BLE001 - the model failed on this batch: said, and serving goes on
            self._error(500, f"the model failed: {type(err).__name__}: {err}")
        else:
            self._json(200, dict(answers[0]) if single else {"answers": list(answers)})

    def _body(self, limits: Limits) -> bytes:
        lengths = self.headers.get_all("Content-Length") or []
        if "Transfer-Encoding" in self.headers:  # whatever the coding, and however many headers name it
            if lengths:  # which one frames the body? A proxy in front may have picked the other
                raise BadRequest(
                    400, "Transfer-Encoding and Content-Length together: send one Content-Length"
                )
            raise BadRequest(
                411, "Transfer-Encoding is not taken (chunked or any other): send a Content-Length"
            )
        if not lengths:
            raise BadRequest(411, "Content-Length: missing")
        if len(lengths) > 1:  # which one frames the body? A proxy in front may have picked the other
            raise BadRequest(400, f"Content-Length: given {len(lengths)} times ({', '.join(lengths)})")
        length = lengths[0].strip(" \t")
        if not (length.isascii() and length.isdigit()):
            raise BadRequest(400, f"Content-Length: {lengths[0]!r} is not a size in bytes")
        if len(length) > 15:  # past any body taken (and int() refuses thousands of digits)
            raise BadRequest(
                413, f"body: a size of {len(length)} digits, at most {limits.max_body_bytes} bytes"
            )
        size = int(length)
        if size > limits.max_body_bytes:
            if size <= DRAINED_BYTES:  # read and dropped: a client still sending would see a reset, not 413
                left = size
                while left > 0 and (chunk := self.rfile.read(min(1 << 16, left))):
                    left -= len(chunk)
            raise BadRequest(413, f"body: {size} bytes, at most {limits.max_body_bytes}")
        body = self.rfile.read(size)  # bounded by the socket timeout and the read timeout
        if len(body) != size:
            raise BadRequest(400, f"body: {len(body)} of the {size} bytes announced arrived")
        return body

    # ---- replies ---------------------------------------------------------------------------------------
    def _error(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        self._json(status, {"error": message}, headers)

    def _json(self, status: int, value: Any, headers: dict[str, str] | None = None) -> None:
        # A lone surrogate (a field name sent as "\ud800", echoed in an error) has no UTF-8: written as the
        # JSON escape it came as.
        body = json.dumps(value, ensure_ascii=False).encode("utf-8", "backslashreplace")
        self._send(status, body, "application/json", headers or {})

    def _send(self, status: int, body: bytes, kind: str, headers: dict[str, str]) -> None:
        if self.server.stopping.is_set():
            self.close_connection = True
        try:
            # A read near its request's deadline left a shorter timeout: the reply gets the socket timeout.
            self.connection.settimeout(self.server.settings.socket_timeout.total_seconds())
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            for name, value in headers.items():
                self.send_header(name, value)
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
        except OSError:  # the client went away (or stopped reading past the socket timeout)
            self.close_connection = True
