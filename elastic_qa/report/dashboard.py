"""`elastic-qa dashboard RUN_DIR`: the run report, live, in a browser.

A standard-library HTTP server answers two paths and nothing else: `/`, the page (dashboard_page.py),
and `/state.json`, the run's state (live.py), refreshed from the bytes appended to its logs since the
last ask. No path from a request reaches the filesystem: every other path is a 404, `..` and its
encodings included. It binds to loopback unless told otherwise and then also refuses a request whose Host
header names another host (a web page elsewhere cannot read it by DNS rebinding); over ssh, forward the
port (`ssh -L`, docs/dashboard.md). It works the same on a finished run.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import secrets
import socket
import sys
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from elastic_qa.exits import EXIT_BAD_INPUT
from elastic_qa.report.dashboard_page import dashboard_html
from elastic_qa.report.live import LiveRun

DEFAULT_PORT = 8765
SOCKET_TIMEOUT_S = 30.0
LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_name(header: str) -> str:
    """The host of a Host header, without its port: `[::1]:8080` -> `::1`, `localhost:9` -> `localhost`."""
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def make_handler(run: LiveRun, page: bytes, nonce: str, loopback_only: bool) -> type[BaseHTTPRequestHandler]:
    """The request handler: GET / and GET /state.json (?since=VERSION: only the age of the newest line when
    nothing changed since), anything else a 404; with `loopback_only`, a foreign Host header a 403."""
    csp = (
        f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'nonce-{nonce}'; connect-src 'self'; "
        "img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )

    class Handler(BaseHTTPRequestHandler):
        server_version = "elastic-qa-dashboard"
        sys_version = ""
        timeout = SOCKET_TIMEOUT_S  # a client silent this long is dropped (its thread with it)

        def do_GET(self) -> None:
            if loopback_only and not is_loopback(_host_name(self.headers.get("Host", ""))):
                self._send(HTTPStatus.FORBIDDEN, b"this dashboard answers only to a loopback host name\n")
                return
            url = urlsplit(self.path)
            if url.path == "/":
                self._send(HTTPStatus.OK, page, "text/html; charset=utf-8")
            elif url.path == "/state.json":
                since = parse_qs(url.query).get("since", [""])[0]
                run.refresh()  # LiveRun locks: two tabs never read the same new bytes twice
                state = run.state()
                if since == str(state["version"]):
                    state = {key: state[key] for key in ("version", "idle_s", "behind")} | {"unchanged": True}
                self._send(HTTPStatus.OK, json.dumps(state).encode(), "application/json")
            else:
                self._send(HTTPStatus.NOT_FOUND, b"not found\n")

        def _send(self, status: HTTPStatus, body: bytes, kind: str = "text/plain; charset=utf-8") -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Content-Security-Policy", csp)
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Referrer-Policy", "no-referrer")
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass  # a request a second is not worth a line

    return Handler


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a browser left open does not keep Ctrl-C waiting


class _Server6(_Server):
    address_family = socket.AF_INET6


def serve(run_dir: Path, host: str, port: int) -> ThreadingHTTPServer:
    """A server for `run_dir` bound to host:port (port 0: any free one); serve_forever() runs it."""
    nonce = secrets.token_urlsafe(18)
    run = LiveRun(run_dir)
    page = dashboard_html(run.root.name, nonce).encode()
    server_class = _Server6 if ":" in host else _Server
    return server_class((host, port), make_handler(run, page, nonce, is_loopback(host)))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="elastic-qa dashboard",
        description="The run report, live, in a browser: progress and ETA, loss and evaluations, world "
        "size with regroups, checkpoints, who is in the job, faults. Follows the run's logs as they grow; "
        "works on a finished run too. Binds to loopback: from another machine, forward the port "
        "(ssh -L PORT:127.0.0.1:PORT host).",
    )
    parser.add_argument("run_dir", help="the run directory (run.dir)")
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this host only)"
    )
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: any free one)"
    )
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        print(f"elastic-qa dashboard: RUN_DIR {run_dir} is not a directory", file=sys.stderr)
        return EXIT_BAD_INPUT
    if not 0 <= args.port <= 65535:
        print(f"elastic-qa dashboard: --port {args.port} is not a port (0 to 65535)", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        server = serve(run_dir, args.host, args.port)
    except OSError as err:
        print(f"elastic-qa dashboard: cannot listen on {args.host}:{args.port}: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if not is_loopback(args.host):
        print(
            f"elastic-qa dashboard: warning: bound to {args.host}: anyone who can reach it sees the run "
            "(there is no login); the default 127.0.0.1 with ssh -L keeps it to you",
            file=sys.stderr,
        )
    bound_host, bound_port = str(server.server_address[0]), int(server.server_address[1])
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    print(f"dashboard of {run_dir.resolve()} at http://{shown}:{bound_port}/ (Ctrl-C stops it)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
