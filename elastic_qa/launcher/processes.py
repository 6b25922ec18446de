"""The processes of a job on this host: which are alive, whose children they are, how a child is tied to
the process that starts it and how a tree of them is ended, and the environment in which a child Python
process imports this same elastic_qa."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import elastic_qa
from elastic_qa.liveness import is_forkserver
from elastic_qa.liveness import pid_runs as alive

PR_SET_PDEATHSIG = 1
# Looked up once, here: a child between fork and exec must not load libraries (another thread may have
# held the loader's lock at the fork).
_prctl: Callable[..., int] | None
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _prctl = None


def children(pid: int) -> list[int]:
    """Direct child processes of `pid`, zombies left out (read from /proc, no psutil)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry))
    return sorted(found)


def workers_of(agent_pid: int) -> list[int]:
    """The worker processes of a torchrun agent: its children, or, with warm workers (torchrun
    --start-method=forkserver), the children of its multiprocessing forkserver; the resource tracker
    that multiprocessing starts beside the forkserver is no worker. A forked worker's command line is
    the forkserver's: it is told apart by its parent, not by its command line."""
    found = []
    for pid in children(agent_pid):
        if is_forkserver(pid):
            found += children(pid)
        elif not is_resource_tracker(pid):
            found.append(pid)
    return found


def is_resource_tracker(pid: int) -> bool:
    """Whether `pid` is a multiprocessing resource tracker: the process that unlinks the named semaphores
    (and shared memory) a process registered with it once every process that could still use them is
    gone, dead by SIGKILL included."""
    return any("multiprocessing.resource_tracker" in part for part in cmdline(pid))


def descendants(pid: int) -> list[int]:
    """Every live process under `pid`: children, their children, and so on."""
    found, frontier = [], [pid]
    while frontier:
        frontier = [kid for parent in frontier for kid in children(parent)]
        found += frontier
    return found


def cmdline(pid: int) -> list[str]:
    """The command line of a process; empty when it is gone (or /proc cannot say)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return [part.decode(errors="replace") for part in handle.read().split(b"\0") if part]
    except OSError:
        return []


def tied_to_this_process() -> Callable[[], None]:
    """A Popen `preexec_fn`: the child gets SIGTERM when the thread that starts it ends, so also when this
    process dies, however it dies (SIGKILL, os._exit, a crash): nothing it started runs on without it.
    On Linux (PR_SET_PDEATHSIG); elsewhere it does nothing. Start the child from a thread that lives as
    long as the child should."""
    parent, sigterm = os.getpid(), int(signal.SIGTERM)

    def tie() -> None:
        if _prctl is None:
            return
        _prctl(PR_SET_PDEATHSIG, sigterm, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the tie was made
            os.kill(os.getpid(), sigterm)

    return tie


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signum)


def kill_trees(roots: Iterable[int]) -> list[int]:
    """SIGKILL every process of the trees under `roots`, the roots too; return their pids. Each process is
    stopped (SIGSTOP) before its children are listed, so that none starts another (a torchrun agent
    restarting its workers) between the listing and the kill. Multiprocessing resource trackers are spared,
    roots or not: a torchrun agent with warm workers registers named semaphores (/dev/shm/sem.mp-*) with
    one, which unlinks them and exits once the rest of the tree is dead; killed too, they would stay in
    /dev/shm until the machine reboots."""
    seen: list[int] = []
    frontier = [pid for pid in roots if alive(pid) and not is_resource_tracker(pid)]
    try:
        while frontier:
            for pid in frontier:
                _signal(pid, signal.SIGSTOP)
            seen += frontier
            kids = [kid for pid in frontier for kid in children(pid) if kid not in seen]
            frontier = [kid for kid in kids if not is_resource_tracker(kid)]
    finally:  # interrupted or not, nothing is left stopped: a stopped agent never ends, nor its launcher
        for pid in seen:
            _signal(pid, signal.SIGKILL)
    return seen


def end_process(process: subprocess.Popen, grace_s: float) -> int:
    """SIGTERM, then SIGKILL if it has not exited within `grace_s`; its exit code. A torchrun given
    SIGTERM stops its workers first (they are in sessions of their own: a SIGKILL would orphan them)."""
    if process.poll() is None:
        process.terminate()
        try:
            return process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
    return process.wait()


def python_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) with the directory this elastic_qa was imported from
    first on PYTHONPATH: a child `python -m elastic_qa...` then runs the same code as its parent, from a
    checkout's tree or from the installed package, whatever its working directory."""
    env = dict(os.environ if base is None else base)
    home = str(Path(elastic_qa.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (home, env.get("PYTHONPATH")) if p)
    return env
