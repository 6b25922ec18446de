"""Step holds: a chaos run (or a test) holds the job after step N until it has acted at N.

A fault scheduled at step N used to be a race: the runner polled the logs while the job trained on, and
on a loaded machine a slow recovery let the job run past N, or to its end, before the fault landed
("1 of 4 requested faults injected"). With `debug.hold_dir` set, whoever drives the job arms a hold per
step (`arm`: a `hold-<N>` file, before the job starts); every rank, after completing step N (logged,
and saved if a save was due), waits until `release-<N>` exists (`release`). A job that resumed past N
(a stop saved N+1) holds after the first step it completes beyond N instead, so no hold is ever jumped.

Each rank waits on its own, with no collective, so a long hold cannot trip `dist.timeout`. The wait is
bounded (`debug.hold_timeout`, then a warning and training goes on) and ends early when the worker is
asked to stop (SIGTERM/SIGINT, e.g. its agent regrouping for a joining node): a stop is never delayed.
Off by default; when off, nothing is read. When on, the holds are listed once per process and a step
costs a comparison, plus one stat per step while a passed hold is not yet released.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

from elastic_qa.config import Config
from elastic_qa.observe.events import Event
from elastic_qa.observe.log import get_logger

POLL_S = 0.05
HOLD, RELEASE, SAVE = "hold-", "release-", "save-"
HEAL_HOLD, HEAL_RELEASE = "heal-hold-", "heal-release-"  # the replica mode: a peer's state being sent

# hold_dir -> steps armed and not yet seen released by this process (listed once: armed before start).
_pending: dict[str, list[int]] = {}
# hold_dir -> steps at which to save (listed once, like the holds: every rank agrees without a word).
_saves: dict[str, frozenset[int]] = {}


def _name(prefix: str, step: int) -> str:
    return f"{prefix}{step:08d}"


def arm(hold_dir: Path, steps: Sequence[int], saves: Sequence[int] = (), heals: Sequence[int] = ()) -> None:
    """Driver side, before the job starts: hold the job after each of `steps`, have it save a checkpoint at
    each of `saves` (a save to hit: kill-during-save, released just before it), and, in the replica mode,
    hold the first heal a group serves at or after each of `heals` (kill-during-heal)."""
    hold_dir.mkdir(parents=True, exist_ok=True)
    for prefix, chosen in ((HOLD, steps), (SAVE, saves), (HEAL_HOLD, heals)):
        for step in chosen:
            (hold_dir / _name(prefix, step)).touch()


def release(hold_dir: Path, step: int) -> bool:
    """Driver side: let the job go on past step `step`; False if it had been released already."""
    path = hold_dir / _name(RELEASE, step)
    if path.exists():
        return False
    path.touch()
    return True


def release_all(hold_dir: Path) -> None:
    """Driver side, when the run is over: nothing may stay held (a process outliving its driver)."""
    for step in armed(hold_dir):
        release(hold_dir, step)
    for step in armed(hold_dir, HEAL_HOLD):
        (hold_dir / _name(HEAL_RELEASE, step)).touch()


def release_heal(hold_dir: Path, step: int) -> None:
    """Driver side: let the heal held at `step` go on."""
    (hold_dir / _name(HEAL_RELEASE, step)).touch()


def armed(hold_dir: Path, prefix: str = HOLD) -> list[int]:
    """The steps held in `hold_dir` (its `hold-<N>` files; `prefix=SAVE`: the saves asked for)."""
    steps = (path.name[len(prefix) :] for path in hold_dir.glob(prefix + "*"))
    return sorted(int(step) for step in steps if step.isdigit())


def save_due(cfg: Config, step: int) -> bool:
    """Trainer side: whether a save was asked for at `step` (the same answer on every rank)."""
    if not cfg.debug.hold_dir:
        return False
    if cfg.debug.hold_dir not in _saves:
        _saves[cfg.debug.hold_dir] = frozenset(armed(Path(cfg.debug.hold_dir), SAVE))
    return step in _saves[cfg.debug.hold_dir]


def hold_after_step(cfg: Config, step: int, stop_requested: Callable[[], bool]) -> None:
    """Trainer side, after each completed step: wait for the release of every armed hold <= `step`."""
    if not cfg.debug.hold_dir:
        return
    hold_dir = Path(cfg.debug.hold_dir)
    pending = _pending.setdefault(cfg.debug.hold_dir, armed(hold_dir))
    while pending and pending[0] <= step:
        _wait_for_release(cfg, hold_dir, pending[0], step, stop_requested)
        pending.pop(0)


def _wait_for_release(
    cfg: Config, hold_dir: Path, hold: int, step: int, stop_requested: Callable[[], bool]
) -> None:
    released = hold_dir / _name(RELEASE, hold)
    log = get_logger()
    timeout = cfg.debug.hold_timeout.total_seconds()
    # Said even when the release came first (the driver saw step N logged and fired before this rank got
    # here): the evidence that the job did not pass N before the fault is this line, either way.
    already = released.exists()
    log.info(Event.HOLD, step=step, hold=hold, waiting_for=str(released), timeout_s=timeout, released=already)
    if already:
        return
    started = time.monotonic()
    while not released.exists():
        if stop_requested():  # a stop (SIGTERM from a regrouping agent, Ctrl-C) is never held up
            log.info("hold_ended", step=step, hold=hold, why="stop requested")
            return
        if time.monotonic() - started > timeout:
            log.warning(
                "hold_timeout", step=step, hold=hold, waited_for=str(released), after_s=round(timeout, 1)
            )
            return
        time.sleep(POLL_S)
    log.info("hold_released", step=step, hold=hold, held_s=round(time.monotonic() - started, 3))


# hold_dir -> heal holds not yet passed by this process
_heals: dict[str, list[int]] = {}


def hold_before_heal(cfg: Config, step: int) -> None:
    """Sender side of a heal, before the state leaves: wait for the release of every armed heal hold <= `step`
    (bounded by debug.hold_timeout, as the step holds). Logged `hold` with `heal: true`."""
    if not cfg.debug.hold_dir:
        return
    hold_dir = Path(cfg.debug.hold_dir)
    pending = _heals.setdefault(cfg.debug.hold_dir, armed(hold_dir, HEAL_HOLD))
    log = get_logger()
    while pending and pending[0] <= step:
        hold = pending.pop(0)
        released = hold_dir / _name(HEAL_RELEASE, hold)
        log.info(
            Event.HOLD, step=step, hold=hold, heal=True, waiting_for=str(released), released=released.exists()
        )
        deadline = time.monotonic() + cfg.debug.hold_timeout.total_seconds()
        while not released.exists() and time.monotonic() < deadline:
            time.sleep(POLL_S)
