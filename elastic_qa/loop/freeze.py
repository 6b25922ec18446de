"""Freezing the parameters the span loss cannot see, decided by rank 0's probe at start-up, or by the answer
the run's newest checkpoint carries for the same model."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from elastic_qa.checkpoint.locate import newest_saved_trainer
from elastic_qa.checkpoint.store import CheckpointError
from elastic_qa.config import Config
from elastic_qa.data.features import Features
from elastic_qa.data.loader import collate
from elastic_qa.dist import DistContext
from elastic_qa.models import ModelFamily
from elastic_qa.models.invariance import freeze, loss_invariant_parameters
from elastic_qa.observe.events import Event
from elastic_qa.observe.log import get_logger

# Windows the start-up probe for loss-invariant parameters reads (a float64 forward and backward).
PROBE_WINDOWS = 4
# trainer.pt's key for the probe's answer: {"identity": model_identity(...), "frozen": [names]}.
ANSWER_KEY = "loss_invariant"


def model_identity(model: torch.nn.Module, cfg: Config) -> str:
    """What the probe's answer is a property of: the model settings and every trainable parameter's name
    and shape (sha256). Another model, architecture, size or vocabulary gives another identity."""
    shapes = [[name, list(param.shape)] for name, param in model.named_parameters() if param.requires_grad]
    text = json.dumps([cfg.to_dict()["model"], shapes], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def stored_answer(cfg: Config) -> Any:
    """The probe's answer as the run's newest readable checkpoint carries it (its trainer.pt alone, checked
    against its sha256 and loaded with weights_only), or None: no checkpoint, none readable, or one written
    before answers travelled. Reads only."""
    try:
        saved = newest_saved_trainer(cfg.checkpoint_dir)
    except (CheckpointError, OSError, ValueError):
        return None
    return saved[1].get(ANSWER_KEY) if saved else None


def known_frozen(answer: Any, identity: str, names: list[str]) -> list[str] | None:
    """The frozen names of a stored `answer` when it is one for this model (`identity`), else None."""
    if not isinstance(answer, dict) or answer.get("identity") != identity:
        return None
    frozen = answer.get("frozen")
    if not isinstance(frozen, list) or not set(frozen) <= set(names):
        return None
    return [str(name) for name in frozen]


def freeze_loss_invariant(
    model: torch.nn.Module,
    cfg: Config,
    family: ModelFamily,
    train: Features,
    ctx: DistContext,
    group: ProcessGroup | None,
) -> dict[str, Any]:
    """Freeze the parameters the span loss cannot see (models/invariance.py), the same on every rank; the
    answer, {"identity", "frozen": names}, for the checkpoints to carry.

    Rank 0 decides and the others take its answer (broadcast on `group`). It probes only when the run's
    newest checkpoint carries no answer for this model: the probe's float64 copy of the model is its
    largest cost (gigabytes and seconds for a base-size encoder), which a restart
    should not pay again for a model it already probed, nor a node of 8 ranks 8 times over.
    """
    names = [name for name, param in model.named_parameters() if param.requires_grad]
    identity = model_identity(model, cfg)
    flags = torch.zeros(len(names), dtype=torch.uint8)
    source = ""
    if ctx.rank == 0:
        found = known_frozen(stored_answer(cfg), identity, names)
        source = "checkpoint"
        if found is None:
            rows = np.arange(min(PROBE_WINDOWS, len(train)))
            probe = collate(train, rows, full_width=family.full_width)
            found = loss_invariant_parameters(model, probe, family.span_loss_per_window)
            source = "probe"
        chosen = set(found)
        flags = torch.tensor([name in chosen for name in names], dtype=torch.uint8)
    if ctx.distributed:
        dist.broadcast(flags, src=0, group=group)
    frozen = [name for name, flag in zip(names, flags.tolist(), strict=True) if flag]
    freeze(model, frozen)
    if ctx.is_main:
        get_logger().info(Event.FROZEN_PARAMETERS, count=len(frozen), names=frozen, source=source)
    return {"identity": identity, "frozen": frozen}
