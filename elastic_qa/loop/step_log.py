"""The `step` line: the global batch's mean loss (its sums carried on the control all-reduce), and the same
figures for the console, TensorBoard and the trackers."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from elastic_qa.dist import DistContext
from elastic_qa.observe.console import Console
from elastic_qa.observe.log import get_logger
from elastic_qa.observe.tensorboard import TensorBoardScalars
from elastic_qa.observe.trackers import Trackers
from elastic_qa.train_state import TrainState


class StepStats(NamedTuple):
    loss_sum: torch.Tensor  # over this rank's windows (detached)
    samples: int  # this rank's samples (0 for an empty share)
    grad_norm: torch.Tensor | None  # before clipping; None where nothing needed it (loop/step.py)


# Sums the ranks' values (ControlPlane.carry): `carry(values, deliver)` calls `deliver(sums)` later.
Carry = Callable[[torch.Tensor, Callable[[torch.Tensor], None]], None]


class StepLog:
    def __init__(self, ctx: DistContext, console: Console, scalars: TensorBoardScalars | None) -> None:
        self.ctx, self.console, self.scalars = ctx, console, scalars
        self.log = get_logger()

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
        carry(values, lambda totals: self._write(figures, local, totals.tolist(), trackers))

    def _write(
        self,
        figures: dict[str, Any],
        local: tuple[float, float],
        totals: list[float],
        trackers: Trackers | None,
    ) -> None:
        step, lr, norm, rate = figures["step"], figures["lr"], figures["grad_norm"], figures["samples_per_s"]
        loss = totals[0] / max(totals[1], 1.0)
        local_loss = local[0] / max(local[1], 1.0)
        self.log.info(
            "step",
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
            trackers.log(step, loss=loss, grad_norm=norm, lr=lr, samples_per_s=rate, world_size=world)
