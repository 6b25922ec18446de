"""Fault schedules: parsing, seeded randomness, the job's node bounds, and fitting the job."""

from __future__ import annotations

import subprocess
import sys

import pytest

from elastic_qa.chaos.schedule import (
    FINAL,
    KINDS,
    Fault,
    fit_job,
    parse_fault,
    random_schedule,
    slices,
    validate,
)
from elastic_qa.config import load_config, packaged_config

NODE_DELTA = {"kill-node": -1, "term-node": -1, "join-node": 1}


def test_explicit_faults_parse_steps_times_and_durations() -> None:
    assert parse_fault("kill-worker@step=40") == Fault("kill-worker", at_step=40)
    assert parse_fault("join-node@time=20s") == Fault("join-node", at_time=20.0)
    assert parse_fault("freeze-worker@step=5,for=2s") == Fault("freeze-worker", at_step=5, duration=2.0)
    assert parse_fault("freeze-worker@step=5,for=never").duration is None
    assert parse_fault("storage-errors@time=1m").duration == 5.0
    assert parse_fault("log-full@step=9").duration == 3.0
    assert parse_fault("final-storage-errors@step=145,for=4s").duration == 4.0
    assert parse_fault("second-job@step=60").duration == 60.0  # its longest life
    assert parse_fault("hup@step=3") == Fault("hup", at_step=3)
    text = "freeze-worker@step=5,for=never"
    assert parse_fault(parse_fault(text).describe()) == parse_fault(text)


@pytest.mark.parametrize(
    "text",
    [
        "explode@step=3",
        "kill-worker",
        "kill-worker@step=x",
        "kill-worker@step=1,time=2s",
        "kill-worker@when=3",
        "kill-worker@step=0",
        "log-full@step=3,for=never",
    ],
)
def test_malformed_faults_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="--fault"):
        parse_fault(text)


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another() -> None:
    first = random_schedule(7, 60, 1500, agents=2, min_nodes=1, max_nodes=4)
    assert first == random_schedule(7, 60, 1500, agents=2, min_nodes=1, max_nodes=4)
    assert first != random_schedule(8, 60, 1500, agents=2, min_nodes=1, max_nodes=4)
    assert {f.kind for f in first} == set(KINDS)


@pytest.mark.parametrize("seed", range(20))
def test_random_schedules_honour_the_node_bounds(seed: int) -> None:
    faults = random_schedule(seed, 40, 400, agents=2, min_nodes=1, max_nodes=3)
    nodes = 2
    for fault in faults:
        if fault.kind in ("kill-node", "term-node"):
            assert nodes >= 2  # never the store host, so a second agent must exist
        nodes += NODE_DELTA.get(fault.kind, 0)
        assert 1 <= nodes <= 3
    validate(faults, agents=2, min_nodes=1, max_nodes=3, max_steps=400)


@pytest.mark.parametrize("seed", range(30))
def test_random_faults_fire_by_step_one_per_slice_and_leave_the_last_slice_for_recovery(seed: int) -> None:
    max_steps, count = 40, 4  # the tiny job, which used to end before three of four timed faults
    faults = random_schedule(seed, count, max_steps, agents=2, min_nodes=1, max_nodes=4)
    width, final_step = slices(max_steps, count)
    regular = [f for f in faults if f.kind != FINAL]
    assert all(f.at_time is None for f in faults)
    for index, fault in enumerate(regular):
        assert index * width < fault.at_step <= (index + 1) * width
    assert max(f.at_step for f in regular) <= max_steps - width
    finals = [f for f in faults if f.kind == FINAL]
    assert finals in ([], faults[-1:])
    assert all(f.at_step == final_step < max_steps for f in finals)


def test_the_final_save_fault_is_drawn_at_most_once_and_always_last() -> None:
    for seed in range(10):
        faults = random_schedule(seed, 100, 1500, agents=2, min_nodes=1, max_nodes=3)
        finals = [i for i, f in enumerate(faults) if f.kind == FINAL]
        assert finals == [99]
        assert faults[-1].at_step > faults[-2].at_step


def test_a_second_job_is_started_only_in_the_first_half_of_the_job() -> None:
    for seed in range(10):
        faults = random_schedule(seed, 100, 1500, agents=2, min_nodes=1, max_nodes=3)
        assert all(f.at_step <= 750 for f in faults if f.kind == "second-job")
    only = random_schedule(1, 4, 40, agents=2, min_nodes=1, max_nodes=3, kinds=("second-job",))
    assert len(only) == 4  # when nothing else may be drawn, late second jobs are still drawn


def test_a_job_too_short_for_its_faults_is_refused_before_it_starts() -> None:
    with pytest.raises(ValueError, match=r"train\.max_steps=40"):
        random_schedule(1, 20, 40, agents=2, min_nodes=1, max_nodes=4)


def tiny(*overrides: str):
    return load_config(packaged_config("tiny"), list(overrides))


def test_a_fast_job_is_slowed_down_and_given_checkpoints_so_that_every_fault_finds_it_running() -> None:
    cfg = tiny()  # 40 steps of a few ms, a 30-minute checkpoint interval
    faults = [Fault("kill-during-save", at_step=5), Fault("kill-worker", at_step=15)]
    fitted = fit_job(cfg, faults, min_gap_s=2.0)
    fitted_cfg = tiny(*(f"{key}={value}" for key, value in fitted.items()))
    width, _ = slices(40, 2)
    assert width * fitted_cfg.debug.step_delay.total_seconds() >= 2.0
    assert (
        fitted_cfg.checkpoint.interval.total_seconds() <= width * fitted_cfg.debug.step_delay.total_seconds()
    )
    assert fitted_cfg.debug.save_delay.total_seconds() > 0


def test_a_second_job_gets_enough_training_after_it_to_start_and_race_the_main_job() -> None:
    fitted = fit_job(tiny(), [Fault("second-job", at_step=10)], min_gap_s=2.0)
    delay = tiny(f"debug.step_delay={fitted['debug.step_delay']}").debug.step_delay.total_seconds()
    assert (40 - 10) * delay >= 15.0


def test_a_job_that_already_fits_its_schedule_is_left_alone() -> None:
    cfg = tiny("train.max_steps=1500", "debug.step_delay=150ms", "checkpoint.interval=3s")
    faults = random_schedule(63, 100, 1500, agents=2, min_nodes=1, max_nodes=3, kinds=("kill-worker",))
    assert fit_job(cfg, faults, min_gap_s=2.0) == {}
    assert fit_job(cfg, [], min_gap_s=2.0) == {}


def test_an_explicit_schedule_that_breaks_the_bounds_is_refused() -> None:
    with pytest.raises(ValueError, match="max 2"):
        validate([parse_fault("join-node@time=1s")], agents=2, min_nodes=1, max_nodes=2)
    with pytest.raises(ValueError, match="min 2"):
        validate([parse_fault("kill-node@time=1s")], agents=2, min_nodes=2, max_nodes=4)


def test_an_explicit_schedule_that_could_never_fire_is_refused() -> None:
    with pytest.raises(ValueError, match="never fire"):
        validate([parse_fault("kill-worker@step=40")], agents=2, min_nodes=1, max_nodes=4, max_steps=40)
    final, kill = parse_fault("final-storage-errors@step=35"), parse_fault("kill-worker@step=38")
    with pytest.raises(ValueError, match="last"):
        validate([final, kill], agents=2, min_nodes=1, max_nodes=4, max_steps=40)
    with pytest.raises(ValueError, match="at most once"):
        validate([final, final], agents=2, min_nodes=1, max_nodes=4, max_steps=40)
    validate([kill, parse_fault("final-storage-errors@step=39")], 2, 1, 4, max_steps=40)


def test_an_explicit_schedule_with_two_faults_at_one_step_is_refused() -> None:
    """The job is held after each fault's step until that fault has fired, and the next fault waits for a
    step trained after it: two faults at one step would wait for each other."""
    two = [parse_fault("kill-worker@step=20"), parse_fault("corrupt-checkpoint@step=20")]
    with pytest.raises(ValueError, match="two faults at step=20"):
        validate(two, agents=2, min_nodes=1, max_nodes=4, max_steps=40)
    validate([two[0], parse_fault("corrupt-checkpoint@step=21")], 2, 1, 4, max_steps=40)


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
    result = subprocess.run(
        [sys.executable, "-m", "chaos", "schedule", "--faults", "30"],  # 30 faults on the 40-step tiny job
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "train.max_steps=40" in result.stderr


def test_random_schedules_freeze_a_worker_for_ever_only_when_the_group_keeps_two() -> None:
    """With --min 1 the group can shrink to one worker, whom nobody would notice frozen for ever."""
    for seed in range(20):
        lone = random_schedule(seed, 40, 4000, agents=2, min_nodes=1, max_nodes=3)
        assert all(f.duration is not None for f in lone if f.kind == "freeze-worker"), seed
    kept = [
        f
        for seed in range(20)
        for f in random_schedule(seed, 40, 4000, agents=2, min_nodes=2, max_nodes=3)
        if f.kind == "freeze-worker"
    ]
    assert any(f.duration is None for f in kept)
