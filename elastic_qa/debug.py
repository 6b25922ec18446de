"""Fault injection for tests and chaos runs (`debug.*` settings): one object per worker, off by default.

The loop and the checkpoint session see only `Faults`, built once from the debug settings: `pauses` (may
the loop stop after a step?), `after_step` (a kill, a delay, a step hold), `save_due` (a checkpoint asked
for by a chaos run) and `before_file` (a slow or full disk under the checkpoint writer). None of the
settings is read anywhere else in the training path.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from elastic_qa import step_holds as holds
from elastic_qa.config import Config
from elastic_qa.observe.events import Event
from elastic_qa.observe.log import get_logger


class Faults:
    """The faults `cfg.debug` injects into the worker of rank `rank`."""

    def __init__(self, cfg: Config, rank: int) -> None:
        self.cfg, self.rank = cfg, rank
        debug = cfg.debug
        self.delay = debug.step_delay.total_seconds()
        self.save_delay = debug.save_delay.total_seconds()
        self.storage_flag = Path(debug.storage_fault_file) if debug.storage_fault_file else None
        # Whether the loop may stop after a step (a delay, a kill, a hold): where false, it never calls in.
        self.pauses = bool(debug.hold_dir or debug.kill_at_step or self.delay > 0)

    def before_file(self, name: str) -> None:
        """Before each checkpoint file write: a delay, and ENOSPC while `debug.storage_fault_file` exists."""
        if self.save_delay:
            time.sleep(self.save_delay)
        if self.storage_flag is not None and self.storage_flag.exists():
            raise OSError(errno.ENOSPC, f"injected storage fault ({self.storage_flag} exists)", name)

    def after_step(
        self,
        step: int,
        stop_requested: Callable[[], bool] = lambda: False,
        flush: Callable[[], None] = lambda: None,
    ) -> None:
        """After each step: SIGKILL at `debug.kill_at_step` (once per run, however often the step is
        replayed: a marker file under the run directory remembers), then `debug.step_delay` and the step
        holds of `debug.hold_dir` (step_holds.py; `stop_requested` ends a hold early).

        Before a delay or a hold, `flush` writes the step lines carried so far (a collective: the config is
        the same on every rank), so that a test waiting for step N's line sees it while step N holds. Not
        before the kill: the killed worker's lines are on their way, as a real SIGKILL finds them."""
        cfg, debug, rank = self.cfg, self.cfg.debug, self.rank
        if debug.kill_at_step == step and debug.kill_rank == rank:
            marker = Path(cfg.run.dir) / "debug" / f"killed-step-{step}-rank-{rank}"
            if not marker.exists():
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.touch()
                get_logger().warning(Event.DEBUG_KILL, step=step)
                os.kill(os.getpid(), signal.SIGKILL)
        if debug.hold_dir or self.delay > 0:
            flush()
        if self.delay > 0:
            time.sleep(self.delay)
        holds.hold_after_step(cfg, step, stop_requested)

    def save_due(self, step: int) -> bool:
        """A checkpoint asked for at this step by a chaos run (step_holds.py; never outside one)."""
        return holds.save_due(self.cfg, step)
