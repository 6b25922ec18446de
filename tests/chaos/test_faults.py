"""Fault plumbing that needs no running job: flag windows that overlap, when a fault has a target."""

from __future__ import annotations

import random
import subprocess
from pathlib import Path

import pytest

from elastic_qa.chaos.faults import FlagFile, Injector, NoTarget
from elastic_qa.chaos.schedule import parse_fault


def test_a_flag_stays_while_any_of_its_overlapping_windows_is_open(tmp_path: Path) -> None:
    actions: list[dict] = []
    flag = FlagFile(tmp_path / "storage-fault", actions.append)
    storage = flag.open("storage-errors")
    final = flag.open("final-storage-errors")
    flag.close(storage, "storage-errors", "after 3s")
    assert flag.path.exists()  # the final save's window is still open
    flag.close(final, "final-storage-errors", "3s after max_steps")
    assert not flag.path.exists()
    assert [a["action"] for a in actions] == ["flag_created", "flag_created", "window_closed", "flag_removed"]


def test_closing_everything_at_the_end_of_a_run_removes_the_flag(tmp_path: Path) -> None:
    flag = FlagFile(tmp_path / "log-fault", lambda action: None)
    flag.open("log-full")
    flag.close_all("the run is over")
    assert not flag.path.exists()


class OneWorkerJob:
    """A job whose group has shrunk to one agent with one worker (a real process: this test's child)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def live_agents(self) -> list[dict]:
        return [{"index": 0, "pid": 1, "is_host": True}]

    def workers(self, agent: dict) -> list[int]:
        return [self.pid]


def test_a_worker_is_frozen_for_ever_only_when_a_peer_can_notice(tmp_path: Path) -> None:
    """Alone in its group, a worker frozen for ever is noticed by nobody: the job would hang (a soak did)."""
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        flags = [FlagFile(tmp_path / name, lambda action: None) for name in ("storage", "logs")]
        injector = Injector(
            OneWorkerJob(sleeper.pid), random.Random(0), tmp_path, *flags, lambda a: None, 100
        )
        with pytest.raises(NoTarget, match="needs a peer"):
            injector.inject(parse_fault("freeze-worker@step=5,for=never"))
        assert sleeper.poll() is None and "T" not in Path(f"/proc/{sleeper.pid}/stat").read_text().split()[2]
    finally:
        sleeper.kill()
        sleeper.wait()
