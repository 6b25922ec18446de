"""One builder per cache key, also across hosts that share the cache directory on network storage.

Correctness rests on one atomic step: a builder writes into a private staging directory and publishes it
with `rename(staging, final)`, which fails when `final` already exists (a directory is only renamed onto
an empty one, and a published cache never is): the loser discards its copy and uses the winner's, and
no reader ever sees a half-written cache. The lease only saves work: a file created with O_EXCL (atomic
on NFS v3+ and every local filesystem, unlike flock, which some network filesystems ignore) names its
holder (host, boot id, pid and its start time: see elastic_qa.liveness), who refreshes its mtime (and its
staging directory's) while building. Waiters break a lease only once its holder is provably gone
(`liveness.judge`, the mtime as heartbeat): on this host a pid that no longer runs, or runs as another
process (a reused pid), or a reboot; on another host a heartbeat older than STALE_S. If two builders ever
overlap, the rename still lets exactly one publish.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from elastic_qa.liveness import HOST, Holder, Verdict, judge, this_process
from elastic_qa.prep.files import read_small

HEARTBEAT_S = 5.0
STALE_S = 120.0  # no heartbeat for this long: the holder's host is taken for dead
LEASE_BYTES = 64 * 1024  # a lease record is a few hundred bytes; a larger file is not one


def _holder_dead(host: str, pid: int, age: float) -> bool:
    """A holder known only by host and pid (a staging directory's name): its mtime is its heartbeat."""
    return judge(Holder(host, pid, heartbeat=time.time() - age), STALE_S).gone


@dataclass(frozen=True)
class LeaseHolder:
    """Who holds a lease, as read from its file."""

    holder: Holder
    since: float | None  # when it took the lease (None: a lease written before this was recorded)
    verdict: Verdict

    def describe(self) -> str:
        since = f", since {_clock(self.since)}" if self.since else ""
        return f"{self.holder.describe()}{since} ({self.verdict.why})"


def _clock(stamp: float) -> str:
    return datetime.fromtimestamp(stamp, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def read_holder(path: Path) -> LeaseHolder | None:
    """The holder of the lease at `path` and whether it is gone; None when there is no lease. A file that
    cannot be read as one (being written right now, or garbage) is judged by its age alone."""
    try:
        heartbeat = path.stat().st_mtime
        record = json.loads(read_small(str(path), LEASE_BYTES))
        holder = Holder.from_dict(record, heartbeat)
        since = float(record["since"]) if record.get("since") is not None else None
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        try:
            heartbeat = path.stat().st_mtime
        except OSError:
            return None
        holder, since = Holder("", 0, heartbeat=heartbeat), None
        age = time.time() - heartbeat
        return LeaseHolder(holder, since, Verdict(age > STALE_S, f"unreadable lease, {age:.0f} s old"))
    return LeaseHolder(holder, since, judge(holder, STALE_S))


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
        handle.write(json.dumps({**this_process().to_dict(), "since": time.time(), "token": token}))
    try:
        yield Lease(path, token)
    finally:
        with contextlib.suppress(OSError, ValueError):
            # Not if a waiter broke it meanwhile.
            if json.loads(read_small(str(path), LEASE_BYTES)).get("token") == token:
                path.unlink()


def _break_if_dead(path: Path) -> None:
    holder = read_holder(path)
    if holder is not None and holder.verdict.gone:
        # Renamed first so that only one waiter removes it; a race at worst lets two build (see module).
        broken = path.with_name(f"{path.name}.broken-{HOST}-{os.getpid()}")
        with contextlib.suppress(OSError):
            os.rename(path, broken)
            broken.unlink()


def clean_stale_staging(root: Path, key: str) -> None:
    """Remove staging directories of builders that are gone: this host's by pid and age (the name holds no
    start time), other hosts' by age (`_holder_dead`)."""
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
