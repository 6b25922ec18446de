"""Predictions and SQuAD scores, single-process or sharded over ranks.

Each rank predicts a disjoint, contiguous, non-shuffled share of the evaluation windows; the per-window
best spans are gathered to rank 0, which picks each question's best answer over its windows and scores it
once (every rank evaluating everything would count each question world-size times).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from elastic_qa.data.cursor import rank_slice
from elastic_qa.data.features import Features
from elastic_qa.data.loader import collate
from elastic_qa.data.squad import QAExample
from elastic_qa.metrics import squad_scores
from elastic_qa.models import ModelFamily, model_inputs


@dataclass(frozen=True)
class WindowPrediction:
    example_index: int
    score: float  # best start+end logit of a real span
    null_score: float  # start+end logit of [CLS]: "no answer here"
    start_char: int
    end_char: int
    loss: float = 0.0  # span loss of this window against its gold start/end


def best_spans(
    start_logits: torch.Tensor, end_logits: torch.Tensor, max_answer_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per window: best score over spans start <= end < start + max_answer_len (excluding [CLS]),
    its start and end token, and the null score."""
    length = start_logits.shape[1]
    scores = start_logits[:, :, None] + end_logits[:, None, :]
    rows = torch.arange(length, device=scores.device)
    allowed = (rows[None, :] >= rows[:, None]) & (rows[None, :] < rows[:, None] + max_answer_len)
    allowed[0, :] = False
    allowed[:, 0] = False
    scores = scores.masked_fill(~allowed, float("-inf"))
    flat = scores.flatten(1).argmax(dim=1)
    best = scores.flatten(1).gather(1, flat[:, None]).squeeze(1)
    null = start_logits[:, 0] + end_logits[:, 0]
    return best, flat // length, flat % length, null


@torch.no_grad()
def predict_windows(
    model: nn.Module,
    family: ModelFamily,
    features: Features,
    rows: range,
    batch_size: int,
    max_answer_len: int,
    device: torch.device,
    autocast_dtype: torch.dtype | None = None,
) -> list[WindowPrediction]:
    was_training = model.training
    model.eval()
    out: list[WindowPrediction] = []
    try:
        for first in range(rows.start, rows.stop, batch_size):
            index = np.arange(first, min(first + batch_size, rows.stop))
            batch = collate(features, index)
            with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                start, end = model(**model_inputs(batch, device))
            losses = family.span_loss_per_window(
                start, end, batch["start_positions"].to(device), batch["end_positions"].to(device)
            ).cpu()
            best, s_tok, e_tok, null = (t.cpu() for t in best_spans(start, end, max_answer_len))
            for j, row in enumerate(index):
                offsets = features.offsets[row]
                out.append(
                    WindowPrediction(
                        int(features.example_index[row]),
                        float(best[j]),
                        float(null[j]),
                        int(offsets[s_tok[j], 0]),
                        int(offsets[e_tok[j], 1]),
                        float(losses[j]),
                    )
                )
    finally:
        model.train(was_training)
    return out


def answers_from_windows(windows: list[WindowPrediction], examples: list[QAExample]) -> dict[str, str]:
    """Per question: the best span over its windows, or "" when [CLS] beats every span (SQuAD v2)."""
    best: dict[int, WindowPrediction] = {}
    null: dict[int, float] = {}
    for w in windows:
        if w.start_char >= 0 and (w.example_index not in best or w.score > best[w.example_index].score):
            best[w.example_index] = w
        null[w.example_index] = min(null.get(w.example_index, float("inf")), w.null_score)
    answers = {}
    for index, example in enumerate(examples):
        choice = best.get(index)
        if choice is None or null.get(index, float("-inf")) > choice.score:
            answers[example.id] = ""
        else:
            answers[example.id] = example.context[choice.start_char : choice.end_char]
    return answers


def _gather_windows(
    mine: list[WindowPrediction], total: int, world: int, device: torch.device
) -> list[WindowPrediction]:
    """All ranks' window predictions, as plain float64 tensors (no pickles cross the wire)."""
    widest = rank_slice(total, world, 0)[1]  # rank 0's share is the largest
    rows = torch.full((widest, 6), -1.0, dtype=torch.float64)
    if mine:
        rows[: len(mine)] = torch.tensor(
            [[w.example_index, w.score, w.null_score, w.start_char, w.end_char, w.loss] for w in mine],
            dtype=torch.float64,
        )
    parts = [torch.empty_like(rows, device=device) for _ in range(world)]
    dist.all_gather(parts, rows.to(device))
    merged = []
    for rank, part in enumerate(parts):
        start, stop = rank_slice(total, world, rank)
        for row in part[: stop - start].cpu().tolist():
            merged.append(WindowPrediction(int(row[0]), row[1], row[2], int(row[3]), int(row[4]), row[5]))
    return merged


def evaluate(
    model: nn.Module,
    family: ModelFamily,
    features: Features,
    examples: list[QAExample],
    batch_size: int,
    max_answer_len: int,
    device: torch.device,
    autocast_dtype: torch.dtype | None = None,
) -> dict[str, float] | None:
    """SQuAD EM/F1 and the mean window loss on rank 0 (None on other ranks); collective when distributed."""
    distributed = dist.is_available() and dist.is_initialized()
    world, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
    start, stop = rank_slice(len(features), world, rank)
    mine = predict_windows(
        model, family, features, range(start, stop), batch_size, max_answer_len, device, autocast_dtype
    )
    if distributed:
        mine = _gather_windows(mine, len(features), world, device)
        if rank != 0:
            return None
    predictions = answers_from_windows(mine, examples)
    golds = {e.id: [a.text for a in e.answers] for e in examples}
    scores = squad_scores(predictions, golds)
    scores["loss"] = sum(w.loss for w in mine) / max(len(mine), 1)
    return scores
