"""Export for transformers models: a directory `AutoModelForQuestionAnswering.from_pretrained` and the
question-answering pipeline load as they are (config.json, model.safetensors, the tokenizer's files).

For a transformers family to wire in as its `ModelFamily.export` / `load_export` hooks; transformers is
imported only when these run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def save_pretrained_qa(model: Any, tokenizer: Any, out: Path) -> None:
    """Write a `PreTrainedModel` with a question-answering head and its tokenizer into `out`.

    Weights go out as safetensors only (transformers' default since 4.35, its only format from 5).
    """
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # one line of "Writing model shards" per export is noise
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _loadable_by_transformers_4(out / "tokenizer_config.json")
    if not (out / "model.safetensors").is_file() and not (out / "model.safetensors.index.json").is_file():
        raise RuntimeError(f"{out}: transformers wrote no safetensors weights")


def load_pretrained_qa(directory: Path) -> tuple[Any, Any]:
    """The model and tokenizer `save_pretrained_qa` wrote: safetensors only, never code from the directory."""
    from transformers import AutoModelForQuestionAnswering, AutoTokenizer

    model = AutoModelForQuestionAnswering.from_pretrained(
        directory, use_safetensors=True, trust_remote_code=False
    )
    tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=False)
    return model, tokenizer


def _loadable_by_transformers_4(config_path: Path) -> None:
    """transformers 5 names a generic fast tokenizer `TokenizersBackend`, a class 4.x does not have;
    `PreTrainedTokenizerFast` is the same tokenizer under the name both versions load."""
    if not config_path.is_file():
        return
    config = json.loads(config_path.read_text())
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
