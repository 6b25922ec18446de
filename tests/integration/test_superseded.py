"""A worker group that a newer group of its job has superseded stops within checkpoint.fence_check_every,
commits nothing, and its agent starts a newer group, instead of training on, unsaved, until its next save.

How it happens: torchrun's c10d rendezvous took a late agent (heartbeats delayed on a loaded host) for dead
and formed a round without it, while the late agent's group trained on (seen in the goodput benchmark at
load 14-16: two world-size-1 groups of one job for 17 minutes). Here the newer group is what the stale one
can see of it, its registration: a claim of the next attempt number in the store, as that group's rank 0
writes it. A real torchrun agent runs the stale group.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from elastic_qa.checkpoint.confined import ATTEMPTS_DIR
from elastic_qa.observe.follow import read_events
from elastic_qa.step_holds import release
from tests.integration import test_elastic as elastic
from tests.integration.test_node_local import wait_for_event

pytestmark = pytest.mark.integration


def test_a_superseded_group_stops_commits_nothing_more_and_its_agent_starts_a_newer_one(
    tmp_path: Path, cache_dir: Path
) -> None:
    run_dir = tmp_path / "run"
    hold, hold_dir = elastic.held_at(run_dir, 30)
    job = elastic.run_job(run_dir, cache_dir, hold, "checkpoint.fence_check_every=0.2s", agents=1)
    try:
        job.wait_for_step(30)  # held after step 30; step 20's checkpoint is committed
        wait_for_event(run_dir, lambda e: e["event"] == "checkpoint_committed" and e["step"] == 20)
        attempts = run_dir / "checkpoints" / ATTEMPTS_DIR
        numbers = [int(m.group(1)) for p in attempts.iterdir() if (m := re.match(r"attempt-(\d+)", p.name))]
        stale = max(numbers)
        token = "00112233aabbccdd"
        claim = {"attempt": stale + 1, "world_size": 1, "time": time.time(), "token": token}
        (attempts / f"attempt-{stale + 1:08d}.{token}.json").write_text(json.dumps(claim))
        superseded = wait_for_event(run_dir, lambda e: e["event"] == "attempt_superseded")
        assert (superseded["attempt"], superseded["newest"]) == (stale, stale + 1)
        assert job.wait_for_new_attempt(after=stale + 1), "no newer group started"
        release(hold_dir, 30)
    finally:
        code = elastic.finish(job)
    assert code == 0
    events = read_events(run_dir)
    assert [e["attempt"] for e in events if e["event"] == "worker_start"] == [stale, stale + 2]
    # The stale group left its hold (a stop ends a hold), stopped at its next agreement, and its stop's save
    # was refused.
    stopping = [(e["step"], e["attempt"]) for e in events if e["event"] == "stopping"]
    assert len(stopping) == 1 and stopping[0][1] == stale and 30 <= stopping[0][0] < elastic.MAX_STEPS
    assert [e["step"] for e in events if e["event"] == "not_saved_stale"] == [stopping[0][0]]
    committed = [(e["step"], e["attempt"]) for e in events if e["event"] == "checkpoint_committed"]
    assert (20, stale) in committed and all(step <= 20 for step, attempt in committed if attempt == stale)
    # The newer group resumed from the stale group's last commit, not from its node-local copy of step 30.
    resumes = [e for e in events if e["event"] == "resume"]
    assert resumes and resumes[-1]["step"] == 20
    done = [e for e in events if e["event"] == "train_done"]
    assert done and done[-1]["step"] == elastic.MAX_STEPS
