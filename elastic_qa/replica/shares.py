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
    """One worker's ledger file: `share` lines before the cross-group sum, `commit` lines after the vote (the
    same `try` number joins them), and a `lineage` line where this worker's group claims one.
    O_APPEND and one write per line: a killed worker leaves at most its last line torn."""

    def __init__(self, run_dir: str | Path, group: int, worker: int) -> None:
        directory = Path(run_dir) / "ledger"
        directory.mkdir(parents=True, exist_ok=True)
        # A pid can come back (a container restarted on the same run directory): the start time keeps the
        # name new, so a line never joins the torn last line of a killed writer.
        name = f"replica-group-{group:03d}.worker-{worker:03d}.pid-{os.getpid()}.{time.time_ns()}.jsonl"
        self._fd = os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
        self.group, self.worker = group, worker
        self._try = 0

    def share(
        self,
        step: int,
        epoch: int,
        quorum: int,
        participants: int,
        rank: int,
        samples: list[int],
        held: int = 0,
    ) -> None:
        """This worker's windows of `step`, before they leave for the cross-group sum; `held`: the lineage
        its group held while training them (quorum ids start over with a restarted Lighthouse: this tells
        two attempts with one quorum id apart)."""
        self._try += 1
        self._write(
            kind="share", step=step, epoch=epoch, quorum=quorum, participants=participants, rank=rank,
            samples=samples, attempt=self._try, held=held,
        )  # fmt: skip

    def commit(self, step: int, quorum: int, committed: bool, lineage: int) -> None:
        """The vote on the step this worker's last share line was of; `lineage`: the one it commits in."""
        self._write(
            kind="commit", step=step, quorum=quorum, committed=committed, lineage=lineage, attempt=self._try
        )

    def lineage(self, lineage: int, parent: int, from_step: int) -> None:
        """This worker's group claimed `lineage`, continuing `parent` (0: none) after step `from_step`."""
        self._write(kind="lineage", lineage=lineage, parent=parent, from_step=from_step)

    def _write(self, **fields: Any) -> None:
        line = json.dumps({"group": self.group, "worker": self.worker, **fields}, separators=(",", ":"))
        os.write(self._fd, (line + "\n").encode())

    def close(self) -> None:
        os.close(self._fd)


def read_replica_ledger(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every replica ledger line of a run, each with the name of its `file` (torn lines of killed writers
    skipped)."""
    rows = []
    for path in sorted((Path(run_dir) / "ledger").glob("replica-group-*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                rows.append({**row, "file": path.name})
    return rows


@dataclass
class Verdict:
    steps: int  # steps checked (1 .. steps)
    retried: int = 0  # step attempts (step, quorum) that did not commit and were trained again
    discarded: int = 0  # steps committed in lineages the final model does not descend from (a split's cost)
    segments: list[tuple[int, int, int]] = field(default_factory=list)  # the final model's chain (chain_of)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def lineages(self) -> list[int]:
        """The final model's lineages, newest first."""
        return [lineage for lineage, _, _ in self.segments]

    def on_chain(self, lineage: int, step: int) -> bool:
        """Whether step `step` of `lineage` is one the final model descends from."""
        return any(name == lineage and low <= step <= high for name, low, high in self.segments)


Try = tuple[str, int]  # (ledger file, attempt number in it)


def chain_of(
    lineages: dict[int, tuple[int, int]], final: int, steps: int, problems: list[str]
) -> list[tuple[int, int, int]]:
    """The final model's lineages as (lineage, from_step, to_step) segments, newest first: each lineage's
    committed steps from_step+1 .. to_step are the model's. A lineage without a record, a loop, or a chain
    that does not reach step 0 is a problem."""
    segments: list[tuple[int, int, int]] = []
    lineage, to_step = final, steps
    while lineage:
        if lineage not in lineages:
            problems.append(f"lineage {lineage} has no lineage line")
            break
        if any(seen == lineage for seen, _, _ in segments):
            problems.append(f"the lineages loop at {lineage}")
            break
        parent, from_step = lineages[lineage]
        if from_step > to_step:
            problems.append(
                f"lineage {lineage} starts after step {from_step}, past its child's start {to_step}"
            )
            break
        segments.append((lineage, from_step, to_step))
        lineage, to_step = parent, from_step
    else:
        if to_step != 0:
            problems.append(f"the final model's lineages start at step {to_step}, not 0")
    return segments


def quorum_shares(
    of_step: dict[str, list[dict[str, Any]]], quorum: int, summed: set[Try], voted: set[Try]
) -> list[dict[str, Any]]:
    """The share lines of the attempt at a step that `quorum` committed, one per worker that took part
    (`of_step`: each worker file's share lines of that step, in order).

    torchft's vote is per group: a group whose sum went through commits even when another group's vote said
    no afterwards (that group then heals from it), and a worker killed after the sum writes no commit line.
    Either way every member's share is in the committed gradient. `summed`: the attempts whose commit line,
    whatever its vote, names the lineage the step was committed in (their sum went through); a worker of
    the quorum without such a line contributes its last share of that step in that quorum, held in the
    same lineage, of an attempt that has no commit line at all (`voted`: the attempts that have one)."""
    lines, held, rest = [], set(), []
    for rows in of_step.values():
        chosen = [row for row in rows if (row["file"], row["attempt"]) in summed]
        if chosen:
            lines.append(chosen[-1])
            held.add(chosen[-1].get("held"))
        else:
            rest.append(rows)
    for rows in rest:
        candidates = [
            row for row in rows
            if row["quorum"] == quorum and row.get("held") in held
            and (row["file"], row["attempt"]) not in voted
        ]  # fmt: skip
        if candidates:
            lines.append(candidates[-1])
    return lines


def verify(
    rows: list[dict[str, Any]], num_samples: int, global_batch_size: int, seed: int, steps: int, workers: int
) -> Verdict:
    """Whether steps 1..`steps` of the final model's chain of lineages were each committed by exactly one
    quorum whose shares are exactly the step's global batch (the ledger's lines `rows`, `workers` per
    group). Steps committed in lineages off that chain (the losing side of a split) are counted, not faults:
    the final model never saw them."""
    verdict = Verdict(steps)
    lineages: dict[int, tuple[int, int]] = {}
    shares: dict[Try, dict[str, Any]] = {}
    by_step: dict[int, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))  # step ->
    # each worker file's share lines of that step, in order
    committed: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)  # (lineage, step) -> commits
    summed: dict[tuple[int, int], set[Try]] = defaultdict(set)  # (lineage, step) -> attempts of any vote
    voted: set[Try] = set()
    failed: set[tuple[int, int]] = set()  # (step, quorum)
    for row in rows:
        kind = row.get("kind")
        if kind == "lineage":
            record = (row["parent"], row["from_step"])
            if lineages.setdefault(row["lineage"], record) != record:
                verdict.problems.append(f"lineage {row['lineage']} recorded twice, differently")
        elif kind == "share":
            if (row["file"], row["attempt"]) in shares:
                verdict.problems.append(f"step {row['step']}: a share line written twice ({row['file']})")
            shares[row["file"], row["attempt"]] = row
            by_step[row["step"]][row["file"]].append(row)
        elif kind == "commit":
            summed[row["lineage"], row["step"]].add((row["file"], row["attempt"]))
            voted.add((row["file"], row["attempt"]))
            if row.get("committed") is True:
                committed[row["lineage"], row["step"]].append(row)
            else:
                failed.add((row["step"], row["quorum"]))
    # The final model's lineage: the newest that committed the last step (an older one that got there too,
    # the losing side of a split or a job started again from scratch, is discarded work).
    finals = sorted({lineage for lineage, step in committed if step == steps})
    if not finals:
        verdict.problems.append(f"step {steps}: committed by 0 lineages, not one")
        return verdict
    segments = verdict.segments = chain_of(lineages, finals[-1], steps, verdict.problems)
    on_chain = {
        (lineage, step) for lineage, low, high in segments for step in range(low + 1, high + 1)
    }  # fmt: skip
    committed_quorums = {(step, row["quorum"]) for (_, step), rows_ in committed.items() for row in rows_}
    verdict.retried = len(failed - committed_quorums) + len(failed & committed_quorums)
    verdict.discarded = len({key for key in committed if key not in on_chain and key[1] <= steps})
    lineage_of = {step: lineage for lineage, step in on_chain}
    batches = itertools.islice(GlobalCursor(num_samples, global_batch_size, seed).batches(1), steps)
    for batch in batches:
        if batch.step not in lineage_of:
            continue  # the chain was broken: said above
        commits = committed.get((lineage_of[batch.step], batch.step), [])
        quorums = sorted({row["quorum"] for row in commits})
        if len(quorums) != 1:
            verdict.problems.append(
                f"step {batch.step}: committed by {len(quorums)} quorums ({quorums}) in lineage "
                f"{lineage_of[batch.step]}, not one"
            )
            continue
        key = (lineage_of[batch.step], batch.step)
        lines = quorum_shares(by_step[batch.step], quorums[0], summed[key], voted)
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
    beyond = sorted(step for lineage, step in committed if step > steps and lineage in verdict.lineages)
    if beyond:
        verdict.problems.append(f"steps beyond {steps} committed: {beyond[:5]}")
    return verdict
