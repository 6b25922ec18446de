"""TrainState: one state_dict / load_state_dict under constant keys, the data position stored once."""

from __future__ import annotations

import pytest
import torch

from elastic_qa.checkpoint.manager import LoadedCheckpoint
from elastic_qa.checkpoint.state import MODEL_FILE, OPTIMIZER_FILE, TRAINER_FILE, check_safe
from elastic_qa.config import load_config, packaged_config
from elastic_qa.data.cursor import GlobalCursor
from elastic_qa.dist import DistContext
from elastic_qa.optim import build_optimizer, build_scheduler
from elastic_qa.state import STATE_FORMAT, ResumeError, TrainState

CTX = DistContext(0, 1, 0, torch.device("cpu"), None, 1)


def fresh_state(seed: int = 0) -> TrainState:
    cfg = load_config(packaged_config("tiny"))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    optimizer = build_optimizer(model, cfg)
    return TrainState(
        cfg, CTX, model, optimizer, build_scheduler(optimizer, cfg), None, GlobalCursor(100, 16, 1)
    )


def trained_state(steps: int) -> TrainState:
    state = fresh_state()
    for step in range(1, steps + 1):
        loss = state.model(torch.randn(16, 4)).pow(2).sum()
        loss.backward()
        state.optimizer.step()
        state.scheduler.step()
        state.optimizer.zero_grad()
        state.complete_step(
            {"step": step, "epoch": state.cursor.epoch, "global_count": 16, "global_tokens": 160}
        )
    return state


def as_loaded(files: dict, step: int) -> LoadedCheckpoint:
    return LoadedCheckpoint(
        step, "ckpt/step", {}, files[MODEL_FILE], files[OPTIMIZER_FILE], files[TRAINER_FILE]
    )


def test_a_state_round_trips_through_its_state_dict() -> None:
    saved = trained_state(9)
    files = saved.state_dict({}, attempt=4)
    check_safe(files)  # loadable with weights_only=True
    restored = fresh_state(seed=1)
    restored.load_state_dict(as_loaded(files, 9))

    assert (restored.step, restored.tokens_seen) == (9, 9 * 160)
    assert restored.cursor.state_dict() == saved.cursor.state_dict()
    assert restored.scheduler.state_dict()["last_epoch"] == 9
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
        "config",
        "versions",
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
