"""Freezing the parameters the span loss cannot see, decided by rank 0's probe at start-up."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from elastic_qa.data.features import Features
from elastic_qa.data.loader import collate
from elastic_qa.dist import DistContext
from elastic_qa.models import ModelFamily
from elastic_qa.models.invariance import freeze, loss_invariant_parameters
from elastic_qa.observe.log import get_logger

# Windows the start-up probe for loss-invariant parameters reads (a float64 forward and backward).
PROBE_WINDOWS = 4


def freeze_loss_invariant(
    model: torch.nn.Module, family: ModelFamily, train: Features, ctx: DistContext, group: Any
) -> list[str]:
    """Freeze the parameters the span loss cannot see (models/invariance.py), the same on every rank; the
    names frozen.

    Rank 0 probes and the others take its answer (broadcast on `group`): the probe's float64 copy of the
    model is its largest cost (measured on a random bert-base: ~2.5 GB and seconds), which a node of 8
    ranks should not pay 8 times over at every restart.
    """
    names = [name for name, param in model.named_parameters() if param.requires_grad]
    flags = torch.zeros(len(names), dtype=torch.uint8)
    if ctx.rank == 0:
        rows = np.arange(min(PROBE_WINDOWS, len(train)))
        probe = collate(train, rows, full_width=family.full_width)
        found = set(loss_invariant_parameters(model, probe, family.span_loss_per_window))
        flags = torch.tensor([name in found for name in names], dtype=torch.uint8)
    if ctx.distributed:
        dist.broadcast(flags, src=0, group=group)
    frozen = [name for name, flag in zip(names, flags.tolist(), strict=True) if flag]
    freeze(model, frozen)
    if ctx.is_main:
        get_logger().info("frozen_parameters", count=len(frozen), names=frozen)
    return frozen
