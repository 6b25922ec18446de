"""`elastic-qa bench goodput`'s replica side: which sides run, the per-fault stall rule, and a real run.

No timing assertions: the real runs check that every figure is there and sane, that each fault hit a replica
group (a worker, or the group's torchrun agent) that then healed, and that the ledger check ran, passed, and
can fail.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from elastic_qa.bench import goodput
from elastic_qa.bench.cli import main
from elastic_qa.bench.goodput_figures import Step, gap_per_fault
from elastic_qa.bench.goodput_replicas import KINDS, ReplicaSide
from elastic_qa.observe.follow import read_events
from tests.bench.test_goodput import sane


def test_the_replica_side_runs_by_default_and_takes_every_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(goodput, "torchft_missing", lambda: None)
    names, skipped = goodput.choose_sides(None)
    assert names == ["product", "bare", "torchft", "replicas"] and skipped == {}
    assert set(goodput.KINDS) <= KINDS  # node faults included: nothing to refuse


def test_without_torchft_the_replica_side_is_skipped_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(goodput, "torchft_missing", lambda: "torchft is not importable (test)")
    names, skipped = goodput.choose_sides(["bare", "replicas"])
    assert names == ["bare"] and skipped == {"replicas": "torchft is not importable (test)"}


def test_a_groups_workers_are_those_of_its_newest_agent(tmp_path: Path) -> None:
    """A group whose agent the launcher replaced: its new agent's workers count their restarts from 0 again,
    yet they, not the old agent's restarted workers, are the group's."""
    side = ReplicaSide(tmp_path / "run", "tiny", [], seed=0, faults=30)
    assert side.cfg.replica.max_group_restarts == 30  # a group restart per fault

    def started(ts: float, group: int, pid: int) -> dict[str, Any]:
        return {"event": "group_started", "ts": ts, "group": group, "pid": pid}

    def worker(ts: float, group: int, pid: int, restart: int) -> dict[str, Any]:
        return {
            "event": "worker_start",
            "ts": ts,
            "replica_group": group,
            "pid": pid,
            "restart_count": restart,
        }

    side.events += [started(1, 0, 100), started(1, 1, 200), worker(2, 0, 101, 0), worker(2, 1, 201, 0)]
    side.events += [worker(3, 0, 102, 1)]  # group 0's worker killed: its torchrun restarted it
    assert side.current_workers() == {0: [102], 1: [201]}
    side.events += [started(4, 0, 110)]  # group 0's agent killed: the launcher started a new one
    assert side.agents()[0]["pid"] == 110 and side.current_workers() == {1: [201]}
    assert not side.whole()  # the new agent has no worker yet
    side.events += [worker(5, 0, 111, 0)]
    assert side.current_workers() == {0: [111], 1: [201]}


def test_the_next_faults_stall_is_not_charged_to_the_previous_fault() -> None:
    # Steps every 0.1 s, stalls of 1.4 s at a fault at 1.45 and of 1.5 s at a fault at 4.4: each fault
    # has its own stall (the second one's interval starts before it, inside the first fault's window).
    times = (
        [0.1 * i for i in range(15)] + [2.8 + 0.1 * i for i in range(16)] + [5.8 + 0.1 * i for i in range(5)]
    )
    steps = [Step(ts, number, "p") for number, ts in enumerate(times, start=1)]
    gaps = gap_per_fault(steps, [1.45, 4.4])
    assert gaps == [pytest.approx(1.4), pytest.approx(1.5)]


def read_rows(path: Path) -> list[dict[str, Any]]:
    """A ledger file's whole lines (a killed worker may leave its last line torn)."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


@pytest.mark.integration
@pytest.mark.bench
def test_a_short_goodput_run_of_bare_and_replicas(tmp_path: Path, cache_dir: Path) -> None:
    pytest.importorskip("torchft")
    out = tmp_path / "goodput.json"
    argv = [
        "goodput", "--mtbf", "3s", "--faults", "2", "--kinds", "kill-worker", "--sides", "bare,replicas",
        "--parallel", "--seed", "3", "--out", str(out), "--work-dir", str(tmp_path / "work"),
        f"data.cache_dir={cache_dir}",
    ]  # fmt: skip
    assert main(argv) == 0
    result: dict[str, Any] = json.loads(out.read_text())
    replicas = result["sides"]["replicas"]
    sane(replicas, 2)
    sane(result["sides"]["bare"], 2)
    assert set(result["ratios"]) == {"replicas/bare"}
    ledger = replicas["ledger"]
    assert ledger["ok"] and ledger["problems"] == [], ledger
    assert ledger["steps_checked"] >= replicas["committed_steps"]  # every committed step line was checked
    # Each fault SIGKILLed a worker of a replica group, another process each time, and each killed group
    # was restarted by its torchrun and healed from its peer.
    victims = [record["target"] for record in replicas["faults"]]
    assert all(target.startswith("replica group ") for target in victims) and len(set(victims)) == 2
    assert replicas["worker_restarts"] >= 2 and replicas["heals"] >= 2
    assert all(lost >= 0 for lost in replicas["lost_steps"]["per_fault"])
    assert replicas["params"]["equal"] in (None, True)
    # The check can fail: step 1's shares trained their first window again in place of the others (a newer
    # line for each share of step 1, in every worker's file).
    run_dir = tmp_path / "work" / "replicas"
    side = ReplicaSide(run_dir, "tiny", [f"data.cache_dir={cache_dir}"], seed=0)
    for path in sorted((run_dir / "ledger").glob("replica-group-*.jsonl")):
        rows, torn = read_rows(path), not path.read_text().endswith("\n")
        with open(path, "a") as log:
            log.write("\n" if torn else "")  # a new line, not the end of a killed worker's torn one
            for row in rows:
                if row.get("kind") == "share" and row["step"] == 1 and row["samples"]:
                    row["samples"] = [row["samples"][0]] * len(row["samples"])
                    log.write(json.dumps(row) + "\n")
    verdict = side.report([], [])["ledger"]
    assert not verdict["ok"] and any("step 1:" in problem for problem in verdict["problems"]), verdict


@pytest.mark.integration
@pytest.mark.bench
def test_a_short_goodput_run_of_node_faults_on_the_replica_side(tmp_path: Path, cache_dir: Path) -> None:
    """kill-node then term-node (seed 1): each ends one group's torchrun agent, the launcher starts the group
    again, and the new group heals from its peer; the bench follows the new agent's workers."""
    pytest.importorskip("torchft")
    out = tmp_path / "goodput.json"
    argv = [
        "goodput", "--mtbf", "3s", "--faults", "2", "--kinds", "kill-node,term-node", "--sides", "replicas",
        "--seed", "1", "--pin", "--out", str(out), "--work-dir", str(tmp_path / "work"),
        f"data.cache_dir={cache_dir}",
    ]  # fmt: skip
    assert main(argv) == 0  # 0: every fault landed and the job was whole again after the last one
    result = json.loads(out.read_text())
    replicas = result["sides"]["replicas"]
    # --pin: the two groups' agents on two cores, each new agent on the core its lost one held.
    pinned = [(row["pid"], row["core"]) for row in result["pinned"] if row["side"] == "replicas"]
    cores = sorted(os.sched_getaffinity(0))
    assert len({pid for pid, _ in pinned}) >= 4 and {core for _, core in pinned} <= set(cores[:2])
    assert len(cores) < 2 or {core for _, core in pinned[:2]} == set(cores[:2])
    sane(replicas, 2)
    ledger = replicas["ledger"]
    assert ledger["ok"] and ledger["problems"] == [], ledger
    faults = replicas["faults"]
    signals = [(record["fault"], record.get("signal")) for record in faults]
    assert signals == [("kill-node", "SIGKILL"), ("term-node", "SIGTERM")], faults
    assert all(" agent (pid " in record["target"] for record in faults), faults
    assert replicas["group_restarts"] >= 2
    # The launcher saw each signalled agent exit and started its group again, which healed from its peer
    # before the next fault.
    run_dir = tmp_path / "work" / "replicas"
    records = read_rows(run_dir / "agents" / "replicas.jsonl")
    assert sum(row["event"] == "group_started" for row in records) >= 4
    assert sum(row["event"] == "group_exit" for row in records) >= 2
    heals = [row for row in read_events(run_dir) if row["event"] == "heal"]
    ends = [record["ts"] for record in faults[1:]] + [float("inf")]
    for record, end in zip(faults, ends, strict=True):
        group = int(record["target"].split()[2])  # "replica group N agent (pid P)..."
        assert any(row.get("replica_group") == group and record["ts"] < row["ts"] < end for row in heals), (
            record
        )
