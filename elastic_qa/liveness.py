"""Is the process that holds something (a cache lease, a run) provably gone, or possibly still alive?

A holder is recorded as {host, boot_id, pid, start, heartbeat}: `boot_id` is the kernel's id of the current
boot (/proc/sys/kernel/random/boot_id), `start` the process's start time in clock ticks since boot (field
22 of /proc/<pid>/stat), `heartbeat` the wall-clock time the holder last said it was alive. A pid alone
proves nothing: pids are reused, and after a reboot or in a fresh container pid 1 or a low pid always
runs. The rules, from the strongest evidence to the weakest:

    another host          gone only when its heartbeat is older than the stale threshold (no pid to ask)
    this host, another boot      gone (every process of that boot has ended)
    this host, this boot  gone when the pid does not run (or is a zombie) or runs with another start time
                          (the pid was reused); alive when the pid runs with the recorded start time
    no start time         (a record written before these fields existed, or no /proc): gone when the pid
                          does not run, or when the heartbeat is older than the stale threshold (a live
                          holder beats more often than that); else alive

A heartbeat that is no time (NaN, infinite) or lies further ahead of this host's clock than the stale
threshold is no sign of life: the hosts' clocks must agree to well within it, so it counts as stale (such
a record used to hold a run forever).

Standard library only: the data cache and the launcher use it without torch.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# Underscores: a host name is also part of file names that are split at '-' (prep/lease.py's staging).
HOST = socket.gethostname().replace("-", "_") or "host"
_BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"


def boot_id() -> str | None:
    """This boot's id, or None where the kernel does not tell (not Linux)."""
    try:
        with open(_BOOT_ID_FILE) as handle:
            return handle.read().strip() or None
    except OSError:
        return None


def _stat_fields(pid: int) -> list[str] | None:
    """Fields 3 onwards of /proc/<pid>/stat (after the command name, which may hold spaces and ')'),
    or None when the process does not exist or /proc cannot say."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int) -> int | None:
    """When `pid` started, in clock ticks since boot (field 22 of /proc/<pid>/stat); None if unknown."""
    fields = _stat_fields(pid)
    if fields is None or len(fields) < 20:
        return None
    with contextlib.suppress(ValueError):
        return int(fields[19])  # field 22; fields[0] is field 3
    return None


def torchrun_agent_pid() -> int | None:
    """The pid of the live torchrun agent that started this process, else None (see `agent_lineage`)."""
    lineage = agent_lineage()
    return lineage[-1] if lineage else None


def agent_lineage() -> list[int] | None:
    """The processes between this one and the torchrun agent that started it, the agent last: [agent]
    for a worker the agent spawned; [forkserver, agent] for a warm worker, forked by the agent's
    multiprocessing forkserver (launcher/warm_start.py). None outside torchrun.

    Call it at start-up, before the agent can have died. A parent that is pid 1 is no agent to watch:
    either the process was re-parented already (to init) or the agent is the container's init, whose
    end ends every process in it. A parent that is a subreaper cannot be told from outside, but neither
    does it change while the process lives, which is all the watchdog looks for. The forkserver does not
    end with the agent (each worker holds the pipe whose closing would tell it), so a warm worker watches
    the forkserver's parent as well as its own.
    """
    parent = os.getppid()
    if "TORCHELASTIC_RUN_ID" not in os.environ or parent <= 1:
        return None
    if not is_forkserver(parent):
        return [parent]
    agent = parent_pid(parent)
    return [parent, agent] if agent is not None and agent > 1 else None


def lineage_intact(lineage: list[int]) -> bool:
    """Whether each process of `agent_lineage()`'s answer is still the parent of the one before it."""
    return os.getppid() == lineage[0] and all(
        parent_pid(child) == parent for child, parent in itertools.pairwise(lineage)
    )


def parent_pid(pid: int) -> int | None:
    """The parent of `pid` (field 4 of /proc/<pid>/stat), or None when it is gone or /proc cannot say."""
    fields = _stat_fields(pid)
    if fields is None or len(fields) < 2 or fields[0] == "Z":
        return None
    with contextlib.suppress(ValueError):
        return int(fields[1])
    return None


def is_forkserver(pid: int) -> bool:
    """Whether `pid` is a multiprocessing forkserver (or a process it forked: they share its command line)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return b"multiprocessing.forkserver" in handle.read()
    except OSError:
        return False


def pid_runs(pid: int) -> bool:
    """`pid` exists and is not a zombie (a killed process its parent has not reaped yet)."""
    if pid <= 0:
        return False
    fields = _stat_fields(pid)
    if fields is not None:
        return fields[0] != "Z"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    except OSError:
        return False
    return True


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    boot_id: str | None = None
    start: int | None = None  # clock ticks since boot; None: unknown (an older record, or no /proc)
    heartbeat: float = 0.0  # time.time() of its last sign of life

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}"

    def to_dict(self) -> dict[str, Any]:
        return {"host": self.host, "pid": self.pid, "boot_id": self.boot_id, "start": self.start}

    @classmethod
    def from_dict(cls, record: Mapping[str, Any], heartbeat: float) -> Holder:
        """A holder from a record (raises KeyError, TypeError or ValueError for one that is not)."""
        start = record.get("start")
        boot = record.get("boot_id")
        return cls(
            host=str(record["host"]),
            pid=int(record["pid"]),
            boot_id=str(boot) if boot else None,
            start=int(start) if start is not None else None,
            heartbeat=float(heartbeat),
        )


def this_process(pid: int | None = None, heartbeat: float | None = None) -> Holder:
    """A record of `pid` (default: this process) on this host, as holders write it."""
    pid = os.getpid() if pid is None else pid
    beat = time.time() if heartbeat is None else heartbeat
    return Holder(HOST, pid, boot_id(), start_time(pid), beat)


@dataclass(frozen=True)
class Verdict:
    gone: bool
    why: str  # a clause for a sentence: "pid 7 runs with the recorded start time"


def judge(holder: Holder, stale_s: float, now: float | None = None) -> Verdict:
    """Whether `holder` is provably gone (the rules in the module's docstring) and why."""
    age = (time.time() if now is None else now) - holder.heartbeat
    beat = f"its last heartbeat {max(age, 0.0):.0f} s ago"
    if not (math.isfinite(age) and age >= -stale_s):  # no time, or from a clock far ahead of ours
        age, beat = math.inf, f"its heartbeat {holder.heartbeat!r} is no time this host's clock agrees with"
    if holder.host != HOST:
        if age > stale_s:
            return Verdict(True, f"host {holder.host}: {beat}, stale after {stale_s:.0f} s")
        return Verdict(False, f"host {holder.host}: {beat} (stale after {stale_s:.0f} s)")
    mine = boot_id()
    if holder.boot_id and mine and holder.boot_id != mine:
        return Verdict(True, "this host has rebooted since")
    if not pid_runs(holder.pid):
        return Verdict(True, f"pid {holder.pid} no longer runs")
    current = start_time(holder.pid) if holder.start is not None else None
    if holder.start is not None and current is not None:
        if current != holder.start:
            return Verdict(True, f"pid {holder.pid} is another process now (the pid was reused)")
        return Verdict(False, f"pid {holder.pid} runs, with the recorded start time")
    # No start time to compare: the pid may be reused, but a live holder would have beaten since.
    if age > stale_s:
        return Verdict(True, f"pid {holder.pid} runs but {beat}, stale after {stale_s:.0f} s")
    return Verdict(False, f"pid {holder.pid} runs, {beat}")


def judge_all(holders: Iterable[Holder], stale_s: float, now: float | None = None) -> Verdict:
    """A group of processes (a job's workers and agents) is gone only when each of them is; else the
    first one alive says why it is not."""
    verdicts = [judge(holder, stale_s, now) for holder in holders]
    alive = [verdict for verdict in verdicts if not verdict.gone]
    if alive:
        return alive[0]
    if not verdicts:
        return Verdict(True, "it names no process")
    return Verdict(True, "; ".join(dict.fromkeys(verdict.why for verdict in verdicts)))
