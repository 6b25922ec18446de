"""The step lines a dead rank 0 never wrote: a survivor's emergency checkpoint carries the lines it wrote
from the last sums that arrived, and the new rank 0 writes those rank 0's log does not hold
(loop/step_log.py)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from elastic_qa.dist import DistContext
from elastic_qa.loop.step_log import StepLog, StepStats
from elastic_qa.observe.console import Console
from elastic_qa.train_state import unwritten_lines


class Recorder:
    """Stands in for the structlog logger: keeps the lines."""

    def __init__(self) -> None:
        self.lines: list[dict[str, Any]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.lines.append({"event": str(event), **fields})


def step_log(rank: int, agreements: list[int]) -> StepLog:
    ctx = DistContext(rank, 2, rank, torch.device("cpu"), "gloo", 2)
    log = StepLog(ctx, Console("none", 10, enabled=False, stream=io.StringIO()), None, lambda: agreements[0])
    log.log = Recorder()
    return log


def log_step(log: StepLog, step: int, carried: list[Any]) -> None:
    state = SimpleNamespace(
        step=step,
        scheduler=SimpleNamespace(get_last_lr=lambda: [1e-3]),
        cursor=SimpleNamespace(samples_consumed=8 * step),
    )
    stats = StepStats(torch.tensor(2.0 * step), 4, torch.tensor(0.5))
    log.step(state, 0, stats, 9.0, None, lambda values, deliver: carried.append((values, deliver)))


def test_a_survivor_carries_the_lines_of_the_last_sums_and_rank_0_writes_the_ones_its_log_lacks(
    tmp_path: Path,
) -> None:
    agreements = [0]
    survivor = step_log(rank=1, agreements=agreements)
    carried: list[Any] = []
    for step in (1, 2):
        log_step(survivor, step, carried)
    agreements[0] = 1  # the first sums arrive: lines 1 and 2 written
    for values, deliver in carried:
        deliver(values * 2)  # the whole batch's sums: twice this rank's
    carried.clear()
    for step in (3, 4, 5):
        log_step(survivor, step, carried)
    agreements[0] = 2  # the next sums arrive: lines 3-5 written; rank 0 dies before writing its own
    for values, deliver in carried:
        deliver(values * 2)
    carried.clear()
    log_step(survivor, 6, carried)  # its sums never arrive: the next all-reduce fails

    saved = unwritten_lines(survivor.unwritten(), "test")  # as an emergency checkpoint stores and loads them
    assert [(line["step"], line["written"]) for line in saved] == [
        (3, True),
        (4, True),
        (5, True),
        (6, False),
    ]

    logs = tmp_path / "logs"
    logs.mkdir()  # the old rank 0 had written step 3 (and older ones) before it died
    old = [{"event": "step", "step": step, "attempt": 1, "rank": 0} for step in (1, 2, 3)]
    (logs / "rank-000.host.pid-10.jsonl").write_text("".join(json.dumps(row) + "\n" for row in old))
    new_rank_0 = step_log(rank=0, agreements=[0])
    new_rank_0.recover(saved, attempt=1, trackers=None, logs=logs)
    lines = new_rank_0.log.lines  # type: ignore[attr-defined]
    assert [(line["step"], "loss_ranks" in line) for line in lines] == [(4, False), (5, False), (6, True)]
    assert lines[0]["loss"] == 2.0 * 4 / 4  # the whole batch's mean, as rank 0 would have written it
    assert lines[2]["loss_ranks"] == [1] and all(line["recovered"] for line in lines)


def test_rank_0_carries_no_line_it_wrote_itself() -> None:
    agreements = [0]
    rank_0 = step_log(rank=0, agreements=agreements)
    carried: list[Any] = []
    log_step(rank_0, 1, carried)
    agreements[0] = 1
    for values, deliver in carried:
        deliver(values * 2)
    assert rank_0.unwritten() == []
