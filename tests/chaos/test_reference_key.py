"""The chaos reference cache: reused only for the same training, by the same code."""

from __future__ import annotations

import pytest

from elastic_qa.chaos import runner


def test_where_a_run_is_observed_does_not_change_its_reference() -> None:
    base = runner.reference_key("tiny", ["train.max_steps=30"], agents=2)
    assert base == runner.reference_key("tiny", ["train.max_steps=30", "run.dir=/elsewhere"], agents=2)
    assert base != runner.reference_key("tiny", ["train.max_steps=31"], agents=2)
    assert base != runner.reference_key("tiny", ["train.max_steps=30"], agents=3)


def test_a_reference_trained_by_other_code_is_not_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    base = runner.reference_key("tiny", [], agents=2)
    monkeypatch.setattr(runner, "code_fingerprint", lambda: "another-model")
    assert runner.reference_key("tiny", [], agents=2) != base


def test_the_code_fingerprint_is_stable() -> None:
    assert runner.code_fingerprint() == runner.code_fingerprint()
