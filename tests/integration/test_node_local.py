"""Real torchrun agents on this host: a killed worker while durable storage refuses the emergency save. The
survivor's emergency save lands in node memory only; the restarted group restores it from there (every rank
holds it, verified, of the newest attempt), loses no step, and ends with the fault-free run's parameters.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from elastic_qa.chaos.evidence import run_config
from elastic_qa.checkpoint.node_local import NodeLocalCopy
from elastic_qa.observe.follow import read_events
from elastic_qa.step_holds import release
from tests.integration import test_elastic as elastic

pytestmark = pytest.mark.integration
reference = elastic.reference  # the fault-free run at world size 2 (module-scoped fixture)


def wait_for_event(run_dir: Path, predicate, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for event in read_events(run_dir):
            if predicate(event):
                return event
        time.sleep(0.1)
    raise TimeoutError(f"no such event in {run_dir} within {timeout} s")


def test_a_killed_worker_whose_emergency_save_only_reached_node_memory_resumes_from_it(
    tmp_path: Path, cache_dir: Path, reference: dict
) -> None:
    run_dir, storage_down = tmp_path / "run", tmp_path / "storage-down"
    hold, hold_dir = elastic.held_at(run_dir, 25)
    job = elastic.run_job(
        run_dir,
        cache_dir,
        hold,
        f"debug.storage_fault_file={storage_down}",
        "checkpoint.emergency_retry_for=0s",
    )
    try:
        job.wait_for_step(25)
        wait_for_event(run_dir, lambda e: e["event"] == "checkpoint_committed" and e["step"] == 20)
        storage_down.touch()  # the store takes nothing from here until the copy is in node memory
        victim = next(a for a in job.live_agents() if not a["is_host"])
        for pid in job.workers(victim):
            os.kill(pid, signal.SIGKILL)
        release(hold_dir, 25)
        wait_for_event(run_dir, lambda e: e["event"] == "checkpoint_node_local_only")
        storage_down.unlink()
    finally:
        code = elastic.finish(job)
    assert code == 0
    result = elastic.assert_nothing_lost(run_dir, reference, max_lost=0, restarts=1, bitwise=True)
    events = result["events"]
    restored = [e for e in events if e["event"] == "node_local_restore"]
    assert [e["step"] for e in restored] == [25]
    resumes = [e for e in events if e["event"] == "resume"]
    assert {(e["step"], e["node_local"]) for e in resumes} == {(25, True)}
    assert {e["step"] for e in events if e["event"] == "node_local_made_durable"} == {25}  # each rank says so


def test_a_killed_benchmark_job_leaves_no_node_local_copy(tmp_path: Path, cache_dir: Path) -> None:
    # A benchmark's job ends killed (kill_everything), so no worker removes its copy from node memory: the
    # benchmark does, with remove_node_local_copy, and the durable checkpoints stay.
    run_dir = tmp_path / "run"
    job = elastic.run_job(run_dir, cache_dir, "train.max_steps=100000", "debug.step_delay=20ms", agents=1)
    try:
        wait_for_event(run_dir, lambda e: e["event"] == "checkpoint_committed" and e["step"] == 20)
    finally:
        job.kill_everything()
    copy = NodeLocalCopy.for_run(run_config(run_dir))
    assert copy is not None
    directory = Path(copy.directory)
    assert list(directory.glob("step-*/manifest.json")), "the job's copy in node memory, before the removal"
    job.remove_node_local_copy()
    assert not directory.exists() and not Path(copy.lock_path).exists()
    assert list((run_dir / "checkpoints").glob("step-*/manifest.json"))  # durable checkpoints untouched
    job.remove_node_local_copy()  # twice: nothing left to do
