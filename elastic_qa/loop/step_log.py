"""The `step` line: the global batch's mean loss (one all-reduce), and the same figures for the console,
TensorBoard and the trackers."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from elastic_qa.dist import DistContext
from elastic_qa.observe.console import Console
from elastic_qa.observe.log import get_logger
from elastic_qa.observe.tensorboard import TensorBoardScalars
from elastic_qa.observe.trackers import Trackers
from elastic_qa.train_state import TrainState


class StepStats(NamedTuple):
    loss_sum: torch.Tensor  # over this rank's windows (detached)
    samples: int  # this rank's samples (0 for an empty share)
    grad_norm: torch.Tensor  # before clipping


class StepLog:
    def __init__(
        self, ctx: DistContext, group: Any, console: Console, scalars: TensorBoardScalars | None
    ) -> None:
        self.ctx, self.group, self.console, self.scalars = ctx, group, console, scalars
        self.log = get_logger()

    def step(
        self,
        state: TrainState,
        epoch: int,
        stats: StepStats,
        samples_per_s: float,
        trackers: Trackers | None,
    ) -> None:
        """Log the step `state` just completed, with this rank's `stats` (collective: the mean loss)."""
        local = torch.stack([stats.loss_sum.float().cpu(), torch.tensor(float(stats.samples))])
        totals = local.clone()
        if self.ctx.distributed:
            dist.all_reduce(totals, group=self.group)
        loss = (totals[0] / totals[1].clamp(min=1)).item()
        local_loss = (local[0] / local[1].clamp(min=1)).item()
        rate = samples_per_s
        lr = float(state.scheduler.get_last_lr()[0])  # a float already; torch types it float | Tensor
        norm = float(stats.grad_norm)
        self.log.info(
            "step",
            step=state.step,
            epoch=epoch,
            loss=round(loss, 6),
            rank_loss=round(local_loss, 6),
            lr=lr,
            grad_norm=round(norm, 6),
            samples_per_s=round(rate, 2),
            world_size=self.ctx.world_size,
            cursor=state.cursor.samples_consumed,
        )
        self.console.progress(state.step, loss, rate)
        if self.scalars:
            self.scalars.add(state.step, loss=local_loss, grad_norm=norm, lr=lr, samples_per_s=rate)
        if trackers:
            world = float(self.ctx.world_size)
            trackers.log(state.step, loss=loss, grad_norm=norm, lr=lr, samples_per_s=rate, world_size=world)
