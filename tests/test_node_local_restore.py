"""The node-local copy through the trainer and its checkpoint session, in this process on a one-rank gloo
group: an emergency save while durable storage fails leaves the step in node memory, the next start on the
node restores it (reading each file once) and commits it to the store; a damaged copy, or one of a stale
attempt, is passed over for the store's newest; a finished job leaves no copy behind."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elastic_qa.checkpoint.fencing import Fence
from elastic_qa.checkpoint.payload import MODEL_FILE
from elastic_qa.checkpoint.store import CheckpointStore
from elastic_qa.elastic.control import PeerFailure
from elastic_qa.observe.follow import read_events
from elastic_qa.trainer import Trainer
from tests import test_trainer_inprocess as inprocess

pytestmark = pytest.mark.filterwarnings("ignore:.*set_vital.*:UserWarning")
# The trainer on a one-rank group, and what its store holds (verified): as in test_trainer_inprocess.py.
world_of_one, started, committed = inprocess.world_of_one, inprocess.started, inprocess.committed


def die_after_step_3_with_storage_down(trainer: Trainer, storage_down: Path) -> dict[str, torch.Tensor]:
    """Step 4's agreement fails (a lost peer) while durable storage is full: the emergency save of step 3
    reaches node memory only. Returns the parameters at step 3; the hold goes as with the worker's exit."""
    agree = trainer.control.all_reduce
    assert agree is not None

    def lost_peer(flags: torch.Tensor):
        if trainer.state.step == 3:
            trainer.session.checkpointer.wait()  # step 2's background save is in the store
            storage_down.touch()
            raise dist.DistBackendError("[gloo] Connection closed by peer [127.0.0.1]:29500")
        return agree(flags)

    trainer.control.all_reduce = lost_peer
    with pytest.raises(PeerFailure):
        trainer.train()
    trainer.session.hold.stop_heartbeat()
    trainer.session.hold.release()
    return {name: value.clone() for name, value in trainer.model.state_dict().items()}


def overrides(tmp_path: Path) -> tuple[str, ...]:
    return (
        "train.max_steps=6",
        "checkpoint.every_steps=2",
        "checkpoint.emergency_retry_for=0s",
        f"debug.storage_fault_file={tmp_path / 'storage-down'}",
    )


def resume_event(run_dir: str) -> dict:
    return [event for event in read_events(Path(run_dir)) if event.get("event") == "resume"][-1]


def test_the_emergency_step_only_in_node_memory_is_restored_and_made_durable(started, tmp_path) -> None:
    first = started(*overrides(tmp_path))
    at_step_3 = die_after_step_3_with_storage_down(first, tmp_path / "storage-down")
    assert committed(first) == [2]  # the store could not take step 3
    (tmp_path / "storage-down").unlink()  # storage is back for the restarted worker
    again = started(*overrides(tmp_path))
    assert again.state.step == 3 and resume_event(again.cfg.run.dir)["node_local"] is True
    for name, value in again.model.state_dict().items():
        assert torch.equal(value, at_step_3[name]), name
    again.session.checkpointer.wait()
    assert committed(again)[-1] == 3  # never only in memory for longer than one background save
    assert again.train()["step"] == 6
    assert committed(again)[-1] == 6


def test_a_restore_from_node_memory_reads_and_hashes_each_state_file_once(
    started, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = started(*overrides(tmp_path))
    die_after_step_3_with_storage_down(first, tmp_path / "storage-down")
    (tmp_path / "storage-down").unlink()
    assert first.session.node_local is not None
    copy_dir = first.session.node_local.directory
    reads: list[str] = []  # the node-local files read (each read also hashes what it reads)
    read_entry = CheckpointStore._read_entry

    def counted(store: CheckpointStore, path: str, entry: Any, keep: bool) -> bytes:
        if path.startswith(copy_dir):
            reads.append(entry["name"])
        return read_entry(store, path, entry, keep)

    monkeypatch.setattr(CheckpointStore, "_read_entry", counted)
    again = started(*overrides(tmp_path))
    assert again.state.step == 3 and resume_event(again.cfg.run.dir)["node_local"] is True
    files = sorted(set(reads))
    assert MODEL_FILE in files and sorted(reads) == files  # each once: it was twice (verify, then load)


def test_a_damaged_node_local_copy_is_passed_over_for_the_durable_newest(started, tmp_path) -> None:
    first = started(*overrides(tmp_path))
    die_after_step_3_with_storage_down(first, tmp_path / "storage-down")
    assert first.session.node_local is not None
    model = Path(first.session.node_local.store.path("step-00000003", MODEL_FILE))
    data = bytearray(model.read_bytes())
    data[-20] ^= 0xFF
    model.write_bytes(bytes(data))
    (tmp_path / "storage-down").unlink()
    again = started(*overrides(tmp_path))
    assert again.state.step == 2 and resume_event(again.cfg.run.dir)["node_local"] is False


def test_a_copy_written_by_an_attempt_that_is_no_longer_the_newest_is_never_used(started, tmp_path) -> None:
    first = started(*overrides(tmp_path))
    die_after_step_3_with_storage_down(first, tmp_path / "storage-down")
    (tmp_path / "storage-down").unlink()
    Fence(first.session.store).register(world_size=1)  # a newer group registered after the copy was made
    again = started(*overrides(tmp_path))
    assert again.state.step == 2 and resume_event(again.cfg.run.dir)["node_local"] is False


def test_a_finished_job_leaves_no_node_local_copy(started) -> None:
    trainer = started("train.max_steps=4", "checkpoint.every_steps=2")
    node_local = trainer.session.node_local
    assert node_local is not None
    trainer.train()
    assert committed(trainer) == [2, 4]
    assert not os.path.exists(node_local.directory) and not os.path.exists(node_local.lock_path)
