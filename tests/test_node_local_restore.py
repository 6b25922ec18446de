"""The node-local copy through the trainer and its checkpoint session, in this process on a one-rank gloo
group: an emergency save while durable storage fails leaves the step in node memory, the next start on the
node restores it (reading each file once) and commits it to the store; a damaged copy, or one of a stale
attempt, is passed over for the store's newest; a finished job leaves no copy behind. A root another user
made first is never used, and a stuck writer holding the lock never holds up a save or a stop."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elastic_qa.checkpoint.backends import open_store
from elastic_qa.checkpoint.fencing import Fence
from elastic_qa.checkpoint.node_local import NodeLocalCopy
from elastic_qa.checkpoint.payload import MODEL_FILE
from elastic_qa.checkpoint.store import CheckpointStore
from elastic_qa.elastic.control import PeerFailure
from elastic_qa.observe.follow import read_events
from elastic_qa.trainer import Trainer
from tests import test_trainer_inprocess as inprocess
from tests.checkpoint.helpers import hers, lock_held
from tests.conftest import tiny_overrides

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


# ---- another user, a stuck writer ----------------------------------------------------------------------


def test_a_node_local_root_another_user_made_first_never_holds_up_a_save(started, tmp_path) -> None:
    # She created the shared root first, mode 0777, and holds the flock of this run's predictable lock.
    root = hers(tmp_path / "shm" / "elastic_qa")
    durable = open_store(str(tmp_path / "run" / "checkpoints"))
    lock = Path(NodeLocalCopy(str(root), durable.display(durable.root)).lock_path)
    lock.touch()
    with lock_held(lock):
        trainer = started(
            "train.max_steps=6", "checkpoint.every_steps=2", f"checkpoint.node_local_dir={root}"
        )
        assert trainer.session.node_local is not None
        assert trainer.session.node_local.root == f"{root}-{os.geteuid()}"  # this user's own place instead
        assert trainer.train()["step"] == 6
        assert committed(trainer) == [2, 4, 6]
    assert sorted(p.name for p in root.iterdir()) == [lock.name]  # nothing of ours in her directory
    warnings = [e for e in read_events(Path(trainer.cfg.run.dir)) if e["event"] == "node_local_root_unsafe"]
    assert len(warnings) == 1 and str(root) == warnings[0]["root"]


def test_an_emergency_save_behind_a_stuck_node_local_writer_still_commits_the_step(started) -> None:
    # Step 4's agreement fails (a lost peer) while a writer holds the copy's lock: the emergency save gives
    # up on node memory after URGENT_LOCK_WAIT_S and commits step 3 to the store. The holder lets go after
    # 90 s, so that a save waiting without a bound ends (late) rather than hangs.
    trainer = started("train.max_steps=6", "checkpoint.every_steps=2")
    copy = trainer.session.node_local
    assert copy is not None
    agree = trainer.control.all_reduce
    assert agree is not None
    failed_at: list[float] = []
    with contextlib.ExitStack() as stack:

        def lost_peer(flags: torch.Tensor):
            if trainer.state.step == 3:
                trainer.session.checkpointer.wait()  # step 2's background save is done
                stack.enter_context(lock_held(Path(copy.lock_path), at_most_s=90))
                failed_at.append(time.monotonic())
                raise dist.DistBackendError("[gloo] Connection closed by peer [127.0.0.1]:29500")
            return agree(flags)

        trainer.control.all_reduce = lost_peer
        with pytest.raises(PeerFailure):
            trainer.train()
        saved_in = time.monotonic() - failed_at[0]
    trainer.session.hold.stop_heartbeat()
    trainer.session.hold.release()
    assert committed(trainer) == [2, 3]
    # 5 s given up on the copy and the durable save: inside torchrun's 30 s between SIGTERM and SIGKILL.
    assert saved_in < 20, saved_in
    events = read_events(Path(trainer.cfg.run.dir))
    assert {e["step"] for e in events if e["event"] == "node_local_skipped"} == {3}
    urgent = [e for e in events if e["event"] == "node_local_lock_wait" and e["urgent"]]
    assert len(urgent) == 1, urgent  # the copy's second try (with the durable save) does not wait again


def wait_for_event(run_dir: Path, name: str, process: subprocess.Popen) -> None:
    """Until the run logs event `name` (AssertionError should its process end first, or a hang guard of
    120 s pass: a run stuck before it would never end)."""
    deadline = time.monotonic() + 120
    while not any(event.get("event") == name for event in read_events(run_dir)):
        assert process.poll() is None, f"the run ended ({process.returncode}) without logging {name}"
        assert time.monotonic() < deadline, f"no {name} in {run_dir}"
        time.sleep(0.05)


def test_a_sigterm_while_a_stuck_writer_holds_the_node_local_lock_stops_with_the_step_committed(
    tmp_path: Path, cache_dir: Path
) -> None:
    # A writer of this user that never lets go (a stopped process of an older job on the same run).
    root, run_dir = tmp_path / "shm", tmp_path / "run"
    root.mkdir(mode=0o700)
    durable = open_store(str(run_dir / "checkpoints"))
    lock = Path(NodeLocalCopy(str(root), durable.display(durable.root)).lock_path)
    overrides = tiny_overrides(
        run_dir,
        cache_dir,
        "train.max_steps=100000",
        "checkpoint.every_steps=2",
        f"checkpoint.node_local_dir={root}",
    )
    command = [sys.executable, "-m", "elastic_qa.train", "--config", "tiny", *overrides]
    with lock_held(lock):
        run = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            wait_for_event(run_dir, "node_local_lock_wait", run)  # the step-2 save waits on the lock
            run.send_signal(signal.SIGTERM)
            _, stderr = run.communicate(timeout=300)  # a guard against a hang, not a timing goal
        finally:
            run.kill()
    assert run.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    events = read_events(run_dir)
    stop = [e for e in events if e["event"] == "checkpoint_committed" and e["reason"] == "sigterm"]
    assert (
        len(stop) == 1 and open_store(str(run_dir / "checkpoints")).list_steps()[-1].step == stop[0]["step"]
    )
    assert "node_local_skipped" in {e["event"] for e in events}
    # One wait cut short by the stop, then no more waiting on that holder until the stop commits.
    urgent = [e for e in events if e["event"] == "node_local_lock_wait" and e["urgent"]]
    assert len(urgent) == 1, urgent
