"""The HTTP side of `elastic-qa serve`: the standard library's ThreadingHTTPServer, one thread a connection.

    POST /v1/answer   questions -> answers (serve/schema.py); 400/413 bad body, 503 queue full or stopping,
                      504 not answered within the request timeout
    GET  /healthz     the model (source, step, kind), ready, the batching settings and counts
    GET  /            the page to ask from (serve/page.py)

Request threads only read, check and wait: the model runs on the batcher's one thread, so a slow client
holds its own connection's thread, never the model. Every socket has a timeout (a client that stops
sending is dropped). `stop` stops accepting, closes idle keep-alive connections, lets the requests in
flight finish and then stops the model thread.
"""

from __future__ import annotations

import contextlib
import json
import queue
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from elastic_qa.serve.batcher import Batcher, Busy, Stopped, TimedOut
from elastic_qa.serve.page import PAGE, PAGE_POLICY
from elastic_qa.serve.schema import BadRequest, Limits, parse_questions

REFUSAL_S = 1.0  # the most time a refused connection is given to take its 503 and close
DRAINED_BYTES = 16 << 20  # an oversized body up to this size is read (and dropped) before the 413
ROUTES = {"/": "GET", "/healthz": "GET", "/v1/answer": "POST"}


@dataclass(frozen=True)
class ServeSettings:
    """How requests are served (the `elastic-qa serve` flags)."""

    limits: Limits
    request_timeout: timedelta  # a request waiting longer for its answers gets 504
    socket_timeout: timedelta  # a client silent this long (mid-request or idle keep-alive) is dropped
    model: dict[str, Any]  # what /healthz says of the model: source, step, kind, null_threshold
    max_connections: int = 128  # open connections (one thread each); beyond: 503 and closed at once


class QAServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer that answers through a Batcher and stops gracefully (see the module doc)."""

    daemon_threads = True  # still joined by server_close (block_on_close): stop waits for requests in flight

    def __init__(self, address: tuple[str, int], batcher: Batcher, settings: ServeSettings) -> None:
        self.batcher = batcher
        self.settings = settings
        self.stopping = threading.Event()
        self._lock = threading.Lock()  # guards _open: the connections and whether each is mid-request
        self._open: dict[Handler, bool] = {}
        self._slots = threading.BoundedSemaphore(settings.max_connections)
        self._refused: queue.Queue[socket.socket] = queue.Queue(maxsize=64)
        threading.Thread(target=self._refuse, name="refuser", daemon=True).start()
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, Handler)

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
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()  # no thread started: the slot is not taken
            raise

    def _refuse(self) -> None:
        """503 to each connection beyond the bound: the reply, our end closed for writing, then what the
        client sent read (briefly) before closing, so that unread bytes do not turn the close into a reset
        that would lose the reply."""
        while True:
            request = self._refused.get()
            body = json.dumps({"error": f"busy: {self.settings.max_connections} connections are open"})
            reply = (
                "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n{body}"
            )
            with contextlib.suppress(OSError):
                request.settimeout(REFUSAL_S)
                request.sendall(reply.encode())
                request.shutdown(socket.SHUT_WR)
                until = time.monotonic() + REFUSAL_S
                while time.monotonic() < until and request.recv(1 << 16):
                    pass
            request.close()

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _track(self, handler: Handler, busy: bool | None) -> bool:
        """Record a connection as busy/idle (None: gone); False when an idle one should close now."""
        with self._lock:
            if busy is None:
                self._open.pop(handler, None)
            else:
                self._open[handler] = busy
            return not (self.stopping.is_set() and busy is False)

    def stop(self) -> None:
        """Stop accepting, let the requests in flight finish, stop the model thread. Call from a thread
        other than the one running serve_forever."""
        self.stopping.set()
        self.shutdown()  # serve_forever returns: nothing more is accepted
        self.socket.close()  # connections still in the backlog are refused, not left hanging
        with self._lock:
            idle = [handler for handler, busy in self._open.items() if not busy]
        for handler in idle:  # waiting for a next request on a keep-alive connection: none will come
            with contextlib.suppress(OSError):
                handler.connection.shutdown(socket.SHUT_RDWR)
        self.server_close()  # joins every connection's thread: in-flight requests are answered first
        self.batcher.close()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: a client's connection serves many requests
    # Headers and body go out in two writes; with Nagle's algorithm the second waits for the client's
    # delayed ACK of the first (40 ms on Linux): every answer took 40 ms more.
    disable_nagle_algorithm = True
    server_version = "elastic-qa-serve"
    server: QAServer

    def setup(self) -> None:
        self.connection = self.request
        self.connection.settimeout(self.server.settings.socket_timeout.total_seconds())
        super().setup()
        self.server._track(self, False)

    def finish(self) -> None:
        self.server._track(self, None)
        super().finish()

    def parse_request(self) -> bool:  # the request line has arrived: busy until its answer is written
        self.server._track(self, True)
        return super().parse_request()

    def handle_one_request(self) -> None:
        super().handle_one_request()
        if not self.server._track(self, False):
            self.close_connection = True

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

    def do_POST(self) -> None:
        if self._route("POST") == "/v1/answer":
            self._answer()

    def do_PUT(self) -> None:
        self._route("PUT")

    def do_DELETE(self) -> None:
        self._route("DELETE")

    def do_PATCH(self) -> None:
        self._route("PATCH")

    def _route(self, method: str) -> str | None:
        """The path when `method` is what it takes; otherwise 404 or 405 is sent and None returned."""
        path = urlsplit(self.path).path
        allowed = ROUTES.get(path)
        if allowed != method:
            self.close_connection = True  # a body it may have sent is not read: the stream is lost
        if allowed is None:
            self._error(404, f"{path}: no such endpoint (POST /v1/answer, GET /healthz, GET /)")
        elif allowed != method:
            self._error(405, f"{path}: takes {allowed}, not {method}", {"Allow": allowed})
        else:
            return path
        return None

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
            answers = self.server.batcher.submit(pairs, settings.request_timeout)
        except BadRequest as err:
            self._error(err.status, str(err))
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
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raise BadRequest(411, "Transfer-Encoding chunked is not taken: send a Content-Length")
        length = self.headers.get("Content-Length")
        if length is None:
            raise BadRequest(411, "Content-Length: missing")
        try:
            size = int(length)
        except ValueError:
            size = -1
        if size < 0:
            raise BadRequest(400, f"Content-Length: {length!r} is not a size in bytes")
        if size > limits.max_body_bytes:
            if size <= DRAINED_BYTES:  # read and dropped: a client still sending would see a reset, not 413
                left = size
                while left > 0 and (chunk := self.rfile.read(min(1 << 16, left))):
                    left -= len(chunk)
            raise BadRequest(413, f"body: {size} bytes, at most {limits.max_body_bytes}")
        body = self.rfile.read(size)  # each read bounded by the socket timeout
        if len(body) != size:
            raise BadRequest(400, f"body: {len(body)} of the {size} bytes announced arrived")
        return body

    # ---- replies ---------------------------------------------------------------------------------------
    def _error(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        self._json(status, {"error": message}, headers)

    def _json(self, status: int, value: Any, headers: dict[str, str] | None = None) -> None:
        body = json.dumps(value, ensure_ascii=False).encode()
        self._send(status, body, "application/json", headers or {})

    def _send(self, status: int, body: bytes, kind: str, headers: dict[str, str]) -> None:
        if self.server.stopping.is_set():
            self.close_connection = True
        try:
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
            self.wfile.write(body)
        except OSError:  # the client went away (or stopped reading past the socket timeout)
            self.close_connection = True
