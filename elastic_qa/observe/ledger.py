"""The sample ledger (`debug.sample_ledger`): per rank and step, which dataset samples were trained on.

Each line is written when a rank *starts* a step, before its gradient all-reduce: a step can only complete
once every rank has reached that all-reduce, so every completed step has all its lines. A step that was
started but lost to a failure is run again by a later attempt, and readers take, for each step, the lines
of the highest attempt that ran it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


class SampleLedger:
    def __init__(self, run_dir: str, attempt: int, rank: int, world_size: int) -> None:
        directory = Path(run_dir) / "ledger"
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"attempt-{attempt:08d}.rank-{rank:03d}.jsonl"
        # O_APPEND and one write() per line: a SIGKILL never leaves a half line behind a complete one.
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.attempt, self.rank, self.world_size = attempt, rank, world_size

    def record(self, step: int, epoch: int, samples: list[int]) -> None:
        line = json.dumps(
            {
                "attempt": self.attempt,
                "step": step,
                "epoch": epoch,
                "rank": self.rank,
                "world_size": self.world_size,
                "samples": samples,
            },
            separators=(",", ":"),
        )
        os.write(self._fd, (line + "\n").encode())

    def close(self) -> None:
        os.close(self._fd)


def read_ledger(run_dir: str | Path) -> list[dict]:
    """Every ledger line of a run (torn last lines of killed writers are skipped)."""
    rows = []
    for path in sorted((Path(run_dir) / "ledger").glob("attempt-*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def effective_order(rows: list[dict]) -> dict[int, list[dict]]:
    """For each step, the entries of the highest attempt that ran it (sorted by rank)."""
    best: dict[int, int] = {}
    for row in rows:
        best[row["step"]] = max(best.get(row["step"], -1), row["attempt"])
    chosen: dict[int, list[dict]] = {}
    for row in rows:
        if row["attempt"] == best[row["step"]]:
            chosen.setdefault(row["step"], []).append(row)
    return {step: sorted(entries, key=lambda r: r["rank"]) for step, entries in sorted(chosen.items())}
