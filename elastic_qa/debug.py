"""Fault injection for tests and chaos runs (`debug.*` settings): every hook in one place, off by default."""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from elastic_qa import holds
from elastic_qa.config import Config
from elastic_qa.observe.events import Event
from elastic_qa.observe.log import get_logger


def storage_fault_hook(cfg: Config) -> Callable[[str], None]:
    """Before each checkpoint file write: a delay, and ENOSPC while `debug.storage_fault_file` exists."""
    delay = cfg.debug.save_delay.total_seconds()
    flag = Path(cfg.debug.storage_fault_file) if cfg.debug.storage_fault_file else None

    def before_file(name: str) -> None:
        if delay:
            time.sleep(delay)
        if flag is not None and flag.exists():
            raise OSError(errno.ENOSPC, f"injected storage fault ({flag} exists)", name)

    return before_file


def pauses(cfg: Config) -> bool:
    """Whether the debug settings may stop the loop after a step (a delay, a kill, a hold): where it is
    false, `after_step` has nothing to do."""
    debug = cfg.debug
    return bool(debug.hold_dir or debug.kill_at_step or debug.step_delay.total_seconds() > 0)


def after_step(
    cfg: Config,
    rank: int,
    step: int,
    stop_requested: Callable[[], bool] = lambda: False,
    flush: Callable[[], None] = lambda: None,
) -> None:
    """After each step: SIGKILL at `debug.kill_at_step` (once per run, however often the step is replayed:
    a marker file under the run directory remembers), then `debug.step_delay` and the step holds of
    `debug.hold_dir` (holds.py; `stop_requested` ends a hold early).

    Before a delay or a hold, `flush` writes the step lines carried so far (a collective: the config is
    the same on every rank), so that a test waiting for step N's line sees it while step N holds. Not
    before the kill: the killed worker's lines are on their way, as a real SIGKILL finds them."""
    debug = cfg.debug
    if debug.kill_at_step == step and debug.kill_rank == rank:
        marker = Path(cfg.run.dir) / "debug" / f"killed-step-{step}-rank-{rank}"
        if not marker.exists():
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
            get_logger().warning(Event.DEBUG_KILL, step=step)
            os.kill(os.getpid(), signal.SIGKILL)
    if debug.hold_dir or debug.step_delay.total_seconds() > 0:
        flush()
    if debug.step_delay.total_seconds() > 0:
        time.sleep(debug.step_delay.total_seconds())
    holds.hold_after_step(cfg, step, stop_requested)


def save_due(cfg: Config, step: int) -> bool:
    """A checkpoint asked for at this step by a chaos run (holds.py; never outside one)."""
    return holds.save_due(cfg, step)
