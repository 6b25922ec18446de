"""Optimizer and learning-rate schedule: AdamW (fused where it can be) with warm-up, then cosine or linear
decay, or a constant rate (train.lr_schedule).

The schedule is an object whose shape and position travel in every checkpoint (LambdaLR saves a callable
object's attributes). A resume with another train.lr_schedule, max_steps, warmup_steps or min_lr_ratio
re-aims it (`retarget`) rather than re-stretching it: the learning rate continues from its value at the
checkpoint and follows the new shape to the floor at the new horizon, never jumping back up.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch
from torch import nn

from elastic_qa.config import LR_SCHEDULE_BEFORE_THE_KEY, Config

# Modules whose weights are not decayed: norms (a scale, not a projection) and embeddings (rows that a batch
# rarely touches would only shrink). Biases, whatever module holds them, are not decayed either.
_NO_DECAY_MODULES = (nn.Embedding, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.modules.batchnorm._NormBase)


def decay_groups(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Trainable parameters to weight-decay, and the rest, by the module that holds them (in model order)."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    seen: set[int] = set()
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if id(param) in seen or not param.requires_grad:
                continue
            seen.add(id(param))
            exempt = param.ndim < 2 or isinstance(module, _NO_DECAY_MODULES)
            (no_decay if exempt else decay).append(param)
    return decay, no_decay


ScheduleKind = Literal["cosine", "linear", "constant"]


class LRSchedule:
    """Linear warm-up over `warmup_steps`, then, by `kind`, cosine or linear decay to `min_ratio` at
    `total_steps`, or a constant multiplier; after a `retarget` at step s, the same from the multiplier it
    had at s (a constant stays there).

    Attributes are plain numbers and a string: they are the schedule's state in the checkpoint
    (weights_only loads it).
    """

    def __init__(
        self, warmup_steps: int, total_steps: int, min_ratio: float, kind: ScheduleKind = "cosine"
    ) -> None:
        self.warmup_steps, self.total_steps, self.min_ratio = warmup_steps, total_steps, min_ratio
        self.kind: str = kind
        self.decay_from = -1  # step the current decay starts at (-1: right after warm-up)
        self.decay_start_value = 1.0  # multiplier there

    def __call__(self, completed: int) -> float:
        retargeted = self.decay_from >= 0
        if completed < self.warmup_steps and not retargeted:
            return (completed + 1) / self.warmup_steps
        top, floor = self.decay_start_value, self.min_ratio
        if self.kind == "constant":
            return top
        start = self.decay_from if retargeted else self.warmup_steps
        progress = min(1.0, (completed - start) / max(1, self.total_steps - start))
        if self.kind == "linear":
            return floor + (top - floor) * (1 - progress)
        return floor + (top - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    def settings(self) -> tuple[str, int, int, float]:
        return self.kind, self.warmup_steps, self.total_steps, self.min_ratio

    def retarget(
        self, completed: int, warmup_steps: int, total_steps: int, min_ratio: float, kind: ScheduleKind
    ) -> None:
        """New settings on resume at step `completed`, keeping the schedule's position (see the module)."""
        if (kind, warmup_steps, total_steps, min_ratio) == self.settings():
            return
        warming_up = completed < warmup_steps and completed < self.warmup_steps and self.decay_from < 0
        if not warming_up:  # the new shape starts from where the old one stands
            self.decay_from, self.decay_start_value = completed, self(completed)
        # Still warming up, the warm-up (the same for every kind) goes on: it does not depend on the rest.
        self.kind = kind
        self.warmup_steps, self.total_steps, self.min_ratio = warmup_steps, total_steps, min_ratio


def lr_multiplier(
    warmup_steps: int, total_steps: int, min_ratio: float, kind: ScheduleKind = "cosine"
) -> Callable[[int], float]:
    """Linear warm-up over `warmup_steps`, then `kind`'s decay to `min_ratio` at `total_steps`."""
    return LRSchedule(warmup_steps, total_steps, min_ratio, kind)


def build_optimizer(model: torch.nn.Module, cfg: Config) -> torch.optim.Optimizer:
    decay, no_decay = decay_groups(model)
    groups = [
        {"params": decay, "weight_decay": cfg.train.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    try:
        # The fused kernel (CPU and CUDA since torch 2.4) is one pass over the parameters, several times
        # faster than foreach or the loop on CPU (docs/benchmarks.md, "Throughput": the figures and command).
        return torch.optim.AdamW(groups, lr=cfg.train.peak_lr, fused=True)
    except (RuntimeError, ValueError):  # a device or torch build without the fused kernel
        return torch.optim.AdamW(groups, lr=cfg.train.peak_lr, foreach=True)


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: Config, total_steps: int | None = None
) -> torch.optim.lr_scheduler.LambdaLR:
    """The LR schedule of `cfg`, ending at `total_steps` (default train.max_steps; run_length.end_step)."""
    train = cfg.train
    total = train.max_steps if total_steps is None else total_steps
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, LRSchedule(train.warmup_steps, total, train.min_lr_ratio, train.lr_schedule)
    )


def retarget_schedule(
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    cfg: Config,
    saved_state: dict,
    saved_train: dict,
    total_steps: int | None = None,
) -> None:
    """After `scheduler.load_state_dict(saved_state)`: aim its schedule at this config's settings and at
    `total_steps` (default train.max_steps), keeping its position. A checkpoint written before the schedule
    kept its settings (its `lr_lambdas` are None) was trained with those of its stored config,
    `saved_train`; one written before it kept its kind (no `kind` among them) was cosine."""
    train = cfg.train
    total = train.max_steps if total_steps is None else total_steps
    kept = [entry for entry in saved_state.get("lr_lambdas", ()) if entry is not None]
    for schedule in {id(f): f for f in scheduler.lr_lambdas}.values():
        if not isinstance(schedule, LRSchedule):
            continue
        if kept and "kind" not in kept[0]:
            schedule.kind = LR_SCHEDULE_BEFORE_THE_KEY  # load_state_dict left this config's kind in place
        if not kept and saved_train:
            schedule.kind = str(saved_train.get("lr_schedule", LR_SCHEDULE_BEFORE_THE_KEY))
            schedule.warmup_steps = int(saved_train.get("warmup_steps", schedule.warmup_steps))
            schedule.total_steps = int(saved_train.get("max_steps", schedule.total_steps))
            schedule.min_ratio = float(saved_train.get("min_lr_ratio", schedule.min_ratio))
        schedule.retarget(
            scheduler.last_epoch, train.warmup_steps, total, train.min_lr_ratio, train.lr_schedule
        )
