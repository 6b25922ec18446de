"""The learning-rate schedule: each shape, a re-aim across shapes that keeps the position, and its kind
travelling through a checkpoint (weights_only) and defaulting to cosine for a checkpoint that predates it."""

from __future__ import annotations

import io
import itertools
import math

import pytest
import torch

from elastic_qa.config import load_config, packaged_config
from elastic_qa.optim import LRSchedule, build_scheduler, retarget_schedule

KINDS = ("cosine", "linear", "constant")


def test_every_shape_warms_up_linearly_to_the_peak() -> None:
    for kind in KINDS:
        schedule = LRSchedule(warmup_steps=10, total_steps=110, min_ratio=0.1, kind=kind)
        assert [schedule(step) for step in range(10)] == pytest.approx([(s + 1) / 10 for s in range(10)])
        assert schedule(10) == pytest.approx(1.0)


def test_cosine_decays_along_half_a_cosine_to_the_floor() -> None:
    schedule = LRSchedule(warmup_steps=10, total_steps=110, min_ratio=0.1, kind="cosine")
    assert schedule(35) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert schedule(60) == pytest.approx(0.55)
    assert schedule(110) == schedule(500) == pytest.approx(0.1)


def test_linear_decays_in_a_straight_line_to_the_floor() -> None:
    schedule = LRSchedule(warmup_steps=10, total_steps=110, min_ratio=0.1, kind="linear")
    assert schedule(35) == pytest.approx(0.1 + 0.9 * 0.75)
    assert schedule(60) == pytest.approx(0.55)
    assert schedule(110) == schedule(500) == pytest.approx(0.1)


def test_linear_to_zero_is_transformers_linear_schedule() -> None:
    """run_qa's Trainer: get_linear_schedule_with_warmup; after warm-up the multipliers are the same (its
    warm-up starts from 0, this one from 1 / warmup_steps)."""
    transformers = pytest.importorskip("transformers")
    for warmup in (0, 7):
        theirs = transformers.get_linear_schedule_with_warmup(
            torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), warmup, 50
        ).lr_lambdas[0]
        mine = LRSchedule(warmup_steps=warmup, total_steps=50, min_ratio=0.0, kind="linear")
        assert [mine(s) for s in range(warmup, 60)] == pytest.approx([theirs(s) for s in range(warmup, 60)])


def test_constant_stays_at_the_peak_whatever_the_horizon_and_floor() -> None:
    schedule = LRSchedule(warmup_steps=4, total_steps=20, min_ratio=0.1, kind="constant")
    assert [schedule(step) for step in range(4, 40)] == [1.0] * 36


@pytest.mark.parametrize(("old", "new"), list(itertools.permutations(KINDS, 2)))
def test_another_shape_on_resume_starts_from_the_multiplier_at_the_checkpoint(old: str, new: str) -> None:
    schedule = LRSchedule(warmup_steps=5, total_steps=40, min_ratio=0.1, kind=old)
    at_resume = schedule(25)
    schedule.retarget(25, warmup_steps=5, total_steps=80, min_ratio=0.1, kind=new)  # type: ignore[arg-type]

    rates = [schedule(step) for step in range(25, 81)]
    assert rates[0] == pytest.approx(at_resume)  # no jump
    if new == "constant":
        assert rates == pytest.approx([at_resume] * len(rates))
    else:
        assert all(b <= a for a, b in itertools.pairwise(rates))
        assert rates[-1] == pytest.approx(0.1)
    if new == "linear":  # a straight line from there: equal steps down
        assert rates[1] - rates[0] == pytest.approx(rates[-1] - rates[-2])


def test_another_shape_during_warm_up_keeps_warming_up() -> None:
    schedule = LRSchedule(warmup_steps=10, total_steps=40, min_ratio=0.1, kind="cosine")
    schedule.retarget(3, warmup_steps=10, total_steps=40, min_ratio=0.0, kind="linear")
    assert schedule(3) == pytest.approx(0.4) and schedule(9) == pytest.approx(1.0)
    assert schedule(25) == pytest.approx(0.5)  # then linear, from the peak at step 10 to 0 at 40


def test_unchanged_settings_leave_the_schedule_as_it_is() -> None:
    schedule = LRSchedule(warmup_steps=5, total_steps=40, min_ratio=0.1, kind="linear")
    before = vars(schedule).copy()
    schedule.retarget(20, warmup_steps=5, total_steps=40, min_ratio=0.1, kind="linear")
    assert vars(schedule) == before


def scheduler_of(*overrides: str) -> torch.optim.lr_scheduler.LambdaLR:
    cfg = load_config(packaged_config("tiny"), overrides)
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.train.peak_lr)
    return build_scheduler(optimizer, cfg)


def stepped(scheduler: torch.optim.lr_scheduler.LambdaLR, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    for _ in range(steps):
        scheduler.optimizer.step()
        scheduler.step()
    return scheduler


def through_a_file(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def multipliers(scheduler: torch.optim.lr_scheduler.LambdaLR, steps: range) -> list[float]:
    schedule = scheduler.lr_lambdas[0]
    return [schedule(step) for step in steps]


def test_the_kind_travels_in_the_state_dict_and_loads_with_weights_only() -> None:
    linear = ("train.lr_schedule=linear", "train.min_lr_ratio=0", "train.max_steps=40")
    saved = stepped(scheduler_of(*linear), 12)
    state = through_a_file(saved.state_dict())
    assert state["lr_lambdas"][0]["kind"] == "linear"

    restored = scheduler_of("train.max_steps=40")  # built as cosine; the checkpoint says linear
    restored.load_state_dict(state)
    assert restored.lr_lambdas[0].kind == "linear"
    assert multipliers(restored, range(12, 41)) == multipliers(saved, range(12, 41))


def test_a_resume_with_the_same_config_continues_the_schedule_exactly() -> None:
    linear = ("train.lr_schedule=linear", "train.max_steps=40")
    saved = stepped(scheduler_of(*linear), 12)
    state = through_a_file(saved.state_dict())
    resumed = scheduler_of(*linear)
    resumed.load_state_dict(state)
    retarget_schedule(resumed, load_config(packaged_config("tiny"), linear), state, {})
    assert stepped(resumed, 10).get_last_lr() == stepped(saved, 10).get_last_lr()


@pytest.mark.parametrize("era", ["schedule-without-kind", "schedule-without-settings"])
def test_a_checkpoint_from_before_the_kind_was_cosine_and_a_new_shape_starts_from_there(era: str) -> None:
    cosine = stepped(scheduler_of("train.max_steps=40"), 20)
    at_save = cosine.get_last_lr()[0]
    state = through_a_file(cosine.state_dict())
    saved_train = load_config(packaged_config("tiny"), ["train.max_steps=40"]).to_dict()["train"]
    del saved_train["lr_schedule"]
    if era == "schedule-without-kind":
        for entry in state["lr_lambdas"]:
            del entry["kind"]
    else:
        state["lr_lambdas"] = [None] * len(state["lr_lambdas"])

    linear = ("train.lr_schedule=linear", "train.max_steps=40")
    resumed = scheduler_of(*linear)
    resumed.load_state_dict(state)
    retarget_schedule(resumed, load_config(packaged_config("tiny"), linear), state, saved_train)
    # The position is cosine's at step 20, not linear's: from there a straight line to the floor.
    assert resumed.lr_lambdas[0](20) * resumed.base_lrs[0] == pytest.approx(at_save)
    assert resumed.lr_lambdas[0].kind == "linear"
    rates = multipliers(resumed, range(20, 41))
    assert rates[1] - rates[0] == pytest.approx(rates[-1] - rates[-2]) and rates[-1] == pytest.approx(0.05)
