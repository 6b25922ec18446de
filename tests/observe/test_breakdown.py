"""Step-time breakdown and diagnosis: what each rank logs, and when rank 0 calls a run data-, communication-
or straggler-bound. Time is a fake clock the test advances, so the shares are exact on any machine."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elastic_qa import dist as dist_module
from elastic_qa.dist import CommTimer, DistContext
from elastic_qa.elastic.control import ControlPlane, gloo_all_reduce
from elastic_qa.observe import breakdown as breakdown_module
from elastic_qa.observe.breakdown import StepTimer
from tests.spawned import spawn_ranks

CPU = torch.device("cpu")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Recorder:
    """Stands in for the structlog logger and the console: keeps what they were told."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.lines: list[str] = []

    def info(self, event: str, **fields: Any) -> None:
        self.events.append({"event": event, "level": "info", **fields})

    def warning(self, event: str, **fields: Any) -> None:
        self.events.append({"event": event, "level": "warning", **fields})

    def line(self, text: str) -> None:
        self.lines.append(text)

    def named(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == event]

    def findings(self) -> list[str]:
        return [e["finding"] for e in self.named("diagnosis")]


def use_clock(monkeypatch: pytest.MonkeyPatch | None = None) -> Clock:
    clock = Clock()
    fake = SimpleNamespace(perf_counter=clock.perf_counter)
    if monkeypatch is None:  # in a spawned process: nothing to restore
        breakdown_module.time = fake
        dist_module.time = fake
    else:
        monkeypatch.setattr(breakdown_module, "time", fake)
        monkeypatch.setattr(dist_module, "time", fake)
    return clock


def run_step(
    timer: StepTimer,
    clock: Clock,
    step: int,
    ctx: DistContext,
    log: Recorder,
    *,
    data: float = 0.0,
    compute: float = 0.1,
    comm: float = 0.0,
    optimizer: float = 0.0,
    other: float = 0.0,
    console: Recorder | None = None,
    plane: ControlPlane | None = None,
) -> None:
    """One step the way the trainer marks it; `comm` seconds of all-reduce overlap the end of backward.
    With `plane`, the ranks' figures ride on the control all-reduce, as in training."""
    agreement = plane.start(step, False, False, None) if plane else None
    timer.start_step(step)
    clock.advance(data)
    timer.mark("data")
    clock.advance(compute - comm)
    if comm:
        timer.comm.started()
        clock.advance(comm)
        timer.comm.finished()
    timer.mark("forward_backward")
    if plane:
        plane.finish(step, agreement)
        plane.deliver()
    clock.advance(optimizer)
    timer.mark("optimizer")
    timer.mark("log_and_save")
    clock.advance(other)
    timer.finish_step(ctx, None, log, console, plane.carry if plane else None)


def single() -> DistContext:
    return DistContext(0, 1, 0, CPU, None, 1)


def test_comm_time_is_the_union_of_bucket_intervals_not_their_sum(monkeypatch) -> None:
    clock = use_clock(monkeypatch)
    timer = CommTimer()
    timer.started()  # bucket A: 0 .. 3
    clock.advance(1)
    timer.started()  # bucket B: 1 .. 4, queued behind A
    clock.advance(2)
    timer.finished()
    clock.advance(1)
    timer.finished()
    clock.advance(5)  # idle: not communication
    timer.started()  # bucket C: 9 .. 9.5
    clock.advance(0.5)
    timer.finished()

    assert timer.take() == pytest.approx(4.5)  # the sum of durations would be 3 + 3 + 0.5 = 6.5
    assert timer.take() == 0.0


def test_every_reporting_step_logs_the_breakdown_of_the_window(monkeypatch) -> None:
    clock = use_clock(monkeypatch)
    timer, log = StepTimer(CPU, 4, CommTimer()), Recorder()
    for step in range(1, 9):
        run_step(
            timer, clock, step, single(), log, data=0.01, compute=0.1, comm=0.02, optimizer=0.03, other=0.06
        )

    rows = log.named("step_breakdown")
    assert [r["step"] for r in rows] == [4, 8] and all(r["steps"] == 4 for r in rows)
    row = rows[-1]
    assert row["step_s"] == pytest.approx(0.2)
    assert row["data_s"] == pytest.approx(0.01) and row["forward_backward_s"] == pytest.approx(0.1)
    assert row["comm_s"] == pytest.approx(0.02) and row["optimizer_s"] == pytest.approx(0.03)
    assert row["other_s"] == pytest.approx(0.06)
    assert row["data_share"] == pytest.approx(0.05) and row["comm_share"] == pytest.approx(0.1)
    assert row["peak_memory_mb"] > 0
    assert log.findings() == []  # 5% data, 10% communication: below both thresholds


def test_a_checkpoint_stall_is_reported_per_step_of_its_window(monkeypatch) -> None:
    clock = use_clock(monkeypatch)
    timer, log = StepTimer(CPU, 2, CommTimer()), Recorder()
    run_step(timer, clock, 1, single(), log)
    timer.add_stall(0.004)
    run_step(timer, clock, 2, single(), log)
    run_step(timer, clock, 3, single(), log)
    run_step(timer, clock, 4, single(), log)

    assert [r["checkpoint_stall_s"] for r in log.named("step_breakdown")] == pytest.approx([0.002, 0.0])


def test_on_cuda_the_previous_steps_queued_kernels_are_not_timed_as_the_next_steps_data_wait(
    monkeypatch,
) -> None:
    """The CPU runs ahead of the GPU; a reporting step must start from an idle GPU. The fake device holds
    the seconds of queued work that a synchronize waits for."""
    clock = use_clock(monkeypatch)
    queued = {"seconds": 0.0}

    def synchronize(device=None) -> None:
        clock.advance(queued["seconds"])
        queued["seconds"] = 0.0

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 0)
    timer, log = StepTimer(torch.device("cuda", 0), 2, CommTimer()), Recorder()
    run_step(timer, clock, 1, single(), log, compute=0.01)  # not a reporting step: never synchronised
    queued["seconds"] = 0.08  # its kernels are still running when step 2 starts
    run_step(timer, clock, 2, single(), log, data=0.01, compute=0.01)

    (row,) = log.named("step_breakdown")
    assert row["data_s"] == pytest.approx(0.01)  # not 0.09: the queued kernels are not data wait
    assert row["forward_backward_s"] == pytest.approx(0.01)


@pytest.mark.parametrize(
    ("phases", "expected"),
    [
        ({"data": 0.03, "compute": 0.1}, ["data-bound"]),  # 23% data wait
        ({"data": 0.01, "compute": 0.1}, []),  # 9%
        ({"compute": 0.1, "comm": 0.05}, ["communication-bound"]),  # 50% in all-reduce
        ({"compute": 0.1, "comm": 0.015}, []),  # 15%
        ({"data": 0.05, "compute": 0.1, "comm": 0.08}, ["data-bound", "communication-bound"]),
    ],
    ids=["data-bound", "data-fine", "comm-bound", "comm-fine", "both"],
)
def test_rank_0_names_what_bounds_the_run(monkeypatch, phases: dict[str, float], expected: list[str]) -> None:
    clock = use_clock(monkeypatch)
    timer, log, console = StepTimer(CPU, 1, CommTimer()), Recorder(), Recorder()
    for step in range(1, 4):
        run_step(timer, clock, step, single(), log, console=console, **phases)

    kinds = [finding.split(":")[0] for finding in log.findings()]
    assert kinds == expected * 3  # logged at every reporting step...
    assert [line.split(": ", 1)[1].split(":")[0] for line in console.lines] == expected  # ...printed once


def test_the_console_hears_once_of_a_finding_that_went_away_and_came_back(monkeypatch) -> None:
    clock = use_clock(monkeypatch)
    timer, log, console = StepTimer(CPU, 1, CommTimer()), Recorder(), Recorder()
    for step, data in enumerate([0.05, 0.05, 0.0, 0.05], start=1):
        run_step(timer, clock, step, single(), log, console=console, data=data)

    assert len(log.findings()) == 3  # the log has every window's finding; the console, the news only
    assert len(console.lines) == 1 and "data-bound" in console.lines[0]
    assert "raise data.num_workers" in console.lines[0]


def _straggler_rank(rank: int, world: int, store_path: str, out: str, carried: bool) -> None:
    """One rank of a real gloo group: rank 1 computes three times as long as rank 0 for three windows.
    `carried`: the figures ride on the control all-reduce (every step a control step, as at period 0)."""
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        clock = use_clock()
        timer, log, console = StepTimer(CPU, 1, CommTimer()), Recorder(), Recorder()
        ctx = DistContext(rank, world, rank, CPU, "gloo", world)
        plane = ControlPlane(rank == 0, 0.0, gloo_all_reduce(dist.group.WORLD)) if carried else None
        for step in range(1, 4):
            compute = 0.3 if rank == 1 else 0.1
            run_step(timer, clock, step, ctx, log, compute=compute, console=console, plane=plane)
            log.info("window_done", step=step)
        if plane:
            plane.flush()  # the last window's figures, as the trainer does at the end
        Path(out, f"rank{rank}.json").write_text(json.dumps({"events": log.events, "lines": console.lines}))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("carried", [False, True], ids=["gathered", "carried-on-the-control-all-reduce"])
def test_a_rank_slower_than_the_median_in_two_windows_running_is_named_a_straggler(
    tmp_path: Path, carried: bool
) -> None:
    spawn_ranks(_straggler_rank, (2, str(tmp_path / "store"), str(tmp_path), carried), nprocs=2)

    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    rank1 = json.loads((tmp_path / "rank1.json").read_text())
    steps = [(e["step"], e["finding"]) for e in rank0["events"] if e["event"] == "diagnosis"]
    assert [step for step, _ in steps] == [2, 3]  # one slow window is noise, two running is a straggler
    assert all(finding.startswith("straggler: rank 1 ") for _, finding in steps)
    assert len(rank0["lines"]) == 1 and "straggler: rank 1" in rank0["lines"][0]
    assert not any(e["event"] == "diagnosis" for e in rank1["events"])  # only rank 0 diagnoses
    assert [e["step"] for e in rank1["events"] if e["event"] == "step_breakdown"] == [1, 2, 3]


def test_time_left_out_is_not_in_the_step_rate() -> None:
    # Steps end at 1, 2, 3 s; 10 s of another loop; then a step at 14 s: the rate is one step a second.
    timer = StepTimer(CPU, 0, CommTimer())
    timer.rate_window.extend([1.0, 2.0, 3.0])
    timer.window_started = 0.5
    timer.leave_out(10.0)
    timer.rate_window.append(14.0)
    assert timer.mean_step_s() == 1.0 and timer.samples_per_s(16) == 16.0
    assert timer.window_started == 10.5


def test_the_step_rate_is_that_of_the_last_rate_window_steps(monkeypatch) -> None:
    # Ten steps of 3 s, then twenty of 1 s: the window holds the twenty and none of the slow ones.
    clock = use_clock(monkeypatch)
    timer = StepTimer(CPU, 0, CommTimer())
    for step in range(1, 31):
        timer.start_step(step)
        clock.advance(3.0 if step <= 10 else 1.0)
        timer.finish_step(None, None, None, None)
    assert breakdown_module.RATE_WINDOW == 20
    assert timer.mean_step_s() == 1.0 and timer.samples_per_s(16) == 16.0
    clock.advance(1.0)  # one more step of 1 s pushes out nothing slow: still one a second
    timer.finish_step(None, None, None, None)
    assert timer.mean_step_s() == 1.0
