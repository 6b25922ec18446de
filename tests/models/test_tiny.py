"""The random models `python -m elastic_qa.models.tiny` writes: tiny ones for tests, bert-base-shaped ones
for measuring costs at real size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from transformers import BertConfig, BertForQuestionAnswering

from elastic_qa.models import tiny

BERT_BASE_QA_PARAMETERS = 108_893_186  # bert-base-uncased's encoder without its pooler, plus a 768 x 2 head


def test_the_base_size_has_bert_bases_shape_and_parameter_count() -> None:
    sizes, positions = tiny.SIZES["base"]
    model = BertForQuestionAnswering(BertConfig(max_position_embeddings=positions, **sizes))
    assert sum(p.numel() for p in model.parameters()) == BERT_BASE_QA_PARAMETERS


def test_the_tiny_size_takes_its_vocabulary_from_its_tokenizer(tmp_path: Path) -> None:
    directory = tmp_path / "m"
    assert tiny.main([str(directory), "--size", "tiny"]) == 0
    config = json.loads((directory / "config.json").read_text())
    vocabulary = json.loads((directory / "tokenizer.json").read_text())["model"]["vocab"]
    assert config["vocab_size"] == len(vocabulary) and config["hidden_size"] == 32


def test_the_small_size_is_a_four_layer_bert_of_hidden_128(tmp_path: Path) -> None:
    directory = tmp_path / "m"
    assert tiny.main([str(directory), "--size", "small"]) == 0
    config = json.loads((directory / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]) == (4, 128, 4)
    model = BertForQuestionAnswering.from_pretrained(directory)
    assert sum(p.numel() for p in model.parameters()) == 938_242


def test_an_unknown_size_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="size 'large'"):
        tiny.create(tmp_path, size="large")
