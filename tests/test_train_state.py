"""TrainState: one state_dict / load_state_dict under constant keys, the data position stored once."""

from __future__ import annotations

import itertools

import pytest
import torch

from elastic_qa.checkpoint.manager import LoadedCheckpoint
from elastic_qa.checkpoint.payload import MODEL_FILE, OPTIMIZER_FILE, TRAINER_FILE, check_safe
from elastic_qa.config import load_config, packaged_config
from elastic_qa.data.cursor import GlobalCursor
from elastic_qa.dist import DistContext
from elastic_qa.optim import build_optimizer, build_scheduler
from elastic_qa.train_state import STATE_FORMAT, ResumeError, TrainState, unwritten_lines

CTX = DistContext(0, 1, 0, torch.device("cpu"), None, 1)


def fresh_state(seed: int = 0, *overrides: str) -> TrainState:
    cfg = load_config(packaged_config("tiny"), overrides)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    optimizer = build_optimizer(model, cfg)
    return TrainState(
        cfg, CTX, model, optimizer, build_scheduler(optimizer, cfg), None, GlobalCursor(100, 16, 1)
    )


def trained_state(steps: int, *overrides: str, state: TrainState | None = None) -> TrainState:
    state = state or fresh_state(0, *overrides)
    for step in range(state.step + 1, steps + 1):
        loss = state.model(torch.randn(16, 4)).pow(2).sum()
        loss.backward()
        state.optimizer.step()
        state.scheduler.step()
        state.optimizer.zero_grad()
        state.complete_step(step, state.cursor.epoch, global_count=16, global_tokens=160)
    return state


def as_loaded(files: dict, step: int) -> LoadedCheckpoint:
    return LoadedCheckpoint(
        step, "ckpt/step", {}, files[MODEL_FILE], files[OPTIMIZER_FILE], files[TRAINER_FILE]
    )


def test_a_state_round_trips_through_its_state_dict() -> None:
    saved = trained_state(9, "checkpoint.keep_best=f1")
    saved.best.observe(9, {"em": 0.25, "f1": 0.5, "loss": 2.0})
    files = saved.state_dict({}, attempt=4)
    check_safe(files)  # loadable with weights_only=True
    restored = fresh_state(1, "checkpoint.keep_best=f1")
    restored.load_state_dict(as_loaded(files, 9))

    assert (restored.step, restored.tokens_seen) == (9, 9 * 160)
    assert restored.cursor.state_dict() == saved.cursor.state_dict()
    assert restored.scheduler.state_dict()["last_epoch"] == 9
    assert (restored.best.step, restored.best.value) == (9, 0.5)  # the best so far survives a resume
    for a, b in zip(saved.model.parameters(), restored.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_the_data_position_is_stored_once() -> None:
    state = trained_state(8)
    trainer = state.state_dict({}, attempt=1)[TRAINER_FILE]
    assert trainer["format"] == STATE_FORMAT
    assert set(trainer) == {
        "format",
        "lr_scheduler",
        "grad_scaler",
        "data",
        "counters",
        "rng",
        "saved_by",
        "length",
        "config",
        "versions",
        "best",
    }
    assert trainer["data"] == state.cursor.state_dict()
    assert trainer["counters"] == {"step": 8, "tokens_seen": 8 * 160}


def test_a_checkpoint_of_the_earlier_layout_still_loads() -> None:
    """Format 1 (no format number): a `trainer` table that repeated the data position."""
    saved = trained_state(5)
    files = saved.state_dict({}, attempt=2)
    current = files[TRAINER_FILE]
    files[TRAINER_FILE] = {
        "scheduler": current["lr_scheduler"],
        "scaler": None,
        "trainer": {
            "step": 5,
            "epoch": 0,
            "samples_consumed": 80,
            "global_batch_size": 16,
            "world_size": 1,
            "tokens_seen": 800,
            "attempt": 2,
        },
        "data": current["data"],
        "rng": {},
        "config": current["config"],
        "versions": current["versions"],
    }
    restored = fresh_state(seed=3)
    restored.load_state_dict(as_loaded(files, 5))
    assert (restored.step, restored.tokens_seen) == (5, 800)
    assert restored.cursor.samples_consumed == 80


def test_a_newer_format_is_refused_naming_the_version() -> None:
    files = trained_state(1).state_dict({}, attempt=1)
    files[TRAINER_FILE]["format"] = STATE_FORMAT + 1
    with pytest.raises(ResumeError, match=f"format {STATE_FORMAT + 1} is newer"):
        fresh_state().load_state_dict(as_loaded(files, 1))


def test_a_vocabulary_travels_in_the_trainer_state_and_another_one_is_refused_on_resume() -> None:
    saved = trained_state(3)
    saved.vocabulary = '{"model": {"vocab": {"[PAD]": 0}}}'
    files = saved.state_dict({}, attempt=1)
    check_safe(files)
    assert files[TRAINER_FILE]["vocabulary"] == saved.vocabulary
    same = fresh_state(1)
    same.vocabulary = saved.vocabulary
    same.load_state_dict(as_loaded(files, 3))
    assert same.step == 3
    other = fresh_state(1)
    other.vocabulary = '{"model": {"vocab": {"[PAD]": 0, "paris": 1}}}'
    with pytest.raises(ResumeError, match="another wordpiece vocabulary"):
        other.load_state_dict(as_loaded(files, 3))
    assert other.step == 0
    for a, b in zip(other.model.parameters(), fresh_state(1).model.parameters(), strict=True):
        assert torch.equal(a, b)  # refused before any weight was loaded


def lr_of(state: TrainState) -> float:
    return state.scheduler.get_last_lr()[0]


def resumed(files: dict, step: int, *overrides: str) -> TrainState:
    state = fresh_state(1, *overrides)
    state.load_state_dict(as_loaded(files, step))
    return state


@pytest.mark.parametrize("legacy", [False, True], ids=["schedule-in-checkpoint", "older-checkpoint"])
def test_a_raised_max_steps_continues_the_lr_from_the_checkpoint_and_decays_over_the_new_horizon(
    legacy: bool,
) -> None:
    saved = trained_state(30, "train.max_steps=40", "train.warmup_steps=5", "train.min_lr_ratio=0.1")
    at_save = lr_of(saved)
    files = saved.state_dict({}, attempt=1)
    if legacy:  # written before the schedule kept its settings: they come from the stored config
        files[TRAINER_FILE]["lr_scheduler"]["lr_lambdas"] = [None, None]
    resume = ("train.max_steps=80", "train.warmup_steps=5", "train.min_lr_ratio=0.1")
    state = resumed(files, 30, *resume)
    assert lr_of(state) == pytest.approx(at_save)  # the LR the checkpoint ended with

    rates = [lr_of(trained_state(step, state=state)) for step in range(31, 81)]
    assert rates[0] <= at_save and rates[0] == pytest.approx(at_save, rel=0.01)  # no jump back up
    assert all(b <= a for a, b in itertools.pairwise(rates))  # decays all the way...
    assert rates[-1] == pytest.approx(0.1 * state.cfg.train.peak_lr)  # ...to the floor at the new end

    # The re-aimed schedule travels in the next checkpoint: a resume without changes continues it.
    again = resumed(state.state_dict({}, attempt=2), 80, *resume)
    assert lr_of(again) == pytest.approx(rates[-1])


def test_another_lr_schedule_on_resume_goes_on_from_the_checkpoints_lr_in_the_new_shape() -> None:
    settings = ("train.max_steps=60", "train.warmup_steps=5", "train.min_lr_ratio=0.1")
    saved = trained_state(30, *settings)  # cosine, half-way down
    at_save = lr_of(saved)
    assert 0.1 * saved.cfg.train.peak_lr < at_save < saved.cfg.train.peak_lr
    resume = (*settings, "train.lr_schedule=constant")
    state = resumed(saved.state_dict({}, attempt=1), 30, *resume)

    rates = [lr_of(trained_state(step, state=state)) for step in range(31, 46)]
    assert rates == pytest.approx([at_save] * len(rates))  # constant from where cosine stood
    again = resumed(state.state_dict({}, attempt=2), 45, *resume)  # the new shape travels on
    assert lr_of(trained_state(60, state=again)) == pytest.approx(at_save)


def test_an_unchanged_config_resumes_the_schedule_exactly() -> None:
    uninterrupted = trained_state(20)
    files = trained_state(10).state_dict({}, attempt=1)
    state = trained_state(20, state=resumed(files, 10))
    assert lr_of(state) == lr_of(uninterrupted)


def test_the_grad_scalers_loss_scale_and_growth_count_come_back_on_resume() -> None:
    """fp16 trains with a GradScaler; a fresh one would restart its scale and growth count."""
    saved = fresh_state()
    saved.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    for _ in range(4):  # one growth (x2 after 3 finite steps), then one step towards the next
        saved.scaler.scale(saved.model(torch.randn(16, 4)).pow(2).sum()).backward()
        saved.scaler.step(saved.optimizer)
        saved.scaler.update()
        saved.optimizer.zero_grad()
    files = saved.state_dict({}, attempt=1)
    check_safe(files)
    restored = fresh_state(seed=1)
    restored.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    restored.load_state_dict(as_loaded(files, 4))

    assert files[TRAINER_FILE]["grad_scaler"]["scale"] == 2048.0
    assert restored.scaler.state_dict() == saved.scaler.state_dict()
    assert restored.scaler.state_dict()["_growth_tracker"] == 1


def test_a_checkpoints_unwritten_step_lines_come_back_typed_and_a_malformed_list_is_refused() -> None:
    line = {"step": 7, "epoch": 0, "lr": 1e-3, "grad_norm": 0.5, "samples_per_s": 99.0, "cursor": 112,
            "ts": 1.5, "world_size": 2, "rank": 1, "loss_sum": 12.0, "samples": 8}  # fmt: skip
    [back] = unwritten_lines([line], "ckpt")  # a line from before `written` existed: not written
    assert back == {**line, "written": False} and isinstance(back["samples"], float)
    assert unwritten_lines([{**line, "written": True}], "ckpt")[0]["written"] is True
    assert unwritten_lines([{**line, "written": "yes"}], "ckpt")[0]["written"] is False  # only True is
    for broken in ([{**line, "step": "seven"}], [{k: v for k, v in line.items() if k != "ts"}], 3):
        with pytest.raises(ResumeError, match="checkpoint ckpt: unwritten_lines"):
            unwritten_lines(broken, "ckpt")
