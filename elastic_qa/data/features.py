"""Examples -> fixed-size token windows with exact character offsets for the answer span.

A window is `[CLS] question [SEP] context-slice [SEP]`. Contexts longer than one window are split into
windows that overlap by `doc_stride` tokens. The answer maps to token positions inside the window that
holds all of it; in any other window, and for unanswerable questions, the target is position 0 ([CLS]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from elastic_qa.config import Config, DataConfig
from elastic_qa.data.squad import QAExample
from elastic_qa.data.tokenizer import CLS, PAD, SEP, Tokenizer, tokenizer_for


@dataclass
class Features:
    """Column arrays, one row per window (memory-mappable: plain numpy, no Python objects)."""

    input_ids: np.ndarray  # int32 [N, L], the tokenizer's padding id after the last token
    lengths: np.ndarray  # int32 [N]: real tokens in each window (padding follows them; no left padding)
    segment_ids: np.ndarray  # int8 [N, L]: 0 question, 1 context
    start_positions: np.ndarray  # int32 [N]: any max_seq_len DataConfig accepts (int16 stopped at 32767)
    end_positions: np.ndarray  # int32 [N]
    example_index: np.ndarray  # int32 [N]: which example a window came from
    offsets: np.ndarray  # int32 [N, L, 2]: character span of context tokens, -1 elsewhere

    COLUMNS = (
        "input_ids",
        "lengths",
        "segment_ids",
        "start_positions",
        "end_positions",
        "example_index",
        "offsets",
    )

    def __len__(self) -> int:
        return len(self.input_ids)


def _answer_tokens(spans: list[tuple[int, int]], start_char: int, end_char: int) -> tuple[int, int]:
    """First and last context token overlapping [start_char, end_char)."""
    first = next(i for i, (s, e) in enumerate(spans) if e > start_char)
    last = max(i for i, (s, e) in enumerate(spans) if s < end_char)
    return first, max(first, last)


def features_for(examples: list[QAExample], cfg: DataConfig) -> Features:
    """Windows of `examples` with the tokenizer and window sizes of a data config."""
    return build_features(examples, tokenizer_for(cfg), cfg.max_seq_len, cfg.max_query_len, cfg.doc_stride)


class BuiltinFeaturizer:
    """The built-in tokenizers' windows (`data.tokenizer`): what the native model reads."""

    @staticmethod
    def tokenizer(cfg: Config) -> Tokenizer:
        return tokenizer_for(cfg.data)

    @staticmethod
    def features(examples: list[QAExample], cfg: Config) -> Features:
        return features_for(examples, cfg.data)

    @staticmethod
    def cache_identity(cfg: Config) -> dict[str, Any]:
        data = cfg.data
        return {
            "tokenizer": data.tokenizer,
            "vocab_size": data.vocab_size if data.tokenizer == "word" else None,
            "lowercase": data.lowercase if data.tokenizer == "word" else None,
            "max_seq_len": data.max_seq_len,
            "max_query_len": data.max_query_len,
            "doc_stride": data.doc_stride,
        }


def build_features(
    examples: list[QAExample],
    tokenizer: Tokenizer,
    max_seq_len: int,
    max_query_len: int,
    doc_stride: int,
) -> Features:
    rows_ids, rows_len, rows_seg, rows_off, starts, ends, owners = [], [], [], [], [], [], []
    for example_index, example in enumerate(examples):
        q_ids = tokenizer.encode(example.question)[0][:max_query_len]
        c_ids, c_spans = tokenizer.encode(example.context)
        answer = None
        if example.answers and c_ids:
            first = example.answers[0]
            answer = _answer_tokens(c_spans, first.start, first.start + len(first.text))
        room = max_seq_len - len(q_ids) - 3
        window_start = 0
        while True:
            window_end = min(window_start + room, len(c_ids))
            head = [CLS, *q_ids, SEP]
            ids = head + c_ids[window_start:window_end] + [SEP]
            offsets = [(-1, -1)] * len(head) + c_spans[window_start:window_end] + [(-1, -1)]
            start = end = 0
            if answer and window_start <= answer[0] and answer[1] < window_end:
                start = answer[0] - window_start + len(head)
                end = answer[1] - window_start + len(head)
            pad = max_seq_len - len(ids)
            rows_ids.append(ids + [PAD] * pad)
            rows_len.append(len(ids))
            rows_seg.append([0] * len(head) + [1] * (len(ids) - len(head)) + [0] * pad)
            rows_off.append(offsets + [(-1, -1)] * pad)
            starts.append(start)
            ends.append(end)
            owners.append(example_index)
            if window_end >= len(c_ids):
                break
            window_start += room - doc_stride
    return Features(
        input_ids=np.asarray(rows_ids, dtype=np.int32),
        lengths=np.asarray(rows_len, dtype=np.int32),
        segment_ids=np.asarray(rows_seg, dtype=np.int8),
        start_positions=np.asarray(starts, dtype=np.int32),
        end_positions=np.asarray(ends, dtype=np.int32),
        example_index=np.asarray(owners, dtype=np.int32),
        offsets=np.asarray(rows_off, dtype=np.int32).reshape(len(rows_ids), max_seq_len, 2),
    )
