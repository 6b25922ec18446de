"""One builder per cache key, also across hosts that share the cache directory on network storage.

Correctness rests on one atomic step: a builder writes into a private staging directory and publishes it
with `rename(staging, final)`, which fails when `final` already exists (a directory is only renamed onto
an empty one, and a published cache never is): the loser discards its copy and uses the winner's, and
no reader ever sees a half-written cache. The lease only saves work: a file created with O_EXCL (atomic
on NFS v3+ and every local filesystem, unlike flock, which some network filesystems ignore) names its
holder, who refreshes its mtime (and its staging directory's) while building. Waiters break a lease
whose holder is a dead process on this host, or whose heartbeat is older than STALE_S (a host that
died); if two builders ever overlap, the rename still lets exactly one publish.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

HOST = socket.gethostname().replace("-", "_") or "host"
HEARTBEAT_S = 5.0
STALE_S = 120.0  # no heartbeat for this long: the holder's host is taken for dead


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _holder_dead(host: str, pid: int, age: float) -> bool:
    if host == HOST:
        return not pid_alive(pid)
    return age > STALE_S


class Lease:
    """A held lease: `beat()` often (it touches the file at most every HEARTBEAT_S)."""

    def __init__(self, path: Path, token: str) -> None:
        self.path, self.token = path, token
        self.last = time.monotonic()
        self.touched: list[Path] = [path]

    def beat(self) -> None:
        # Called from the builder's own loop, not a thread: worker processes are forked, which is only
        # safe while this process runs a single thread.
        if time.monotonic() - self.last < HEARTBEAT_S:
            return
        self.last = time.monotonic()
        for path in self.touched:
            with contextlib.suppress(OSError):
                os.utime(path)


@contextlib.contextmanager
def lease(path: Path) -> Iterator[Lease | None]:
    """Yield a Lease while this process holds the one at `path`, else None (someone else holds it)."""
    token = uuid.uuid4().hex
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        _break_if_dead(path)
        yield None
        return
    with os.fdopen(fd, "w") as handle:
        handle.write(json.dumps({"host": HOST, "pid": os.getpid(), "token": token}))
    try:
        yield Lease(path, token)
    finally:
        with contextlib.suppress(OSError, ValueError):
            if json.loads(path.read_text()).get("token") == token:  # not if a waiter broke it meanwhile
                path.unlink()


def _break_if_dead(path: Path) -> None:
    try:
        age = time.time() - path.stat().st_mtime
        holder = json.loads(path.read_text())
        host, pid = str(holder["host"]), int(holder["pid"])
    except FileNotFoundError:
        return
    except (OSError, ValueError, KeyError, TypeError):
        host, pid = "", 0  # being written right now, or garbage: judge by age alone
        age = time.time() - path.stat().st_mtime if path.exists() else 0.0
    if _holder_dead(host, pid, age):
        # Renamed first so that only one waiter removes it; a race at worst lets two build (see module).
        broken = path.with_name(f"{path.name}.broken-{HOST}-{os.getpid()}")
        with contextlib.suppress(OSError):
            os.rename(path, broken)
            broken.unlink()


def clean_stale_staging(root: Path, key: str) -> None:
    """Remove staging directories of builders that died: this host's by pid, other hosts' by age."""
    for staging in root.glob(f"{key}.tmp-*"):
        suffix = staging.name.removeprefix(f"{key}.tmp-")
        host, _, pid = suffix.rpartition("-")
        try:
            age = time.time() - staging.stat().st_mtime
            dead = _holder_dead(host or HOST, int(pid), age)
        except (OSError, ValueError):
            continue
        if dead:
            shutil.rmtree(staging, ignore_errors=True)


def publish(staging: Path, final: Path) -> bool:
    """Rename `staging` to `final`; False (and `staging` removed) when another builder published first."""
    try:
        os.rename(staging, final)
        return True
    except OSError as err:
        if err.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not final.exists():
            raise
    shutil.rmtree(staging, ignore_errors=True)
    return False
