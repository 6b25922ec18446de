"""A transformers QA model exported by `save_pretrained_qa` loads in transformers' own Auto classes (and
its question-answering pipeline where the installed version still has one), and back through
`load_pretrained_qa`, with the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elastic_qa.models.hf_export import load_pretrained_qa, save_pretrained_qa

transformers = pytest.importorskip("transformers")

WORDS = [
    "[PAD]",
    "[UNK]",
    "[CLS]",
    "[SEP]",
    "[MASK]",
    "where",
    "does",
    "bako",
    "live",
    "?",
    "in",
    "rome",
    ".",
]


def tiny_bert(tmp_path: Path):
    tmp_path.mkdir()
    (tmp_path / "vocab.txt").write_text("\n".join(WORDS) + "\n")
    tokenizer = transformers.BertTokenizerFast(vocab_file=str(tmp_path / "vocab.txt"))
    config = transformers.BertConfig(
        vocab_size=len(WORDS), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.BertForQuestionAnswering(config).eval(), tokenizer


@pytest.fixture
def exported(tmp_path: Path):
    model, tokenizer = tiny_bert(tmp_path / "src")
    out = tmp_path / "export"
    out.mkdir()
    save_pretrained_qa(model, tokenizer, out)
    return model, out


def test_the_export_is_safetensors_that_transformers_auto_classes_load(exported) -> None:
    model, out = exported
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert not list(out.glob("*.bin"))  # no pickles
    loaded = transformers.AutoModelForQuestionAnswering.from_pretrained(out)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    again, tokenizer = load_pretrained_qa(out)
    inputs = tokenizer("where does bako live ?", "bako live in rome .", return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(again(**inputs).start_logits, model(**inputs).start_logits)


@pytest.mark.skipif(
    not hasattr(transformers, "QuestionAnsweringPipeline"),
    reason="this transformers has no extractive question-answering pipeline (removed in 5.0)",
)
def test_the_export_loads_in_the_question_answering_pipeline(exported) -> None:
    _, out = exported
    answer = transformers.pipeline("question-answering", model=str(out), tokenizer=str(out), device="cpu")(
        question="where does bako live ?", context="bako live in rome ."
    )
    assert answer["answer"] in "bako live in rome ." and answer["start"] < answer["end"]
