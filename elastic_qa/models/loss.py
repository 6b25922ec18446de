"""The span loss: one cross-entropy over positions for the start and one for the end, per window.

It is the same for every family, since each family's model scores every position of a window as answer
start and end, position 0 standing for "no answer in this window".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def span_loss_per_window(
    start_logits: torch.Tensor,
    end_logits: torch.Tensor,
    start_positions: torch.Tensor,
    end_positions: torch.Tensor,
) -> torch.Tensor:
    """Mean of the start and end cross-entropies, per window."""
    start = F.cross_entropy(start_logits, start_positions, reduction="none")
    return 0.5 * (start + F.cross_entropy(end_logits, end_positions, reduction="none"))


def span_loss(
    start_logits: torch.Tensor,
    end_logits: torch.Tensor,
    start_positions: torch.Tensor,
    end_positions: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """Weighted *sum* over the batch of the per-window span loss (the caller normalises)."""
    return (span_loss_per_window(start_logits, end_logits, start_positions, end_positions) * weights).sum()
