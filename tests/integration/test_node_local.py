"""Real torchrun agents on this host: a killed worker while durable storage refuses the emergency save. The
survivor's emergency save lands in node memory only; the restarted group restores it from there (every rank
holds it, verified, of the newest attempt), loses no step, and ends with the fault-free run's parameters.
The same job first loses a worker with storage working and resumes from the durable emergency checkpoint.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from elastic_qa.observe.follow import read_events
from elastic_qa.step_holds import release
from tests.integration import test_elastic as elastic

pytestmark = pytest.mark.integration


def wait_for_event(run_dir: Path, predicate, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for event in read_events(run_dir):
            if predicate(event):
                return event
        time.sleep(0.1)
    raise TimeoutError(f"no such event in {run_dir} within {timeout} s")


def test_killed_workers_resume_from_the_emergency_checkpoint_then_from_one_only_in_node_memory(
    tmp_path: Path, cache_dir: Path, reference: dict
) -> None:
    # One job, two kills of rank 1's worker (these were two tests, each a job of its own): the first (by
    # debug.kill_at_step, storage working) resumes from the durable emergency checkpoint; the second, while
    # durable storage refuses the emergency save, resumes from the copy in node memory.
    run_dir, storage_down = tmp_path / "run", tmp_path / "storage-down"
    hold, hold_dir = elastic.held_at(run_dir, 45)
    job = elastic.run_job(
        run_dir,
        cache_dir,
        hold,
        "debug.kill_at_step=25",
        "debug.kill_rank=1",
        f"debug.storage_fault_file={storage_down}",
        "checkpoint.emergency_retry_for=0s",
    )
    try:
        job.wait_for_step(45)
        wait_for_event(run_dir, lambda e: e["event"] == "checkpoint_committed" and e["step"] == 40)
        storage_down.touch()  # the store takes nothing from here until the copy is in node memory
        victim = next(a for a in job.live_agents() if not a["is_host"])
        for pid in job.workers(victim):
            os.kill(pid, signal.SIGKILL)
        release(hold_dir, 45)
        wait_for_event(run_dir, lambda e: e["event"] == "checkpoint_node_local_only")
        storage_down.unlink()
    finally:
        code = elastic.finish(job)
    assert code == 0
    result = elastic.assert_nothing_lost(run_dir, reference, max_lost=1, restarts=2, bitwise=True)
    assert result["restarts"][1]["lost"] == 0, result["restarts"]  # the node-memory save lost nothing
    events = result["events"]
    assert elastic.world_sizes(events) == [2, 2, 2]
    emergency = [e for e in events if e["event"] == "emergency_checkpoint"]
    assert emergency and emergency[0]["step"] == 25
    # Every worker, the restarted groups' too, was a fork of its agent's forkserver (warm workers).
    startups = [e for e in events if e["event"] == "startup"]
    assert {e["restart_count"] for e in startups} == {0, 1, 2} and all(e["warm"] for e in startups)
    # Both restores come from node memory (at least as new as the store's newest, and of the newest
    # attempt); only step 45 was not in the store, so only it is made durable.
    restored = [e for e in events if e["event"] == "node_local_restore"]
    assert [e["step"] for e in restored] == [25, 45]
    resumes = [e for e in events if e["event"] == "resume"]
    assert {(e["step"], e["node_local"]) for e in resumes} == {(25, True), (45, True)}
    assert {e["step"] for e in events if e["event"] == "node_local_made_durable"} == {45}  # each rank says so
