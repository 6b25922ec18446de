"""The node-local copy on its own: newest only, verified, one directory per run, a full /dev/shm (a real
tmpfs too small for a copy) turning it off with one warning; a root another user made or can replace is
never used, and no wait on the lock is unbounded, nor long once a stop is asked."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_qa.checkpoint import node_local
from elastic_qa.checkpoint.node_local import NodeLocalCopy
from elastic_qa.checkpoint.payload import MODEL_FILE, OPTIMIZER_FILE, TRAINER_FILE
from elastic_qa.checkpoint.store import serialize
from elastic_qa.config import CheckpointConfig
from tests.checkpoint.helpers import HER, hers, lock_held

Logs = list[dict[str, Any]]  # the `events` fixture (tests/checkpoint/conftest.py): every level captured

FIELDS = {"attempt": 3, "run": "a" * 32, "world_size": 1}


def files(value: float, numel: int = 16) -> dict[str, bytes]:
    return {
        MODEL_FILE: serialize({"w": torch.full((numel,), value)}),
        OPTIMIZER_FILE: serialize({"state": {}}),
        TRAINER_FILE: serialize({"trainer": {"step": int(value)}}),
    }


def steps(copy: NodeLocalCopy) -> list[int]:
    return [info.step for info in copy.store.list_steps(committed_only=False)]


def test_only_the_newest_copy_is_kept_and_it_verifies(tmp_path: Path) -> None:
    copy = NodeLocalCopy(str(tmp_path / "shm"), "/durable/run-a/checkpoints")
    assert copy.newest() is None
    assert copy.commit(2, files(2.0), FIELDS)
    assert copy.commit(4, files(4.0), FIELDS)
    assert steps(copy) == [4]
    newest = copy.newest()
    assert newest is not None and (newest.step, newest.attempt, newest.run) == (4, 3, "a" * 32)
    # An older step of the same attempt (a background save finishing after an emergency one) is not
    # written over the newer copy.
    assert copy.commit(3, files(3.0), FIELDS)
    assert steps(copy) == [4]
    # The same step of a newer attempt replaces it.
    assert copy.commit(4, files(4.5), {**FIELDS, "attempt": 4})
    newest = copy.newest()
    assert newest is not None and newest.attempt == 4


def test_a_damaged_copy_is_not_offered(tmp_path: Path) -> None:
    copy = NodeLocalCopy(str(tmp_path / "shm"), "/durable/run-a/checkpoints")
    assert copy.commit(5, files(5.0), FIELDS)
    model = Path(copy.store.path("step-00000005", MODEL_FILE))
    data = bytearray(model.read_bytes())
    data[-20] ^= 0xFF
    model.write_bytes(bytes(data))
    assert copy.newest() is None


def test_each_run_and_each_job_on_a_node_has_its_own_directory(tmp_path: Path) -> None:
    first = NodeLocalCopy(str(tmp_path / "shm"), "/durable/run-a/checkpoints")
    second = NodeLocalCopy(str(tmp_path / "shm"), "/durable/run-b/checkpoints")
    assert first.directory != second.directory
    assert first.commit(7, files(7.0), FIELDS)
    assert second.newest() is None
    first.remove()
    assert not os.path.exists(first.directory) and not os.path.exists(first.lock_path)


def test_a_directory_other_users_can_write_into_is_never_used(tmp_path: Path) -> None:
    copy = NodeLocalCopy(str(tmp_path / "shm"), "/durable/run-a/checkpoints")
    assert copy.commit(1, files(1.0), FIELDS)
    os.chmod(copy.directory, 0o777)
    assert copy.newest() is None


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real tmpfs of 64 KiB (root only): the node memory a copy does not fit in."""
    mount = tmp_path / "small-shm"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_full_node_memory_turns_the_copy_off_with_one_warning(tiny_tmpfs: Path, events: Logs) -> None:
    copy = NodeLocalCopy(str(tiny_tmpfs / "elastic_qa"), "/durable/run-a/checkpoints")
    assert copy.commit(1, files(1.0), FIELDS)  # small: fits
    assert not copy.commit(2, files(2.0, numel=64 * 1024), FIELDS)  # 256 KiB: ENOSPC
    assert not copy.commit(3, files(3.0), FIELDS)  # off from here on: no second warning
    warnings = [entry for entry in events if entry["event"] == "node_local_off"]
    assert len(warnings) == 1 and "No space left" in warnings[0]["error"]
    assert copy.newest() is None
    assert not os.path.exists(copy.directory)  # the memory it held is given back


# ---- another user, a stuck writer ----------------------------------------------------------------------

URL = "/durable/run-a/checkpoints"


def lock_of(root: Path) -> Path:
    return Path(NodeLocalCopy(str(root), URL).lock_path)


def opened(root: Path) -> NodeLocalCopy | None:
    return NodeLocalCopy.open(CheckpointConfig(node_local_dir=str(root)), URL)


def test_a_root_another_user_made_first_is_passed_over_even_while_she_holds_the_lock(
    tmp_path: Path, events: Logs
) -> None:
    root = hers(tmp_path / "shm" / "elastic_qa")
    lock = lock_of(root)
    lock.touch()
    os.chown(lock, HER, HER)
    with lock_held(lock):  # her process (the flock, not its uid, is what blocks)
        copy = opened(root)
        assert copy is not None and copy.root == f"{root}-{os.geteuid()}"  # this user's own, not hers
        assert copy.commit(1, files(1.0), FIELDS)
    assert sorted(p.name for p in root.iterdir()) == [lock.name]  # nothing written into her directory
    warnings = [entry for entry in events if entry["event"] == "node_local_root_unsafe"]
    assert len(warnings) == 1 and f"belongs to uid {HER}" in warnings[0]["reason"]
    newest = copy.newest()
    assert newest is not None and newest.step == 1


@pytest.mark.parametrize("kind", ["a symlink to a directory of this user", "writable by others"])
def test_a_root_of_this_user_that_is_a_symlink_or_writable_by_others_is_passed_over(
    tmp_path: Path, kind: str
) -> None:
    root = tmp_path / "shm" / "elastic_qa"
    (tmp_path / "shm").mkdir()
    if kind.startswith("a symlink"):
        (tmp_path / "mine").mkdir(mode=0o700)
        root.symlink_to(tmp_path / "mine")
    else:
        root.mkdir()
        os.chmod(root, 0o777)
    copy = opened(root)
    assert copy is not None and copy.root == f"{root}-{os.geteuid()}"
    assert copy.commit(1, files(1.0), FIELDS)
    assert (
        not list((tmp_path / "mine").iterdir()) if kind.startswith("a symlink") else not list(root.iterdir())
    )


def test_with_no_safe_root_the_copy_is_off_with_one_warning(tmp_path: Path, events: Logs) -> None:
    root = hers(tmp_path / "shm" / "elastic_qa")
    hers(tmp_path / "shm" / f"elastic_qa-{os.geteuid()}")  # she made the fallback too
    assert opened(root) is None
    assert opened(root) is None  # said once
    warnings = [entry for entry in events if entry["event"] == "node_local_root_unsafe"]
    assert len(warnings) == 1 and "node-local copy off" in warnings[0]["effect"]


def test_a_root_in_a_directory_whose_entries_others_can_replace_is_not_used(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # no sticky bit: anyone may rename this user's root away and plant another
    assert opened(shared / "elastic_qa") is None
    os.chmod(shared, 0o1777)  # as /dev/shm and /tmp are
    copy = opened(shared / "elastic_qa")
    assert copy is not None and copy.root == str(shared / "elastic_qa")


def test_a_lock_file_that_is_not_this_users_own_turns_the_copy_off(tmp_path: Path, events: Logs) -> None:
    copy = NodeLocalCopy(str(tmp_path / "shm"), URL)
    (tmp_path / "shm").mkdir(mode=0o700)
    Path(copy.lock_path).touch()
    os.chown(copy.lock_path, HER, HER)
    assert not copy.commit(1, files(1.0), FIELDS)
    assert [entry["event"] for entry in events] == ["node_local_off"]
    assert f"belongs to uid {HER}" in events[0]["error"]


def test_a_lock_held_past_the_bound_turns_the_copy_off_and_leaves_the_holders_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, events: Logs
) -> None:
    monkeypatch.setattr(node_local, "LOCK_WAIT_S", 0.2)  # the bound, not its size, is under test
    copy = NodeLocalCopy(str(tmp_path / "shm"), URL)
    assert copy.commit(1, files(1.0), FIELDS)
    with lock_held(Path(copy.lock_path)):  # a stuck writer of this user
        assert not copy.commit(2, files(2.0), FIELDS)
        assert not copy.commit(3, files(3.0), FIELDS)  # off: no second wait
    names = [entry["event"] for entry in events]
    assert names == ["node_local_lock_wait", "node_local_off"], names
    assert "held by another process" in events[1]["error"]
    assert steps(copy) == [1]  # not removed under the holder's feet


def test_a_writer_waiting_on_the_lock_gives_up_soon_once_a_stop_is_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, events: Logs
) -> None:
    # The stop is asked while the writer waits: its first look at `urgent` comes after the lock was found
    # taken. LOCK_WAIT_S shrunk from 60 s to 20 s bounds the test should the stop be ignored.
    monkeypatch.setattr(node_local, "LOCK_WAIT_S", 20.0)
    monkeypatch.setattr(node_local, "URGENT_LOCK_WAIT_S", 0.2)
    looks: list[float] = []

    def stop_asked() -> bool:
        looks.append(time.monotonic())
        return len(looks) > 1  # not yet at the first look, from the second on

    copy = NodeLocalCopy(str(tmp_path / "shm"), URL, urgent=stop_asked)
    (tmp_path / "shm").mkdir(mode=0o700)
    with lock_held(Path(copy.lock_path)):
        started = time.monotonic()
        assert not copy.commit(1, files(1.0), FIELDS)
        waited = time.monotonic() - started
        # The saves until the ranks agree on the stop: the holder outlasted one urgent wait, so they only
        # try the lock (URGENT_LOCK_WAIT_S at each kept a 1-process run from stopping within 30 s).
        monkeypatch.setattr(node_local, "URGENT_LOCK_WAIT_S", 20.0)
        started = time.monotonic()
        assert not copy.commit(2, files(2.0), FIELDS)
        again = time.monotonic() - started
    assert waited < 10 and again < 10, (waited, again)  # far from LOCK_WAIT_S / the 20 s urgent bound
    names = [entry["event"] for entry in events]
    assert names == [
        "node_local_lock_wait",
        "node_local_lock_wait",
        "node_local_skipped",
        "node_local_skipped",
    ], names
    assert [entry["urgent"] for entry in events[:2]] == [False, True]
    assert copy.enabled and copy.commit(1, files(1.0), FIELDS)  # skipped, not off: the lock is free
