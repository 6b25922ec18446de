"""Exactly once under changing quorums: each step's global batch split over whoever takes part, and the proof.

A step's global batch is read at the global cursor (data/cursor.py), whatever the quorum: the windows of step
s are the same whether one replica group trains it or four. They are split over the quorum's participants
times the workers of each group ("virtual ranks"), and the loss is normalised by the global count, so the
summed gradient is the mean over the global batch for any number of participants. The cursor moves only when
the step commits; a step that does not commit is trained again, with the same windows, by the next quorum.

The ledger proves it. Before its gradients leave for the cross-group sum, every worker appends the windows of
its share (a `share` line: step, quorum, participants, its place); after the vote, a `commit` line. A step
counts as trained by the quorum whose vote said yes: the sum finished on every member of that quorum, so all
of its shares are in the gradient (each was written before its member's sum began). `verify` takes the run's
lines and says, for every step, whether exactly one quorum committed it and whether that quorum's shares are
exactly that step's global batch: no window repeated, none skipped.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from elastic_qa.data.cursor import GlobalBatch, GlobalCursor, rank_slice
from elastic_qa.data.features import Features
from elastic_qa.data.loader import RankBatchKey, StepBatch, step_batch


def share_of(batch: GlobalBatch, participants: int, rank: int, workers: int, worker: int) -> list[int]:
    """The windows of `batch` that worker `worker` (of `workers`) of the group at `rank` among `participants`
    trains: one contiguous slice, sizes differing by at most one."""
    start, stop = rank_slice(batch.global_count, participants * workers, rank * workers + worker)
    return batch.global_indices[start:stop]


def share_batch(
    features: Features, batch: GlobalBatch, share: list[int], lengths: np.ndarray, full_width: bool
) -> StepBatch:
    """The tensors of one share (an empty share trains one window with weight 0, as the classic loader)."""
    key = RankBatchKey(
        batch.step,
        batch.epoch,
        batch.global_count,
        int(lengths[batch.global_indices].sum()),
        tuple(share) or (batch.global_indices[0],),
        not share,
    )
    return step_batch(features, key, full_width=full_width)


class ReplicaLedger:
    """One worker's ledger file: `share` lines before the cross-group sum, `commit` lines after the vote.
    O_APPEND and one write per line: a killed worker leaves at most its last line torn."""

    def __init__(self, run_dir: str | Path, group: int, worker: int) -> None:
        directory = Path(run_dir) / "ledger"
        directory.mkdir(parents=True, exist_ok=True)
        # A pid can come back (a container restarted on the same run directory): the start time keeps the
        # name new, so a line never joins the torn last line of a killed writer.
        name = f"replica-group-{group:03d}.worker-{worker:03d}.pid-{os.getpid()}.{time.time_ns()}.jsonl"
        self._fd = os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
        self.group, self.worker = group, worker

    def share(
        self, step: int, epoch: int, quorum: int, participants: int, rank: int, samples: list[int]
    ) -> None:
        self._write(
            kind="share", step=step, epoch=epoch, quorum=quorum, participants=participants, rank=rank,
            samples=samples,
        )  # fmt: skip

    def commit(self, step: int, quorum: int, committed: bool) -> None:
        self._write(kind="commit", step=step, quorum=quorum, committed=committed)

    def _write(self, **fields: Any) -> None:
        line = json.dumps({"group": self.group, "worker": self.worker, **fields}, separators=(",", ":"))
        os.write(self._fd, (line + "\n").encode())

    def close(self) -> None:
        os.close(self._fd)


def read_replica_ledger(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every replica ledger line of a run (torn lines of killed writers skipped)."""
    rows = []
    for path in sorted((Path(run_dir) / "ledger").glob("replica-group-*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows


@dataclass
class Verdict:
    steps: int  # steps checked (1 .. steps)
    retried: int = 0  # step attempts that did not commit and were trained again
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(
    rows: list[dict[str, Any]], num_samples: int, global_batch_size: int, seed: int, steps: int, workers: int
) -> Verdict:
    """Whether steps 1..`steps` were each committed by exactly one quorum whose shares are exactly the step's
    global batch (the ledger's lines `rows`, `workers` per group)."""
    verdict = Verdict(steps)
    committed: dict[int, set[int]] = defaultdict(set)
    attempted: dict[int, set[int]] = defaultdict(set)
    shares: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        if row.get("kind") == "commit":
            attempted[row["step"]].add(row["quorum"])
            if row.get("committed") is True:
                committed[row["step"]].add(row["quorum"])
        elif row.get("kind") == "share":
            shares[row["step"], row["quorum"]].append(row)
    batches = itertools.islice(GlobalCursor(num_samples, global_batch_size, seed).batches(1), steps)
    for batch in batches:
        quorums = committed.get(batch.step, set())
        verdict.retried += len(attempted.get(batch.step, set()) - quorums)
        if len(quorums) != 1:
            verdict.problems.append(
                f"step {batch.step}: committed by {len(quorums)} quorums ({sorted(quorums)}), not one"
            )
            continue
        quorum = next(iter(quorums))
        lines = shares[batch.step, quorum]
        places = {(row["rank"], row["worker"]) for row in lines}
        participants = {row["participants"] for row in lines}
        if len(participants) != 1:
            verdict.problems.append(
                f"step {batch.step}: shares disagree on the participants ({participants})"
            )
            continue
        expected = {(r, w) for r in range(participants.pop()) for w in range(workers)}
        if places != expected or len(lines) != len(expected):
            verdict.problems.append(
                f"step {batch.step}: shares of {sorted(places)}, expected {sorted(expected)}"
            )
            continue
        trained = sorted(sample for row in lines for sample in row["samples"])
        if trained != sorted(batch.global_indices):
            verdict.problems.append(
                f"step {batch.step}: trained {len(trained)} windows that are not its batch"
            )
        if any(row["epoch"] != batch.epoch for row in lines):
            verdict.problems.append(f"step {batch.step}: a share of another epoch")
    beyond = sorted(step for step in committed if step > steps)
    if beyond:
        verdict.problems.append(f"steps beyond {steps} committed: {beyond[:5]}")
    return verdict
