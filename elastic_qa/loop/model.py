"""The model a run trains: built alike on every rank, frozen where the loss cannot see, compiled, wrapped."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed import ProcessGroup

from elastic_qa.compile import CompileWatch, compile_model, use_compile_cache
from elastic_qa.config import Config
from elastic_qa.data.cache import PreparedData
from elastic_qa.data.cursor import GlobalCursor
from elastic_qa.dist import CommTimer, DistContext, unwrap, wrap_model
from elastic_qa.loop.freeze import freeze_loss_invariant
from elastic_qa.models import ModelFamily
from elastic_qa.observe.startup import STARTUP
from elastic_qa.optim import build_optimizer, build_scheduler
from elastic_qa.run_length import end_step
from elastic_qa.train_state import TrainState


@dataclass
class TrainedModel:
    model: torch.nn.Module  # wrapped for this run (DDP when distributed): dist.unwrap gives the model
    trained: list[torch.nn.Parameter]  # those that require grad, listed once (the clipping's list)
    draws_random: bool  # a step draws random numbers (dropout): it re-seeds them per step and rank
    compile_watch: CompileWatch | None  # train.compile: what the compiler did, told at each step
    comm_timer: CommTimer  # the gradient all-reduce's time (DDP's comm hook)
    loss_invariant: dict[str, Any] | None  # the freeze's answer, carried by checkpoints (None: no freeze)


def build_trained_model(
    cfg: Config, ctx: DistContext, data: PreparedData, family: ModelFamily, group: ProcessGroup | None
) -> TrainedModel:
    """Identical initial weights on every rank (seeded by run.seed); the freeze's answer is rank 0's (its
    probe's, or the one the newest checkpoint carries for this model), broadcast on `group`."""
    torch.manual_seed(cfg.run.seed)
    model = family.build_model(cfg, data.vocab_size)
    STARTUP.mark("model_build")
    loss_invariant = None
    if cfg.train.freeze_loss_invariant:
        loss_invariant = freeze_loss_invariant(model, cfg, family, data.train, ctx, group)
        STARTUP.mark("probe")
    model = model.to(ctx.device)
    # Listed once: walking the modules for them at every step costs as much as the clipping.
    trained = [param for param in model.parameters() if param.requires_grad]
    # Re-seeded only when a step draws random numbers (a pretrained model keeps dropout of its own
    # when model.dropout is null).
    draws_random = (cfg.model.dropout or 0.0) > 0 or any(
        isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()
    )
    compile_watch = None
    if cfg.train.compile:  # in place and before DDP wraps it: elastic_qa/compile.py says why
        compile_watch = CompileWatch(use_compile_cache(cfg))
        compile_model(model, cfg, family.full_width)
    comm_timer = CommTimer()
    wrapped = wrap_model(model, ctx, cfg.dist, comm_timer)
    STARTUP.mark("model_build")
    return TrainedModel(wrapped, trained, draws_random, compile_watch, comm_timer, loss_invariant)


def new_train_state(cfg: Config, ctx: DistContext, data: PreparedData, built: TrainedModel) -> TrainState:
    """The training state of a fresh start around `built`: its optimizer and schedule to the run's end
    step (a resume may keep its checkpoint's: TrainState), the fp16 gradient scaler, the data cursor."""
    optimizer = build_optimizer(unwrap(built.model), cfg)
    end = end_step(cfg.train, len(data.train))
    return TrainState(
        cfg,
        ctx,
        built.model,
        optimizer,
        build_scheduler(optimizer, cfg, end),
        torch.amp.GradScaler("cuda") if cfg.train.precision == "fp16" else None,
        GlobalCursor(len(data.train), cfg.train.global_batch_size, cfg.run.seed),
        vocabulary=data.vocabulary,
        end=end,
        loss_invariant=built.loss_invariant,
    )
