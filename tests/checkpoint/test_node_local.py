"""The node-local copy on its own: newest only, verified, one directory per run, and a full /dev/shm
(a real tmpfs too small for a copy) turning it off with one warning."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from elastic_qa.checkpoint.node_local import NodeLocalCopy
from elastic_qa.checkpoint.payload import MODEL_FILE, OPTIMIZER_FILE, TRAINER_FILE
from elastic_qa.checkpoint.store import serialize

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


def test_a_full_node_memory_turns_the_copy_off_with_one_warning(tiny_tmpfs: Path) -> None:
    copy = NodeLocalCopy(str(tiny_tmpfs / "elastic_qa"), "/durable/run-a/checkpoints")
    assert copy.commit(1, files(1.0), FIELDS)  # small: fits
    with capture_logs() as logs:
        assert not copy.commit(2, files(2.0, numel=64 * 1024), FIELDS)  # 256 KiB: ENOSPC
        assert not copy.commit(3, files(3.0), FIELDS)  # off from here on: no second warning
    warnings = [entry for entry in logs if entry["event"] == "node_local_off"]
    assert len(warnings) == 1 and "No space left" in warnings[0]["error"]
    assert copy.newest() is None
    assert not os.path.exists(copy.directory)  # the memory it held is given back
