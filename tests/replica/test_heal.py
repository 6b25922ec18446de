"""The heal transport of replica-group mode (elastic_qa/replica/heal.py): real sockets, real files."""

from __future__ import annotations

import http.client
import io
import multiprocessing
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_qa.replica.heal import (
    DIGEST_HEADER,
    KEY_ENV,
    TOKEN_HEADER,
    HealError,
    HealServer,
    fetch,
    fetch_token,
    heal_key,
    state_digest,
    verify_state,
)

TIMEOUT = 30.0


@pytest.fixture
def key() -> bytes:
    return secrets.token_bytes(32)


@pytest.fixture
def server(key: bytes) -> Iterator[HealServer]:
    with HealServer(key, offer_wait=0.2) as serving:
        yield serving


@pytest.fixture(autouse=True)
def no_env_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)


def sample_state(step: int = 7) -> dict[str, Any]:
    """What torchft hands to send: our checkpoint files dict under user/default, torchft's counters."""
    model = {
        "encoder.weight": torch.randn(4, 3),
        "encoder.bias": torch.zeros(3),
        "embed.ids": torch.arange(10, dtype=torch.int64),
        "head.half": torch.ones(2, 2, dtype=torch.bfloat16),
    }
    optimizer = {
        "state": {
            0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 3), "exp_avg_sq": torch.rand(4, 3)}
        },
        "param_groups": [
            {
                "lr": 1e-3,
                "betas": (0.9, 0.999),
                "eps": 1e-8,
                "weight_decay": 0.0,
                "amsgrad": False,
                "params": [0],
            }
        ],
    }
    trainer = {
        "step": step,
        "epoch": 1,
        "rng": torch.get_rng_state(),
        "nested": [[1, 2.5, "x", None, True], {"a": [torch.ones(2)], "b": (3, "y")}],
    }
    files = {"model.pt": model, "optimizer.pt": optimizer, "trainer.pt": trainer}
    return {"user": {"default": files}, "torchft": {"step": step, "batches_committed": 4 * step}}


def clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(clone(v) for v in value)
    return value


def assert_same(got: Any, want: Any, where: str = "state") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert got.dtype == want.dtype and got.device.type == "cpu", where
        assert torch.equal(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), where
        for k in want:
            assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}[{i}]")
    else:
        assert type(got) is type(want) and got == want, where


# ------------------------------------------------------------------------------------------ round trip


def test_round_trip(server: HealServer, key: bytes) -> None:
    state = sample_state(7)
    server.offer(7, state)
    assert_same(fetch(server.address(), 7, key, TIMEOUT), state)


def test_offer_is_a_snapshot(server: HealServer, key: bytes) -> None:
    state = sample_state(7)
    before = clone(state)
    server.offer(7, state)
    files = state["user"]["default"]
    files["model.pt"]["encoder.weight"].add_(1.0)
    files["optimizer.pt"]["state"][0]["exp_avg"].zero_()
    files["trainer.pt"]["nested"][1]["a"][0].mul_(5)
    files["trainer.pt"]["step"] = 99
    assert_same(fetch(server.address(), 7, key, TIMEOUT), before)


def test_a_new_offer_replaces_the_old(server: HealServer, key: bytes) -> None:
    server.offer(7, sample_state(7))
    later = sample_state(8)
    server.offer(8, later)
    assert_same(fetch(server.address(), 8, key, TIMEOUT), later)
    with pytest.raises(HealError, match="no state for step 7"):
        fetch(server.address(), 7, key, TIMEOUT)


def test_address_names_the_bound_port(server: HealServer) -> None:
    assert server.address() == f"http://127.0.0.1:{server.port}"


def test_ipv6(key: bytes) -> None:
    try:
        serving = HealServer(key, host="::1")
    except OSError as err:
        pytest.skip(f"no IPv6 loopback here: {err}")
    with serving:
        assert serving.address() == f"http://[::1]:{serving.port}"
        serving.offer(3, {"x": torch.ones(3)})
        assert torch.equal(fetch(serving.address(), 3, key, TIMEOUT)["x"], torch.ones(3))


# ---------------------------------------------------------------------------------------- refusals


def test_wrong_key_is_refused(server: HealServer, key: bytes) -> None:
    server.offer(7, sample_state(7))
    with pytest.raises(HealError, match=r"refused .* \(not the same heal key\)"):
        fetch(server.address(), 7, secrets.token_bytes(32), TIMEOUT)


def raw_get(server: HealServer, path: str, token: str | None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=TIMEOUT)
    try:
        conn.request("GET", path, headers={} if token is None else {TOKEN_HEADER: token})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_tokens_are_per_step(server: HealServer, key: bytes) -> None:
    server.offer(5, sample_state(5))
    assert raw_get(server, "/heal/5", None) == (403, b"")
    assert raw_get(server, "/heal/5", "0" * 64) == (403, b"")
    assert raw_get(server, "/heal/6", fetch_token(key, 5)) == (403, b"")  # a step-5 token asks for 5 only
    assert raw_get(server, "/heal/6", fetch_token(key, 6)) == (404, b"")
    assert raw_get(server, "/checkpoint/5/full", fetch_token(key, 5)) == (404, b"")
    status, body = raw_get(server, "/heal/5", fetch_token(key, 5))
    assert status == 200 and len(body) > 0


def test_no_offer_other_step_withdrawn(server: HealServer, key: bytes) -> None:
    with pytest.raises(HealError, match="no state for step 7"):
        fetch(server.address(), 7, key, TIMEOUT)
    server.offer(7, sample_state(7))
    with pytest.raises(HealError, match="no state for step 6"):
        fetch(server.address(), 6, key, TIMEOUT)
    fetch(server.address(), 7, key, TIMEOUT)
    server.withdraw()
    with pytest.raises(HealError, match="no state for step 7"):
        fetch(server.address(), 7, key, TIMEOUT)


def test_a_request_that_comes_before_the_offer_waits_for_it(key: bytes) -> None:
    """A healing peer learns whom to ask at the moment its peer learns to send: it may ask first."""
    with HealServer(key, offer_wait=60) as serving:
        got: list[dict] = []
        asking = threading.Thread(target=lambda: got.append(fetch(serving.address(), 3, key, 60)))
        asking.start()
        deadline = time.monotonic() + 60
        while serving.waiting == 0 and time.monotonic() < deadline:  # the request is in, with no offer yet
            time.sleep(0.005)
        assert serving.waiting == 1
        serving.offer(2, sample_state(2))  # another step's offer does not answer it
        serving.offer(3, sample_state(3))
        asking.join(60)
        assert got and got[0]["torchft"]["step"] == 3


def test_closed_server_and_nobody_listening(key: bytes) -> None:
    serving = HealServer(key)
    serving.offer(1, {"x": torch.ones(1)})
    address = serving.address()
    serving.close()
    serving.close()  # idempotent
    with pytest.raises(HealError, match="cannot fetch"):
        fetch(address, 1, key, TIMEOUT)
    with pytest.raises(HealError, match="not an http"):
        fetch("https://127.0.0.1:1", 1, key, TIMEOUT)


def test_server_writes_nothing_to_stderr(
    server: HealServer, key: bytes, capfd: pytest.CaptureFixture
) -> None:
    server.offer(7, sample_state(7))
    fetch(server.address(), 7, key, TIMEOUT)
    raw_get(server, "/heal/7", None)
    raw_get(server, "/nothing", None)
    with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as sock:
        sock.sendall(b"POST /heal/7 HTTP/1.0\r\n\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.0 501")
    with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as sock:
        sock.sendall(b"GARBAGE\r\n\r\n")
        sock.recv(100)
    fetch(server.address(), 7, key, TIMEOUT)  # served after all that: the handlers above have finished
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")


# -------------------------------------------------------------------------------- hostile servers


class FakePeer:
    """A hand-written heal server: `respond(handler, step)` answers each GET however the test wants."""

    def __init__(self, respond: Callable[[BaseHTTPRequestHandler, int], object]) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                respond(self, int(self.path.rsplit("/", 1)[1]))

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


MakePeer = Callable[[Callable[[BaseHTTPRequestHandler, int], object]], FakePeer]


@pytest.fixture
def fake_peer() -> Iterator[MakePeer]:
    peers: list[FakePeer] = []

    def make(respond: Callable[[BaseHTTPRequestHandler, int], object]) -> FakePeer:
        peers.append(FakePeer(respond))
        return peers[-1]

    yield make
    for peer in peers:
        peer.close()


def send(handler: BaseHTTPRequestHandler, body: bytes, digest: str | None, length: int | None = None) -> None:
    handler.send_response(200)
    handler.send_header("Content-Length", str(len(body) if length is None else length))
    if digest is not None:
        handler.send_header(DIGEST_HEADER, digest)
    handler.end_headers()
    handler.wfile.write(body)


def saved(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def test_tampered_state_fails_its_checksum(fake_peer: MakePeer, key: bytes) -> None:
    real, forged = saved({"w": torch.ones(3)}), saved({"w": torch.zeros(3)})
    peer = fake_peer(lambda h, step: send(h, forged, state_digest(key, step, real)))
    with pytest.raises(HealError, match=r"state from .* for step 4 failed its checksum"):
        fetch(peer.url, 4, key, TIMEOUT)


def test_missing_or_stale_digest_fails(fake_peer: MakePeer, key: bytes) -> None:
    blob = saved({"w": torch.ones(3)})
    peer = fake_peer(lambda h, step: send(h, blob, None))
    with pytest.raises(HealError, match="failed its checksum"):
        fetch(peer.url, 4, key, TIMEOUT)
    stale = fake_peer(lambda h, step: send(h, blob, state_digest(key, step - 1, blob)))  # another step's
    with pytest.raises(HealError, match="failed its checksum"):
        fetch(stale.url, 4, key, TIMEOUT)
    other_key = fake_peer(lambda h, step: send(h, blob, state_digest(secrets.token_bytes(32), step, blob)))
    with pytest.raises(HealError, match="failed its checksum"):
        fetch(other_key.url, 4, key, TIMEOUT)


class Payload:
    """Unpickled, it opens (so creates) the marker file: code run by whoever loads it unsafely."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


class Plain:
    def __init__(self) -> None:
        self.value = 1


def test_code_in_the_pickle_never_runs(fake_peer: MakePeer, key: bytes, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    blob = saved({"model.pt": {"w": torch.ones(2)}, "trainer.pt": {"x": Payload(marker)}})
    peer = fake_peer(lambda h, step: send(h, blob, state_digest(key, step, blob)))  # the right key
    with pytest.raises(HealError, match=f"state from {peer.url} for step 4 is not a loadable state"):
        fetch(peer.url, 4, key, TIMEOUT)
    assert not marker.exists()
    # The payload is live: loaded the unsafe way (torchft's), it runs.
    loaded = torch.load(io.BytesIO(blob), weights_only=False)
    loaded["trainer.pt"]["x"].close()
    assert marker.exists()


def test_a_class_instance_is_refused(fake_peer: MakePeer, key: bytes) -> None:
    blob = saved({"model.pt": {"w": torch.ones(2)}, "trainer.pt": Plain()})
    peer = fake_peer(lambda h, step: send(h, blob, state_digest(key, step, blob)))
    with pytest.raises(HealError, match="not a loadable state"):
        fetch(peer.url, 4, key, TIMEOUT)


def test_not_a_dict_or_not_torch_is_refused(fake_peer: MakePeer, key: bytes) -> None:
    listed = saved([torch.ones(2)])
    peer = fake_peer(lambda h, step: send(h, listed, state_digest(key, step, listed)))
    with pytest.raises(HealError, match="is a list, not a dict"):
        fetch(peer.url, 4, key, TIMEOUT)
    junk = b"not a torch file at all"
    junk_peer = fake_peer(lambda h, step: send(h, junk, state_digest(key, step, junk)))
    with pytest.raises(HealError, match="not a loadable state"):
        fetch(junk_peer.url, 4, key, TIMEOUT)


def test_over_max_bytes_is_refused_before_reading(fake_peer: MakePeer, key: bytes) -> None:
    release = threading.Event()

    def announce_huge(handler: BaseHTTPRequestHandler, step: int) -> None:
        handler.send_response(200)
        handler.send_header("Content-Length", str(1 << 50))
        handler.send_header(DIGEST_HEADER, "0" * 64)
        handler.end_headers()
        handler.wfile.flush()
        release.wait(TIMEOUT)  # sends no body: a client that tried to read it would wait out its timeout

    peer = fake_peer(announce_huge)
    try:
        with pytest.raises(HealError, match=f"is {1 << 50} bytes, over the limit of 1000"):
            fetch(peer.url, 4, key, TIMEOUT, max_bytes=1000)
    finally:
        release.set()


def test_over_max_bytes_from_a_real_server(server: HealServer, key: bytes) -> None:
    server.offer(7, sample_state(7))
    with pytest.raises(HealError, match="over the limit of 100"):
        fetch(server.address(), 7, key, TIMEOUT, max_bytes=100)


def test_short_body_is_refused(fake_peer: MakePeer, key: bytes) -> None:
    blob = saved({"w": torch.ones(100)})
    peer = fake_peer(lambda h, step: send(h, blob[:50], state_digest(key, step, blob), length=len(blob)))
    with pytest.raises(HealError, match=f"cut short: 50 of {len(blob)} bytes"):
        fetch(peer.url, 4, key, TIMEOUT)


def test_bad_content_length_is_refused(fake_peer: MakePeer, key: bytes) -> None:
    def no_length(handler: BaseHTTPRequestHandler, step: int) -> None:
        handler.send_response(200)
        handler.end_headers()
        handler.wfile.write(b"abc")

    peer = fake_peer(no_length)
    with pytest.raises(HealError, match="without a valid Content-Length"):
        fetch(peer.url, 4, key, TIMEOUT)


def test_silent_peer_times_out(fake_peer: MakePeer, key: bytes) -> None:
    release = threading.Event()
    peer = fake_peer(lambda h, step: release.wait(TIMEOUT))
    try:
        with pytest.raises(HealError, match="cannot fetch the state of step 4"):
            fetch(peer.url, 4, key, 0.3)
    finally:
        release.set()


# ------------------------------------------------------------------------------------------ verify_state


def test_verify_state() -> None:
    model = {"a.weight": torch.ones(2, 3), "a.bias": torch.ones(3)}
    shapes = {name: t.shape for name, t in model.items()}
    verify_state({"model.pt": model, "trainer.pt": {}}, shapes)
    verify_state(model, shapes)
    with pytest.raises(HealError, match=r"missing a.bias"):
        verify_state({"model.pt": {"a.weight": torch.ones(2, 3)}}, shapes)
    with pytest.raises(HealError, match=r"unexpected extra"):
        verify_state({"model.pt": {**model, "extra": torch.ones(1)}}, shapes)
    with pytest.raises(HealError, match=r"shape mismatch a.weight \(3, 2\) != \(2, 3\)"):
        verify_state({"model.pt": {**model, "a.weight": torch.ones(3, 2)}}, shapes)
    with pytest.raises(HealError, match=r"a.bias int != \(3,\)"):
        verify_state({"model.pt": {**model, "a.bias": 3}}, shapes)
    with pytest.raises(HealError, match="not a mapping"):
        verify_state({"model.pt": [1]}, shapes)


# ---------------------------------------------------------------------------------------------- the key


def key_path(run_dir: Path) -> Path:
    return run_dir / "replica" / "heal.key"


def test_key_file_is_created_private_and_reused(tmp_path: Path) -> None:
    old = os.umask(0)  # the file is 0600 whatever the umask
    try:
        first = heal_key(tmp_path / "run")
    finally:
        os.umask(old)
    path = key_path(tmp_path / "run")
    info = path.lstat()
    assert len(first) == 32
    assert info.st_mode & 0o777 == 0o600 and info.st_uid == os.getuid()
    assert path.read_text() == first.hex()
    assert heal_key(str(tmp_path / "run")) == first
    assert heal_key(tmp_path / "other") != first


def test_a_written_key_with_a_newline_is_accepted(tmp_path: Path) -> None:
    path = key_path(tmp_path)
    path.parent.mkdir()
    chosen = secrets.token_bytes(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, chosen.hex().upper().encode() + b"\n")
    os.close(fd)
    assert heal_key(tmp_path) == chosen


def test_symlinked_key_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text(secrets.token_hex(32))
    target.chmod(0o600)
    path = key_path(tmp_path)
    path.parent.mkdir()
    path.symlink_to(target)
    with pytest.raises(HealError, match=f"^{path}: is a symbolic link"):
        heal_key(tmp_path)
    path.unlink()
    path.symlink_to(tmp_path / "dangling")  # O_EXCL refuses to create through it too
    with pytest.raises(HealError, match="symbolic link"):
        heal_key(tmp_path)
    assert not (tmp_path / "dangling").exists()


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o602, 0o700 | 0o010])
def test_key_open_to_others_is_refused(tmp_path: Path, mode: int) -> None:
    heal_key(tmp_path)
    key_path(tmp_path).chmod(mode)
    with pytest.raises(HealError, match=f"{key_path(tmp_path)}: has mode {mode:04o}"):
        heal_key(tmp_path)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_key_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    heal_key(tmp_path)
    os.chown(key_path(tmp_path), 65534, -1)
    with pytest.raises(HealError, match="is owned by uid 65534"):
        heal_key(tmp_path)


def test_key_not_a_regular_file_is_refused(tmp_path: Path) -> None:
    path = key_path(tmp_path)
    path.parent.mkdir()
    os.mkfifo(path, 0o600)  # O_NONBLOCK: opening it does not hang
    with pytest.raises(HealError, match="is not a regular file"):
        heal_key(tmp_path)
    path.unlink()
    path.mkdir(mode=0o700)
    with pytest.raises(HealError, match=f"^{path}: "):
        heal_key(tmp_path)


@pytest.mark.parametrize(
    "content", [b"abc", b"z" * 64, b"a" * 66, b"a" * 63 + b" ", b"a" * 32 + b"\n" + b"a" * 32]
)
def test_key_file_with_bad_content_is_refused(tmp_path: Path, content: bytes) -> None:
    path = key_path(tmp_path)
    path.parent.mkdir()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, content)
    os.close(fd)
    with pytest.raises(HealError, match=f"^{path}: does not hold exactly 64 hex characters"):
        heal_key(tmp_path)


def test_empty_key_file_is_waited_for_then_refused(tmp_path: Path) -> None:
    path = key_path(tmp_path)
    path.parent.mkdir()
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    with pytest.raises(HealError, match=f"^{path}: is empty"):
        heal_key(tmp_path, settle_s=0.05)


def test_env_key_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    chosen = secrets.token_bytes(32)
    monkeypatch.setenv(KEY_ENV, chosen.hex())
    assert heal_key(tmp_path) == chosen
    assert not key_path(tmp_path).exists()


@pytest.mark.parametrize("value", ["", "abc", "g" * 64, "a" * 66, "a" * 63])
def test_bad_env_key_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(KEY_ENV, value)
    with pytest.raises(HealError, match=f"^{KEY_ENV} must be 64 hex characters") as caught:
        heal_key(tmp_path)
    if len(value) > 3:
        assert value not in str(caught.value)  # a secret is never echoed
    assert not key_path(tmp_path).exists()


def race_for_key(run_dir: str, barrier: Any, results: Any) -> None:
    try:
        barrier.wait(TIMEOUT)
        results.put(heal_key(run_dir).hex())
    except (HealError, OSError, threading.BrokenBarrierError) as err:
        results.put(f"error: {err!r}")


def test_racing_processes_get_the_same_key(tmp_path: Path) -> None:
    context = multiprocessing.get_context("fork")
    racers = 4
    for round_ in range(5):
        run_dir = tmp_path / f"run{round_}"
        barrier, results = context.Barrier(racers), context.Queue()
        processes = [
            context.Process(target=race_for_key, args=(str(run_dir), barrier, results)) for _ in range(racers)
        ]
        for process in processes:
            process.start()
        keys = [results.get(timeout=TIMEOUT) for _ in processes]
        for process in processes:
            process.join(TIMEOUT)
            assert process.exitcode == 0
        assert len(set(keys)) == 1, keys
        assert keys[0] == key_path(run_dir).read_text()
