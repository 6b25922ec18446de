"""The heal transport of replica-group mode: how a restarted replica group gets the training state from a
live peer, safely.

When a replica group restarts or joins, torchft asks a live peer to send it the whole training state (a
"heal"). torchft's own HTTPTransport unpickles whatever bytes arrive from the network with
``weights_only=False`` and checks nothing: anything that can reach its port, or answer in the peer's place,
runs code in the trainer. This module is the transport the torchft adapter (``replica/ft.py``) delegates to
instead; it imports torch and the standard library only, never torchft.

- The state is loaded with ``torch.load(weights_only=True)``: tensors, containers and plain values only, the
  format the product's checkpoints already use. A pickle that names anything else (a class, ``os.system``)
  is refused before any of it runs.
- Every state is checksummed: the sender serializes it once (:meth:`HealServer.offer`), and sends with it
  ``HMAC-SHA256(key, b"state:<step>:" + sha256(bytes))``; the receiver recomputes it over exactly the
  bytes it read, before unpickling anything. A truncated, corrupted, stale (another step's) or forged state
  fails, and the caller restores from disk instead.
- The key (:func:`heal_key`) is the job's shared secret, which only its owner can read: without it another
  user of the machine (or of the network) can neither fetch the weights off the port (each request carries
  ``HMAC-SHA256(key, b"fetch:<step>")``, else 403) nor feed a replica a state of their own.

What it does not do: encrypt. The bytes cross the network in the clear (as torchft's do), so someone who
can watch the traffic between two hosts can read the weights, and replay a fetch token for the same step.
Integrity holds regardless; confidentiality on the wire is the network's business (a private fabric).

All the replica groups of a job must share one key: ``ELASTIC_QA_REPLICA_KEY`` (64 hex characters, e.g.
``python -c 'import secrets; print(secrets.token_hex(32))'``) set alike on every node, or else the file
``<run_dir>/replica/heal.key``, created on first use, which is shared only where the run directory is on a
file system every node sees.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import http.client
import io
import logging
import os
import re
import secrets
import socket
import stat
import threading
import time
import urllib.parse
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

KEY_ENV = "ELASTIC_QA_REPLICA_KEY"
KEY_FILE = Path("replica") / "heal.key"
TOKEN_HEADER = "X-Heal-Token"
DIGEST_HEADER = "X-Heal-Digest"
DEFAULT_MAX_BYTES = 64 << 30

_KEY_BYTES = 32
_HEX_KEY = re.compile(rb"[0-9a-fA-F]{64}")
_DIGITS = re.compile(r"[0-9]+")
_PATH = re.compile(r"/heal/([0-9]{1,19})")
_CHUNK = 8 << 20


class HealError(RuntimeError):
    """A heal could not be done safely (no key, no state, refused, damaged, forged): restore from disk."""


# --------------------------------------------------------------------------------------------- the key


def heal_key(run_dir: str | Path, *, settle_s: float = 2.0) -> bytes:
    """The job's 32-byte heal key: ``$ELASTIC_QA_REPLICA_KEY`` (64 hex characters) when set, else the file
    ``<run_dir>/replica/heal.key``, created (mode 0600, a fresh random key) if absent.

    An existing file must be a regular file (not a symlink), owned by this user, with no permission for
    group or others, holding exactly 64 hex characters (a trailing newline allowed); anything else raises
    :class:`HealError` naming the file and what is wrong. Processes racing to create it all end with the
    winner's key: a loser that finds it still empty (being written) waits for it up to ``settle_s``.
    """
    if KEY_ENV in os.environ:
        value = os.environ[KEY_ENV].strip().encode("utf-8", "replace")
        if not _HEX_KEY.fullmatch(value):
            # Never echo the value: it is meant to be a secret.
            raise HealError(
                f"{KEY_ENV} must be 64 hex characters (a 32-byte key), got {len(value)} characters"
            )
        return bytes.fromhex(value.decode("ascii"))
    path = Path(run_dir) / KEY_FILE
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    created = _create_key(path)
    if created is not None:
        return created
    deadline = time.monotonic() + settle_s
    pause = 0.005
    while True:
        text = _read_key_file(path)
        if text:
            return _parse_key(path, text)
        if time.monotonic() >= deadline:
            raise HealError(f"{path}: is empty (a key file left half-written? remove it to make a new key)")
        time.sleep(pause)
        pause = min(pause * 2, 0.1)


def _create_key(path: Path) -> bytes | None:
    """A new key written to ``path``, or None if the file exists already (another's or an earlier one)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        return None
    except OSError as err:
        raise HealError(f"{path}: cannot create the heal key file ({err.strerror})") from err
    key = secrets.token_bytes(_KEY_BYTES)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        data = key.hex().encode("ascii")
        written = os.write(fd, data)
        if written != len(data):
            raise HealError(f"{path}: short write creating the heal key file")
        os.fsync(fd)
    finally:
        os.close(fd)
    return key


def _read_key_file(path: Path) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise HealError(f"{path}: is a symbolic link; the heal key must be a regular file") from err
        raise HealError(f"{path}: cannot open the heal key file ({err.strerror})") from err
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise HealError(f"{path}: is not a regular file; the heal key must be one")
        if info.st_uid != os.getuid():
            raise HealError(f"{path}: is owned by uid {info.st_uid}, not by this user (uid {os.getuid()})")
        mode = stat.S_IMODE(info.st_mode)
        if mode & 0o077:
            raise HealError(f"{path}: has mode {mode:04o}; group and others must have no access (chmod 600)")
        return os.read(fd, 4096)
    finally:
        os.close(fd)


def _parse_key(path: Path, text: bytes) -> bytes:
    value = text.rstrip(b"\r\n")
    if not _HEX_KEY.fullmatch(value):
        raise HealError(f"{path}: does not hold exactly 64 hex characters (a 32-byte heal key)")
    return bytes.fromhex(value.decode("ascii"))


# --------------------------------------------------------------------------------------- tokens, digests


def fetch_token(key: bytes, step: int) -> str:
    """The ``X-Heal-Token`` value that asks for the state of ``step``."""
    return hmac.new(key, b"fetch:%d" % step, hashlib.sha256).hexdigest()


def state_digest(key: bytes, step: int, blob: bytes | bytearray | memoryview) -> str:
    """The ``X-Heal-Digest`` value of the serialized state ``blob`` of ``step``."""
    return hmac.new(key, b"state:%d:" % step + hashlib.sha256(blob).digest(), hashlib.sha256).hexdigest()


# ------------------------------------------------------------------------------------------ the sender


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A peer that hangs up mid-transfer is its own problem (it fails its checksum and reads from disk):
        # no traceback on stderr per request.
        logger.debug("heal request from %s failed", client_address, exc_info=True)


class _Server6(_Server):
    address_family = socket.AF_INET6


class HealServer:
    """Serves the state :meth:`offer` staged to the peers that hold the key, on ``GET /heal/<step>``.

    Started on construction in a daemon thread, bound to ``host`` on ``port`` (0: any free port). Requests
    need ``X-Heal-Token`` (see :func:`fetch_token`), else 403; a step other than the one on offer, or none
    on offer, is 404. ``io_timeout`` bounds each socket operation of a request (a stalled peer).
    """

    def __init__(
        self,
        key: bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        io_timeout: float = 60.0,
        offer_wait: float | None = None,
    ) -> None:
        if len(key) < 16:
            raise ValueError("the heal key must be at least 16 bytes")
        self._key = key
        self._host = host
        self._lock = threading.Lock()
        self._offered = threading.Condition(self._lock)  # notified at each offer and at close
        self.waiting = 0  # requests waiting for the offer of their step
        self._offer: tuple[int, bytes, str] | None = None
        self._closed = False
        server = self

        class Handler(BaseHTTPRequestHandler):
            timeout = io_timeout
            server_version = "elastic-qa-heal"
            sys_version = ""

            def do_GET(self) -> None:
                match = _PATH.fullmatch(self.path.split("?", 1)[0])
                if match is None:
                    self._empty(404)
                    return
                step = int(match.group(1))
                token = self.headers.get(TOKEN_HEADER, "")
                if not hmac.compare_digest(
                    token.strip().encode("ascii", "replace"), fetch_token(server._key, step).encode("ascii")
                ):
                    self._empty(403)
                    return
                offer = server._offer_for(step, io_timeout if offer_wait is None else offer_wait)
                if offer is None:
                    self._empty(404)
                    return
                _, blob, digest = offer
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(blob)))
                self.send_header(DIGEST_HEADER, digest)
                self.end_headers()
                view = memoryview(blob)
                for start in range(0, len(blob), _CHUNK):
                    self.wfile.write(view[start : start + _CHUNK])

            def _empty(self, code: int) -> None:
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        cls = _Server6 if ":" in host else _Server
        self._server = cls((host, port), Handler)
        # poll_interval: how long close() waits for the serving thread to notice.
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), name="heal-server", daemon=True
        )
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def address(self) -> str:
        """The URL peers fetch from: ``http://<host>:<port>`` (this host's name when bound to all)."""
        host = self._host
        if host in ("", "0.0.0.0", "::"):
            host = socket.gethostname()
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    def offer(self, step: int, state: Mapping[str, Any]) -> None:
        """Stage ``state`` as the state of ``step``: serialized here, once, so that changing its tensors
        afterwards does not change what is served. Replaces the previous offer."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        buffer = io.BytesIO()
        torch.save(state, buffer)
        blob = buffer.getvalue()
        digest = state_digest(self._key, step, blob)
        with self._offered:
            self._offer = (step, blob, digest)
            self._offered.notify_all()

    def _offer_for(self, step: int, wait_s: float) -> tuple[int, bytes, str] | None:
        """The offer of `step`, waiting up to `wait_s` for it: a healing peer learns whom to ask from the
        quorum at the same moment as this side learns to send, and may ask first."""
        deadline = time.monotonic() + wait_s
        with self._offered:
            self.waiting += 1
            try:
                while not self._closed and (self._offer is None or self._offer[0] != step):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return None
                    self._offered.wait(left)
                return None if self._closed else self._offer
            finally:
                self.waiting -= 1

    def withdraw(self) -> None:
        """Serve nothing from now on (a transfer already under way finishes from its own copy)."""
        with self._lock:
            self._offer = None

    def close(self) -> None:
        """Stop serving and free the port (idempotent)."""
        with self._offered:
            self._offer = None
            if self._closed:
                return
            self._closed = True
            self._offered.notify_all()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> HealServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------- the receiver


def fetch(url: str, step: int, key: bytes, timeout: float, max_bytes: int = DEFAULT_MAX_BYTES) -> dict:
    """The state of ``step`` from the :class:`HealServer` at ``url``, checked and loaded on the CPU.

    Raises :class:`HealError` for anything short of a whole, authentic state: refused (403: not the same
    key), none for that step (404), over ``max_bytes`` (refused before reading), short, failing its
    checksum, not loadable with ``weights_only=True``, or no answer within ``timeout`` seconds (overall).
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise HealError(f"cannot heal from {url!r}: not an http://host:port address")
    try:
        port = parts.port or 80
    except ValueError as err:
        raise HealError(f"cannot heal from {url!r}: bad port") from err
    target = parts.path.rstrip("/") + f"/heal/{step}"
    deadline = time.monotonic() + timeout
    conn = http.client.HTTPConnection(parts.hostname, port, timeout=timeout)
    try:
        try:
            conn.request("GET", target, headers={TOKEN_HEADER: fetch_token(key, step)})
            # Kept: the connection forgets its socket once it sees a response that closes it (HTTP/1.0).
            sock = conn.sock
            response = conn.getresponse()
            if response.status == 403:
                raise HealError(f"{url} refused to send the state of step {step} (not the same heal key)")
            if response.status == 404:
                raise HealError(f"{url} has no state for step {step}")
            if response.status != 200:
                raise HealError(f"{url} answered {response.status} {response.reason} for step {step}")
            if response.getheader("Transfer-Encoding") is not None:
                raise HealError(f"state from {url} for step {step} came without a plain Content-Length")
            length_text = (response.getheader("Content-Length") or "").strip()
            if not _DIGITS.fullmatch(length_text):
                raise HealError(f"state from {url} for step {step} came without a valid Content-Length")
            length = int(length_text)
            if length > max_bytes:
                raise HealError(
                    f"state from {url} for step {step} is {length} bytes, over the limit of {max_bytes}"
                )
            blob = _read_exactly(response, sock, length, deadline, url, step)
            got = (response.getheader(DIGEST_HEADER) or "").strip().encode("ascii", "replace")
        except (OSError, http.client.HTTPException) as err:
            # socket.timeout is an OSError: a dead or stalled peer, like a refused connection.
            raise HealError(f"cannot fetch the state of step {step} from {url}: {err!r}") from err
    finally:
        conn.close()
    if not hmac.compare_digest(got, state_digest(key, step, blob).encode("ascii")):
        raise HealError(f"state from {url} for step {step} failed its checksum")
    try:
        state = torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu")
    except Exception as err:
        # weights_only refused a global (code), or the bytes are no torch.save output at all.
        raise HealError(f"state from {url} for step {step} is not a loadable state: {err}") from err
    if not isinstance(state, dict):
        raise HealError(f"state from {url} for step {step} is a {type(state).__name__}, not a dict")
    return state


def _read_exactly(
    response: http.client.HTTPResponse,
    sock: socket.socket | None,
    length: int,
    deadline: float,
    url: str,
    step: int,
) -> bytearray:
    blob = bytearray(length)
    view = memoryview(blob)
    done = 0
    while done < length:
        left = deadline - time.monotonic()
        if left <= 0:
            raise HealError(
                f"timed out fetching the state of step {step} from {url} ({done} of {length} bytes)"
            )
        if sock is not None:
            sock.settimeout(left)
        n = response.readinto(view[done : done + _CHUNK])
        if not n:
            raise HealError(f"state from {url} for step {step} was cut short: {done} of {length} bytes")
        done += n
    return blob


def verify_state(received: Mapping[str, Any], expected_shapes: Mapping[str, torch.Size]) -> None:
    """Raise :class:`HealError` unless the received model state (``received["model.pt"]`` when present,
    else ``received`` itself) has exactly the parameter names and shapes of ``expected_shapes``."""
    model = received.get("model.pt", received)
    if not isinstance(model, Mapping):
        raise HealError(f"the received model state is a {type(model).__name__}, not a mapping")
    missing = sorted(set(expected_shapes) - set(model))
    extra = sorted(set(model) - set(expected_shapes))
    wrong = []
    for name, shape in expected_shapes.items():
        value = model.get(name)
        if name not in model or (isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(shape)):
            continue
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        wrong.append(f"{name} {got} != {tuple(shape)}")
    problems = []
    if missing:
        problems.append(f"missing {_few(missing)}")
    if extra:
        problems.append(f"unexpected {_few(extra)}")
    if wrong:
        problems.append(f"shape mismatch {_few(sorted(wrong))}")
    if problems:
        raise HealError("the received model state does not fit this model: " + "; ".join(problems))


def _few(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")
