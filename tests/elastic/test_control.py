"""The control plane: every rank agrees on stop, save and the next control step; phases move only forward;
values carried on its all-reduce (the step line's loss sums) arrive summed, as their own all-reduce gave."""

from __future__ import annotations

import io
import json
import os
import threading
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elastic_qa.dist import DistContext
from elastic_qa.elastic.control import ControlPlane, Phase, failure_reason, gloo_all_reduce
from elastic_qa.loop.step_log import StepLog, StepStats
from elastic_qa.observe.console import Console
from tests.spawned import spawn_ranks


class FakeGroup:
    """An all-reduce (sum) over `size` ranks running in threads: what gloo does, without processes."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size)
        self.parts: dict[int, torch.Tensor] = {}
        self.calls = 0

    def all_reduce_for(self, rank: int):
        def all_reduce(tensor: torch.Tensor):
            group = self

            class Work:
                def wait(self) -> None:
                    group.parts[rank] = tensor.clone()
                    group.barrier.wait()
                    tensor.copy_(sum(group.parts.values()))
                    if group.barrier.wait() == 0:
                        group.parts.clear()
                        group.calls += 1
                    group.barrier.wait()  # nobody starts the next round before the parts are cleared

            return Work()

        return all_reduce


def run_ranks(size: int, body) -> list:
    group, results = FakeGroup(size), [None] * size

    def run(rank: int) -> None:
        plane = ControlPlane(rank == 0, period_s=0.1, all_reduce=group.all_reduce_for(rank))
        results[rank] = body(rank, plane)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return results


def test_a_stop_asked_on_any_rank_reaches_every_rank_at_the_same_step() -> None:
    def body(rank: int, plane: ControlPlane) -> list[tuple[int, bool, bool]]:
        seen = []
        for step in range(1, 13):
            pending = plane.start(step, stop_requested=(rank == 2 and step >= 7), save_due=False, step_s=0.05)
            decision = plane.finish(step, pending)
            seen.append((step, pending is not None, decision.stop))
        return seen

    results = run_ranks(3, body)

    assert results[0] == results[1] == results[2]
    control_steps = [step for step, control, _ in results[0] if control]
    assert control_steps == [1, 3, 5, 7, 9, 11]  # rank 0 proposed 0.1 s / 0.05 s = every 2 steps
    assert [step for step, _, stop in results[0] if stop] == [7, 9, 11]


def test_only_rank_zeros_timer_decides_a_save() -> None:
    def body(rank: int, plane: ControlPlane) -> bool:
        # Clocks differ between ranks: rank 1 thinks a save is due, rank 0 does not, then the reverse.
        first = plane.finish(1, plane.start(1, False, save_due=(rank == 1), step_s=None))
        second = plane.finish(2, plane.start(2, False, save_due=(rank == 0), step_s=None))
        return first.save, second.save

    assert run_ranks(2, body) == [(False, True), (False, True)]


def test_a_single_process_needs_no_collective() -> None:
    plane = ControlPlane(True, period_s=0.1, all_reduce=None)
    decision = plane.finish(1, plane.start(1, stop_requested=True, save_due=True, step_s=0.01))
    assert decision.stop and decision.save
    assert plane.next_control == 1 + 10


def test_phases_move_only_along_the_documented_transitions() -> None:
    plane = ControlPlane(True, period_s=0.1, all_reduce=None)
    plane.enter(Phase.DONE)
    plane.enter(Phase.EMERGENCY)  # the final broadcast can still fail
    with pytest.raises(RuntimeError, match="emergency -> running"):
        plane.enter(Phase.RUNNING)
    stopping = ControlPlane(True, period_s=0.1, all_reduce=None)
    stopping.enter(Phase.STOPPING)
    with pytest.raises(RuntimeError):
        stopping.enter(Phase.DONE)


def test_a_collective_failure_nested_in_two_future_callbacks_reads_as_its_cause_once() -> None:
    """A DDP bucket's failure passes through two `.then` callbacks (the comm hook's and the timing one)."""
    cause = "[pair.cc:537] Read error [127.0.0.1]:5849: Connection reset by peer."
    failed: torch.futures.Future = torch.futures.Future()
    bucket = failed.then(lambda f: f.value()).then(lambda f: f.value())
    failed.set_exception(RuntimeError(f"{cause}\nits second line"))
    with pytest.raises(RuntimeError) as raised:
        bucket.wait()
    assert str(raised.value).count(cause) == 1 and "running the callback" in str(raised.value)
    assert failure_reason(raised.value) == f"RuntimeError: {cause}"
    assert failure_reason(TimeoutError()) == "TimeoutError"
    assert failure_reason(ValueError("x" * 1000)) == f"ValueError: {'x' * 300}"


def test_carried_values_arrive_summed_with_the_next_agreement_and_flush_sums_the_rest() -> None:
    def body(rank: int, plane: ControlPlane) -> list[tuple[int, int, float]]:
        got: list[tuple[int, int, float]] = []  # (carried at, delivered at, sum)
        now = [0]
        for step in range(1, 8):
            now[0] = step
            pending = plane.start(step, False, False, step_s=0.05)  # a control step every 2: 1, 3, 5, 7
            plane.finish(step, pending)
            plane.deliver()
            values = torch.tensor([float(rank + step)])
            plane.carry(values, lambda t, at=step: got.append((at, now[0], t.item())))
        plane.flush()  # step 7's values: no agreement after it
        return got

    results = run_ranks(3, body)

    assert results[0] == results[1] == results[2]
    delivered = [(at, when) for at, when, _ in results[0]]
    assert delivered == [(1, 3), (2, 3), (3, 5), (4, 5), (5, 7), (6, 7), (7, 7)]
    assert [total for _, _, total in results[0]] == [3.0 * at + 3 for at in range(1, 8)]  # ranks 0+1+2


class Recorder:
    """Stands in for the structlog logger: keeps the lines."""

    def __init__(self) -> None:
        self.lines: list[dict[str, Any]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.lines.append({"event": event, **fields})


def loss_sum(rank: int, step: int) -> tuple[torch.Tensor, int]:
    """A rank's loss sum over its windows at a step, and how many: rank 2's share is empty at step 4."""
    samples = 0 if (rank, step) == (2, 4) else 3 + rank
    values = torch.rand(samples, generator=torch.Generator().manual_seed(100 * step + rank)) * 7
    return values.sum(), samples


def _logging_rank(rank: int, world: int, store: str, out: str) -> None:
    """One rank of a real gloo group: a step line every 2 steps, its sums carried on the control all-reduce
    (a control step every 3 steps), beside the sums the old blocking all-reduce gave at the logging step."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        plane = ControlPlane(rank == 0, 0.3, gloo_all_reduce(dist.group.WORLD))
        ctx = DistContext(rank, world, rank, torch.device("cpu"), "gloo", world)
        step_log = StepLog(ctx, Console("none", 10, enabled=False, stream=io.StringIO()), None)
        step_log.log = Recorder()
        before: dict[int, float] = {}
        for step in range(1, 11):
            pending = plane.start(step, False, False, step_s=0.1)
            plane.finish(step, pending)
            plane.deliver()
            if step % 2:
                continue
            total, samples = loss_sum(rank, step)
            state = SimpleNamespace(
                step=step,
                scheduler=SimpleNamespace(get_last_lr=lambda step=step: [1e-3 / step]),
                cursor=SimpleNamespace(samples_consumed=100 * step),
            )
            step_log.step(
                state, 0, StepStats(total, samples, torch.tensor(0.5 * step)), 9.0, None, plane.carry
            )
            # The same sums from a blocking all-reduce of their own, now (as StepLog did before it carried
            # them; in float64, as the carried sums are).
            old = torch.tensor([float(total), float(samples)], dtype=torch.float64)
            dist.all_reduce(old)
            before[step] = round(old[0].item() / max(old[1].item(), 1.0), 6)
        plane.flush()
        Path(out, f"rank{rank}.json").write_text(json.dumps({"lines": step_log.log.lines, "before": before}))
    finally:
        dist.destroy_process_group()


def test_step_lines_from_carried_sums_equal_those_of_a_blocking_all_reduce_on_three_gloo_ranks(
    tmp_path: Path,
) -> None:
    spawn_ranks(_logging_rank, (3, str(tmp_path / "store"), str(tmp_path)), nprocs=3)

    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(3)]
    for rank, got in enumerate(ranks):
        lines = got["lines"]
        assert [line["step"] for line in lines] == [2, 4, 6, 8, 10]
        assert {str(line["step"]): line["loss"] for line in lines} == got["before"]
        # The line carries its own step's figures, not those of the step it was written at.
        assert [line["grad_norm"] for line in lines] == [0.5 * step for step in (2, 4, 6, 8, 10)]
        assert [line["lr"] for line in lines] == [1e-3 / step for step in (2, 4, 6, 8, 10)]
        assert [line["cursor"] for line in lines] == [100 * step for step in (2, 4, 6, 8, 10)]
        for line in lines:
            total, samples = loss_sum(rank, line["step"])
            assert line["rank_loss"] == round(float(total) / max(samples, 1), 6)
    assert ranks[0]["before"] == ranks[1]["before"] == ranks[2]["before"]


def _dying_rank(rank: int, store: str, out: str) -> None:
    """Rank 1 carries a step line's sums, then dies before the agreement that would sum them."""
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    plane = ControlPlane(rank == 0, 0.0, gloo_all_reduce(dist.group.WORLD))
    plane.finish(1, plane.start(1, False, False, None))
    plane.carry(torch.tensor([1.0, 2.0]), lambda sums: None)
    dist.barrier()  # both carried: rank 1 goes now
    if rank == 1:
        os._exit(0)
    try:
        plane.finish(2, plane.start(2, False, False, None))
    except (RuntimeError, dist.DistBackendError) as err:  # what the trainer's emergency path catches
        Path(out, "failure.txt").write_text(failure_reason(err))
    else:
        Path(out, "failure.txt").write_text("")


def test_a_peer_dying_before_the_carried_sums_arrive_fails_the_agreement_as_the_trainer_expects(
    tmp_path: Path,
) -> None:
    spawn_ranks(_dying_rank, (str(tmp_path / "store"), str(tmp_path)), nprocs=2)

    assert (tmp_path / "failure.txt").read_text() != ""
