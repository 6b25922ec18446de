"""`elastic-qa bench goodput`: the fault-time draw, the figures from a known step log, and real runs.

No timing assertions: the real runs check that every figure is there and sane, that the ledger check ran
and passed, and that no fault ever targeted the store host's agent.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from elastic_qa.bench.cli import main
from elastic_qa.bench.goodput import KINDS, NODE_KINDS, LauncherSide, draw_plan
from elastic_qa.bench.goodput_figures import Step, lost_per_fault, side_figures
from elastic_qa.bench.pinning import Pinner
from elastic_qa.bench.torchft_side import TorchftSide
from elastic_qa.chaos.faults import NoTarget
from elastic_qa.launcher.processes import python_env
from tests.bench.test_interrupted import processes_of, wait_until


# ---- the draw -----------------------------------------------------------------------------------------
def test_the_same_seed_draws_the_same_fault_times_and_kinds() -> None:
    assert draw_plan(7, 30.0, 20, list(KINDS)) == draw_plan(7, 30.0, 20, list(KINDS))
    assert draw_plan(7, 30.0, 20, list(KINDS)) != draw_plan(8, 30.0, 20, list(KINDS))


def test_fault_gaps_average_the_mtbf_and_only_the_kinds_asked_for() -> None:
    plan = draw_plan(3, 30.0, 4000, ["kill-worker", "term-node"])
    times = [0.0] + [at for at, _ in plan.faults]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert all(gap > 0 for gap in gaps)  # strictly increasing times
    assert statistics.fmean(gaps) == pytest.approx(30.0, rel=0.05)
    assert {kind for _, kind in plan.faults} == {"kill-worker", "term-node"}
    assert plan.end_s > plan.faults[-1][0]


# ---- the figures from a known log ---------------------------------------------------------------------
def lineage(group: str, first_step: int, last_step: int, first_ts: float, weight: float = 1.0) -> list[Step]:
    """Steps first_step..last_step of one group, one second apart from first_ts."""
    return [
        Step(first_ts + i, step, group, weight) for i, step in enumerate(range(first_step, last_step + 1))
    ]


def test_a_kill_that_loses_one_step_and_stalls_six_seconds() -> None:
    # attempt 1 trains steps 1..10 (ts 0..9); a fault at 9.5; attempt 2 resumes from step 9 and trains
    # 10..20 (ts 15..25); a second fault at 20.5 stops nothing.
    steps = lineage("a1", 1, 10, 0.0) + lineage("a2", 10, 20, 15.0)
    figures = side_figures(steps, [9.5, 20.5])
    assert figures["lost_steps"]["per_fault"] == [1, 0]
    assert figures["no_step_s"]["per_fault"] == [6.0, 1.0]
    assert figures["committed_steps"] == 19  # steps 2..20 of the final lineage: step 10 counts once
    assert figures["clean_step_s"] == 1.0
    assert figures["wall_s"] == 25.0
    assert figures["effective"] == pytest.approx(19 / 25)
    assert figures["lost_steps"]["mean"] == 0.5 and figures["lost_steps"]["max"] == 1
    assert figures["no_step_s"]["max"] == 6.0


def test_a_fault_inside_the_previous_stall_shares_it_and_takes_its_restart() -> None:
    steps = lineage("a1", 1, 10, 0.0) + lineage("a2", 10, 20, 15.0)
    figures = side_figures(steps, [9.5, 12.0])
    assert figures["no_step_s"]["per_fault"] == [6.0, 6.0]
    assert figures["lost_steps"]["per_fault"] == [0, 1]  # the restart came after the second fault


def test_lost_steps_are_counted_once_against_the_group_just_before() -> None:
    # a1 reaches 100, a2 resumes from 90 and reaches 95, a3 resumes from 90 again: a2 lost 10 (91..100),
    # a3 lost 5 (91..95), not 10 again for a1's steps that a2 already paid for.
    steps = lineage("a1", 1, 100, 0.0) + lineage("a2", 91, 95, 110.0) + lineage("a3", 91, 120, 130.0)
    assert lost_per_fault(steps, [100.5, 115.0]) == [10, 5]


def test_a_reach_beyond_the_step_lines_counts() -> None:
    # a1's lines stop at step 10, but its ledger says every rank began step 13 before the kill.
    steps = lineage("a1", 1, 10, 0.0) + lineage("a2", 10, 20, 15.0)
    assert lost_per_fault(steps, [9.5], {"a1": 13}) == [4]
    assert lost_per_fault(steps, [9.5], {"a2": 99}) == [1]  # only the group before a restart counts


def test_half_batch_steps_count_half_and_set_no_clean_pace() -> None:
    # torchft: one replica alone trains half the global batch per step (weight 0.5), faster.
    steps = lineage("r0", 1, 10, 0.0) + [Step(9.0 + 0.5 * i, 10 + i, "r0", 0.5) for i in range(1, 5)]
    figures = side_figures(steps, [9.2], lost=[0])
    assert figures["committed_steps"] == 9 + 4 * 0.5
    assert figures["clean_step_s"] == 1.0
    assert figures["lost_steps"]["per_fault"] == [0]


def test_too_few_steps_is_an_error() -> None:
    with pytest.raises(ValueError, match="too few"):
        side_figures([Step(0.0, 1, "a")], [])


# ---- real runs ----------------------------------------------------------------------------------------
def run_bench(tmp_path: Path, *argv: str) -> dict[str, Any]:
    out = tmp_path / "goodput.json"
    code = main(["goodput", *argv, "--out", str(out), "--work-dir", str(tmp_path / "work")])
    assert code == 0
    return json.loads(out.read_text())


def sane(figures: dict[str, Any], faults: int, paced: bool = True) -> None:
    """`paced`: the run had clean full-batch steps (a torchft replica restarted on a loaded host may
    spend the whole short run starting, leaving only half-batch steps: no clean pace, no effective time)."""
    assert figures["faults_injected"] == faults
    assert figures["wall_s"] > 0 and figures["committed_steps"] > 0
    if paced or figures["clean_step_s"] is not None:
        assert figures["clean_step_s"] > 0
        assert 0 < figures["effective"] <= 1.0
    assert len(figures["lost_steps"]["per_fault"]) == faults
    assert len(figures["no_step_s"]["per_fault"]) == faults
    assert all(gap is None or gap > 0 for gap in figures["no_step_s"]["per_fault"])


@pytest.mark.integration
@pytest.mark.bench
def test_a_short_goodput_run_of_product_and_bare(tmp_path: Path, cache_dir: Path) -> None:
    result = run_bench(
        tmp_path, "--mtbf", "4s", "--faults", "3", "--sides", "product,bare", "--seed", "5",
        f"data.cache_dir={cache_dir}",
    )  # fmt: skip
    product, bare = result["sides"]["product"], result["sides"]["bare"]
    sane(product, 3)
    sane(bare, 3)
    assert product["ledger"]["ok"], product["ledger"]["problems"]  # the exactly-once check ran and passed
    assert product["ledger"]["steps_checked"] >= product["committed_steps"]
    assert bare["lost_steps"]["max"] == 0  # the bare worker has nothing to lose
    assert set(result["ratios"]) == {"product/bare"}
    # The check is the chaos ledger check, and it can fail: a sample trained twice in one step.
    run_dir = tmp_path / "work" / "product"
    side = LauncherSide("product", run_dir, "tiny", [f"data.cache_dir={cache_dir}"], seed=0)
    steps = [Step(0.0, 1, "a"), Step(1.0, product["ledger"]["steps_checked"], "a")]
    files = sorted((run_dir / "ledger").glob("attempt-*.rank-000.jsonl"))
    ledger = [path for path in files if path.read_text().strip()][-1]  # the final lineage's attempt
    line = json.loads(ledger.read_text().splitlines()[0])
    line["samples"] = [line["samples"][0]] * len(line["samples"])
    with open(ledger, "a") as out:  # a newer line for the same attempt and step
        out.write(json.dumps(line) + "\n")
    assert not side.report(steps, [])["ledger"]["ok"]
    # No fault ever hit the store host's agent; every node fault was followed by a replacement.
    for side in ("product", "bare"):
        launch = json.loads((tmp_path / "work" / side / "launch.json").read_text())
        hosts = [agent["pid"] for agent in launch["agents"] if agent["is_host"]]
        records = result["sides"][side]["faults"]
        assert all(f"(pid {pid})" not in record["target"] for record in records for pid in hosts)
        node_faults = sum(record["fault"] in NODE_KINDS for record in records)
        log = (tmp_path / "work" / side / "chaos" / "faults.jsonl").read_text().splitlines()
        joined = [json.loads(line) for line in log if "replacement_joined" in line]
        assert len(joined) <= node_faults  # one at most per node fault (the last may not have joined yet)


def test_the_torchft_side_is_skipped_with_its_reason_when_torchft_is_absent(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "torchft", None)  # `import torchft` now raises ImportError
    result = run_bench(
        tmp_path, "--mtbf", "4s", "--faults", "1", "--sides", "torchft", f"data.cache_dir={cache_dir}"
    )
    assert "torchft" in result["skipped"] and "torchft" not in result["sides"]
    assert "torchft side skipped: torchft is not importable" in capsys.readouterr().out


def test_a_replica_the_bench_signalled_is_no_target_while_it_still_runs(tmp_path: Path) -> None:
    """A fault that waited for the job to be whole fires right after the one it waited for: the replica just
    signalled must not be its target again (its fault would be lost), even while it has not exited yet."""
    side = TorchftSide(tmp_path, "tiny", [], seed=0)
    logs = tmp_path / "logs"
    logs.mkdir()
    deaf = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
        "time.sleep(120)"
    )
    children: list[subprocess.Popen] = []
    try:
        for replica in range(2):
            child = subprocess.Popen([sys.executable, "-c", deaf], stdout=subprocess.PIPE, text=True)
            children.append(child)
            assert child.stdout is not None and child.stdout.readline() == "ready\n"  # SIGTERM ignored now
            side.processes[replica] = child
            step = {
                "event": "step", "ts": time.time(), "step": 1, "committed": True, "participants": 2,
                "trained": True, "replica": replica, "pid": child.pid, "epoch": 0, "position": 0,
                "samples": [0],
            }  # fmt: skip
            (logs / f"torchft.replica-{replica}.pid-{child.pid}.jsonl").write_text(json.dumps(step) + "\n")
        first = side.inject("term-node")
        assert first["signal"] == "SIGTERM" and all(child.poll() is None for child in children)
        with pytest.raises(NoTarget, match="restarting or healing"):
            side.inject("kill-worker")  # the other replica is whole, the signalled one still runs
        assert all(child.poll() is None for child in children)  # nothing was SIGKILLed
    finally:
        for child in children:
            child.kill()
            child.wait()


# A minute alone, several on a loaded 2-core host (a restarted replica imports torch and torchft): long.
@pytest.mark.integration
@pytest.mark.bench
@pytest.mark.long
def test_a_tiny_torchft_run_with_one_fault(tmp_path: Path, cache_dir: Path) -> None:
    pytest.importorskip("torchft")
    result = run_bench(
        tmp_path, "--mtbf", "3s", "--faults", "1", "--sides", "torchft", "--kinds", "kill-worker",
        f"data.cache_dir={cache_dir}",
    )  # fmt: skip
    figures = result["sides"]["torchft"]
    sane(figures, 1, paced=False)
    assert figures["restarts"] >= 1  # the killed replica was started again
    samples = figures["samples"]
    assert samples["trained"] > 0 and samples["repeated"] >= 0 and samples["skipped"] >= 0
    assert figures["torchft_settings"]["heartbeat_timeout_s"] > 0


@pytest.mark.integration
@pytest.mark.bench
def test_a_parallel_run_stopped_by_sigterm_and_a_second_signal_leaves_no_process_of_any_side(
    tmp_path: Path, cache_dir: Path
) -> None:
    work = tmp_path / "work"
    sides = "product,bare,torchft" if importlib.util.find_spec("torchft") else "product,bare"
    bench = subprocess.Popen(
        [
            sys.executable, "-m", "elastic_qa.cli", "bench", "goodput", "--parallel", "--mtbf", "1000s",
            "--faults", "1", "--sides", sides, "--work-dir", str(work), f"data.cache_dir={cache_dir}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=python_env(),
    )  # fmt: skip
    try:
        # Each side has trained: the launcher's sides log steps, torchft's replicas too.
        def trained(side: str) -> bool:
            return any("step" in path.read_text() for path in (work / side / "logs").glob("*.jsonl"))

        wait_until(
            lambda: bench.poll() is not None or all(trained(side) for side in sides.split(",")),
            timeout=240,
            what="every side trained a step",
        )
        assert bench.poll() is None, bench.communicate()[0].decode()[-2000:]
        bench.send_signal(signal.SIGTERM)
        # As `timeout` and a Ctrl-C, or a supervisor that signals twice: the second signal must not break off
        # the stopping of the sides (it did: a SIGSTOPped agent and its launcher ran on).
        bench.send_signal(signal.SIGINT)
        output = bench.communicate(timeout=120)[0].decode()
        # Python runs pending handlers in signal-number order: either may be the one that stopped it.
        assert bench.returncode in (128 + signal.SIGTERM, 128 + signal.SIGINT), output[-2000:]
        wait_until(lambda: not processes_of(work), timeout=90, what="processes of the sides remain")
    finally:
        if bench.poll() is None:
            bench.kill()
        for pid in processes_of(work):
            os.kill(pid, signal.SIGKILL)


def test_pin_gives_each_sides_nodes_a_core_of_their_own_and_a_replacement_the_freed_one() -> None:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("pinning needs 2 cores")
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    nodes = {"a": [subprocess.Popen(sleeper) for _ in range(2)], "b": [subprocess.Popen(sleeper)]}
    try:
        pinner = Pinner({name: lambda name=name: [p.pid for p in nodes[name]] for name in nodes})
        pinner.pin_once()
        assert [os.sched_getaffinity(p.pid) for p in nodes["a"]] == [{cores[0]}, {cores[1]}]
        assert os.sched_getaffinity(nodes["b"][0].pid) == {cores[0]}  # each side counts its own nodes
        gone = nodes["a"].pop(0)  # node 0 of side a is replaced: its successor takes the freed core
        gone.kill()
        gone.wait()
        nodes["a"].append(subprocess.Popen(sleeper))
        pinner.pin_once()
        assert os.sched_getaffinity(nodes["a"][1].pid) == {cores[0]}
        assert [(row["side"], row["core"]) for row in pinner.assignments] == [
            ("a", cores[0]),
            ("a", cores[1]),
            ("b", cores[0]),
            ("a", cores[0]),
        ]
    finally:
        for process in [*nodes["a"], *nodes["b"]]:
            process.kill()
            process.wait()
