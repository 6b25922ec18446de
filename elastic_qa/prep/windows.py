"""Examples -> fixed-size token windows with exact character offsets for the answer span.

A window is `[CLS] question [SEP] context-slice [SEP]`. Contexts longer than one window are split into
windows that overlap by `doc_stride` tokens. The answer maps to token positions inside the window that
holds all of it; in any other window, and for unanswerable questions, the target is position 0 ([CLS]).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from elastic_qa.config import Config, ConfigError, DataConfig, question_tokens
from elastic_qa.data.cache import VOCAB_FILE
from elastic_qa.data.examples import QAExample
from elastic_qa.data.features import Features
from elastic_qa.observe.log import get_logger
from elastic_qa.prep import wordpiece
from elastic_qa.prep.tokenizer import CLS, PAD, SEP, Tokenizer, build_tokenizer


def _answer_tokens(spans: np.ndarray, start_char: int, end_char: int) -> tuple[int, int]:
    """First and last context token overlapping [start_char, end_char) (token spans run in text order)."""
    first = int(np.searchsorted(spans[:, 1], start_char, side="right"))
    last = int(np.searchsorted(spans[:, 0], end_char, side="left")) - 1
    return first, max(first, last)


def tokenizer_for(cfg: DataConfig) -> Tokenizer:
    """The tokenizer a data config describes (wordpiece: the vocabulary of `data.vocab_file`)."""
    if cfg.tokenizer == "wordpiece":
        if not cfg.vocab_file:
            raise ConfigError(
                "data.tokenizer='wordpiece' without data.vocab_file: its vocabulary is trained when the "
                "feature cache is built (elastic-qa prepare)"
            )
        return wordpiece.load(cfg.vocab_file)
    return build_tokenizer(cfg.tokenizer, cfg.vocab_size, cfg.lowercase)


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
        trained = data.tokenizer == "word" or (data.tokenizer == "wordpiece" and not data.vocab_file)
        identity: dict[str, Any] = {
            "tokenizer": data.tokenizer,
            "vocab_size": data.vocab_size if trained else None,
            "lowercase": data.lowercase if trained else None,
            "max_seq_len": data.max_seq_len,
            "max_query_len": data.max_query_len,
            "doc_stride": data.doc_stride,
        }
        if data.tokenizer == "wordpiece":  # a trained vocabulary follows from the inputs, also in the key
            identity["vocabulary"] = (
                {"sha256": wordpiece.vocab_file_sha256(data.vocab_file)}
                if data.vocab_file
                else {"recipe": wordpiece.RECIPE}
            )
        return identity

    @staticmethod
    def store_vocabulary(cfg: Config, texts: Callable[[], Iterable[str]], directory: Path) -> Config:
        """wordpiece: train the vocabulary on `texts` (or read data.vocab_file), check it, write it into
        `directory` and return the config pointing there; other tokenizers store nothing."""
        data = cfg.data
        if data.tokenizer != "wordpiece":
            return cfg
        if data.vocab_file:
            raw = wordpiece.read_vocab_file(data.vocab_file)
            wordpiece.parse(raw, f"data.vocab_file={data.vocab_file!r}")
        else:
            started = time.perf_counter()
            raw = wordpiece.train(texts, data.vocab_size, data.lowercase).encode()
            get_logger().info(
                "vocabulary_trained",
                vocab_size=wordpiece.parse(raw, "the trained vocabulary").vocab_size,
                seconds=round(time.perf_counter() - started, 3),
            )
        path = directory / VOCAB_FILE
        path.write_bytes(raw)
        return dataclasses.replace(cfg, data=dataclasses.replace(data, vocab_file=str(path)))


def build_features(
    examples: list[QAExample],
    tokenizer: Tokenizer,
    max_seq_len: int,
    max_query_len: int,
    doc_stride: int,
) -> Features:
    # Pass 1 plans the windows; pass 2 writes them into preallocated columns (no per-token lists).
    plans = []  # (example, question ids, context ids, context spans, window start, window end, start, end)
    context, c_ids, c_spans = None, np.zeros(0, np.int64), np.zeros((0, 2), np.int64)
    question_limit = question_tokens(max_seq_len, max_query_len, doc_stride, special_tokens=3)
    for example_index, example in enumerate(examples):
        q_ids = tokenizer.encode(example.question)[0][:question_limit]
        if example.context != context:  # SQuAD asks several questions of one context: encode it once
            context = example.context
            ids, spans = tokenizer.encode(context)
            c_ids, c_spans = np.asarray(ids, np.int64), np.asarray(spans, np.int64).reshape(-1, 2)
        answer = None
        if example.answers and len(c_ids):
            given = example.answers[0]
            answer = _answer_tokens(c_spans, given.start, given.start + len(given.text))
        head = len(q_ids) + 2
        room = max_seq_len - head - 1
        window_start = 0
        while True:
            window_end = min(window_start + room, len(c_ids))
            start = end = 0
            if answer and window_start <= answer[0] and answer[1] < window_end:
                start = answer[0] - window_start + head
                end = answer[1] - window_start + head
            plans.append((example_index, q_ids, c_ids, c_spans, window_start, window_end, start, end))
            if window_end >= len(c_ids):
                break
            window_start += room - doc_stride
    count = len(plans)
    input_ids = np.full((count, max_seq_len), PAD, np.int32)
    segment_ids = np.zeros((count, max_seq_len), np.int8)
    offsets = np.full((count, max_seq_len, 2), -1, np.int32)
    lengths = np.zeros(count, np.int32)
    starts, ends, owners = (np.zeros(count, np.int32) for _ in range(3))
    for row, (owner, q_ids, c_ids, c_spans, first, stop, start, end) in enumerate(plans):
        head = len(q_ids) + 2
        tail = head + stop - first  # the closing [SEP]
        input_ids[row, :head] = [CLS, *q_ids, SEP]
        input_ids[row, head:tail] = c_ids[first:stop]
        input_ids[row, tail] = SEP
        segment_ids[row, head : tail + 1] = 1
        offsets[row, head:tail] = c_spans[first:stop]
        lengths[row], starts[row], ends[row], owners[row] = tail + 1, start, end, owner
    return Features(
        input_ids=input_ids,
        lengths=lengths,
        segment_ids=segment_ids,
        start_positions=starts,
        end_positions=ends,
        example_index=owners,
        offsets=offsets,
    )
