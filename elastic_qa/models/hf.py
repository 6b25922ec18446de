"""The `hf` family: a transformers AutoModelForQuestionAnswering with its own fast tokenizer.

Windows follow transformers' question-answering recipe: `question, context` pairs tokenised with
truncation of the context only, overflowing windows that overlap by `data.doc_stride` tokens, padding to
`data.max_seq_len`. The answer maps to the start and end tokens of a window that holds all of it; every
other window (and an unanswerable question) targets [CLS], position 0.

Loaded with `trust_remote_code=False` and weights read as tensors only: nothing from disk is executed.
This module imports transformers, so only `models.family_for` imports it, on demand (`elastic-qa[hf]`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import inspect
import json
import pickle
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
import torch
import transformers
from torch import nn
from transformers import AutoConfig, AutoModelForQuestionAnswering, AutoTokenizer

from elastic_qa.config import Config, ConfigError
from elastic_qa.data.examples import QAExample
from elastic_qa.data.features import Features
from elastic_qa.models.hf_export import load_pretrained_qa, save_pretrained_qa
from elastic_qa.models.hf_source import mismatch, one_line, refused_pickle, resolve

# Bump when the windows this module builds change for the same tokenizer and settings.
RECIPE_VERSION = 1
# transformers' "no limit known" model_max_length is a huge sentinel; a real limit is below this.
_NO_LIMIT = 10**8

transformers.utils.logging.disable_progress_bar()  # one bar per worker per load is noise in the logs


@functools.lru_cache(maxsize=4)
def load_tokenizer(name_or_path: str) -> Any:
    """The fast tokenizer of a model directory or hub id; ConfigError if it cannot serve QA windows."""
    source = resolve(name_or_path)
    where = source.where
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            source.path, local_files_only=source.local_only, trust_remote_code=False
        )
    except MemoryError:
        raise
    except Exception as err:  # noqa: BLE001 - whatever a hostile directory makes it raise is bad input
        raise ConfigError(f"{where}: cannot load its tokenizer ({one_line(err)})") from None
    if not getattr(tokenizer, "is_fast", False):
        # transformers builds a fast tokenizer from a slow one's files where it can (BERT's vocab.txt):
        # only a tokenizer with no fast version gets here.
        raise ConfigError(
            f"{where}: {type(tokenizer).__name__} is a slow (Python) tokenizer with no fast version; "
            f"character offsets need a fast one (tokenizer.json)"
        )
    if tokenizer.padding_side != "right":
        raise ConfigError(f"{where}: the tokenizer pads on the {tokenizer.padding_side}; only right is read")
    if tokenizer.pad_token_id is None or tokenizer.cls_token_id is None:
        raise ConfigError(f"{where}: the tokenizer has no padding or [CLS] token")
    if tokenizer("q", "c")["input_ids"][0] != tokenizer.cls_token_id:
        raise ConfigError(f"{where}: the tokenizer does not put [CLS] first (position 0 means no answer)")
    return tokenizer


def checked_tokenizer(cfg: Config) -> Any:
    """The tokenizer, once the window settings are known to fit it."""
    tokenizer = load_tokenizer(cfg.model.name_or_path)
    data = cfg.data
    limit = tokenizer.model_max_length
    if limit < _NO_LIMIT and data.max_seq_len > limit:
        raise ConfigError(f"data.max_seq_len={data.max_seq_len}: this model reads at most {limit} tokens")
    # As config.py checks for [CLS] and two [SEP]s; max_query_len=0 needs room for a one-token question.
    room = data.max_seq_len - max(1, data.max_query_len) - tokenizer.num_special_tokens_to_add(pair=True)
    if not 0 <= data.doc_stride < room:
        raise ConfigError(
            f"data.doc_stride={data.doc_stride}: must be in [0, {room}) "
            f"(context tokens per window with this tokenizer's special tokens"
            + (", with a question of at least one token)" if data.max_query_len == 0 else ")")
        )
    return tokenizer


class PretrainedTokenizer:
    """The `data.tokenizer.Tokenizer` view of a transformers tokenizer (ids with character spans)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.name = tokenizer.name_or_path
        self.vocab_size = len(tokenizer)  # added tokens included

    def encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        encoded = self._tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return encoded["input_ids"], [tuple(span) for span in encoded["offset_mapping"]]


def tokenizer(cfg: Config) -> PretrainedTokenizer:
    return PretrainedTokenizer(checked_tokenizer(cfg))


def cache_identity(cfg: Config) -> dict[str, Any]:
    """The tokenizer's full definition (vocabulary, normalizer, special tokens) by hash, and the settings."""
    tok = checked_tokenizer(cfg)
    # tokenizer.json, wherever the tokenizer came from, without the truncation and padding state that the
    # last call left in it; keys sorted, since a vocabulary is a hash map.
    definition = json.loads(tok.backend_tokenizer.to_str())
    definition = json.dumps(
        {k: v for k, v in definition.items() if k not in ("truncation", "padding")}, sort_keys=True
    )
    specials = f"{tok.pad_token_id},{tok.cls_token_id},{tok.padding_side},{tok.model_input_names}"
    return {
        "recipe": RECIPE_VERSION,
        "tokenizer_sha256": hashlib.sha256(f"{definition}\n{specials}".encode()).hexdigest(),
        "tokenizers": tokenizers.__version__,
        "max_seq_len": cfg.data.max_seq_len,
        "max_query_len": cfg.data.max_query_len,
        "doc_stride": cfg.data.doc_stride,
    }


def _question(tok: Any, text: str, max_tokens: int) -> str:
    """The question cut before the character where its token number `max_tokens` (from 0) starts: text,
    not ids, since the tokenizer pairs it with the context. A character that several byte-level tokens
    spell is kept whole or dropped whole, so the cut question has at most `max_tokens` tokens."""
    text = text.strip()  # leading spaces would be tokens of their own for byte-level BPE
    while True:
        spans = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        if len(spans) <= max_tokens:
            return text
        text = text[: min(spans[max_tokens][0], len(text) - 1)].rstrip()  # strictly shorter: the loop ends


def _trimmed(context: str, start: int, end: int) -> tuple[int, int]:
    """A span without leading whitespace (byte-level BPE tokens carry the space before a word)."""
    while start < end and context[start].isspace():
        start += 1
    return start, end


def _answer_tokens(
    spans: list[tuple[int, int]], positions: list[int], start_char: int, end_char: int
) -> tuple[int, int]:
    """Start and end token of [start_char, end_char) in a window with these context spans, else (0, 0)."""
    if not spans or spans[0][0] > start_char or spans[-1][1] < end_char:
        return 0, 0  # the window does not hold all of the answer
    first = next((p for p, (s, e) in zip(positions, spans, strict=True) if e > start_char), None)
    if first is None:  # an empty answer at the window's very end: nothing to point at
        return 0, 0
    last = max((p for p, (s, e) in zip(positions, spans, strict=True) if s < end_char), default=first)
    return first, max(first, last)


def features(examples: list[QAExample], cfg: Config) -> Features:
    """Windows of `examples` for the model of `model.name_or_path`; `segment_ids` is 1 on context tokens."""
    tok = checked_tokenizer(cfg)
    length = cfg.data.max_seq_len
    if not examples:
        return _no_windows(length)
    question_limit = cfg.data.question_tokens(tok.num_special_tokens_to_add(pair=True))
    questions = [_question(tok, e.question, question_limit) for e in examples]
    encoded = tok(
        questions,
        [e.context for e in examples],
        truncation="only_second",
        max_length=length,
        stride=cfg.data.doc_stride,
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
        padding="max_length",
    )
    count = len(encoded["input_ids"])
    owners = np.asarray(encoded["overflow_to_sample_mapping"], dtype=np.int32).reshape(count)
    segment_ids = np.zeros((count, length), dtype=np.int8)
    offsets = np.full((count, length, 2), -1, dtype=np.int32)
    starts = np.zeros(count, dtype=np.int32)
    ends = np.zeros(count, dtype=np.int32)
    for row in range(count):
        example = examples[owners[row]]
        positions = [p for p, seq in enumerate(encoded.sequence_ids(row)) if seq == 1]
        spans = [_trimmed(example.context, *encoded["offset_mapping"][row][p]) for p in positions]
        segment_ids[row, positions] = 1
        offsets[row, positions] = spans
        if example.answers:
            answer = example.answers[0]
            starts[row], ends[row] = _answer_tokens(
                spans, positions, answer.start, answer.start + len(answer.text)
            )
    return Features(
        input_ids=np.asarray(encoded["input_ids"], dtype=np.int32).reshape(count, length),
        lengths=np.asarray(encoded["attention_mask"], dtype=np.int32).reshape(count, length).sum(1),
        segment_ids=segment_ids,
        start_positions=starts,
        end_positions=ends,
        example_index=owners,
        offsets=offsets,
    )


def _no_windows(length: int) -> Features:
    empty = np.zeros(0, dtype=np.int32)
    return Features(
        input_ids=np.zeros((0, length), dtype=np.int32),
        lengths=empty,
        segment_ids=np.zeros((0, length), dtype=np.int8),
        start_positions=empty,
        end_positions=empty,
        example_index=empty,
        offsets=np.zeros((0, length, 2), dtype=np.int32),
    )


class PretrainedSpanQA(nn.Module):
    """A transformers QA model under this package's model contract: transformers argument names in,
    start and end logits out (float32, or float64 for a float64 model). `token_type_ids` in is the
    feature cache's segment ids, 1 on context tokens.

    Every position keeps the inner model's own logit, as in transformers' recipe (BertForQuestionAnswering's
    loss is a cross-entropy over every position of the window, padding included): the span loss then
    trains question, separator and padding positions down too, so that an export decodes as a
    recipe-trained model does under the standard n-best post-processing, which takes the top start and end
    logits over all positions before it keeps those inside the context. A mask here would leave those
    positions untrained, and they would crowd context tokens out of that top n. This package's own decoding
    reads context tokens and [CLS] only (evaluate.best_spans).
    """

    def __init__(self, model: nn.Module, newly_initialized: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.model = model
        # Weights the pretrained directory lacked (a base model's QA head), initialised from torch's RNG:
        # a fresh start says so once (Trainer.start), where a resume loads them from its checkpoint.
        self.newly_initialized = newly_initialized
        config = model.config
        # RoBERTa and DistilBERT have no token types (one type, or no such argument): they get none.
        self.token_types = (
            "token_type_ids" in inspect.signature(model.forward).parameters
            and getattr(config, "type_vocab_size", 0) >= 2
        )

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if self.token_types:
            # BERT's pair types: 0 up to the question's [SEP], 1 from the first context token to the end.
            inputs["token_type_ids"] = token_type_ids.cummax(dim=1).values * attention_mask
        output = self.model(**inputs, return_dict=True)
        dtype = torch.promote_types(output.start_logits.dtype, torch.float32)
        return output.start_logits.to(dtype), output.end_logits.to(dtype)


def _with_dropout(config: Any, dropout: float | None) -> None:
    """Every dropout (and LayerDrop) probability of a transformers config set to `model.dropout`; None
    leaves the pretrained config's own."""
    if dropout is None:
        return
    for name, value in config.to_dict().items():
        if ("dropout" in name or "layerdrop" in name) and (value is None or type(value) in (int, float)):
            setattr(config, name, dropout)


def build_model(cfg: Config, vocab_size: int) -> PretrainedSpanQA:
    """The pretrained model (a QA head the checkpoint lacks is initialised from torch's RNG), in float32."""
    source = resolve(cfg.model.name_or_path)
    where = source.where
    try:
        config = AutoConfig.from_pretrained(
            source.path, local_files_only=source.local_only, trust_remote_code=False
        )
        _with_dropout(config, cfg.model.dropout)
        # Mismatched shapes are reported in `loading` (and refused below) rather than raised as an
        # exception whose message points at a report printed elsewhere; that report (transformers' LOAD
        # REPORT, e.g. a base model's missing QA head), and torch's warning about a pickle's protocol, are
        # not printed: the refusal below says what matters in one line, a fresh start names a new head.
        with _quiet_loading():
            model, loading = AutoModelForQuestionAnswering.from_pretrained(
                source.path,
                config=config,
                local_files_only=source.local_only,
                trust_remote_code=False,
                weights_only=True,
                dtype=torch.float32,
                output_loading_info=True,
                ignore_mismatched_sizes=True,
            )
    except MemoryError:
        raise
    except Exception as err:  # noqa: BLE001 - whatever a hostile directory makes it raise is bad input
        raise ConfigError(f"{where}: cannot load the model ({_load_problem(err)})") from None
    _check_loaded(model, loading, where, config)
    if vocab_size > config.vocab_size:
        raise ConfigError(f"{where}: the tokenizer has {vocab_size} ids, the model {config.vocab_size}")
    if cfg.model.grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return PretrainedSpanQA(model, tuple(sorted(loading.get("missing_keys") or ())))


@contextlib.contextmanager
def _quiet_loading() -> Iterator[None]:
    verbosity = transformers.utils.logging.get_verbosity()
    transformers.utils.logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            yield
    finally:
        transformers.utils.logging.set_verbosity(verbosity)


def _load_problem(err: BaseException) -> str:
    """What went wrong loading the weights, on one line; a refused pickle says what weights_only refused."""
    if isinstance(err, pickle.UnpicklingError):
        return f"pytorch_model.bin {refused_pickle(err)}"
    return one_line(err)


def _check_loaded(model: nn.Module, loading: dict[str, Any], where: str, config: Any) -> None:
    """Refuse weights that do not fit config.json: a tensor of another shape, or a part of the base model
    the weights lack (transformers would initialise it at random and train on). A missing QA head is
    expected (a base model's checkpoint has none); weights the model does not use are ignored."""
    described = config.to_dict()
    for key, stored, wanted in sorted(loading.get("mismatched_keys") or (), key=str):
        raise ConfigError(
            f"{where}: the weights do not fit config.json: "
            f"{mismatch(key, tuple(stored), tuple(wanted), described)}"
        )
    prefix = f"{model.base_model_prefix}."
    missing = sorted(key for key in loading.get("missing_keys") or () if key.startswith(prefix))
    if missing:
        raise ConfigError(
            f"{where}: the weights lack {len(missing)} tensors config.json describes (e.g. {missing[0]}): "
            f"the config does not fit them"
        )


def export(model: nn.Module, cfg: Config, out: Path) -> None:
    """A directory transformers loads as it is: the inner pretrained model and the tokenizer it reads."""
    inner = model.model if isinstance(model, PretrainedSpanQA) else model
    save_pretrained_qa(inner, checked_tokenizer(cfg), out)


def load_export(cfg: Config, directory: Path) -> tuple[nn.Module, Config]:
    """The exported model under this package's contract; the tokenizer is read from the same directory."""
    with _quiet_loading():  # an export holds every weight; whatever transformers would say is noise
        model, _ = load_pretrained_qa(directory)
    exported = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name_or_path=str(directory)))
    return PretrainedSpanQA(model.float()), exported
