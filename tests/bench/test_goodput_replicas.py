"""`elastic-qa bench goodput`'s replica side: which sides run, the per-fault stall rule, and a real run.

No timing assertions: the real run checks that every figure is there and sane, that each fault killed a
worker of a replica group that then healed, and that the ledger check ran, passed, and can fail.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from elastic_qa.bench import goodput
from elastic_qa.bench.cli import main
from elastic_qa.bench.goodput_figures import Step, gap_per_fault
from elastic_qa.bench.goodput_replicas import ReplicaSide
from elastic_qa.exits import EXIT_BAD_INPUT
from tests.bench.test_goodput import sane


def test_the_replica_side_runs_by_default_only_with_kill_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(goodput, "torchft_missing", lambda: None)
    names, skipped = goodput.choose_sides(None, ["kill-worker"])
    assert names == ["product", "bare", "torchft", "replicas"] and skipped == {}
    names, skipped = goodput.choose_sides(None, ["kill-worker", "kill-node"])
    assert "replicas" not in names and "supports only kill-worker" in skipped["replicas"]
    with pytest.raises(goodput.UsageError, match="--sides replicas with --kinds kill-node,term-node"):
        goodput.choose_sides(["bare", "replicas"], ["kill-worker", "term-node", "kill-node"])


def test_without_torchft_the_replica_side_is_skipped_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(goodput, "torchft_missing", lambda: "torchft is not importable (test)")
    names, skipped = goodput.choose_sides(["bare", "replicas"], ["kill-worker"])
    assert names == ["bare"] and skipped == {"replicas": "torchft is not importable (test)"}


def test_a_node_kind_for_the_replica_side_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["goodput", "--mtbf", "4s", "--faults", "1", "--sides", "replicas", "--kinds", "kill-node"]
    assert main([*argv, "--work-dir", str(tmp_path / "work")]) == EXIT_BAD_INPUT
    assert "not followed by this side yet" in capsys.readouterr().err


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
