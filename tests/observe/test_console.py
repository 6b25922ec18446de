"""The progress a person sees: drawn in place on a terminal, plain periodic lines elsewhere, an ETA only
once one can be measured, and each piece of news said once."""

from __future__ import annotations

import io

import pytest

from elastic_qa.observe.console import Console, ProgressView, format_eta


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def step(n: int, ts: float, rank: int = 0, world: int = 2) -> dict:
    return {"event": "step", "rank": rank, "step": n, "ts": ts, "loss": 2.5, "samples_per_s": 300.0,
            "world_size": world}  # fmt: skip


def start(rank: int = 0, world: int = 2) -> list[dict]:
    return [
        {"event": "worker_start", "rank": rank, "world_size": world, "ts": 0.0},
        {"event": "train_start", "rank": rank, "step": 0, "max_steps": 100, "ts": 0.0},
    ]


def test_on_a_terminal_progress_is_redrawn_in_place_and_news_goes_above_it() -> None:
    out = Terminal()
    view = ProgressView("auto", out)
    view.feed([*start(), step(10, 1.0), step(20, 2.0)])
    view.feed([{"event": "eval", "rank": 0, "step": 20, "em": 0.5, "f1": 0.6}, step(30, 3.0)])
    view.close()

    text = out.getvalue()
    assert "\n" not in text.split("eval at step 20")[0]  # the bar was redrawn in place until the news
    assert "\r\033[Keval at step 20: EM 50.00  F1 60.00\n" in text
    last = text.rstrip("\n").split("\r")[-1]
    assert last.startswith("[#######") and "step 30/100  loss 2.5000  300 samples/s  eta 7s" in last
    assert "world 2  restarts 0" in last and text.endswith("\n")


def test_elsewhere_progress_is_a_plain_line_at_most_every_period_and_at_the_end() -> None:
    out, clock = io.StringIO(), Clock()
    view = ProgressView("auto", out, clock=clock, plain_every_s=10)
    view.feed(start())
    for n in range(1, 101):
        clock.now = n * 0.5
        view.feed([step(n, n * 0.5)])
    view.feed([{"event": "train_done", "rank": 0, "step": 100}])

    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and "\033" not in out.getvalue()
    # 0.5 s a step, a line every 10 s: steps 1, 21, 41, 61, 81; then the end, whenever it comes
    assert [line.split("/")[0] for line in lines] == ["step 1", "step 21", "step 41", "step 61", "step 81",
                                                      "step 100"]  # fmt: skip
    assert lines[-1].endswith("eta 0s  world 2  restarts 0")


def test_the_eta_is_unknown_until_two_steps_of_one_group_were_seen_and_never_nan() -> None:
    out = io.StringIO()
    view = ProgressView("plain", out, plain_every_s=0)
    view.feed([*start(), step(1, 5.0)])
    view.feed([step(11, 6.0)])
    view.feed(
        [
            {"event": "worker_start", "rank": 0, "world_size": 1, "ts": 7.0},
            {"event": "resume", "rank": 0, "step": 11, "ts": 7.5},
            step(12, 8.0, world=1),
        ]
    )

    first, second, regroup, third = out.getvalue().splitlines()
    assert "eta --" in first and "nan" not in first
    assert "eta 9s" in second  # 89 steps to go at 10 steps/s
    assert regroup == "regrouped: world size 1 (restart 1), resuming from step 11"
    assert "eta --" in third and "world 1  restarts 1" in third  # a new group's rate is measured afresh


def test_other_ranks_steps_are_not_rank_0_progress() -> None:
    out = io.StringIO()
    ProgressView("plain", out, plain_every_s=0).feed([*start(), step(5, 1.0, rank=1)])
    assert out.getvalue() == ""


def test_a_diagnosis_and_a_config_change_are_said_once() -> None:
    out = io.StringIO()
    view = ProgressView("plain", out)
    change = {"key": "train.max_steps", "old": 40, "new": 80, "effect": "the schedule keeps its position"}
    for n in (50, 100, 150):
        view.feed([{"event": "diagnosis", "rank": 0, "step": n, "finding": f"communication-bound: {n}% ..."}])
        view.feed([{"event": "config_changed", "rank": 0, "step": 40, "changes": [change]}])

    assert out.getvalue().splitlines() == [
        "diagnosis at step 50: communication-bound: 50% ...",
        "config changed since the checkpoint: train.max_steps 40 -> 80: the schedule keeps its position",
    ]


def test_console_none_shows_nothing() -> None:
    out = Terminal()
    view = ProgressView("none", out)
    view.feed([*start(), step(1, 1.0), {"event": "eval", "rank": 0, "step": 1, "em": 1.0, "f1": 1.0}])
    view.close()
    assert out.getvalue() == ""


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (None, "--"),
        (float("nan"), "--"),
        (float("inf"), "--"),
        (42.4, "42s"),
        (200, "3m20s"),
        (3900, "1h05m"),
    ],
)
def test_eta_format(seconds: float | None, text: str) -> None:
    assert format_eta(seconds) == text


def test_a_single_workers_console_says_eta_unknown_on_its_first_line(monkeypatch) -> None:
    monkeypatch.delenv("ELASTIC_QA_UNDER_LAUNCHER", raising=False)
    out = io.StringIO()
    Console("auto", 100, enabled=True, stream=out).progress(1, 3.0, 0.0)
    assert out.getvalue() == "step 1/100  loss 3.0000  -- samples/s  eta --\n"


def test_under_the_launcher_a_workers_console_writes_plain_lines_even_when_told_progress(
    monkeypatch,
) -> None:
    monkeypatch.setenv("ELASTIC_QA_UNDER_LAUNCHER", "1")
    out = Terminal()
    console = Console("progress", 100, enabled=True, stream=out)
    console.progress(1, 3.0, 10.0)
    console.progress(2, 2.0, 10.0)
    assert "\r" not in out.getvalue() and len(out.getvalue().splitlines()) == 2
