"""QA model families, chosen by `model.kind`: the one place that knows which model a config trains.

The trainer, evaluation, `elastic-qa eval|ask` and the benchmarks ask `family_for(cfg.model)` and never
name a model class: `native` (models/native.py) and `hf`, a pretrained transformers model with its own
tokenizer (models/hf.py, which imports transformers, so it is loaded on first use). Every family's model
takes the transformers argument names and returns float32 start and end logits [batch, length], position 0
standing for "no answer in this window". Decoding (evaluate.best_spans) reads only context tokens and
position 0, whatever a model scores elsewhere:

    start_logits, end_logits = model(**model_inputs(batch, device))
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from elastic_qa.config import Config, ConfigError, ModelConfig
from elastic_qa.data.examples import QAExample
from elastic_qa.data.features import Features
from elastic_qa.models import native
from elastic_qa.models.loss import span_loss, span_loss_per_window
from elastic_qa.prep.tokenizer import Tokenizer

# The batch keys a model is called with (data.loader.collate produces them).
MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


@dataclass(frozen=True)
class ModelFamily:
    """A model with the tokenizer and windows it reads, and the loss it trains with.

    Every function takes the whole resolved config: a family may need settings from several sections.
    """

    build_model: Callable[[Config, int], nn.Module]
    """(cfg, vocab_size) -> a model initialised from torch's current RNG state (seed it first)."""
    tokenizer: Callable[[Config], Tokenizer]
    """cfg -> the tokenizer the model reads."""
    features: Callable[[list[QAExample], Config], Features]
    """(examples, cfg) -> their windows, tokenised for the model. A pure function of one batch of examples
    (`example_index` counts within the batch), so that preparation may call it batch by batch, in any
    process, and concatenate the results."""
    cache_identity: Callable[[Config], dict[str, Any]]
    """cfg -> everything besides the input data that changes what `features` produces (tokenizer identity,
    e.g. a hash of its files, and window settings), JSON-serialisable: part of the feature cache's key."""
    span_loss: Callable[..., torch.Tensor]
    """(start_logits, end_logits, start_positions, end_positions, weights) -> weighted sum over windows."""
    span_loss_per_window: Callable[..., torch.Tensor]
    """(start_logits, end_logits, start_positions, end_positions) -> loss per window."""
    export: Callable[[nn.Module, Config, Path], None]
    """(model, cfg, empty directory) -> writes the model's weights there (safetensors) and whatever else
    loading it needs besides the resolved config, which `elastic-qa export` writes itself."""
    load_export: Callable[[Config, Path], tuple[nn.Module, Config]]
    """(cfg, exported directory) -> the model `export` wrote (on the CPU) and the config to predict with
    (a family may point it at files in the directory, e.g. its tokenizer's)."""
    full_width: bool = False
    """True: a batch keeps every window at `data.max_seq_len` positions, since the loss reads padding too
    (and a window's loss must not depend on the longest window batched with it); False: a batch is
    trimmed to its longest window (data.loader.collate)."""
    store_vocabulary: Callable[[Config, Callable[[], Iterable[str]], Path], Config] | None = None
    """(cfg, the training texts, a feature cache being built) -> the config to build its windows with,
    after writing there the vocabulary they need (trained on the texts, or read from the config); None:
    the tokenizer needs nothing stored with the cache."""


FAMILIES: dict[str, ModelFamily] = {
    "native": ModelFamily(
        build_model=native.build_model,
        tokenizer=native.tokenizer,
        features=native.features,
        cache_identity=native.cache_identity,
        span_loss=span_loss,
        span_loss_per_window=span_loss_per_window,
        export=native.export,
        load_export=native.load_export,
        store_vocabulary=native.store_vocabulary,
    ),
}


def family_for(cfg: ModelConfig) -> ModelFamily:
    """The family `model.kind` names."""
    if cfg.kind == "hf":
        return _pretrained_family()
    family = FAMILIES.get(cfg.kind)
    if family is None:
        raise ConfigError(f"model.kind={cfg.kind!r}: must be one of {', '.join([*FAMILIES, 'hf'])}")
    return family


@functools.cache
def _pretrained_family() -> ModelFamily:
    try:
        from elastic_qa.models import hf
    except ImportError as err:
        raise ConfigError(
            f"model.kind='hf': needs {err.name or 'transformers'}: pip install 'elastic-qa[hf]'"
        ) from None
    return ModelFamily(
        build_model=hf.build_model,
        tokenizer=hf.tokenizer,
        features=hf.features,
        cache_identity=hf.cache_identity,
        span_loss=span_loss,
        span_loss_per_window=span_loss_per_window,
        export=hf.export,
        load_export=hf.load_export,
        full_width=True,
    )


def model_inputs(
    batch: Mapping[str, Any], device: torch.device, rows: slice = slice(None)
) -> dict[str, torch.Tensor]:
    """The model's keyword arguments for `rows` of a batch, on `device` (non-blocking from pinned memory)."""
    return {name: batch[name][rows].to(device, non_blocking=True) for name in MODEL_INPUTS}
