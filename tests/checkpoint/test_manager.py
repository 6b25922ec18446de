"""Checkpointer: save (sync and async), rotate, survive storage errors, load the newest valid, fencing."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch

from elastic_qa.checkpoint import manager as manager_module
from elastic_qa.checkpoint.backends import open_store
from elastic_qa.checkpoint.fencing import Fence
from elastic_qa.checkpoint.manager import Checkpointer
from elastic_qa.checkpoint.payload import MODEL_FILE, OPTIMIZER_FILE, TRAINER_FILE
from elastic_qa.checkpoint.store import CheckpointError, CheckpointStore, StaleWriterError, step_dir_name
from elastic_qa.config import CheckpointConfig
from tests.checkpoint.faulty_fs import faults
from tests.checkpoint.helpers import (
    Trainee,
    crafted_tensor_file,
    entries,
    event_names,
    file_path,
    flip_byte,
    garble_manifest,
    manifest_fields,
    remove_file,
    remove_manifest,
    small_files,
    snapshot,
    truncate,
)


def checkpointer(store: CheckpointStore, **overrides: Any) -> Checkpointer:
    return Checkpointer(CheckpointConfig(**{"async_": False, **overrides}), store)


def assert_same(a: Any, b: Any, where: str = "state") -> None:
    """Deep equality with torch.equal for tensors (and identical dtypes)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: {sorted(a)} != {sorted(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def committed_steps(store: CheckpointStore) -> list[int]:
    return [info.step for info in store.list_steps()]


def save_steps(ckpt: Checkpointer, steps, size: int = 256) -> None:
    for step in steps:
        ckpt.save(
            step,
            {name: {"x": torch.full((size,), float(step))} for name in manager_module.STATE_FILES},
            manifest_fields(),
        )
    ckpt.wait()


@pytest.fixture
def spy_torch_load(monkeypatch) -> list[dict[str, Any]]:
    """Record the keyword arguments of every torch.load call."""
    calls: list[dict[str, Any]] = []
    real_load = torch.load

    def load(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", load)
    return calls


# ---- save and load --------------------------------------------------------------------------------------


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_a_saved_training_state_is_restored_exactly_by_load_newest(
    store: CheckpointStore, async_: bool, spy_torch_load
) -> None:
    original = Trainee(seed=0)
    original.train(3)
    ckpt = checkpointer(store, async_=async_)
    ckpt.save(3, original.state(), manifest_fields())
    ckpt.close()
    expected = original.state()

    loaded = Checkpointer(CheckpointConfig(), store).load_newest()

    assert loaded is not None and loaded.step == 3
    assert loaded.manifest["step"] == 3 and loaded.manifest["world_size"] == 2
    assert_same(loaded.model, expected[MODEL_FILE], "model")
    assert_same(loaded.optimizer, expected[OPTIMIZER_FILE], "optimizer")
    assert_same(loaded.trainer["scheduler"], expected[TRAINER_FILE]["scheduler"], "scheduler")
    assert spy_torch_load and all(call.get("weights_only") is True for call in spy_torch_load)

    restored = Trainee(seed=99)
    restored.model.load_state_dict(loaded.model)
    restored.optimizer.load_state_dict(loaded.optimizer)
    restored.scheduler.load_state_dict(loaded.trainer["scheduler"])
    assert_same(restored.model.state_dict(), original.model.state_dict(), "model")
    assert_same(restored.optimizer.state_dict(), original.optimizer.state_dict(), "optimizer")
    assert_same(restored.scheduler.state_dict(), original.scheduler.state_dict(), "scheduler")
    # ... and training on from both gives the same parameters: nothing was lost.
    for trainee in (original, restored):
        torch.manual_seed(1234)
        trainee.train(2)
    assert_same(restored.model.state_dict(), original.model.state_dict(), "after training on")


def test_the_saved_state_is_the_state_at_save_time_not_later(store: CheckpointStore) -> None:
    trainee = Trainee()
    trainee.train(1)
    ckpt = checkpointer(store, async_=True)
    at_save = {k: v.clone() for k, v in trainee.model.state_dict().items()}
    ckpt.save(1, trainee.state(), manifest_fields())
    trainee.train(3)  # training goes on while the background writer serialises
    ckpt.close()

    loaded = ckpt.load_newest()
    assert_same(loaded.model, at_save)


def test_an_async_save_returns_before_the_write_and_blocks_for_less_than_it_takes(
    faulty_store: CheckpointStore, events
) -> None:
    faults.before_write = lambda _path: time.sleep(0.1)  # slow storage: ~0.4 s per checkpoint
    ckpt = checkpointer(faulty_store, async_=True)
    trainee = Trainee()

    started = time.perf_counter()
    result = ckpt.save(1, trainee.state(), manifest_fields())
    assert not faulty_store.exists(1)  # still being written: save() returned before the write
    ckpt.wait()
    total = time.perf_counter() - started

    assert faulty_store.exists(1)
    # all >= 4 slowed writes happened after the stall ended (no wall-clock bound on a busy CI box). Not
    # measured from save()'s return: the writer thread starts inside save(), so on a loaded machine its
    # first slowed write may begin before save() has returned (seen: 0.398 s after the return).
    assert total - result.blocking_seconds >= 0.4
    committed = [e for e in events if e["event"] == "checkpoint_committed"]
    assert committed and committed[0]["blocking_seconds"] < committed[0]["seconds"]


def test_a_sync_save_has_committed_when_it_returns(faulty_store: CheckpointStore) -> None:
    ckpt = checkpointer(faulty_store, async_=True)
    result = ckpt.save(1, Trainee().state(), manifest_fields(), blocking=True)

    assert faulty_store.exists(1) and ckpt.last_committed_step == 1
    assert result.waited_seconds == 0.0


def test_a_sync_save_reports_its_whole_duration_as_stall(
    faulty_store: CheckpointStore, events, monkeypatch
) -> None:
    """A sync save blocks throughout: `blocking_seconds == seconds` even if the clock moves between reads."""
    ticks = iter(range(1_000_000))
    monkeypatch.setattr(manager_module.time, "perf_counter", lambda: next(ticks) * 0.00007)
    ckpt = checkpointer(faulty_store)
    ckpt.save(1, Trainee().state(), manifest_fields())

    committed = [e for e in events if e["event"] == "checkpoint_committed"]
    assert len(committed) == 1
    assert committed[0]["blocking_seconds"] == committed[0]["seconds"] > 0


def test_at_most_one_save_is_in_flight_and_the_next_one_waits(
    faulty_store: CheckpointStore, monkeypatch
) -> None:
    faults.before_write = lambda _path: time.sleep(0.03)
    in_flight, peak, lock = [0], [0], threading.Lock()
    real_commit = faulty_store.commit

    def counting_commit(*args: Any, **kwargs: Any) -> Any:
        with lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
        try:
            return real_commit(*args, **kwargs)
        finally:
            with lock:
                in_flight[0] -= 1

    monkeypatch.setattr(faulty_store, "commit", counting_commit)
    ckpt = checkpointer(faulty_store, async_=True, keep_last=10)
    state = Trainee().state()

    results = [ckpt.save(step, state, manifest_fields()) for step in (1, 2, 3)]
    ckpt.close()

    assert peak[0] == 1
    assert results[0].waited_seconds == 0.0
    assert all(r.waited_seconds > 0.05 for r in results[1:])
    assert committed_steps(faulty_store) == [1, 2, 3]


# ---- rotation ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_rotation_keeps_exactly_the_newest_keep_last(store: CheckpointStore, async_: bool) -> None:
    ckpt = checkpointer(store, async_=async_, keep_last=3)
    save_steps(ckpt, range(1, 7))

    assert committed_steps(store) == [4, 5, 6]
    assert [name for name in entries(store) if name.startswith("step-")] == [
        step_dir_name(s) for s in (4, 5, 6)
    ]
    assert all(store.verify(info.path).ok for info in store.list_steps())


def test_rotation_also_keeps_the_milestones(store: CheckpointStore) -> None:
    ckpt = checkpointer(store, keep_last=3, keep_every_steps=4)
    save_steps(ckpt, range(1, 11))

    assert committed_steps(store) == [4, 8, 9, 10]


def test_nothing_is_pruned_until_a_newer_checkpoint_commits(store: CheckpointStore) -> None:
    ckpt = checkpointer(store, keep_last=2)
    save_steps(ckpt, [1, 2])
    assert committed_steps(store) == [1, 2]

    def refuse() -> None:
        raise OSError("refused")

    ckpt.may_commit = refuse  # a save that does not commit prunes nothing either
    save_steps(ckpt, [3])
    assert committed_steps(store) == [1, 2]


def test_prune_never_deletes_the_checkpoint_just_committed(store: CheckpointStore, monkeypatch) -> None:
    monkeypatch.setattr(manager_module, "retained_steps", lambda steps, keep_last, keep_every: set())
    ckpt = checkpointer(store, keep_last=1)

    save_steps(ckpt, [1])
    assert committed_steps(store) == [1]
    save_steps(ckpt, [2])
    assert committed_steps(store) == [2]


def test_prune_never_deletes_a_newer_checkpoint_committed_by_another_writer(store: CheckpointStore) -> None:
    other = checkpointer(store, keep_last=1)
    save_steps(other, [10])
    ckpt = checkpointer(store, keep_last=1)

    save_steps(ckpt, [3, 5])

    assert committed_steps(store) == [5, 10]


def test_prune_leaves_a_checkpoint_being_written_alone(faulty_store: CheckpointStore) -> None:
    """On stores without rename a checkpoint being written is a step dir without a manifest yet."""
    ckpt = checkpointer(faulty_store, keep_last=1)
    save_steps(ckpt, [1])
    in_progress = f"{faulty_store.path(step_dir_name(2))}/model.0123abcd.pt"
    faulty_store.fs.pipe_file(in_progress, b"half a tensor")

    save_steps(ckpt, [3])

    assert committed_steps(faulty_store) == [3]
    assert faulty_store.fs.exists(in_progress)


def test_a_failed_delete_is_logged_and_not_fatal(faulty_store: CheckpointStore, events) -> None:
    ckpt = checkpointer(faulty_store, keep_last=2, give_up_after=timedelta(0))
    faults.fail_removes(match=step_dir_name(1))

    save_steps(ckpt, [1, 2, 3, 4])
    ckpt.close()  # raises if anything was counted as fatal

    assert committed_steps(faulty_store) == [1, 3, 4]
    assert faulty_store.verify(faulty_store.path(step_dir_name(1))).ok
    failed = [e for e in events if e["event"] == "checkpoint_prune_failed"]
    assert failed and {e["step"] for e in failed} == {1}
    assert "checkpoint_failed" not in event_names(events)

    faults.heal()
    save_steps(ckpt, [5])
    assert committed_steps(faulty_store) == [4, 5]


# ---- storage errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("error", ["ENOSPC", "EACCES"])
@pytest.mark.parametrize("after", [0, 1, 3], ids=["first-write", "second-write", "manifest"])
def test_a_storage_error_during_a_save_is_survived_and_cleaned_up(
    faulty_store: CheckpointStore, events, async_: bool, error: str, after: int
) -> None:
    ckpt = checkpointer(faulty_store, async_=async_, keep_last=3, give_up_after=timedelta(minutes=10))
    save_steps(ckpt, [1, 2])
    before = {info.step: snapshot(faulty_store, info.path) for info in faulty_store.list_steps()}

    faults.fail_writes(after=after, error=error, partial=True)
    save_steps(ckpt, [3])  # no exception reaches the caller
    ckpt.raise_if_failed()

    assert committed_steps(faulty_store) == [1, 2]
    assert {info.step: snapshot(faulty_store, info.path) for info in faulty_store.list_steps()} == before
    assert entries(faulty_store) == [step_dir_name(1), step_dir_name(2)]  # nothing partial is left
    failed = [e for e in events if e["event"] == "checkpoint_failed"]
    assert len(failed) == 1 and failed[0]["step"] == 3

    faults.heal()
    save_steps(ckpt, [3])
    assert committed_steps(faulty_store) == [1, 2, 3]
    assert ckpt.last_committed_step == 3


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_a_short_outage_is_survived_however_many_saves_fail_in_it(
    faulty_store: CheckpointStore, async_: bool
) -> None:
    """A full disk for 6 s made 4 fast failures; counting failures gave up before space came back."""
    clock = FakeClock()
    config = CheckpointConfig(async_=async_, give_up_after=timedelta(seconds=60))
    ckpt = Checkpointer(config, faulty_store, clock=clock)
    save_steps(ckpt, [1])
    faults.fail_writes()
    for step in range(2, 8):  # six failures within six seconds
        save_steps(ckpt, [step])
        clock.now += 1.0
    ckpt.raise_if_failed()

    faults.heal()
    save_steps(ckpt, [8])
    ckpt.close()
    assert committed_steps(faulty_store) == [1, 8]


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_saves_failing_for_give_up_after_are_fatal(faulty_store: CheckpointStore, async_: bool) -> None:
    clock = FakeClock()
    config = CheckpointConfig(async_=async_, give_up_after=timedelta(seconds=60))
    ckpt = Checkpointer(config, faulty_store, clock=clock)
    save_steps(ckpt, [1])
    faults.fail_writes()

    save_steps(ckpt, [2])
    clock.now += 59.0
    save_steps(ckpt, [3])  # failing for 59 s: tolerated
    ckpt.raise_if_failed()
    clock.now += 1.0
    save_steps(ckpt, [4])  # 60 s without a successful save: give up
    with pytest.raises(CheckpointError, match="give_up_after"):
        ckpt.raise_if_failed()

    faults.heal()
    with pytest.raises(CheckpointError):
        ckpt.save(5, Trainee().state(), manifest_fields())
    with pytest.raises(CheckpointError):
        ckpt.close()
    assert committed_steps(faulty_store) == [1]


@pytest.mark.parametrize("error", ["storage", "fenced"])
def test_a_fatal_failure_of_the_save_in_flight_stops_the_very_next_save(
    faulty_store: CheckpointStore, error: str
) -> None:
    """The trainer does not wait between async saves: the next save must surface what the last one hit."""
    fence = Fence(faulty_store)
    fence.register(world_size=1)
    ckpt = Checkpointer(
        CheckpointConfig(async_=True, give_up_after=timedelta(0)), faulty_store, may_commit=fence.check
    )
    faults.before_write = lambda _path: time.sleep(0.05)
    if error == "storage":
        faults.fail_writes(after=1)
    else:
        Fence(open_store(faulty_store.url)).register(world_size=1)
    state = Trainee().state()

    ckpt.save(1, state, manifest_fields())  # fails in the background, fatally
    with pytest.raises(CheckpointError):
        ckpt.save(2, state, manifest_fields())

    ckpt.wait()
    assert committed_steps(faulty_store) == []
    assert not [path for path in faults.writes + faults.failed_writes if step_dir_name(2) in path]


def test_a_success_restarts_the_give_up_clock(faulty_store: CheckpointStore) -> None:
    clock = FakeClock()
    ckpt = Checkpointer(
        CheckpointConfig(async_=False, give_up_after=timedelta(seconds=60)), faulty_store, clock=clock
    )
    for step in range(1, 10, 2):
        faults.fail_writes()
        save_steps(ckpt, [step])
        clock.now += 50.0  # 250 s of intermittent failures, never 60 s without a success
        faults.heal()
        save_steps(ckpt, [step + 1])
    ckpt.close()
    assert committed_steps(faulty_store)[-1] == 10


def test_a_state_that_would_not_load_with_weights_only_is_refused_at_save_time(
    store: CheckpointStore,
) -> None:
    ckpt = checkpointer(store, give_up_after=timedelta(0))
    state = Trainee().state()
    state[TRAINER_FILE]["versions"]["torch"] = torch.__version__  # a TorchVersion, not a str

    ckpt.save(1, state, manifest_fields())

    assert committed_steps(store) == []
    with pytest.raises(CheckpointError):
        ckpt.raise_if_failed()


# ---- loading the newest valid checkpoint -------------------------------------------------------------------


def _crafted(store: CheckpointStore, step: int, marker: str) -> None:
    """Replace checkpoint `step` by one whose model.pt runs code when unpickled (with a correct sha256)."""
    store.remove(store.path(step_dir_name(step)))
    store.commit(step, {**small_files(step), MODEL_FILE: crafted_tensor_file(marker)}, manifest_fields())


DAMAGES = {
    "truncated": lambda s, step, _m: truncate(s, file_path(s, step, MODEL_FILE)),
    "flipped-byte": lambda s, step, _m: flip_byte(s, file_path(s, step, OPTIMIZER_FILE)),
    "missing-manifest": lambda s, step, _m: remove_manifest(s, step),
    "garbage-manifest": lambda s, step, _m: garble_manifest(s, step),
    "missing-file": lambda s, step, _m: remove_file(s, step, TRAINER_FILE),
    "crafted-pickle": _crafted,
}


@pytest.mark.parametrize("damage", list(DAMAGES.values()), ids=list(DAMAGES))
def test_load_newest_skips_a_damaged_newest_and_deletes_nothing(
    store: CheckpointStore, damage, tmp_path, events
) -> None:
    trainees = {}
    ckpt = checkpointer(store, keep_last=5)
    for step in (1, 2, 3):
        trainees[step] = Trainee(seed=step)
        trainees[step].train(1)
        ckpt.save(step, trainees[step].state(), manifest_fields())
    marker = tmp_path / "pwned"
    damage(store, 3, str(marker))
    before = {p: snapshot(store, p) for p in (store.path(step_dir_name(s)) for s in (1, 2, 3))}

    loaded = ckpt.load_newest()

    assert loaded is not None and loaded.step == 2
    assert_same(loaded.model, trainees[2].model.state_dict())
    assert {p: snapshot(store, p) for p in before} == before  # nothing deleted or repaired
    rejected = [e for e in events if e["event"] == "checkpoint_rejected"]
    assert [e["step"] for e in rejected] == [3]
    assert not marker.exists()


def test_load_newest_walks_back_over_several_damaged_checkpoints(store: CheckpointStore) -> None:
    ckpt = checkpointer(store, keep_last=5)
    save_steps(ckpt, [1, 2, 3, 4])
    truncate(store, file_path(store, 4, MODEL_FILE))
    garble_manifest(store, 3)
    remove_manifest(store, 2)

    loaded = ckpt.load_newest()

    assert loaded is not None and loaded.step == 1
    assert torch.equal(loaded.model["x"], torch.full((256,), 1.0))


def test_load_newest_returns_none_when_nothing_is_valid(store: CheckpointStore) -> None:
    ckpt = checkpointer(store)
    assert ckpt.load_newest() is None
    save_steps(ckpt, [1])
    flip_byte(store, file_path(store, 1, TRAINER_FILE))
    assert ckpt.load_newest() is None
    assert [info.step for info in store.list_steps()] == [1]


def test_a_checkpoint_whose_file_holds_no_state_dict_is_rejected(store: CheckpointStore) -> None:
    from elastic_qa.checkpoint.store import serialize

    ckpt = checkpointer(store, keep_last=5)
    save_steps(ckpt, [1])
    store.commit(2, {**small_files(2), OPTIMIZER_FILE: serialize([1, 2, 3])}, manifest_fields())

    loaded = ckpt.load_newest()
    assert loaded is not None and loaded.step == 1


# ---- fencing -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_a_stale_attempt_cannot_commit_once_a_newer_one_registered(
    store: CheckpointStore, async_: bool
) -> None:
    old_fence = Fence(store)
    assert old_fence.register(world_size=2) == 1
    stale = Checkpointer(CheckpointConfig(async_=async_), store, may_commit=old_fence.check)
    stale.save(1, Trainee().state(), manifest_fields())
    stale.wait()
    assert committed_steps(store) == [1]  # not stale yet

    new_fence = Fence(open_store(store.url))
    assert new_fence.register(world_size=1) == 2
    stale.save(2, Trainee().state(), manifest_fields())
    stale.wait()

    assert committed_steps(store) == [1]
    assert [name for name in entries(store) if name != "attempts"] == [step_dir_name(1)]
    with pytest.raises(StaleWriterError):
        stale.raise_if_failed()
    with pytest.raises(StaleWriterError):
        stale.save(3, Trainee().state(), manifest_fields())

    current = Checkpointer(CheckpointConfig(async_=async_), store, may_commit=new_fence.check)
    current.save(2, Trainee().state(), manifest_fields())
    current.close()
    assert committed_steps(store) == [1, 2]


def test_attempt_numbers_only_grow(store: CheckpointStore) -> None:
    numbers = [Fence(open_store(store.url)).register(world_size=2) for _ in range(3)]
    assert numbers == [1, 2, 3]
    assert Fence(store).newest() == 3
