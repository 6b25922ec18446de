"""Step holds (elastic_qa/step_holds.py): the job waits after step N until whoever drives it releases N."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path

import pytest

from elastic_qa import step_holds as holds
from elastic_qa.config import Config

WAIT_S = 60  # generous: these threads only wait on each other's events


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(holds, "_pending", {})  # the holds are listed once per process
    monkeypatch.setattr(holds, "_saves", {})


def config(hold_dir: Path | str = "", timeout_s: float = 600) -> Config:
    cfg = Config()
    cfg.debug.hold_dir = str(hold_dir)
    cfg.debug.hold_timeout = timedelta(seconds=timeout_s)
    return cfg


class Held:
    """hold_after_step in a thread; `waiting` is set once it polls (it is held), `stop` ends it early."""

    def __init__(self, cfg: Config, step: int) -> None:
        self.waiting, self.stop = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=holds.hold_after_step, args=(cfg, step, self._asked))
        self.thread.start()

    def _asked(self) -> bool:
        self.waiting.set()
        return self.stop.is_set()

    def ended(self) -> bool:
        self.thread.join(WAIT_S)
        return not self.thread.is_alive()


def test_a_step_is_held_until_its_release_and_then_goes_on(tmp_path: Path) -> None:
    holds.arm(tmp_path, [5])
    held = Held(config(tmp_path), 5)
    assert held.waiting.wait(WAIT_S)  # held: it polls for the release
    assert held.thread.is_alive()
    assert holds.release(tmp_path, 5)
    assert held.ended()
    assert not holds.release(tmp_path, 5)  # released once


def test_a_job_that_resumed_past_a_hold_is_held_at_its_first_step_beyond_it(tmp_path: Path) -> None:
    """A stop saved step N+1: the next group starts after N and must still not run past the fault."""
    holds.arm(tmp_path, [5, 9])
    cfg = config(tmp_path)
    held = Held(cfg, 7)
    assert held.waiting.wait(WAIT_S)
    holds.release(tmp_path, 5)
    assert held.ended()
    holds.hold_after_step(cfg, 8, lambda: False)  # 9 is still ahead: not held
    later = Held(cfg, 9)
    assert later.waiting.wait(WAIT_S)
    holds.release_all(tmp_path)
    assert later.ended()


def test_a_stop_request_ends_a_hold_at_once(tmp_path: Path) -> None:
    """SIGTERM from an agent regrouping (a node joins) or Ctrl-C: a hold never delays a stop."""
    holds.arm(tmp_path, [3])
    held = Held(config(tmp_path), 3)
    assert held.waiting.wait(WAIT_S)
    held.stop.set()
    assert held.ended()
    assert not (tmp_path / "release-00000003").exists()


def test_a_hold_is_bounded_by_debug_hold_timeout(tmp_path: Path) -> None:
    holds.arm(tmp_path, [3])
    held = Held(config(tmp_path, timeout_s=0.1), 3)
    assert held.ended()  # with a warning naming the release file it waited for
    assert not (tmp_path / "release-00000003").exists()


def test_released_and_unarmed_steps_and_no_hold_dir_do_not_wait(tmp_path: Path) -> None:
    holds.arm(tmp_path, [2])
    holds.release(tmp_path, 2)
    never = lambda: pytest.fail("asked whether to stop: it was held")  # noqa: E731
    holds.hold_after_step(config(tmp_path), 2, never)
    holds.hold_after_step(config(tmp_path), 1, never)
    holds.hold_after_step(config(""), 2, never)
    assert holds.armed(tmp_path) == [2]


def test_saves_asked_for_are_due_at_their_steps_only(tmp_path: Path) -> None:
    """kill-during-save at N asks for a save at N+1: every rank lists the same files, so all agree."""
    holds.arm(tmp_path, [4], saves=[5])
    assert [holds.save_due(config(tmp_path), step) for step in (4, 5, 6)] == [False, True, False]
    assert holds.armed(tmp_path) == [4] and holds.armed(tmp_path, holds.SAVE) == [5]
    assert not holds.save_due(config(""), 5)


def test_hold_dir_and_hold_timeout_are_debug_settings_off_by_default() -> None:
    assert Config().debug.hold_dir == ""
    assert Config().debug.hold_timeout == timedelta(minutes=10)


def test_a_hold_released_before_the_job_got_there_is_said_all_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver saw step N logged and fired before this rank reached its hold: the `hold` line is the
    evidence that the job did not pass N before the fault, so it is written either way."""
    said: list[tuple[str, dict]] = []

    class Recorder:  # whatever logging another test in this process configured, the calls are seen
        def info(self, event: str, **fields: object) -> None:
            said.append((event, fields))

        warning = info

    monkeypatch.setattr(holds, "get_logger", Recorder)
    holds.arm(tmp_path, [4])
    holds.release(tmp_path, 4)
    never = lambda: pytest.fail("asked whether to stop: it was held")  # noqa: E731
    holds.hold_after_step(config(tmp_path), 4, never)
    assert [(e, f["hold"], f["step"], f["released"]) for e, f in said] == [("hold", 4, 4, True)]
