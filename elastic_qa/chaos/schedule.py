"""Fault schedules: explicit (`kill-worker@step=40`, `join-node@time=20s`) or random from a seed.

A random schedule is drawn up front from `--seed`, so the same seed gives the same schedule. It is fitted
to the job: faults are triggered by training step, one in each of `count` equal slices of the job's
`train.max_steps` (leaving the last slice for the last fault's recovery), so that every fault finds a
running job, however fast or slow its steps are. Wall-time triggers used to place faults after a short
job had ended (seed 11, 4 faults on the 40-step tiny job: 1 injected, 3 skipped). `fit_job` then slows a
job whose slices would pass too quickly for a fault to act (and checkpoints often enough for the faults
that need a checkpoint to hit). The replica-group mode places its random faults the same way (`spread`,
3 steps apart: chaos/replicas.py).

It honours the job's node bounds by tracking the number of agents each fault leaves: a node is only
killed or stopped while more than `min` agents run (and never the c10d store host), and only joins while
fewer than `max` run. `final-storage-errors` spans the final save, so it is drawn at most once and always
comes last.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass

from elastic_qa.config import Config, format_duration, parse_duration

KINDS = (
    "kill-worker",
    "kill-node",
    "term-node",
    "join-node",
    "freeze-worker",
    "kill-during-save",
    "corrupt-checkpoint",
    "storage-errors",
    "final-storage-errors",
    "corrupt-replay",
    "log-full",
    "hup",
    "second-job",
)
# Faults after which the worker group restarts (and so must recover), and those that must lose nothing.
# second-job restarts nothing: the live job holds its run, so the second job is refused (session/hold.py).
RESTARTING = frozenset(
    {"kill-worker", "kill-node", "term-node", "join-node", "kill-during-save", "hup", "corrupt-replay"}
)
ZERO_LOSS = frozenset({"term-node", "join-node", "hup"})
# Faults whose window (`for=`) has a default: freeze length, storage/log error window, the final window
# (seconds after max_steps), the second job's longest life.
DEFAULT_FOR = {
    "freeze-worker": 3.0,
    "storage-errors": 5.0,
    "log-full": 3.0,
    "final-storage-errors": 3.0,
    "second-job": 60.0,
}
# Faults that act on a checkpoint or a save: the job must save within each fault's slice.
NEEDS_SAVES = frozenset(
    {"kill-during-save", "corrupt-checkpoint", "corrupt-replay", "storage-errors", "second-job"}
)
FINAL = "final-storage-errors"
# Seconds of training a second job needs after its trigger: its start (torch, the data: 3-8 s on a busy
# 2-core box), then the main job's next commit, which is fenced.
SECOND_JOB_RUNWAY_S = 15.0
# Effect of each fault on the number of agents.
_NODE_DELTA = {"kill-node": -1, "term-node": -1, "join-node": +1}


@dataclass(frozen=True)
class Fault:
    kind: str
    at_step: int | None = None  # inject once the job has completed this step
    at_time: float | None = None  # ... or this many seconds after the job started
    duration: float | None = None  # the kind's window (see DEFAULT_FOR); freeze-worker: None is never

    def describe(self) -> str:
        when = f"step={self.at_step}" if self.at_step is not None else f"time={self.at_time:g}s"
        extra = ""
        if self.duration is not None:
            extra = f",for={format_duration_s(self.duration)}"
        elif self.kind == "freeze-worker":
            extra = ",for=never"
        return f"{self.kind}@{when}{extra}"

    def to_dict(self) -> dict:
        return asdict(self)


def restarts_group(
    kind: str, duration_s: float | None, dist_timeout_s: float, final_retry_s: float = math.inf
) -> bool:
    """A freeze restarts the group only when it outlasts dist.timeout (or never thaws); the final storage
    errors only when they outlast checkpoint.final_retry_for (the job then exits 1 and is restarted)."""
    if kind == "freeze-worker":
        return duration_s is None or duration_s >= dist_timeout_s
    if kind == FINAL:
        return duration_s is not None and duration_s >= final_retry_s
    return kind in RESTARTING


def format_duration_s(seconds: float) -> str:
    from datetime import timedelta

    return format_duration(timedelta(seconds=seconds))


def parse_fault(text: str, kinds: tuple[str, ...] = KINDS) -> Fault:
    """`KIND@step=N`, `KIND@time=20s`, optionally `,for=5s` (see DEFAULT_FOR for what the window is);
    KIND one of `kinds` (the replica-group mode has kinds of its own: chaos/replicas.py)."""
    kind, sep, rest = text.partition("@")
    if kind not in kinds:
        raise ValueError(f"--fault {text!r}: unknown fault {kind!r} (one of {', '.join(kinds)})")
    if not sep:
        raise ValueError(f"--fault {text!r}: say when, e.g. {kind}@step=40 or {kind}@time=20s")
    at_step = at_time = None
    duration = DEFAULT_FOR.get(kind)
    for part in rest.split(","):
        key, _, value = part.partition("=")
        try:
            if key == "step":
                at_step = int(value)
                if at_step < 1:
                    raise ValueError("step must be >= 1")
            elif key == "time":
                at_time = parse_duration(value).total_seconds()
            elif key == "for":
                if value == "never" and kind != "freeze-worker":
                    raise ValueError("only freeze-worker can last for=never")
                duration = None if value == "never" else parse_duration(value).total_seconds()
            else:
                raise ValueError(f"unknown key {key!r}")
        except ValueError as err:
            raise ValueError(f"--fault {text!r}: {err}") from None
    if (at_step is None) == (at_time is None):
        raise ValueError(f"--fault {text!r}: give exactly one of step=N or time=DURATION")
    return Fault(kind, at_step, at_time, duration)


def validate(
    faults: list[Fault], agents: int, min_nodes: int, max_nodes: int, max_steps: int | None = None
) -> None:
    """Refuse an explicit schedule that would break the node bounds or could never fire."""
    count = agents
    for fault in sorted(faults, key=_order):
        count += _NODE_DELTA.get(fault.kind, 0)
        if count < min_nodes or count < 1:
            raise ValueError(f"{fault.describe()} would leave {count} agents (min {min_nodes})")
        if count > max_nodes:
            raise ValueError(f"{fault.describe()} would make {count} agents (max {max_nodes})")
        if max_steps is not None and fault.at_step is not None and fault.at_step >= max_steps:
            raise ValueError(f"{fault.describe()} would never fire: the job ends at step {max_steps}")
    finals = [f for f in faults if f.kind == FINAL]
    if len(finals) > 1:
        raise ValueError(f"{FINAL} spans the final save: give it at most once")
    if finals and sorted(faults, key=_order)[-1] != finals[0]:
        raise ValueError(f"{FINAL} spans the final save: it must be the last fault")
    steps = [f.at_step for f in faults if f.at_step is not None]
    for step in sorted({s for s in steps if steps.count(s) > 1}):
        # The job is held after each fault's step until that fault fires, and the next fault waits for
        # a step trained after it: two faults at one step would wait for each other.
        raise ValueError(f"two faults at step={step}: give each fault its own step")


def _order(fault: Fault) -> tuple[float, float]:
    return (fault.at_time if fault.at_time is not None else math.inf, fault.at_step or 0)


def ordered(faults: list[Fault]) -> list[Fault]:
    """The order the runner injects in: time triggers first (by time), then step triggers (by step)."""
    return sorted(faults, key=_order)


def slices(max_steps: int, count: int, least: int = 2) -> tuple[int, int]:
    """(steps per fault slice, the step the final fault fires at) for `count` faults on the job, each
    slice `least` steps at least."""
    width = max_steps // (count + 1)
    if width < least:
        raise ValueError(
            f"{count} faults need at least {least * (count + 1)} steps ({least} per fault, and room for the "
            f"last fault's recovery); the job has train.max_steps={max_steps}"
        )
    return width, max_steps - max(1, min(5, width // 2))


def spread(
    rng: random.Random,
    drawn: list[str],
    max_steps: int,
    duration: Callable[[str], float | None],
    gap: int = 1,
) -> list[Fault]:
    """Faults of the kinds `drawn`, in order, one at a random step of each of `len(drawn)` equal slices of
    [1, max_steps - slice], `gap` steps apart at least (the replica mode needs 3: chaos/replicas.py), each
    with the window `duration(kind)` drawn after its step; `final-storage-errors` a few steps before
    max_steps. With gap 1 the steps are drawn as they always were: a seed keeps its schedule."""
    width, final_step = slices(max_steps, len(drawn), max(2, gap))
    faults = []
    for index, kind in enumerate(drawn):
        step = final_step if kind == FINAL else 1 + index * width + rng.randrange(width - gap + 1)
        faults.append(Fault(kind, at_step=step, duration=duration(kind)))
    return faults


def random_schedule(
    seed: int,
    count: int,
    max_steps: int,
    agents: int,
    min_nodes: int,
    max_nodes: int,
    kinds: tuple[str, ...] = KINDS,
) -> list[Fault]:
    """`count` faults, one at a random step of each of `count` equal slices of [1, max_steps - slice],
    kinds drawn uniformly among those the node bounds allow at that point (`final-storage-errors` at most
    once, moved to a few steps before max_steps; `second-job` only in the first half of the job)."""
    rng = random.Random(seed)
    slices(max_steps, count)  # a job too short is refused before anything is drawn
    drawn: list[str] = []
    nodes = agents
    for index in range(count):
        allowed = [
            kind
            for kind in kinds
            if min_nodes <= nodes + _NODE_DELTA.get(kind, 0) <= max_nodes
            # kill-node/term-node never target the store host, so they need a second agent
            and not (kind in ("kill-node", "term-node") and nodes < 2)
            and not (kind == FINAL and FINAL in drawn)
        ]
        # A second job takes seconds to start (torch, the data): it must find the main job far from done.
        early = [kind for kind in allowed if not (kind == "second-job" and 2 * index >= count)]
        allowed = early or allowed
        kind = rng.choice(allowed)
        drawn.append(kind)
        nodes += _NODE_DELTA.get(kind, 0)
    if FINAL in drawn:  # no effect on the node count, so moving it to the end keeps the bounds
        drawn.remove(FINAL)
        drawn.append(FINAL)
    return spread(rng, drawn, max_steps, lambda kind: _random_duration(rng, kind, min_nodes))


def _random_duration(rng: random.Random, kind: str, min_nodes: int) -> float | None:
    if kind == "freeze-worker":
        # For ever only where the group can never shrink to one worker: alone, nobody would notice it.
        longest = [1.0, 2.0, 4.0, None] if min_nodes >= 2 else [1.0, 2.0, 4.0, 8.0]
        seconds = rng.choice(longest) if rng.random() < 0.25 else rng.uniform(1.0, 4.0)
    elif kind in ("storage-errors", "final-storage-errors"):
        seconds = rng.uniform(2.0, 6.0)
    elif kind == "log-full":
        seconds = rng.uniform(1.0, 4.0)
    else:
        seconds = DEFAULT_FOR.get(kind)
    return None if seconds is None else round(seconds, 2)


def fit_job(cfg: Config, faults: list[Fault], min_gap_s: float) -> dict[str, str]:
    """Overrides that make the job long enough for a random schedule, with the reason for each.

    Each fault has `max_steps // (count + 1)` steps to act in; when that takes less than `min_gap_s` at
    the configured `debug.step_delay`, the delay is raised (steps themselves take a few ms on the tiny
    model, so the delay alone is what can be counted on). Faults that hit a save or a checkpoint need
    saves to come about as often as faults: a `checkpoint.interval` over four slices (the tiny config's
    30m, say, on a job of seconds) is shortened to one slice (at least 1 s); kill-during-save gets a
    `debug.save_delay` of 50 ms when none is set, so that the save window is wide enough to hit; a second
    job needs SECOND_JOB_RUNWAY_S of training after its trigger to start and race the main one. None of
    these change what is trained (the reference run ignores debug and checkpoint settings).
    """
    if not faults:
        return {}
    width, _ = slices(cfg.train.max_steps, len(faults))
    fitted: dict[str, str] = {}
    delay = cfg.debug.step_delay.total_seconds()
    if width * delay < min_gap_s:
        delay = math.ceil(1000 * min_gap_s / width) / 1000
        fitted["debug.step_delay"] = f"{delay * 1000:g}ms"
    for fault in faults:  # a second job needs the main job to run on while it starts and is fenced
        if fault.kind == "second-job" and fault.at_step is not None:
            needed = SECOND_JOB_RUNWAY_S / max(1, cfg.train.max_steps - fault.at_step)
            if delay < needed:
                delay = math.ceil(1000 * needed) / 1000
                fitted["debug.step_delay"] = f"{delay * 1000:g}ms"
    kinds = {f.kind for f in faults}
    if kinds & NEEDS_SAVES:
        slice_s = width * delay
        interval = cfg.checkpoint.interval.total_seconds()
        every = cfg.checkpoint.every_steps
        if interval > 4 * slice_s and not (0 < every <= 4 * width):
            fitted["checkpoint.interval"] = format_duration_s(max(1.0, round(slice_s, 1)))
    if "kill-during-save" in kinds and cfg.debug.save_delay.total_seconds() == 0:
        fitted["debug.save_delay"] = "50ms"
    return fitted


__all__ = [
    "DEFAULT_FOR",
    "FINAL",
    "KINDS",
    "RESTARTING",
    "ZERO_LOSS",
    "Fault",
    "fit_job",
    "ordered",
    "parse_fault",
    "random_schedule",
    "restarts_group",
    "slices",
    "spread",
    "validate",
]
