"""Examples -> token windows: overlap by doc_stride, exact answer offsets, [CLS] targets elsewhere."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from elastic_qa.data.examples import Answer, QAExample
from elastic_qa.data.features import Features
from elastic_qa.prep.synthetic import generate
from elastic_qa.prep.tokenizer import CLS, PAD, SEP, ByteTokenizer, WordTokenizer
from elastic_qa.prep.windows import build_features

WORD = WordTokenizer(4096)


def example(context: str, answer: str | None, question: str = "which one ?", qid: str = "q") -> QAExample:
    answers = (Answer(answer, context.index(answer)),) if answer else ()
    return QAExample(qid, question, context, answers)


def long_context(words: int = 100) -> str:
    return " ".join(f"w{i}" for i in range(words))


def context_tokens(features: Features, row: int) -> list[int]:
    return [int(i) for i, seg in zip(features.input_ids[row], features.segment_ids[row], strict=True)
            if seg == 1 and i != SEP]  # fmt: skip


def answer_text(features: Features, row: int, context: str) -> str:
    start, end = int(features.start_positions[row]), int(features.end_positions[row])
    return context[features.offsets[row, start, 0] : features.offsets[row, end, 1]]


def test_columns_have_the_documented_shapes_and_dtypes():
    features = build_features(list(generate("train", 20, 7, 0.2)), WORD, 64, 24, 32)
    n = len(features)
    assert n >= 20
    assert features.input_ids.shape == (n, 64) and features.input_ids.dtype == np.int32
    assert features.segment_ids.shape == (n, 64) and features.segment_ids.dtype == np.int8
    assert features.start_positions.shape == (n,) and features.start_positions.dtype == np.int32
    assert features.end_positions.dtype == np.int32
    assert features.example_index.dtype == np.int32
    assert features.offsets.shape == (n, 64, 2) and features.offsets.dtype == np.int32
    assert sorted(set(features.example_index.tolist())) == list(range(20))


def test_consecutive_windows_of_a_long_context_overlap_by_doc_stride():
    context = long_context(100)
    features = build_features([example(context, None, "q ?")], WORD, 32, 8, 10)
    # question "q ?" is 2 tokens: 32 - 2 - 3 = 27 context tokens per window, advancing by 27 - 10
    all_tokens = WORD.encode(context)[0]
    windows = [context_tokens(features, row) for row in range(len(features))]
    assert len(windows) == 6
    starts = [0, 17, 34, 51, 68, 85]
    for window, start in zip(windows, starts, strict=True):
        assert window == all_tokens[start : start + 27]
    for previous, following in itertools.pairwise(windows):
        assert previous[-10:] == following[:10]
    assert windows[-1][-1] == all_tokens[-1]  # the last window reaches the end of the context


def test_a_context_that_fits_gives_one_window():
    features = build_features([example("a short context .", None)], WORD, 64, 24, 32)
    assert len(features) == 1


def test_rows_are_cls_question_sep_context_sep_then_pads_with_segments_0_and_1():
    ex = example("paris is the capital of france .", "paris", question="what is the capital ?")
    features = build_features([ex], WORD, 32, 24, 4)
    q_ids, c_ids = WORD.encode(ex.question)[0], WORD.encode(ex.context)[0]
    expected = [CLS, *q_ids, SEP, *c_ids, SEP]
    row = features.input_ids[0].tolist()
    assert row == expected + [PAD] * (32 - len(expected))
    head = len(q_ids) + 2
    segments = features.segment_ids[0].tolist()
    assert segments == [0] * head + [1] * (len(c_ids) + 1) + [0] * (32 - len(expected))
    offsets = features.offsets[0]
    assert (offsets[:head] == -1).all()
    assert (offsets[head + len(c_ids) :] == -1).all()  # final [SEP] and pads
    assert [tuple(o) for o in offsets[head : head + len(c_ids)].tolist()] == WORD.encode(ex.context)[1]


def test_the_question_is_cut_to_max_query_len():
    ex = example("ctx here .", None, question=" ".join(f"q{i}" for i in range(30)))
    features = build_features([ex], WORD, 64, 5, 10)
    assert features.input_ids[0, :7].tolist() == [CLS, *WORD.encode(ex.question)[0][:5], SEP]
    assert features.segment_ids[0, 7] == 1


def test_max_query_len_0_keeps_the_question_whole_up_to_what_leaves_doc_stride_plus_one_context_tokens():
    context = " ".join(f"c{i}" for i in range(100))
    whole = example(context, None, question=" ".join(f"q{i}" for i in range(30)))
    features = build_features([whole], WORD, 64, 0, 10)
    q_ids = WORD.encode(whole.question)[0]
    assert features.input_ids[0, : len(q_ids) + 2].tolist() == [CLS, *q_ids, SEP]
    # 64 tokens, [CLS] [SEP] [SEP], 10 shared: a question keeps at most 64 - 3 - 11 = 50 tokens
    longest = example(context, None, question=" ".join(f"q{i}" for i in range(80)))
    features = build_features([longest], WORD, 64, 0, 10)
    assert features.input_ids[0, :52].tolist() == [CLS, *WORD.encode(longest.question)[0][:50], SEP]
    # Windows of 64 - 52 - 1 = 11 context tokens sharing 10: each starts one token after the one before.
    assert len(features) > 1 and features.lengths[0] == 64
    assert features.offsets[1, 52].tolist() == features.offsets[0, 53].tolist()


@pytest.mark.parametrize(
    ("context", "answer"),
    [
        ("Marie Curie was born in Warsaw in 1867, then moved to Paris.", "Warsaw"),
        ("Marie Curie was born in Warsaw in 1867, then moved to Paris.", "born in Warsaw in 1867"),
        ("The price was $3.50 (tax included).", "$3.50"),
        ("现存的明长城东起辽宁虎山，西至甘肃嘉峪关，全长约八千八百五十公里。", "甘肃嘉峪关"),
        ("Apple在2007年发布了iPhone，价格是499美元。", "iPhone"),
        ("Apple在2007年发布了iPhone，价格是499美元。", "2007年"),
    ],
)
@pytest.mark.parametrize("tokenizer", [WORD, ByteTokenizer()], ids=["word", "byte"])
def test_answer_positions_map_back_through_offsets_to_exactly_the_answer(context, answer, tokenizer):
    ex = example(context, answer)
    features = build_features([ex], tokenizer, 256, 24, 32)
    assert len(features) == 1
    assert features.start_positions[0] > 0
    assert features.start_positions[0] <= features.end_positions[0]
    assert answer_text(features, 0, context) == answer


@pytest.mark.parametrize("tokenizer", [WORD, ByteTokenizer()], ids=["word", "byte"])
def test_every_window_that_holds_the_answer_targets_it_and_every_other_targets_cls(tokenizer):
    context = long_context(60) + " the answer is zebra crossing here . " + long_context(60)
    ex = example(context, "zebra crossing")
    features = build_features([ex], tokenizer, 48, 8, 12)
    assert len(features) > 3
    first_char, last_char = ex.answers[0].start, ex.answers[0].start + len("zebra crossing")
    holding = 0
    for row in range(len(features)):
        offsets = features.offsets[row]
        context_spans = [tuple(o) for o, s in zip(offsets, features.segment_ids[row], strict=True) if s == 1]
        chars = {c for s, e in context_spans if s >= 0 for c in range(s, e)}
        holds_all = first_char in chars and last_char - 1 in chars
        if holds_all:
            holding += 1
            assert answer_text(features, row, context) == "zebra crossing"
        else:
            assert (features.start_positions[row], features.end_positions[row]) == (0, 0)
    assert holding >= 1


def test_a_window_holding_only_part_of_the_answer_targets_cls():
    # 27 context tokens per window, stride 10: a 12-token answer starting at token 20 is cut by window 0
    words = [f"w{i}" for i in range(60)]
    answer = " ".join(words[20:32])
    context = " ".join(words)
    features = build_features([example(context, answer, "q ?")], WORD, 32, 8, 10)
    window0 = context_tokens(features, 0)
    assert WORD.encode("w20")[0][0] in window0 and WORD.encode("w31")[0][0] not in window0
    assert (features.start_positions[0], features.end_positions[0]) == (0, 0)
    assert any(answer_text(features, row, context) == answer for row in range(1, len(features)))


def test_unanswerable_questions_target_cls_in_every_window():
    features = build_features([example(long_context(80), None)], WORD, 32, 8, 10)
    assert len(features) > 1
    assert not features.start_positions.any()
    assert not features.end_positions.any()


def test_windows_record_which_example_they_came_from():
    examples = [example(long_context(80), None, qid="a"), example("short .", None, qid="b")]
    features = build_features(examples, WORD, 32, 8, 10)
    assert features.example_index.tolist() == [0] * (len(features) - 1) + [1]


def test_synthetic_answers_survive_featurisation():
    examples = generate("train", 300, 7, 0.15)
    features = build_features(examples, WORD, 64, 24, 32)
    for row in range(len(features)):
        ex = examples[features.example_index[row]]
        if features.start_positions[row] > 0:
            assert answer_text(features, row, ex.context) == ex.answers[0].text
    answerable = {i for i, e in enumerate(examples) if e.answers}
    targeted = {int(features.example_index[r]) for r in range(len(features)) if features.start_positions[r]}
    assert targeted == answerable
