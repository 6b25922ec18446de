"""Fault schedules: explicit (`kill-worker@step=40`, `join-node@time=20s`) or random from a seed.

A random schedule is drawn up front from `--seed`, so the same seed gives the same schedule. It honours the
job's node bounds by tracking the number of agents each fault leaves: a node is only killed or stopped
while more than `min` agents run (and never the c10d store host), and only joins while fewer than `max` run.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

from elastic_qa.config import format_duration, parse_duration

KINDS = (
    "kill-worker",
    "kill-node",
    "term-node",
    "join-node",
    "freeze-worker",
    "kill-during-save",
    "corrupt-checkpoint",
    "storage-errors",
)
# Faults after which the worker group restarts (and so must recover), and those that must lose nothing.
RESTARTING = frozenset({"kill-worker", "kill-node", "term-node", "join-node", "kill-during-save"})
ZERO_LOSS = frozenset({"term-node", "join-node"})
# Effect of each fault on the number of agents.
_NODE_DELTA = {"kill-node": -1, "term-node": -1, "join-node": +1}


@dataclass(frozen=True)
class Fault:
    kind: str
    at_step: int | None = None  # inject once the job has completed this step
    at_time: float | None = None  # ... or this many seconds after the job started
    duration: float | None = (
        None  # freeze-worker: seconds until SIGCONT (None: never); storage-errors: seconds
    )

    def describe(self) -> str:
        when = f"step={self.at_step}" if self.at_step is not None else f"time={self.at_time:g}s"
        extra = f",for={format_duration_s(self.duration)}" if self.duration is not None else ""
        return f"{self.kind}@{when}{extra}"

    def to_dict(self) -> dict:
        return asdict(self)


def restarts_group(kind: str, freeze_s: float | None, dist_timeout_s: float) -> bool:
    """A freeze restarts the group only when it outlasts dist.timeout (or never thaws)."""
    if kind == "freeze-worker":
        return freeze_s is None or freeze_s >= dist_timeout_s
    return kind in RESTARTING


def format_duration_s(seconds: float) -> str:
    from datetime import timedelta

    return format_duration(timedelta(seconds=seconds))


def parse_fault(text: str) -> Fault:
    """`KIND@step=N`, `KIND@time=20s`, optionally `,for=5s` (freeze length, storage-error window)."""
    kind, sep, rest = text.partition("@")
    if kind not in KINDS:
        raise ValueError(f"--fault {text!r}: unknown fault {kind!r} (one of {', '.join(KINDS)})")
    if not sep:
        raise ValueError(f"--fault {text!r}: say when, e.g. {kind}@step=40 or {kind}@time=20s")
    at_step = at_time = duration = None
    for part in rest.split(","):
        key, _, value = part.partition("=")
        try:
            if key == "step":
                at_step = int(value)
            elif key == "time":
                at_time = parse_duration(value).total_seconds()
            elif key == "for":
                duration = None if value == "never" else parse_duration(value).total_seconds()
            else:
                raise ValueError(f"unknown key {key!r}")
        except ValueError as err:
            raise ValueError(f"--fault {text!r}: {err}") from None
    if (at_step is None) == (at_time is None):
        raise ValueError(f"--fault {text!r}: give exactly one of step=N or time=DURATION")
    if kind == "freeze-worker" and duration is None and "for=never" not in rest:
        duration = 3.0
    if kind == "storage-errors" and duration is None:
        duration = 5.0
    return Fault(kind, at_step, at_time, duration)


def validate(faults: list[Fault], agents: int, min_nodes: int, max_nodes: int) -> None:
    """Refuse an explicit schedule that would break the node bounds."""
    count = agents
    for fault in sorted(faults, key=_order):
        count += _NODE_DELTA.get(fault.kind, 0)
        if count < min_nodes or count < 1:
            raise ValueError(f"{fault.describe()} would leave {count} agents (min {min_nodes})")
        if count > max_nodes:
            raise ValueError(f"{fault.describe()} would make {count} agents (max {max_nodes})")


def _order(fault: Fault) -> tuple[float, float]:
    return (fault.at_time if fault.at_time is not None else float("inf"), fault.at_step or 0)


def random_schedule(
    seed: int,
    count: int,
    mean_interval_s: float,
    agents: int,
    min_nodes: int,
    max_nodes: int,
    kinds: tuple[str, ...] = KINDS,
    first_at_s: float = 5.0,
) -> list[Fault]:
    """`count` faults with exponential gaps (mean `mean_interval_s`), kinds drawn uniformly among those
    the node bounds allow at that point."""
    rng = random.Random(seed)
    faults, now, nodes = [], first_at_s, agents
    for _ in range(count):
        allowed = [
            kind
            for kind in kinds
            if min_nodes <= nodes + _NODE_DELTA.get(kind, 0) <= max_nodes
            # kill-node/term-node never target the store host, so they need a second agent
            and not (kind in ("kill-node", "term-node") and nodes < 2)
        ]
        kind = rng.choice(allowed)
        duration = None
        if kind == "freeze-worker":
            duration = rng.choice([1.0, 2.0, 4.0, None]) if rng.random() < 0.25 else rng.uniform(1.0, 4.0)
        elif kind == "storage-errors":
            duration = rng.uniform(2.0, 6.0)
        faults.append(
            Fault(kind, at_time=round(now, 2), duration=None if duration is None else round(duration, 2))
        )
        nodes += _NODE_DELTA.get(kind, 0)
        now += rng.expovariate(1.0 / mean_interval_s)
    return faults


__all__ = [
    "KINDS",
    "RESTARTING",
    "ZERO_LOSS",
    "Fault",
    "parse_fault",
    "random_schedule",
    "restarts_group",
    "validate",
]
