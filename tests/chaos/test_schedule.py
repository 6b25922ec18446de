"""Fault schedules: parsing, seeded randomness, and the job's node bounds."""

from __future__ import annotations

import subprocess
import sys

import pytest

from chaos.schedule import KINDS, Fault, parse_fault, random_schedule, validate

NODE_DELTA = {"kill-node": -1, "term-node": -1, "join-node": 1}


def test_explicit_faults_parse_steps_times_and_durations() -> None:
    assert parse_fault("kill-worker@step=40") == Fault("kill-worker", at_step=40)
    assert parse_fault("join-node@time=20s") == Fault("join-node", at_time=20.0)
    assert parse_fault("freeze-worker@step=5,for=2s") == Fault("freeze-worker", at_step=5, duration=2.0)
    assert parse_fault("freeze-worker@step=5,for=never").duration is None
    assert parse_fault("storage-errors@time=1m").duration == 5.0


@pytest.mark.parametrize(
    "text",
    [
        "explode@step=3",
        "kill-worker",
        "kill-worker@step=x",
        "kill-worker@step=1,time=2s",
        "kill-worker@when=3",
    ],
)
def test_malformed_faults_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="--fault"):
        parse_fault(text)


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another() -> None:
    first = random_schedule(7, 30, 10.0, agents=2, min_nodes=1, max_nodes=4)
    assert first == random_schedule(7, 30, 10.0, agents=2, min_nodes=1, max_nodes=4)
    assert first != random_schedule(8, 30, 10.0, agents=2, min_nodes=1, max_nodes=4)
    assert {f.kind for f in first} == set(KINDS)


@pytest.mark.parametrize("seed", range(20))
def test_random_schedules_honour_the_node_bounds(seed: int) -> None:
    faults = random_schedule(seed, 40, 5.0, agents=2, min_nodes=1, max_nodes=3)
    nodes = 2
    for fault in faults:
        if fault.kind in ("kill-node", "term-node"):
            assert nodes >= 2  # never the store host, so a second agent must exist
        nodes += NODE_DELTA.get(fault.kind, 0)
        assert 1 <= nodes <= 3
    validate(faults, agents=2, min_nodes=1, max_nodes=3)
    assert [f.at_time for f in faults] == sorted(f.at_time for f in faults)


def test_an_explicit_schedule_that_breaks_the_bounds_is_refused() -> None:
    with pytest.raises(ValueError, match="max 2"):
        validate([parse_fault("join-node@time=1s")], agents=2, min_nodes=1, max_nodes=2)
    with pytest.raises(ValueError, match="min 2"):
        validate([parse_fault("kill-node@time=1s")], agents=2, min_nodes=2, max_nodes=4)


def test_the_cli_refuses_bad_arguments_with_exit_code_2(tmp_path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "chaos", "run", "--run-dir", str(tmp_path / "r"), "--fault", "explode@step=1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "explode" in result.stderr
    assert not (tmp_path / "r").exists()
    result = subprocess.run(
        [sys.executable, "-m", "chaos", "run", "--run-dir", str(tmp_path / "r"), "checkpoint.keep_last=0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "checkpoint.keep_last" in result.stderr
