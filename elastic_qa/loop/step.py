"""One optimizer step's forward and backward: this rank's share in micro-batches, under autocast."""

from __future__ import annotations

from contextlib import nullcontext
from typing import cast

import torch
from torch.nn.parallel import DistributedDataParallel

from elastic_qa.config import ConfigError
from elastic_qa.data.loader import StepBatch
from elastic_qa.dist import DistContext
from elastic_qa.models import ModelFamily, model_inputs
from elastic_qa.train_state import TrainState

# What the loss compares the logits with, per window (weights: 0 for the padding rows of an empty share).
TARGETS = ("start_positions", "end_positions", "weights")


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of `train.precision` on `device` (None: fp32); ConfigError where it cannot run."""
    if precision == "fp16" and device.type != "cuda":
        raise ConfigError("train.precision=fp16 needs CUDA (GradScaler); on CPU use train.precision=bf16")
    # autocast would refuse at the first step, in every worker torchrun restarts: say it once, at start-up.
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f"train.precision=bf16: {torch.cuda.get_device_name(device)} cannot compute in bf16; "
            "use train.precision=fp16 or fp32"
        )
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def accumulate_gradients(
    model: torch.nn.Module,
    family: ModelFamily,
    batch: StepBatch,
    ctx: DistContext,
    micro_batch_size: int,
    dtype: torch.dtype | None,
    scaler: torch.amp.GradScaler | None,
) -> torch.Tensor:
    """Forward and backward over `batch` in micro-batches, gradients synced (DDP) on the last one only;
    the sum of the windows' losses (detached, on this rank's device)."""
    device, world_size = ctx.device, ctx.world_size
    distributed = isinstance(model, DistributedDataParallel)  # not in a world of one rank (wrap_model)
    starts = list(range(0, batch.rows, micro_batch_size))
    # DDP averages gradients over ranks; scaling each rank's loss *sum* by world/global_count makes
    # the result the mean over the global batch, however unevenly the ranks' shares are split.
    scale = world_size / batch.global_count
    loss_sum = torch.zeros((), device=device)
    for i, lo in enumerate(starts):
        rows = slice(lo, lo + micro_batch_size)
        sync = i == len(starts) - 1 or not distributed
        with cast(DistributedDataParallel, model).no_sync() if not sync else nullcontext():
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                start_logits, end_logits = model(**model_inputs(batch.tensors, device, rows))
            loss = family.span_loss(
                start_logits,
                end_logits,
                *(batch.tensors[k][rows].to(device, non_blocking=True) for k in TARGETS),
            )
            loss_sum += loss.detach()
            (scaler.scale(loss * scale) if scaler else loss * scale).backward()
    return loss_sum


def optimizer_step(
    state: TrainState, trained: list[torch.nn.Parameter], grad_clip: float | None, norm_wanted: bool = True
) -> torch.Tensor | None:
    """Clip the gradients of `trained` (after unscaling them under fp16), step the optimizer and the
    schedule, clear the gradients; the gradient norm before clipping.

    Without clipping (`grad_clip` 0) the norm is only reported: where `norm_wanted` is false (a step whose
    line is not logged) it is not computed and None is returned. That norm is a pass over every gradient,
    ~4% of the tiny hf model's step on a CPU."""
    if state.scaler:
        state.scaler.unscale_(state.optimizer)
    grad_norm = None
    if grad_clip or norm_wanted:
        grad_norm = clip_gradients(trained, grad_clip or float("inf"))
    if state.scaler:
        state.scaler.step(state.optimizer)
        state.scaler.update()
    else:
        state.optimizer.step()
    state.scheduler.step()
    state.optimizer.zero_grad(set_to_none=True)
    return grad_norm


def clip_gradients(parameters: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """`clip_grad_norm_(parameters, max_norm, foreach=True)`, bitwise: the same norm, the same gradients.

    Where the gradients are on the CPU and the clip factor is 1 (no clipping: the norm is within max_norm,
    or max_norm is inf), the multiplication by 1.0 that torch does anyway (x * 1.0 == x: a pass over every
    gradient: docs/benchmarks.md, "piece by piece") is skipped; torch keeps it because reading the factor
    would synchronise a GPU, so on one this is torch's own function. Clipping or not it costs less than
    torch's, which groups the list by device and dtype twice (CPU time for the tiny hf model's 39 tensors
    on a loaded machine: 175-215 us against 225-325 us).
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    total_norm = getattr(torch.nn.utils, "get_total_norm", None)  # torch >= 2.6
    if total_norm is None or not grads or any(g.device.type != "cpu" for g in grads):
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, foreach=True)
    norm = total_norm(grads, foreach=True)
    factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # clip_grads_with_norm_'s factor
    if factor.item() != 1.0:
        torch._foreach_mul_(grads, factor)  # its multiplication (without grouping the list again)
    return norm
