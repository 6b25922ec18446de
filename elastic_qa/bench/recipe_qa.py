"""The question-answering recipe of transformers' run_qa example, as the `recipe` benchmark's HF side runs it.

Written for the benchmark after run_qa.py and utils_qa.py (transformers' examples), not copied from them:
SQuAD records flattened as the `datasets` squad_v2 loader gives them; training windows with the answer's
start and end tokens, or the [CLS] index when the window does not hold all of the answer or there is none;
evaluation windows whose offsets are None outside the context; and the post-processing that pairs the
`n_best` highest start and end logits of each window into spans, keeps a question's best span over its
windows and compares it with the question's null score (the lowest [CLS] score over its windows).

Nothing here imports the product's data or evaluation code: this is the plain recipe it is compared with.
"""

from __future__ import annotations

import collections
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


def read_squad_examples(path: Path) -> list[dict[str, Any]]:
    """One record per question: id, title, context, question, answers {text: [...], answer_start: [...]}."""
    document = json.loads(Path(path).read_text(encoding="utf-8"))
    records = []
    for article in document["data"]:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                answers = qa.get("answers") or []
                records.append(
                    {
                        "id": qa["id"],
                        "title": article.get("title", ""),
                        "context": paragraph["context"],
                        "question": qa["question"],
                        "answers": {
                            "text": [a["text"] for a in answers],
                            "answer_start": [a["answer_start"] for a in answers],
                        },
                    }
                )
    return records


def _tokenize(
    examples: list[dict[str, Any]], tokenizer: Any, max_seq_len: int, doc_stride: int
) -> tuple[Any, bool]:
    """Question/context pairs (the question with its leading spaces removed), the context truncated,
    overflowing into windows that share `doc_stride` tokens, padded to `max_seq_len`."""
    pad_on_right = tokenizer.padding_side == "right"
    questions = [e["question"].lstrip() for e in examples]
    contexts = [e["context"] for e in examples]
    encoded = tokenizer(
        questions if pad_on_right else contexts,
        contexts if pad_on_right else questions,
        truncation="only_second" if pad_on_right else "only_first",
        max_length=max_seq_len,
        stride=doc_stride,
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
        padding="max_length",
    )
    return encoded, pad_on_right


def _cls_index(input_ids: list[int], tokenizer: Any) -> int:
    if tokenizer.cls_token_id in input_ids:
        return input_ids.index(tokenizer.cls_token_id)
    if tokenizer.bos_token_id in input_ids:
        return input_ids.index(tokenizer.bos_token_id)
    return 0


def prepare_train_features(
    examples: list[dict[str, Any]], tokenizer: Any, max_seq_len: int, doc_stride: int
) -> dict[str, list[Any]]:
    """Model inputs plus start_positions/end_positions per window (the first gold answer)."""
    encoded, pad_on_right = _tokenize(examples, tokenizer, max_seq_len, doc_stride)
    context_id = 1 if pad_on_right else 0
    owners = encoded.pop("overflow_to_sample_mapping")
    offset_mapping = encoded.pop("offset_mapping")
    starts, ends = [], []
    for i, offsets in enumerate(offset_mapping):
        input_ids = encoded["input_ids"][i]
        cls_index = _cls_index(input_ids, tokenizer)
        sequence_ids = encoded.sequence_ids(i)
        answers = examples[owners[i]]["answers"]
        if not answers["answer_start"]:
            starts.append(cls_index)
            ends.append(cls_index)
            continue
        start_char = answers["answer_start"][0]
        end_char = start_char + len(answers["text"][0])
        first = 0  # the window's first and last context tokens
        while sequence_ids[first] != context_id:
            first += 1
        last = len(input_ids) - 1
        while sequence_ids[last] != context_id:
            last -= 1
        if not (offsets[first][0] <= start_char and offsets[last][1] >= end_char):
            starts.append(cls_index)  # the answer is not (all) in this window
            ends.append(cls_index)
            continue
        while first < len(offsets) and offsets[first][0] <= start_char:
            first += 1
        starts.append(first - 1)
        while offsets[last][1] >= end_char:
            last -= 1
        ends.append(last + 1)
    encoded["start_positions"] = starts
    encoded["end_positions"] = ends
    return dict(encoded)


def prepare_validation_features(
    examples: list[dict[str, Any]], tokenizer: Any, max_seq_len: int, doc_stride: int
) -> dict[str, list[Any]]:
    """Model inputs plus, per window, its question's id and its offsets (None outside the context)."""
    encoded, pad_on_right = _tokenize(examples, tokenizer, max_seq_len, doc_stride)
    context_id = 1 if pad_on_right else 0
    owners = encoded.pop("overflow_to_sample_mapping")
    encoded["example_id"] = []
    for i in range(len(encoded["input_ids"])):
        sequence_ids = encoded.sequence_ids(i)
        encoded["example_id"].append(examples[owners[i]]["id"])
        encoded["offset_mapping"][i] = [
            tuple(span) if sequence_ids[k] == context_id else None
            for k, span in enumerate(encoded["offset_mapping"][i])
        ]
    return dict(encoded)


@dataclass(frozen=True)
class QuestionPrediction:
    answer: str  # "" when the null score wins by more than the threshold
    span: str  # the best non-null span's text, whatever the threshold
    null_odds: float  # null score minus the best non-null span's score


def postprocess_qa_predictions(
    examples: list[dict[str, Any]],
    features: dict[str, list[Any]],
    start_logits: np.ndarray,
    end_logits: np.ndarray,
    n_best: int = 20,
    max_answer_len: int = 30,
    null_threshold: float = 0.0,
) -> dict[str, QuestionPrediction]:
    """Per question id: the answer (SQuAD v2: "" when null wins), the best span and the null odds."""
    windows_of: dict[str, list[int]] = collections.defaultdict(list)
    for i, qid in enumerate(features["example_id"]):
        windows_of[qid].append(i)
    out: dict[str, QuestionPrediction] = {}
    for example in examples:
        candidates: list[dict[str, Any]] = []
        null: dict[str, Any] | None = None
        for i in windows_of[example["id"]]:
            starts, ends = start_logits[i], end_logits[i]
            offsets = features["offset_mapping"][i]
            window_null = float(starts[0] + ends[0])
            if null is None or window_null < null["score"]:
                null = {"offsets": (0, 0), "score": window_null}
            for s in np.argsort(starts)[-1 : -n_best - 1 : -1].tolist():
                for e in np.argsort(ends)[-1 : -n_best - 1 : -1].tolist():
                    if s >= len(offsets) or e >= len(offsets) or offsets[s] is None or offsets[e] is None:
                        continue  # outside the context
                    if e < s or e - s + 1 > max_answer_len:
                        continue
                    score = float(starts[s] + ends[e])
                    candidates.append({"offsets": (offsets[s][0], offsets[e][1]), "score": score})
        assert null is not None  # every question has at least one window
        ranked = sorted([*candidates, null], key=lambda c: c["score"], reverse=True)[:n_best]
        if not any(c["offsets"] == (0, 0) for c in ranked):
            ranked.append(null)  # the recipe keeps the null candidate even when it ranked out
        context = example["context"]
        texts = [(context[c["offsets"][0] : c["offsets"][1]], c["score"]) for c in ranked]
        # As the recipe does when no window offers a non-empty span: a placeholder with score 0.
        best_text, best_score = next(((t, s) for t, s in texts if t), ("empty", 0.0))
        null_odds = null["score"] - best_score
        answer = "" if null_odds > null_threshold else best_text
        out[example["id"]] = QuestionPrediction(answer, best_text, null_odds)
    return out
