"""Fault injection (elastic_qa/debug.py): one object per worker, and nothing else in training reads it."""

from __future__ import annotations

import errno
import re
from pathlib import Path

import pytest

from elastic_qa.config import config_from_dict
from elastic_qa.debug import Faults
from tests.conftest import REPO

FAULT_FIELDS = "kill_at_step|kill_rank|step_delay|save_delay|storage_fault_file|hold_dir|hold_timeout"


def test_no_fault_is_injected_by_default() -> None:
    faults = Faults(config_from_dict({}), rank=0)
    assert not faults.pauses and not faults.save_due(1)
    faults.before_file("model.pt")  # no delay, no error


def test_a_storage_fault_fails_checkpoint_writes_while_its_file_exists(tmp_path: Path) -> None:
    flag = tmp_path / "full"
    faults = Faults(config_from_dict({"debug": {"storage_fault_file": str(flag)}}), rank=0)
    faults.before_file("model.pt")
    flag.touch()
    with pytest.raises(OSError) as raised:
        faults.before_file("model.pt")
    assert raised.value.errno == errno.ENOSPC


@pytest.mark.parametrize("setting", [{"kill_at_step": 3}, {"step_delay": "1s"}, {"hold_dir": "/x"}])
def test_a_kill_a_delay_or_a_hold_makes_the_loop_call_in_after_each_step(setting: dict) -> None:
    assert Faults(config_from_dict({"debug": setting}), rank=0).pauses


def test_only_the_fault_injection_module_reads_the_fault_settings_in_the_training_path() -> None:
    """The loop, the session and the checkpoints see `Faults`, never cfg.debug's fault fields (chaos, which
    sets them, and step_holds.py, the step holds `Faults` calls, may read them)."""
    allowed = {"debug.py", "step_holds.py", "config.py"}
    readers = [
        f"{path.relative_to(REPO)}:{number}"
        for path in (REPO / "elastic_qa").rglob("*.py")
        if path.name not in allowed and path.parts[-2] not in ("chaos", "bench")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(rf"\.debug\.({FAULT_FIELDS})\b", line)
    ]
    assert readers == []
