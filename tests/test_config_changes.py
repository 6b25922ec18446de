"""Config changes between a checkpoint and the config resuming it: shapes refused, the rest explained;
settings that are valid but likely mistakes."""

from __future__ import annotations

from elastic_qa.config import load_config, packaged_config
from elastic_qa.config_changes import DEFAULT_EFFECT, config_changes, refusal, suspicious_settings


def tiny(*overrides: str):
    return load_config(packaged_config("tiny"), overrides)


def test_an_unchanged_config_or_another_location_is_no_change() -> None:
    saved = tiny().to_dict()
    assert config_changes(saved, tiny()) == []
    assert config_changes(saved, tiny("run.dir=/elsewhere", "data.cache_dir=/tmp/c")) == []


def test_shape_changes_are_refused_naming_each_and_listed_first() -> None:
    saved = tiny().to_dict()
    changes = config_changes(saved, tiny("train.max_steps=99", "model.d_model=64", "data.vocab_size=512"))

    assert [(c.key, c.shape) for c in changes] == [
        ("data.vocab_size", True),
        ("model.d_model", True),
        ("train.max_steps", False),
    ]
    sentence = refusal(changes, "runs/x/checkpoints")
    assert sentence is not None and "model.d_model" in sentence and "data.vocab_size" in sentence
    assert "train.max_steps" not in sentence


def test_other_changes_are_allowed_with_their_documented_effect() -> None:
    saved = tiny().to_dict()
    changes = config_changes(saved, tiny("train.max_steps=99", "model.dropout=0.1", "log.every_steps=3"))

    assert refusal(changes, "x") is None
    effects = {c.key: c.effect for c in changes}
    assert "keeps its position" in effects["train.max_steps"]
    assert effects["model.dropout"] == effects["log.every_steps"] == DEFAULT_EFFECT


def test_a_key_the_checkpoint_predates_is_not_a_change() -> None:
    saved = tiny().to_dict()
    del saved["model"]["grad_checkpointing"], saved["model"]["d_ff"]
    assert config_changes(saved, tiny()) == []


def test_warmup_as_long_as_the_run_and_a_batch_larger_than_the_data_are_suspicious() -> None:
    assert suspicious_settings(tiny(), train_windows=2000) == []
    found = suspicious_settings(tiny("train.warmup_steps=40", "train.global_batch_size=64"), train_windows=50)
    assert len(found) == 2
    assert "train.warmup_steps=40 >= train.max_steps=40" in found[0]
    assert "train.global_batch_size=64 is larger than the 50 training windows" in found[1]


def test_another_vocab_file_is_no_shape_change_its_content_is_compared_on_resume() -> None:
    saved = tiny("data.tokenizer=wordpiece").to_dict()
    changes = config_changes(
        saved, tiny("data.tokenizer=wordpiece", "data.vocab_file=exported/tokenizer.json")
    )
    assert refusal(changes, "x") is None
    assert [(c.key, c.shape) for c in changes] == [("data.vocab_file", False)]
    assert "compared by content" in changes[0].effect


def test_a_native_checkpoint_from_before_lr_schedule_and_null_dropout_resumes_without_a_change() -> None:
    saved = tiny().to_dict()
    del saved["train"]["lr_schedule"]  # written before the key existed, with dropout 0.0 as then
    assert saved["model"]["dropout"] == 0.0
    assert config_changes(saved, tiny()) == []
    assert config_changes(saved, tiny("model.dropout=null")) == []


def test_another_lr_schedule_than_a_checkpoints_cosine_is_a_change_even_from_before_the_key() -> None:
    saved = tiny().to_dict()
    del saved["train"]["lr_schedule"]
    changes = config_changes(saved, tiny("train.lr_schedule=linear"))
    assert [(c.key, c.old, c.new, c.shape) for c in changes] == [
        ("train.lr_schedule", "cosine", "linear", False)
    ]
    assert "keeps its position" in changes[0].effect


def test_null_dropout_on_an_hf_checkpoint_that_replaced_it_is_a_change() -> None:
    hf = ("model.kind=hf", "model.name_or_path=/m")
    saved = tiny(*hf, "model.dropout=0.0").to_dict()
    changes = config_changes(saved, tiny(*hf))
    assert [(c.key, c.old, c.new, c.shape) for c in changes] == [("model.dropout", 0.0, None, False)]
