"""Fault plumbing that needs no job: flag windows that overlap."""

from __future__ import annotations

from pathlib import Path

from elastic_qa.chaos.faults import FlagFile


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
