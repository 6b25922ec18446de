"""The replica launcher starts a group whose torchrun agent died again, `replica.max_group_restarts` times in
a row; a group that ran `replica.restarts_reset_after` before it died counts from 0 again. The groups here are
real processes that die on cue (a group's torchrun job is not what is tested)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from elastic_qa.config import resolve_config
from elastic_qa.replica.launch import ReplicaJob

# One start of a group: a line in its file; exit 1 for the first `fails` starts, then 0 (the job done).
GROUP = """
import sys
with open(sys.argv[1], "a") as starts:
    starts.write("started\\n")
with open(sys.argv[1]) as starts:
    sys.exit(1 if len(starts.readlines()) <= int(sys.argv[2]) else 0)
"""


class DyingGroups(ReplicaJob):
    fails = 0

    def group_command(self, group: int) -> list[str]:
        return [sys.executable, "-c", GROUP, str(self.run_dir / f"starts-{group}"), str(self.fails)]


def supervised(tmp_path: Path, fails: int, *overrides: str) -> tuple[int, int, list[dict]]:
    """(the group's last exit code, how often it was started, the launcher's group_exit records)."""
    run_dir = tmp_path / "run"
    (run_dir / "agents").mkdir(parents=True)
    cfg = resolve_config("tiny", [f"run.dir={run_dir}", "replica.groups=1", *overrides])
    job = DyingGroups(cfg, "tiny", [])
    job.fails = fails
    job.groups = {0: job.start_group(0)}
    codes = job.supervise_groups()
    records = [json.loads(line) for line in (run_dir / "agents" / "replicas.jsonl").read_text().splitlines()]
    starts = len((run_dir / "starts-0").read_text().splitlines())
    return codes[0], starts, [r for r in records if r["event"] == "group_exit"]


@pytest.mark.parametrize("reset_after", ["1ms", "1h"])
def test_a_group_that_ran_long_enough_before_it_died_counts_its_restarts_from_0_again(
    tmp_path: Path, reset_after: str
) -> None:
    # Every start here runs longer than 1 ms: each death is the first in a row, and the group is started
    # until it finishes; with 1 h, the same group stays down after 2 restarts.
    overrides = ("replica.max_group_restarts=2", f"replica.restarts_reset_after={reset_after}")
    code, starts, exits = supervised(tmp_path, 5, *overrides)
    if reset_after == "1ms":
        assert (code, starts) == (0, 6) and [e["code"] for e in exits] == [1, 1, 1, 1, 1, 0]
    else:
        assert (code, starts) == (1, 3) and [e["code"] for e in exits] == [1, 1, 1]  # the start, 2 restarts
    assert all(e["ran_s"] > 0 for e in exits)
