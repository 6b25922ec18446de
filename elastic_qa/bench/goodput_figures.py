"""The goodput figures of one side, computed from its step timeline and its fault times alone.

A side (the product, the bare floor, torchft, the replica mode) is reduced to `Step` rows, one per completed
step of one group (a product attempt, a bare worker process, a torchft replica process, the process that
wrote a replica-mode step line), and the wall times its faults were injected. From those:

- window: from the first step to the last step of the run (process start-up before the first step is left
  out for every side alike; faults are timed from the first step).
- committed steps: the steps of the final lineage completed inside the window. For each step number the
  newest completion counts once (a step trained, lost to a restore and trained again counts once), weighted
  by the share of the global batch it trained (1 for the product, the bare floor and the replica mode, which
  splits each step's global batch over whoever takes part; participants / 2 for torchft, whose step with one
  live replica trains half the batch).
- clean step time: the median interval between step n-1 and step n of the same group, leaving out the
  first WARMUP_STEPS steps of every group (a restarted process warming up), any interval that contains a
  fault, and steps that trained less than the full global batch (torchft with one live replica).
- effective training time: committed steps x clean step time / wall time, the fraction of the wall time
  that did useful work at the clean pace.
- per fault: lost steps (sides that restore: a group that starts after the fault at step s discards what the
  group before it had reached past s - 1; sides without a restore pass theirs in) and time without a step:
  the longest interval between two consecutive steps (of any group) that ends after this fault and starts
  before the next fault (or the end), leaving out the interval the next fault falls in unless this fault
  falls in it too: that is the next fault's stall. A fault that falls inside the previous fault's stall
  shares that interval with it.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

WARMUP_STEPS = 3


@dataclass(frozen=True)
class Step:
    ts: float  # wall time the step completed
    step: int  # step number in the job's lineage (after a restore: continues from the restored step)
    group: str  # the attempt or process that trained it
    weight: float = 1.0  # share of the global batch it trained


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (q in 0..100) of a non-empty sequence."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def spread(values: Sequence[float]) -> dict[str, Any]:
    if not values:
        return {"count": 0, "mean": None, "median": None, "p90": None, "max": None}
    return {
        "count": len(values),
        "mean": statistics.fmean(values),
        "median": statistics.median(values),
        "p90": percentile(values, 90),
        "max": max(values),
    }


def clean_step_time(steps: Sequence[Step], faults: Sequence[float]) -> float | None:
    by_group: dict[str, list[Step]] = {}
    for row in sorted(steps, key=lambda r: r.ts):
        by_group.setdefault(row.group, []).append(row)
    intervals = []
    for rows in by_group.values():
        for index in range(WARMUP_STEPS + 1, len(rows)):
            before, after = rows[index - 1], rows[index]
            if after.step != before.step + 1 or after.weight < 1.0:
                continue
            if any(before.ts <= fault <= after.ts for fault in faults):
                continue
            intervals.append(after.ts - before.ts)
    return statistics.median(intervals) if intervals else None


def lost_per_fault(
    steps: Sequence[Step], faults: Sequence[float], reached_by: dict[str, int] | None = None
) -> list[int]:
    """Steps a restore discarded, summed per fault: each group's first step s, against the furthest step
    of the group before it (the one whose last step came latest before s; a group starting after a fault
    is charged to the latest fault before it). `reached_by`: group -> furthest step, where a better
    record than the step lines exists (the product's sample ledger also holds steps whose line a dying
    process never wrote)."""
    lost = [0] * len(faults)
    ordered = sorted(steps, key=lambda r: r.ts)
    first_of: dict[str, Step] = {}
    last_of: dict[str, Step] = {}
    for row in ordered:
        first_of.setdefault(row.group, row)
        last_of[row.group] = row
    for first in first_of.values():
        before = [last for group, last in last_of.items() if group != first.group and last.ts < first.ts]
        earlier = [i for i, fault in enumerate(faults) if fault < first.ts]
        if not before or not earlier:
            continue
        previous = max(before, key=lambda r: r.ts)
        reached = max(previous.step, (reached_by or {}).get(previous.group, previous.step))
        lost[earlier[-1]] += max(0, reached - (first.step - 1))
    return lost


def gap_per_fault(steps: Sequence[Step], faults: Sequence[float]) -> list[float | None]:
    times = sorted({row.ts for row in steps})
    intervals = list(itertools.pairwise(times))
    gaps: list[float | None] = []
    for index, fault in enumerate(faults):
        until = faults[index + 1] if index + 1 < len(faults) else float("inf")
        spans = [
            end - start
            for start, end in intervals
            if end > fault and start < until and (end <= until or start <= fault)
        ]
        gaps.append(max(spans) if spans else None)
    return gaps


def committed_steps(steps: Sequence[Step]) -> float:
    """Weighted count of the final lineage's steps after the window's first step."""
    ordered = sorted(steps, key=lambda r: r.ts)
    first, last = ordered[0], ordered[-1]
    newest: dict[int, Step] = {}
    for row in ordered:
        if row.step <= last.step:
            newest[row.step] = row  # the newest completion of each step number
    return sum(row.weight for number, row in newest.items() if number > first.step)


def side_figures(
    steps: Sequence[Step], faults: Sequence[float], lost: Sequence[int] | None = None
) -> dict[str, Any]:
    """The figures of one side (see the module docstring). `lost`: per fault, for a side that does not
    restore (computed from the groups' first steps otherwise)."""
    if len(steps) < 2:
        raise ValueError(f"{len(steps)} steps: too few to measure anything")
    ordered = sorted(steps, key=lambda r: r.ts)
    wall = ordered[-1].ts - ordered[0].ts
    clean = clean_step_time(ordered, faults)
    committed = committed_steps(ordered)
    lost = list(lost) if lost is not None else lost_per_fault(ordered, faults)
    gaps = gap_per_fault(ordered, faults)
    return {
        "faults_injected": len(faults),
        "wall_s": wall,
        "committed_steps": committed,
        "clean_step_s": clean,
        "effective": committed * clean / wall if clean is not None and wall > 0 else None,
        "lost_steps": {**spread([float(x) for x in lost]), "per_fault": lost},
        "no_step_s": {**spread([g for g in gaps if g is not None]), "per_fault": gaps},
    }
