"""Predictions and SQuAD scores, single-process or sharded over ranks.

Each rank predicts a disjoint, contiguous, non-shuffled share of the evaluation windows; the per-window
best spans are gathered to rank 0, which picks each question's best answer over its windows and scores it
once (every rank evaluating everything would count each question world-size times).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from elastic_qa.data.cursor import rank_slice
from elastic_qa.data.examples import QAExample
from elastic_qa.data.features import Features
from elastic_qa.data.loader import collate
from elastic_qa.metrics import best_thresholds, squad_scores, squad_v2_scores
from elastic_qa.models import ModelFamily, model_inputs

if TYPE_CHECKING:
    from elastic_qa.export import PredictionModel


@dataclass(frozen=True)
class WindowPrediction:
    example_index: int
    score: float  # best start+end logit of a span over context tokens (-inf: the window has none)
    null_score: float  # start+end logit of position 0: "no answer here"
    start_char: int  # the span's characters in the context, end exclusive (-1: no span)
    end_char: int
    loss: float = 0.0  # span loss of this window against its gold start/end


@dataclass(frozen=True)
class Prediction:
    """One question's answer, decided over all of its windows."""

    answer: str  # "" when predicted unanswerable
    span: str  # the best span's text, whatever the threshold ("" when no window has one)
    start_char: int  # the best span in the context, end exclusive (-1 when there is none)
    end_char: int
    score: float  # the best span's start+end logit (0.0 when there is none)
    null_odds: float  # the question's null score minus `score`: above the threshold means no answer


def best_spans(
    start_logits: torch.Tensor,
    end_logits: torch.Tensor,
    context: torch.Tensor,
    max_answer_len: int,
    n_best: int = 20,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per window: the best span score, its start and end token, and the null score (position 0).

    Spans pair the `n_best` highest start and end logits over context tokens (`context` [B, L] bool), with
    start <= end and at most `max_answer_len` tokens; a window without such a span scores -inf. Pairing
    top candidates costs O(n_best^2) per window instead of O(L^2).
    """
    null = start_logits[:, 0] + end_logits[:, 0]
    k = min(n_best, start_logits.shape[1])
    start_top, start_at = start_logits.masked_fill(~context, float("-inf")).topk(k, dim=1)
    end_top, end_at = end_logits.masked_fill(~context, float("-inf")).topk(k, dim=1)
    scores = start_top[:, :, None] + end_top[:, None, :]
    tokens = end_at[:, None, :] - start_at[:, :, None] + 1
    scores = scores.masked_fill((tokens < 1) | (tokens > max_answer_len), float("-inf"))
    flat = scores.flatten(1).argmax(dim=1, keepdim=True)
    best = scores.flatten(1).gather(1, flat).squeeze(1)
    return best, start_at.gather(1, flat // k).squeeze(1), end_at.gather(1, flat % k).squeeze(1), null


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
    n_best: int = 20,
) -> list[WindowPrediction]:
    was_training = model.training
    model.eval()
    out: list[WindowPrediction] = []
    try:
        for first in range(rows.start, rows.stop, batch_size):
            index = np.arange(first, min(first + batch_size, rows.stop))
            batch = collate(features, index, full_width=family.full_width)
            width = batch["input_ids"].shape[1]  # collate may trim the batch to its longest window
            assert features.offsets is not None  # evaluation windows keep their offsets (data.cache)
            offsets = np.asarray(features.offsets[index, :width])
            with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                start, end = model(**model_inputs(batch, device))
            start, end = start.float(), end.float()
            losses = family.span_loss_per_window(
                start, end, batch["start_positions"].to(device), batch["end_positions"].to(device)
            ).tolist()
            context = torch.from_numpy(offsets[:, :, 0] >= 0).to(device)
            found = best_spans(start, end, context, max_answer_len, n_best)
            best, s_tok, e_tok, null = (t.tolist() for t in found)  # one device-to-host copy each
            for j, row in enumerate(index):
                has_span = math.isfinite(best[j])
                out.append(
                    WindowPrediction(
                        int(features.example_index[row]),
                        best[j],
                        null[j],
                        int(offsets[j, s_tok[j], 0]) if has_span else -1,
                        int(offsets[j, e_tok[j], 1]) if has_span else -1,
                        losses[j],
                    )
                )
    finally:
        model.train(was_training)
    return out


def predictions_from_windows(
    windows: list[WindowPrediction], examples: Sequence[QAExample], null_threshold: float = 0.0
) -> dict[str, Prediction]:
    """Per question id: the best span over its windows, and "" when its null_odds exceed the threshold.

    The question's null score is the lowest over its windows: the window that holds the answer is the one
    whose "not here" counts (every other window rightly says "not here").
    """
    best: dict[int, WindowPrediction] = {}
    null: dict[int, float] = {}
    for w in windows:
        if w.start_char >= 0 and (w.example_index not in best or w.score > best[w.example_index].score):
            best[w.example_index] = w
        null[w.example_index] = min(null.get(w.example_index, float("inf")), w.null_score)
    predictions = {}
    for index, example in enumerate(examples):
        choice = best.get(index)
        span, start, end, score = "", -1, -1, 0.0
        if choice is not None:
            span = example.context[choice.start_char : choice.end_char]
            start, end, score = choice.start_char, choice.end_char, choice.score
        null_odds = null.get(index, 0.0) - score
        answer = "" if null_odds > null_threshold else span
        predictions[example.id] = Prediction(answer, span, start, end, score, null_odds)
    return predictions


def answers_from_windows(
    windows: list[WindowPrediction], examples: Sequence[QAExample], null_threshold: float = 0.0
) -> dict[str, str]:
    """Per question id: its answer text ("" for no answer)."""
    return {qid: p.answer for qid, p in predictions_from_windows(windows, examples, null_threshold).items()}


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


def predict(
    model: nn.Module,
    family: ModelFamily,
    features: Features,
    examples: Sequence[QAExample],
    batch_size: int,
    max_answer_len: int,
    device: torch.device,
    autocast_dtype: torch.dtype | None = None,
    n_best: int = 20,
    null_threshold: float = 0.0,
) -> tuple[dict[str, Prediction], float] | None:
    """Every question's prediction and the mean window loss on rank 0 (None on other ranks); collective
    when distributed."""
    distributed = dist.is_available() and dist.is_initialized()
    world, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
    start, stop = rank_slice(len(features), world, rank)
    mine = predict_windows(
        model,
        family,
        features,
        range(start, stop),
        batch_size,
        max_answer_len,
        device,
        autocast_dtype,
        n_best,
    )
    if distributed:
        mine = _gather_windows(mine, len(features), world, device)
        if rank != 0:
            return None
    loss = sum(w.loss for w in mine) / max(len(mine), 1)
    return predictions_from_windows(mine, examples, null_threshold), loss


def evaluate(
    model: nn.Module,
    family: ModelFamily,
    features: Features,
    examples: Sequence[QAExample],
    batch_size: int,
    max_answer_len: int,
    device: torch.device,
    autocast_dtype: torch.dtype | None = None,
    n_best: int = 20,
    null_threshold: float = 0.0,
    cjk: bool = False,
) -> dict[str, float] | None:
    """SQuAD EM/F1 (fractions), question count and mean window loss on rank 0 (None on other ranks)."""
    result = predict(
        model,
        family,
        features,
        examples,
        batch_size,
        max_answer_len,
        device,
        autocast_dtype,
        n_best,
        null_threshold,
    )
    if result is None:
        return None
    predictions, loss = result
    golds = {e.id: [a.text for a in e.answers] for e in examples}
    scores = squad_scores({qid: p.answer for qid, p in predictions.items()}, golds, cjk)
    scores["loss"] = loss
    return scores


def answer_questions(
    loaded: PredictionModel,
    pairs: Sequence[tuple[str, str]],
    device: torch.device,
    null_threshold: float,
) -> list[Prediction]:
    """Each (question, context)'s prediction by a loaded model, in order: one pass over all their windows,
    eval_batch_size at a time (`elastic-qa ask`, the Python API's predict)."""
    cfg = loaded.cfg
    examples = [QAExample(str(i), question, context) for i, (question, context) in enumerate(pairs)]
    features = loaded.family.features(examples, cfg)
    result = predict(
        loaded.model, loaded.family, features, examples, cfg.train.eval_batch_size,
        cfg.data.max_answer_len, device, n_best=cfg.eval.n_best, null_threshold=null_threshold,
    )  # fmt: skip
    assert result is not None  # None only on ranks other than 0 of a process group; this is one process
    predictions, _ = result
    return [predictions[example.id] for example in examples]


def answer_record(p: Prediction, null_threshold: float) -> dict[str, Any]:
    """One prediction as `elastic-qa ask --json` prints it (also the Python API's predict and `elastic-qa
    serve`): the answer and its characters in the context (end exclusive; None when no answer), score,
    null_odds, the threshold applied, and the best span whatever the threshold (None when there is none)."""
    answered = bool(p.answer)
    return {
        "answer": p.answer,
        "start": p.start_char if answered else None,
        "end": p.end_char if answered else None,
        "score": p.score,
        "null_odds": p.null_odds,
        "null_threshold": null_threshold,
        "best_span": {"text": p.span, "start": p.start_char, "end": p.end_char} if p.span else None,
    }


def squad_v2_evaluation(
    loaded: PredictionModel,
    examples: Sequence[QAExample],
    features: Features,
    device: torch.device,
    null_threshold: float,
) -> tuple[dict[str, Any], dict[str, Prediction]]:
    """The official SQuAD v2 scores of a loaded model (percentages: exact, f1, total, by HasAns and
    NoAns, and the best null thresholds) and every question's prediction (`elastic-qa eval`, the Python
    API's evaluate)."""
    cfg = loaded.cfg
    result = predict(
        loaded.model, loaded.family, features, examples, cfg.train.eval_batch_size,
        cfg.data.max_answer_len, device, n_best=cfg.eval.n_best, null_threshold=null_threshold,
    )  # fmt: skip
    assert result is not None  # None only on ranks other than 0 of a process group; this is one process
    predictions, _ = result
    golds = {e.id: [a.text for a in e.answers] for e in examples}
    answers = {qid: p.answer for qid, p in predictions.items()}
    scores: dict[str, Any] = dict(squad_v2_scores(answers, golds, cfg.eval.cjk_tokens))
    # Searched over each question's best span: the answer it gets at any threshold above its null_odds.
    spans = {qid: p.span for qid, p in predictions.items()}
    null_odds = {qid: p.null_odds for qid, p in predictions.items()}
    scores.update(best_thresholds(spans, golds, null_odds, cfg.eval.cjk_tokens))
    return scores, predictions
