"""A live job holds its run: a start that is not part of it is refused, unless the holder is provably gone.

Fencing (checkpoint/fencing.py) lets the newest registered attempt win, which is right for a worker group
that regroups, and wrong for a second job started on the same run by hand: its registration would fence the
live job, which then restarts from its last checkpoint (from step 0 when none was saved yet). So before a
group registers, rank 0 takes the hold of the checkpoint store, the thing fencing protects (any fsspec
URL, possibly shared between hosts): a record in `<checkpoint.dir>/holders/<run id>.json` naming the job
(its torchrun run id, TORCHELASTIC_RUN_ID), since when it holds the run, a heartbeat, and every process of
it: each rank's worker and its torchrun agent (host, boot id, pid, start time; see elastic_qa.liveness).

- Same run id: a regrouped or restarted group of the same job (rank 0 may now be another process on
  another host) takes the hold over, keeping `since`.
- Another run id: refused (RunHeldError, exit 2, one line naming the live job and how to join it) unless
  every process of the holder is provably gone: on this host its pid no longer runs or runs with another
  start time, or the host rebooted; on another host its heartbeat is older than STALE_S (the hosts'
  clocks must agree to well within that: the heartbeat is the holder's wall clock). A job that died
  (killed, crashed, stopped) is gone as soon as its processes are, so a restart resumes at once.
- Two starts at one moment: each writes its record, then lists the holders; the one that holds since
  later (run id as tie-break) withdraws. Like fencing, this needs no atomic create, only a listing that
  shows every file written before it began.

Rank 0 refreshes the heartbeat every HEARTBEAT_S from a daemon thread (one small write; a failing write is
logged once and never stops training) and removes the record when the job ends done. A job stopped or
killed leaves it behind: its processes are gone, which is all a later start needs to see.

Only this product's records are ever removed: an entry of `holders/` that is not a regular file holding
one (a directory, a link, a FIFO, anything unreadable; atomic writes never leave a torn record) is no
holder and is left alone, and `holders/` itself is used only as a real directory (checkpoint/confined.py).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import stat
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from elastic_qa.checkpoint.confined import HOLDERS_DIR, confined
from elastic_qa.checkpoint.errors import CheckpointError
from elastic_qa.liveness import Holder, Verdict, judge_all, this_process, torchrun_agent_pid

if TYPE_CHECKING:  # a type only: structlog is not imported here for it
    from elastic_qa.observe.log import EventLog

HEARTBEAT_S = 10.0
STALE_S = 120.0  # no heartbeat for this long: a holder on another host is taken for gone
_SAFE = re.compile(r"[^A-Za-z0-9._-]")
MAX_RECORD_BYTES = 2**20  # a record names a job's processes: a few hundred bytes each


REFUSED_LINE = "is held by a live job"  # in every refusal: how a tool tells it from other exits 2


class RunHeldError(Exception):
    """Another live job holds the run: this start must not go on (exit 2, never fencing that job)."""


def local_processes() -> list[dict[str, Any]]:
    """This worker and its agent, as the hold records them (each rank sends its own to rank 0): while
    the agent lives the job lives, even between a worker's death and the group's restart."""
    found = [this_process().to_dict()]
    parent = torchrun_agent_pid()
    if parent is not None:
        found.append(this_process(parent).to_dict())
    return found


def unique(processes: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each process once (the ranks of one agent all name it)."""
    return list({(p["host"], p["pid"]): p for p in processes}.values())


@dataclass
class HoldRecord:
    run_id: str
    since: float
    heartbeat: float
    run_dir: str
    processes: list[dict[str, Any]]

    @property
    def holders(self) -> list[Holder]:
        return [Holder.from_dict(p, self.heartbeat) for p in self.processes]

    def judge(self, now: float | None = None) -> Verdict:
        return judge_all(self.holders, STALE_S, now)

    def describe(self) -> str:
        first = self.holders[0].describe() if self.processes else "no process"
        return f"run {self.run_id} (rank 0 {first}, since {_clock(self.since)})"

    def to_json(self) -> bytes:
        return json.dumps(self.__dict__).encode()

    @classmethod
    def from_json(cls, data: bytes) -> HoldRecord:
        raw = json.loads(data)
        record = cls(
            str(raw["run_id"]),
            float(raw["since"]),
            float(raw["heartbeat"]),
            str(raw.get("run_dir", "")),
            list(raw["processes"]),
        )
        if not (math.isfinite(record.since) and math.isfinite(record.heartbeat)):
            raise ValueError("since and heartbeat must be times")
        record.holders  # noqa: B018 - raises now for a record whose processes are not ones
        return record


def _clock(stamp: float) -> str:
    return datetime.fromtimestamp(stamp, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def refusal(url: str, holder: HoldRecord, verdict: Verdict) -> str:
    """The one line that refuses a start on a run a live job holds."""
    run_dir = holder.run_dir or "RUN_DIR"
    if holder.run_id.startswith("single-"):  # a process started without torchrun: it takes no peers
        join = "it runs alone (no torchrun), so nothing can join it: wait for it to end"
    else:
        join = (
            f"to add workers to it: launch/local.sh join --run-dir {run_dir} on its host, or elastic-qa "
            f"node --rdzv-id {holder.run_id} with its endpoint"
        )
    return (
        f"{url} {REFUSED_LINE}: {holder.describe()}; alive because {verdict.why}. Nothing was "
        f"changed; {join}; to start anew, stop it first or use another checkpoint.dir"
    )


class RunHold:
    """The hold of the checkpoint store at `url` by job `run_id` (see the module's docstring)."""

    def __init__(
        self, url: str, run_id: str, run_dir: str, fs: fsspec.AbstractFileSystem | None = None
    ) -> None:
        if fs is None:
            fs, root = fsspec.core.url_to_fs(url)
        else:
            root = fs._strip_protocol(url)
        self.url, self.fs, self.run_id, self.run_dir = url, fs, run_id, run_dir
        self.root = root
        self.directory = f"{root.rstrip('/')}/{HOLDERS_DIR}"
        self.mine: HoldRecord | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.beat_error: str | None = None

    def _path(self, run_id: str) -> str:
        return f"{self.directory}/{_SAFE.sub('_', run_id)}.json"

    def _confined(self) -> None:
        """CheckpointError when `holders/` is not a real directory of the checkpoint directory."""
        confined(self.fs, self.root, HOLDERS_DIR)

    def _read(self, path: str) -> bytes:
        """A record's bytes: a regular file only (never through a link, never a FIFO), at most
        MAX_RECORD_BYTES (ValueError for anything else)."""
        if isinstance(self.fs, LocalFileSystem):
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as handle:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise ValueError(f"{path} is not a regular file")
                data = handle.read(MAX_RECORD_BYTES + 1)
        else:
            if self.fs.info(path).get("type") != "file":
                raise ValueError(f"{path} is not a file")
            data = self.fs.cat_file(path, start=0, end=MAX_RECORD_BYTES + 1)
        if len(data) > MAX_RECORD_BYTES:
            raise ValueError(f"{path} is larger than a hold record")
        return data

    # ---- reading ------------------------------------------------------------------------------------
    def others(self) -> list[tuple[str, HoldRecord | None]]:
        """Every other job's record (None: not a record, which atomic writes never leave: no holder)."""
        self._confined()
        self.fs.invalidate_cache()
        try:
            names = self.fs.ls(self.directory, detail=False)
        except FileNotFoundError:
            return []
        mine = self._path(self.run_id).rsplit("/", 1)[-1]
        found: list[tuple[str, HoldRecord | None]] = []
        for name in names:
            base = name.rstrip("/").rsplit("/", 1)[-1]
            if not base.endswith(".json") or base.startswith(".") or base == mine:
                continue
            path = f"{self.directory}/{base}"
            try:
                found.append((path, HoldRecord.from_json(self._read(path))))
            except FileNotFoundError:
                continue  # released meanwhile
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                found.append((path, None))
        return found

    def live_holder(self) -> tuple[HoldRecord, Verdict] | None:
        """Another job's record whose processes are not all provably gone, the oldest first."""
        live = []
        for _, record in self.others():
            if record is not None and record.run_id != self.run_id:
                verdict = record.judge()
                if not verdict.gone:
                    live.append((record.since, record.run_id, record, verdict))
        return (min(live)[2], min(live)[3]) if live else None

    def check(self) -> None:
        """Raise RunHeldError when another live job holds the run (reads only: a start's first check)."""
        held = self.live_holder()
        if held is not None:
            raise RunHeldError(refusal(self.url, *held))

    # ---- holding ------------------------------------------------------------------------------------
    def acquire(self, processes: Iterable[dict[str, Any]], log: EventLog | None = None) -> HoldRecord:
        """Take the hold for this job (rank 0, before it registers an attempt), or raise RunHeldError."""
        now = time.time()
        self._confined()
        try:
            since = HoldRecord.from_json(self._read(self._path(self.run_id))).since  # a regroup
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            since = now
        self.mine = HoldRecord(self.run_id, since, now, self.run_dir, list(processes))
        self.fs.makedirs(self.directory, exist_ok=True)
        self._write(self.mine)
        for path, record in self.others():
            if record is None:  # not ours to judge or remove
                if log is not None:
                    log.warning("run_hold_foreign_entry", path=path)
                continue
            verdict = record.judge()
            if verdict.gone:
                if log is not None:
                    log.warning("run_hold_taken_over", previous=record.describe(), why=verdict.why)
                with contextlib.suppress(OSError):
                    self.fs.rm(path)
            elif (record.since, record.run_id) < (since, self.run_id):
                self.release()  # the older holder stays; one that came after us withdraws on seeing us
                raise RunHeldError(refusal(self.url, record, verdict))
        return self.mine

    def _write(self, record: HoldRecord) -> None:
        """Replace this job's record in one step: a reader sees the old record or the new, never half."""
        path = self._path(record.run_id)
        self._confined()
        if isinstance(self.fs, LocalFileSystem):
            staging = f"{self.directory}/.{uuid.uuid4().hex}.tmp"
            self.fs.pipe_file(staging, record.to_json())
            os.replace(staging, path)
        else:  # object stores: one object write is atomic
            self.fs.pipe_file(path, record.to_json())

    def beat(self) -> None:
        if self.mine is not None:
            self.mine.heartbeat = time.time()
            self._write(self.mine)

    def start_heartbeat(self, log: EventLog | None = None) -> None:
        """Refresh the heartbeat every HEARTBEAT_S from a daemon thread; a failing write is logged once
        and retried at the next beat, never raised into training."""

        def loop() -> None:
            while not self._stop.wait(HEARTBEAT_S):
                try:
                    self.beat()
                    self.beat_error = None
                except Exception as err:  # noqa: BLE001 - storage trouble must not stop training
                    if self.beat_error is None and log is not None:
                        log.warning("run_hold_heartbeat_failed", error=f"{type(err).__name__}: {err}")
                    self.beat_error = str(err) or type(err).__name__

        if self._thread is None and self.mine is not None:
            self._thread = threading.Thread(target=loop, name="run-hold-heartbeat", daemon=True)
            self._thread.start()

    def stop_heartbeat(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)  # a write hung on storage must not hold up the exit
            self._thread = None

    def release(self) -> None:
        """Give the hold up (the job ended done, or withdrew): a later start needs no liveness check."""
        self.stop_heartbeat()
        if self.mine is not None:
            with contextlib.suppress(OSError, CheckpointError):
                self._confined()
                self.fs.rm(self._path(self.run_id))
            self.mine = None


def check_before_start(checkpoint_dir: str, run_id: str, run_dir: str) -> None:
    """Before a start writes anything (the worker, the local launcher, the node command): RunHeldError when
    another live job holds the run, CheckpointError when `holders/` is no real directory of the checkpoint
    directory; other storage trouble is left to the worker's registration, which decides."""
    try:
        RunHold(checkpoint_dir, run_id, run_dir).check()
    except (RunHeldError, CheckpointError):
        raise
    except Exception:  # noqa: BLE001 - storage trouble: the hold taken at registration decides
        pass
