"""The `step` line: the global batch's mean loss (its sums carried on the control all-reduce), and the same
figures for the console, TensorBoard and the trackers.

A line waits for the next agreement for its sums. When the group fails first (a peer died), the steps whose
lines were waiting are still committed by the emergency checkpoint: `unwritten` gives them to it, with what
this rank knows of them (its own share of the loss), and the group that resumes from it writes them
(`recover`), so that every committed step has its line and its tracker record once.

Rank 0 may also die after the last sums arrived and before it wrote their lines (the optimizer step lies
between; on a loaded machine, more): the survivors wrote theirs, rank 0's are missing. So the lines written
from the last sums go with the checkpoint too (`written`, with the whole batch's loss), and the new rank 0
writes each one the old rank 0's log does not hold (its log's tail, in the run's logs directory; a log on
another host's disk is not seen, and such a line can then appear twice). Their tracker records are in the
trackers' backlog already (observe/trackers).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from elastic_qa.dist import DistContext
from elastic_qa.observe.console import Console
from elastic_qa.observe.events import Event
from elastic_qa.observe.log import get_logger
from elastic_qa.observe.tensorboard import TensorBoardScalars
from elastic_qa.observe.trackers import Trackers
from elastic_qa.train_state import TrainState

_TAIL_BYTES = 2**20  # of each rank-0 log: far more than the lines of one control period


class StepStats(NamedTuple):
    loss_sum: torch.Tensor  # over this rank's windows (detached)
    samples: int  # this rank's samples (0 for an empty share)
    grad_norm: torch.Tensor | None  # before clipping; None where nothing needed it (loop/step.py)


# Sums the ranks' values (ControlPlane.carry): `carry(values, deliver)` calls `deliver(sums)` later.
Carry = Callable[[torch.Tensor, Callable[[torch.Tensor], None]], None]


class StepLog:
    def __init__(
        self,
        ctx: DistContext,
        console: Console,
        scalars: TensorBoardScalars | None,
        agreements: Callable[[], int] = lambda: 0,
    ) -> None:
        """`agreements()` counts the sums that have arrived (ControlPlane.agreements): which lines were
        written from the last of them."""
        self.ctx, self.console, self.scalars = ctx, console, scalars
        self.agreements = agreements
        self.log = get_logger()
        # step -> (figures, this rank's sums) of each line carried and not written yet
        self._unwritten: dict[int, tuple[dict[str, Any], tuple[float, float]]] = {}
        # The lines written from the last sums that arrived: (that arrival's number, [(figures, totals)])
        self._last_written: tuple[int, list[tuple[dict[str, Any], list[float]]]] = (-1, [])

    def step(
        self,
        state: TrainState,
        epoch: int,
        stats: StepStats,
        samples_per_s: float,
        trackers: Trackers | None,
        carry: Carry,
    ) -> None:
        """Log the step `state` just completed, with this rank's `stats`. The global mean loss needs every
        rank's sums: `carry` brings them (on the next step's control all-reduce, which no step waits for),
        and the line is written then, stamped with this step's time and figures."""
        # Python floats from here on: a handful of tensor ops per line cost more than the arithmetic.
        local = (float(stats.loss_sum), float(stats.samples))
        figures = {
            "step": state.step,
            "epoch": epoch,
            "lr": float(state.scheduler.get_last_lr()[0]),  # a float already; torch types it float | Tensor
            "grad_norm": float(stats.grad_norm) if stats.grad_norm is not None else float("nan"),
            "samples_per_s": samples_per_s,
            "cursor": state.cursor.samples_consumed,
            "ts": round(time.time(), 6),  # when the step ended, not when its line is written
        }
        values = torch.tensor(local, dtype=torch.float64)
        self._unwritten[state.step] = (figures, local)
        carry(values, lambda totals: self._write(figures, local, totals.tolist(), trackers))

    def unwritten(self) -> list[dict[str, Any]]:
        """What a checkpoint taken now (an emergency save) must carry, in step order (train_state.LINE_FIELDS
        each): the lines written from the last sums (`written`: rank 0 may have died before writing its
        own), then those of completed steps still waiting for their sums."""
        world, rank = self.ctx.world_size, self.ctx.rank
        written = [
            {**figures, "world_size": world, "rank": rank, "loss_sum": totals[0], "samples": totals[1],
             "written": True}
            for figures, totals in self._last_written[1]
            if not self.ctx.is_main  # rank 0's own lines: written by itself
        ]  # fmt: skip
        return written + [
            {**figures, "world_size": world, "rank": rank, "loss_sum": local[0], "samples": local[1]}
            for figures, local in self._unwritten.values()
        ]

    def recover(
        self, lines: list[dict[str, Any]], attempt: int, trackers: Trackers | None, logs: Path | None = None
    ) -> None:
        """Write the lines a checkpoint carried (`unwritten` of attempt `attempt`): rank 0 logs each as the
        `step` event that attempt could not, `recovered`; a line still waiting for its sums has the loss of
        the share the saving rank knew (`loss_ranks`), and one already written by the saving rank is logged
        only where rank 0's log in `logs` does not hold it. Every rank gives the trackers the waiting ones'
        records (rank 0 sends them, the others keep them for an emergency save of their own,
        observe/trackers); the written ones' are in the trackers' backlog already."""
        logged: set[int] = set()  # read only when some line may be in rank 0's log already
        if self.ctx.is_main and logs is not None and any(line.get("written") for line in lines):
            logged = _steps_logged_by_rank_0(logs, attempt)
        for line in lines:
            written = line.get("written", False)
            known = line["samples"] > 0
            loss = line["loss_sum"] / line["samples"] if known else float("nan")
            if self.ctx.is_main and not (written and line["step"] in logged):
                self.log.info(
                    Event.STEP,
                    step=line["step"],
                    epoch=line["epoch"],
                    loss=round(loss, 6),
                    lr=line["lr"],
                    grad_norm=round(line["grad_norm"], 6),
                    samples_per_s=round(line["samples_per_s"], 2),
                    world_size=line["world_size"],
                    cursor=line["cursor"],
                    ts=line["ts"],  # when the step ended, by the attempt that trained it
                    attempt=attempt,
                    recovered=True,
                    **({} if written else {"loss_ranks": [line["rank"]]}),  # written: the whole batch's
                )
            if trackers and not written:
                metrics = _tracker_metrics(loss, line["grad_norm"], line["lr"], line["samples_per_s"])
                if not known:
                    del metrics["loss"]
                trackers.log(line["step"], **metrics, world_size=float(line["world_size"]))

    def _write(
        self,
        figures: dict[str, Any],
        local: tuple[float, float],
        totals: list[float],
        trackers: Trackers | None,
    ) -> None:
        step, lr, norm, rate = figures["step"], figures["lr"], figures["grad_norm"], figures["samples_per_s"]
        self._unwritten.pop(step, None)
        arrival = self.agreements()
        if self._last_written[0] != arrival:
            self._last_written = (arrival, [])
        self._last_written[1].append((figures, totals))
        loss = totals[0] / max(totals[1], 1.0)
        local_loss = local[0] / max(local[1], 1.0)
        self.log.info(
            Event.STEP,
            step=step,
            epoch=figures["epoch"],
            loss=round(loss, 6),
            rank_loss=round(local_loss, 6),
            lr=lr,
            grad_norm=round(norm, 6),
            samples_per_s=round(rate, 2),
            world_size=self.ctx.world_size,
            cursor=figures["cursor"],
            ts=figures["ts"],
        )
        self.console.progress(step, loss, rate)
        if self.scalars:
            self.scalars.add(step, loss=local_loss, grad_norm=norm, lr=lr, samples_per_s=rate)
        if trackers:
            world = float(self.ctx.world_size)
            trackers.log(step, **_tracker_metrics(loss, norm, lr, rate), world_size=world)


def _tracker_metrics(loss: float, grad_norm: float, lr: float, samples_per_s: float) -> dict[str, float]:
    return {"loss": loss, "grad_norm": grad_norm, "lr": lr, "samples_per_s": samples_per_s}


def _steps_logged_by_rank_0(logs: Path, attempt: int) -> set[int]:
    """The steps whose `step` line rank 0 of `attempt` wrote, from the tail of each rank-0 log in `logs`
    (the lines at stake are the last it wrote, if it wrote them); nothing where none can be read."""
    found: set[int] = set()
    for path in sorted(logs.glob("rank-000.*.jsonl")):
        try:
            with open(path, "rb") as handle:
                handle.seek(max(0, handle.seek(0, os.SEEK_END) - _TAIL_BYTES))
                tail = handle.read(_TAIL_BYTES)
        except OSError:
            continue
        for raw in tail.splitlines():
            try:
                row = json.loads(raw)
            except ValueError:  # the first line of the tail, cut; a torn line
                continue
            if (
                isinstance(row, dict)
                and row.get("event") == Event.STEP
                and row.get("attempt") == attempt
                and type(row.get("step")) is int
            ):
                found.add(row["step"])
    return found
