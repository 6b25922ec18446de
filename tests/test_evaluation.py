"""Span decoding and per-question answers over windows, single-process evaluation end to end."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from elastic_qa.config import ModelConfig
from elastic_qa.data.examples import QAExample
from elastic_qa.data.features import Features
from elastic_qa.evaluation import (
    WindowPrediction,
    answers_from_windows,
    best_spans,
    evaluate,
    predict,
    predict_windows,
)
from elastic_qa.models import family_for
from elastic_qa.prep.sources import read_squad
from elastic_qa.prep.tokenizer import PAD, WordTokenizer
from elastic_qa.prep.windows import build_features

FIXTURES = Path(__file__).parent / "fixtures"
FAMILY = family_for(ModelConfig())
CPU = torch.device("cpu")


def brute_force(
    start: torch.Tensor, end: torch.Tensor, context: torch.Tensor, max_answer_len: int
) -> tuple[float, int, int]:
    best = (float("-inf"), -1, -1)
    for s in range(len(start)):
        for e in range(s, min(len(start), s + max_answer_len)):
            score = float(start[s] + end[e])
            if context[s] and context[e] and score > best[0]:
                best = (score, s, e)
    return best


@pytest.mark.parametrize("max_answer_len", [1, 3, 30])
def test_best_spans_with_every_candidate_finds_the_best_allowed_span(max_answer_len):
    generator = torch.Generator().manual_seed(max_answer_len)
    start, end = torch.randn(16, 12, generator=generator), torch.randn(16, 12, generator=generator)
    context = torch.rand(16, 12, generator=generator) > 0.3
    context[:, 0] = False
    context[:, 5] = True  # every window has a context token
    best, s_tok, e_tok, null = best_spans(start, end, context, max_answer_len, n_best=12)
    for row in range(16):
        score, s, e = brute_force(start[row], end[row], context[row], max_answer_len)
        assert (int(s_tok[row]), int(e_tok[row])) == (s, e)
        assert float(best[row]) == pytest.approx(score)
    torch.testing.assert_close(null, start[:, 0] + end[:, 0])


def test_best_spans_pairs_only_the_n_best_starts_and_ends():
    start, end = torch.zeros(1, 8), torch.zeros(1, 8)
    start[0, 1:7] = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 5.0])  # the best start (6) has no end after it
    end[0, 1:7] = torch.tensor([0.0, 3.0, 0.0, 0.0, 0.0, 0.0])
    end[0, 5] = 2.5
    context = torch.ones(1, 8, dtype=torch.bool)
    context[0, 0] = context[0, 7] = False
    best, s_tok, e_tok, _ = best_spans(start, end, context, 30, n_best=2)
    assert (int(s_tok[0]), int(e_tok[0]), float(best[0])) == (1, 2, 4.0)


def test_best_spans_never_picks_a_token_outside_the_context_even_when_it_scores_highest():
    start, end = torch.zeros(1, 8), torch.zeros(1, 8)
    start[0, 0] = end[0, 0] = 100.0  # [CLS]
    start[0, 2] = end[0, 3] = 50.0  # question tokens
    start[0, 6], end[0, 5] = 5.0, 5.0  # end before start: not a span
    context = torch.tensor([[False, False, False, False, True, True, True, True]])
    best, s_tok, e_tok, null = best_spans(start, end, context, 4)
    assert 4 <= int(s_tok[0]) <= int(e_tok[0])
    assert float(null[0]) == 200.0
    assert float(best[0]) == 5.0


def test_best_spans_respects_the_longest_answer():
    start, end = torch.zeros(1, 10), torch.zeros(1, 10)
    start[0, 1], end[0, 9] = 10.0, 10.0  # a 9-token span
    end[0, 3] = 4.0
    context = torch.ones(1, 10, dtype=torch.bool)
    context[0, 0] = False
    _, s_tok, e_tok, _ = best_spans(start, end, context, 3)
    assert (int(s_tok[0]), int(e_tok[0])) == (1, 3)
    _, s_tok, e_tok, _ = best_spans(start, end, context, 9)
    assert (int(s_tok[0]), int(e_tok[0])) == (1, 9)


def test_a_window_without_a_context_token_has_no_span():
    best, _, _, _ = best_spans(torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.bool), 3)
    assert torch.isinf(best).all() and (best < 0).all()


class _Example:
    def __init__(self, qid: str, context: str) -> None:
        self.id, self.context = qid, context


def test_answers_from_windows_picks_the_best_span_across_windows():
    examples = [_Example("a", "zero one two three four five")]
    windows = [
        WindowPrediction(0, score=3.0, null_score=1.0, start_char=5, end_char=8),  # "one"
        WindowPrediction(0, score=7.0, null_score=2.0, start_char=9, end_char=18),  # "two three"
        WindowPrediction(0, score=5.0, null_score=0.5, start_char=19, end_char=23),  # "four"
    ]
    assert answers_from_windows(windows, examples) == {"a": "two three"}


def test_answers_from_windows_returns_empty_when_the_null_score_wins():
    examples = [_Example("a", "zero one two"), _Example("b", "zero one two")]
    windows = [
        WindowPrediction(0, score=3.0, null_score=4.0, start_char=5, end_char=8),
        WindowPrediction(1, score=3.0, null_score=2.0, start_char=5, end_char=8),
    ]
    assert answers_from_windows(windows, examples) == {"a": "", "b": "one"}


def test_the_null_score_of_a_question_is_its_lowest_over_windows():
    # a window that holds the answer has a low null score; other windows say "not here" loudly
    examples = [_Example("a", "zero one two")]
    windows = [
        WindowPrediction(0, score=-5.0, null_score=9.0, start_char=0, end_char=4),
        WindowPrediction(0, score=6.0, null_score=1.0, start_char=5, end_char=8),
    ]
    assert answers_from_windows(windows, examples) == {"a": "one"}


def test_a_question_without_any_window_gets_no_answer():
    assert answers_from_windows([], [_Example("a", "text")]) == {"a": ""}


def test_spans_outside_the_context_are_ignored():
    examples = [_Example("a", "zero one two")]
    windows = [
        WindowPrediction(0, score=9.0, null_score=1.0, start_char=-1, end_char=-1),
        WindowPrediction(0, score=2.0, null_score=1.0, start_char=0, end_char=4),
    ]
    assert answers_from_windows(windows, examples) == {"a": "zero"}


class OracleModel(nn.Module):
    """Scores each window's labelled target highest: [CLS] where the answer is elsewhere or absent."""

    def __init__(self, features: Features) -> None:
        super().__init__()
        self.targets = {}
        for row in range(len(features)):
            ids = features.input_ids[row]
            key = tuple(int(i) for i in ids[ids != PAD])
            self.targets[key] = (int(features.start_positions[row]), int(features.end_positions[row]))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor):
        start = torch.zeros(input_ids.shape, dtype=torch.float32)
        end = torch.zeros(input_ids.shape, dtype=torch.float32)
        for row, (ids, real) in enumerate(zip(input_ids, attention_mask.bool(), strict=True)):
            s, e = self.targets[tuple(int(i) for i in ids[real])]
            start[row, s], end[row, e] = 10.0, 10.0
        return start, end


@pytest.mark.parametrize("fixture", ["squad-v2-handwritten.json", "squad-v2-dev-sample.json"])
def test_evaluate_scores_an_oracle_model_perfectly_across_windows(fixture):
    examples, _ = read_squad(str(FIXTURES / fixture))
    features = build_features(examples, WordTokenizer(4096), 48, 16, 12)  # many windows per context
    assert len(features) > len(examples)
    scores = evaluate(OracleModel(features), FAMILY, features, examples, 7, 30, torch.device("cpu"))
    assert (scores["em"], scores["f1"], scores["count"]) == (1.0, 1.0, len(examples))


def test_predict_windows_maps_token_spans_to_characters_and_restores_training_mode():
    examples, _ = read_squad(str(FIXTURES / "squad-v2-handwritten.json"))
    features = build_features(examples, WordTokenizer(4096), 64, 16, 8)
    model = OracleModel(features).train()
    windows = predict_windows(model, FAMILY, features, range(len(features)), 3, 30, torch.device("cpu"))
    assert model.training
    assert len(windows) == len(features)
    for row, window in enumerate(windows):
        assert window.example_index == int(features.example_index[row])
        if features.start_positions[row] > 0:
            answer = examples[window.example_index].answers[0]
            assert (window.start_char, window.end_char) == (answer.start, answer.start + len(answer.text))
            assert window.score > window.null_score
        else:
            assert window.null_score > window.score


def test_evaluate_of_a_subset_of_rows_is_not_double_counted():
    examples, _ = read_squad(str(FIXTURES / "squad-v2-dev-sample.json"))
    features = build_features(examples, WordTokenizer(4096), 64, 16, 8)
    windows = predict_windows(
        OracleModel(features), FAMILY, features, range(len(features)), 64, 30, torch.device("cpu")
    )
    assert (
        np.bincount([w.example_index for w in windows]).tolist()
        == np.bincount(features.example_index).tolist()
    )


# ---- per-question predictions from crafted logits, through the real windows ----------------------------

CONTEXT = " ".join(f"w{i}" for i in range(20))
EXAMPLE = QAExample("q", "who is it ?", CONTEXT, ())


class LogitTable(nn.Module):
    """Returns the logits a test wrote for each window (found by its token ids); 0 where none were written."""

    def __init__(self, features: Features) -> None:
        super().__init__()
        self.rows = {self.key(features.input_ids[r]): r for r in range(len(features))}
        self.start = torch.zeros(features.input_ids.shape)
        self.end = torch.zeros(features.input_ids.shape)

    @staticmethod
    def key(ids) -> tuple[int, ...]:
        return tuple(int(i) for i in ids if i != PAD)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor):
        rows = [self.rows[self.key(ids)] for ids in input_ids]
        width = input_ids.shape[1]
        return self.start[rows, :width], self.end[rows, :width]


def windows_of(example: QAExample) -> Features:
    # 9 context tokens per window, windows start at words 0, 7 and 14
    return build_features([example], WordTokenizer(4096), 16, 4, 2)


def position(features: Features, row: int, word: str) -> int:
    char = CONTEXT.split().index(word)
    char = len(" ".join(CONTEXT.split()[:char])) + (1 if char else 0)
    return int(np.flatnonzero(features.offsets[row, :, 0] == char)[0])


def predict_one(model: LogitTable, features: Features, **kwargs):
    result = predict(model, FAMILY, features, [EXAMPLE], 2, kwargs.pop("max_answer_len", 30), CPU, **kwargs)
    return result[0]["q"]


def test_the_best_span_can_come_from_the_second_window():
    features = windows_of(EXAMPLE)
    assert len(features) == 3
    model = LogitTable(features)
    model.start[:, 0] = model.end[:, 0] = -1.0  # null score -2 in every window
    model.start[0, position(features, 0, "w2")] = model.end[0, position(features, 0, "w2")] = 3.0
    model.start[1, position(features, 1, "w10")] = 5.0
    model.end[1, position(features, 1, "w11")] = 5.0
    p = predict_one(model, features)
    assert (p.answer, p.span, p.score, p.null_odds) == ("w10 w11", "w10 w11", 10.0, -12.0)
    assert CONTEXT[p.start_char : p.end_char] == "w10 w11"


def test_no_answer_when_the_null_score_beats_every_span_unless_the_threshold_allows_it():
    features = windows_of(EXAMPLE)
    model = LogitTable(features)
    model.start[:, 0] = model.end[:, 0] = 10.0
    model.start[0, position(features, 0, "w2")] = model.end[0, position(features, 0, "w2")] = 3.0
    p = predict_one(model, features)
    assert (p.answer, p.span, p.null_odds) == ("", "w2", 14.0)
    assert predict_one(model, features, null_threshold=14.0).answer == "w2"
    assert predict_one(model, features, null_threshold=13.9).answer == ""


def test_the_answer_is_at_most_max_answer_len_tokens_long():
    features = windows_of(EXAMPLE)
    model = LogitTable(features)
    model.start[:, 0] = model.end[:, 0] = -10.0
    model.start[0, position(features, 0, "w1")] = 10.0
    model.end[0, position(features, 0, "w8")] = 10.0
    model.end[0, position(features, 0, "w3")] = 4.0
    assert predict_one(model, features, max_answer_len=3).answer == "w1 w2 w3"
    assert predict_one(model, features, max_answer_len=8).answer == "w1 w2 w3 w4 w5 w6 w7 w8"


def test_a_span_never_covers_question_or_special_tokens():
    features = windows_of(EXAMPLE)
    model = LogitTable(features)
    model.start[:, 0] = model.end[:, 0] = -10.0
    model.start[:, 1:5] = model.end[:, 1:5] = 50.0  # the question's words
    model.end[:, 15] = 60.0  # the closing [SEP] of a full window
    model.start[2, position(features, 2, "w15")] = model.end[2, position(features, 2, "w16")] = 1.0
    p = predict_one(model, features)
    assert p.answer == "w15 w16"
