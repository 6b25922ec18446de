"""A worker's start-up, timed phase by phase: from the process's birth to its first completed step.

The worker marks the end of each phase as it goes (`STARTUP.mark("restore")`); the trainer logs the whole
as one `startup` event once its first step is done:

    interpreter     process birth (fork by the torchrun agent) to the first line of elastic_qa.train: the
                    Python interpreter, the package root and whatever runs the module (under the local
                    launcher, elastic_qa.launcher.loopback, which imports torch.distributed: most of it)
    imports         elastic_qa.train's imports (torch among them, unless imported already)
    config          arguments, config, logging
    cache_open      the prepared feature cache (prep.prepare)
    process_group   init_process_group, the threads, the control groups
    model_build     the model built, moved and wrapped (DDP)
    probe           the loss-invariance probe (loop/freeze.py), or the answer a checkpoint carried
    optimizer       optimizer, LR schedule, the trainer's state (the first add_param_group imports
                    torch._dynamo: see dynamo_warmup)
    trainer_init    the rest of the trainer (checkpoint store, groups, loggers)
    restore_read    choosing and reading the checkpoint
    restore_apply   loading it into the model, optimizer and the rest
    register        the run's hold and the attempt number
    first_step      the loader built and the first step trained

A phase marked twice adds up. A mark costs one clock read; importing this module imports no torch.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastic_qa.observe.events import Event

if TYPE_CHECKING:  # a type only: structlog is not imported here for it
    from elastic_qa.observe.log import EventLog


def process_birth() -> float | None:
    """The wall-clock time this process was created: its start time in /proc/self/stat (clock ticks since
    boot) against /proc/uptime, both to 10 ms. None where /proc is not there."""
    try:
        stat = Path("/proc/self/stat").read_text()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None
    # The command name (field 2) may hold spaces: fields are counted after its closing parenthesis.
    start_ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime
    return time.time() - (uptime - start_ticks / ticks)


class StartupClock:
    """Seconds per start-up phase, each mark closing the phase that ran since the previous one."""

    def __init__(self) -> None:
        self.born: float | None = None  # the process's creation (process_birth)
        self.phases: dict[str, float] = {}
        self._last = time.time()
        self.reported = False  # the `startup` event is logged (by the trainer, at its first step)
        self.begin()

    def begin(self, born: float | None = None) -> None:
        """The first mark, `interpreter`: from `born` (default: the process's birth) to now. The clock
        begins when this module is first imported (elastic_qa.train imports it first)."""
        now = time.time()
        self.born = born if born is not None else process_birth()
        self.phases, self._last, self.reported = {}, now, False
        if self.born is not None:
            self.phases["interpreter"] = max(0.0, now - self.born)

    def mark(self, phase: str) -> None:
        """`phase` ran from the previous mark to now."""
        now = time.time()
        self.phases[phase] = self.phases.get(phase, 0.0) + (now - self._last)
        self._last = now

    def fields(self) -> dict[str, Any]:
        """The `startup` event's fields: `<phase>_s` for each phase in order, and `total_s`, their sum (from
        the birth to the last mark; from `begin` where the birth is unknown)."""
        fields: dict[str, Any] = {f"{phase}_s": round(seconds, 4) for phase, seconds in self.phases.items()}
        fields["total_s"] = round(sum(self.phases.values()), 4)
        return fields

    def log_first_step(self, log: EventLog, step: int, warm: bool) -> None:
        """The `startup` event, once, after the process's first step: its phases, which restart of the
        job's workers this is (torchrun's count) and whether it is `warm` (a fork with its imports done)."""
        self.mark("first_step")
        self.reported = True
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        log.info(Event.STARTUP, step=step, restart_count=restart, warm=warm, **self.fields())


# The one clock of this process (a worker is one trainer).
STARTUP = StartupClock()


def dynamo_warmup() -> threading.Thread:
    """Import torch._dynamo on a daemon thread now, while the process group forms; join it before the
    main thread imports anything else.

    torch wraps Optimizer.add_param_group and the optimizer's step in `torch._disable_dynamo`, which
    imports torch._dynamo on first use: a second or so of a restart (docs/benchmarks.md, "Before warm
    workers": `python -X importtime`). Imported here first, the optimizer finds it in sys.modules. The
    caller joins the thread before its own next imports: two threads importing overlapping module graphs
    at once can take their module locks in opposite orders, and Python then raises a deadlock error in one
    of them. Call it once torch itself is imported. A failure here is left for the main thread's own
    import to raise.
    """

    def warm() -> None:
        with contextlib.suppress(Exception):  # the optimizer's own import says what is wrong
            import torch._dynamo  # noqa: F401

    thread = threading.Thread(target=warm, name="dynamo-warmup", daemon=True)
    thread.start()
    return thread


def structlog_without_rich() -> None:
    """Import structlog with rich hidden from it, in a worker process that nothing else runs in.

    structlog's package import loads structlog.dev, whose console renderer imports rich when it is
    installed (transformers brings it, through typer): 0.15-0.3 s of every worker's start on a 2-core box
    (`python -X importtime`), for a renderer the worker's JSON-lines logging never calls. Only what structlog
    imports now is affected (its console renderer then prints plain tracebacks); a later `import rich`
    loads it as usual. Nothing is done when structlog or rich is already imported.
    """
    if "structlog" in sys.modules or "rich" in sys.modules:
        return
    sys.modules["rich"] = None  # type: ignore[assignment]  # `import rich` raises ImportError
    try:
        import structlog  # noqa: F401
    finally:
        del sys.modules["rich"]
