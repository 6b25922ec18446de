"""Parameters the span loss cannot see, found by measuring, so that training can leave them alone.

Span loss is a softmax over the positions of a window, so anything that moves every position's logit by the
same amount is invisible to it: the QA head's bias, the bias of the last LayerNorm (it shifts every hidden
state by one vector, hence every logit by one number), and every attention key bias (it adds one number to
each query's scores over all keys, which the attention softmax cancels). Their true gradient is zero, so
what reaches them is rounding noise, and Adam (g / sqrt(v)) turns that noise into full-size steps that
depend on the summation order, i.e. on the world size: measured on a tiny BERT, 1 vs 2 ranks, these
tensors made the whole difference in final parameters.

The probe finds them for any architecture: one float64 forward and backward of a copy of the model at a
randomly perturbed point (so that no tensor's gradient vanishes by accident, e.g. behind a zero-initialised
layer), on a few real windows. A tensor whose gradient norm is below `RELATIVE_ZERO` of the largest is
invariant; float64 rounding puts those near 1e-16, every other tensor many orders above. Freezing them
keeps their initial values, which is exactly what exact arithmetic would do, and changes no prediction.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

RELATIVE_ZERO = 1e-9
PROBE_TOKENS = 64  # positions of each window the probe reads: the invariance is structural, not positional
_PERTURBATION = 0.01
_PROBE_SEED = 0


def loss_invariant_parameters(
    model: nn.Module,
    batch: Mapping[str, Any],
    loss: Callable[..., torch.Tensor],
    input_names: tuple[str, ...] = ("input_ids", "attention_mask", "token_type_ids"),
) -> list[str]:
    """Names of the trainable parameters whose gradient is zero up to rounding (see the module docstring).

    `batch`: a few windows on the CPU (collate's names); `loss(start, end, start_positions, end_positions)`.
    Deterministic and on the CPU: every rank finds the same list. Leaves `model` and torch's RNG untouched.
    """
    batch = _first_tokens(batch, PROBE_TOKENS)
    probe = copy.deepcopy(model).cpu().double().eval()
    generator = torch.Generator().manual_seed(_PROBE_SEED)
    with torch.no_grad():
        for param in probe.parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float64)
            param.add_(noise * _PERTURBATION)
    start, end = probe(**{name: batch[name] for name in input_names})
    loss(start, end, batch["start_positions"], batch["end_positions"]).sum().backward()
    norms = {
        name: (float(param.grad.norm()) if param.grad is not None else 0.0)
        for name, param in probe.named_parameters()
        if param.requires_grad
    }
    largest = max(norms.values(), default=0.0)
    if largest == 0.0:
        return []  # nothing to compare with: freeze nothing
    return [name for name, norm in norms.items() if norm < RELATIVE_ZERO * largest]


def freeze(model: nn.Module, names: list[str]) -> None:
    """Exclude `names` from training (no gradient, so neither DDP nor the optimizer touches them)."""
    wanted = set(names)
    for name, param in model.named_parameters():
        if name in wanted:
            param.requires_grad_(False)


def _first_tokens(batch: Mapping[str, Any], tokens: int) -> dict[str, Any]:
    """Windows cut to their first `tokens` positions; an answer beyond the cut becomes "no answer" (0).

    Activations grow with the length, in float64: a bert-base probe on 8 windows of 384 tokens peaked at
    5.6 GB where 4 windows of 64 took 2.8 GB (most of it the model's float64 copy and its gradients).
    """
    cut = {
        name: value[:, :tokens] if isinstance(value, torch.Tensor) and value.dim() == 2 else value
        for name, value in batch.items()
    }
    for name in ("start_positions", "end_positions"):
        cut[name] = torch.where(batch[name] < tokens, batch[name], 0)
    both = (cut["start_positions"] > 0) & (cut["end_positions"] > 0)
    cut["start_positions"], cut["end_positions"] = cut["start_positions"] * both, cut["end_positions"] * both
    return cut
