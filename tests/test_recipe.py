"""run_qa's recipe in this package's settings, and the packaged hf-base config that follows it."""

from __future__ import annotations

import pytest

from elastic_qa.config import load_config, packaged_config
from elastic_qa.run_qa_recipe import RUN_QA, deviations

pytest.importorskip("transformers")  # kind=hf configs check that transformers is installed


def hf_base(*overrides: str):
    return load_config(packaged_config("hf-base"), ["model.name_or_path=/m", *overrides])


def test_hf_base_is_run_qa_but_for_what_its_header_says_it_keeps_different() -> None:
    assert deviations(hf_base()) == [("train.freeze_loss_invariant", True, False)]
    header = packaged_config("hf-base").read_text().split("\nrun:")[0]
    assert "run_qa's defaults" in header and "train.freeze_loss_invariant: true" in header


def test_every_recipe_setting_is_a_config_key_and_each_change_is_a_deviation() -> None:
    cfg = hf_base("train.freeze_loss_invariant=false")
    assert deviations(cfg) == []
    for key in RUN_QA:
        section, name = key.split(".")
        assert name in cfg.to_dict()[section]
    changed = hf_base("train.freeze_loss_invariant=false", "train.lr_schedule=cosine", "model.dropout=0.0")
    assert deviations(changed) == [("model.dropout", 0.0, None), ("train.lr_schedule", "cosine", "linear")]
