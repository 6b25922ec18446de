"""`bench goodput --pin`: each side's node i on a core of its own, as on machines of their own.

On one host a side's processes share every core, so a replica group whose peer is down steps faster alone
than the two did together (the peer's core is free): a side that spends more of its time with one group
shows a faster clean step, against which all its steps are then weighed, a pace no cluster of separate
machines would give it. With --pin, each side's node-level processes (the launcher sides' torchrun agents,
the torchft side's replica processes, the replica side's group agents) each hold one core, and everything
started under them runs there (CPU affinity is inherited): a survivor keeps its own core only. The sides
still share each core, node i of every side on the same one. What is no node (the launchers, the
Lighthouses, the benchmark itself) runs on any core.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from elastic_qa.launcher.processes import descendants


class Pinner:
    """Every `interval_s`, gives each side's new node-level processes (`sides[name]()`, in node order) the
    lowest core none of that side's live ones holds, and pins what they have started so far."""

    def __init__(self, sides: dict[str, Callable[[], list[int]]], interval_s: float = 0.5) -> None:
        self.sides, self.interval_s = sides, interval_s
        self.cores = sorted(os.sched_getaffinity(0))
        self.held: dict[str, dict[int, int]] = {name: {} for name in sides}  # node-level pid -> its core
        self.assignments: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="goodput-pinner", daemon=True)

    def start(self) -> None:
        self.pin_once()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.pin_once()

    def pin_once(self) -> None:
        for name, roots in self.sides.items():
            with contextlib.suppress(Exception):  # a side between processes: the next look pins it
                self._pin_side(name, roots())

    def _pin_side(self, name: str, roots: list[int]) -> None:
        held = self.held[name]
        for pid in [pid for pid in held if pid not in roots]:
            del held[pid]  # gone: its core is free for the next one
        for pid in roots:
            if pid not in held:  # seen within interval_s of its start: before its imports are done
                taken = set(held.values())
                free = [core for core in self.cores if core not in taken]
                core = free[0] if free else self.cores[len(held) % len(self.cores)]
                held[pid] = core
                self.assignments.append({"side": name, "pid": pid, "core": core, "ts": time.time()})
                # Affinity is a thread's own, inherited by the threads and processes started after: pin
                # every thread of the process and of what it has started so far, once.
                for process in [pid, *descendants(pid)]:
                    pin_threads(process, core)


def pin_threads(pid: int, core: int) -> None:
    """Every thread of `pid` on `core` (a process gone meanwhile is skipped)."""
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(tid), {core})
