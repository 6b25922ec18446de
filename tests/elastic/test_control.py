"""The control plane: every rank agrees on stop, save and the next control step; phases move only forward."""

from __future__ import annotations

import threading

import pytest
import torch

from elastic_qa.elastic.control import ControlPlane, Phase, failure_reason


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
