"""Attempt registration: every number handed out once, even when registrants race; stale writers refused."""

from __future__ import annotations

import multiprocessing
import threading
import uuid
from pathlib import Path

import pytest

from elastic_qa.checkpoint.backends import open_store
from elastic_qa.checkpoint.fencing import KEPT_CLAIMS, Fence
from elastic_qa.checkpoint.store import StaleWriterError


def _register_after(barrier, url: str, results) -> None:
    barrier.wait()
    results.put(Fence(open_store(url)).register(world_size=1))


def test_processes_registering_at_the_same_moment_each_get_their_own_attempt(tmp_path: Path) -> None:
    """Two jobs started on one run directory at once: the old check-then-write handed out duplicates."""
    context = multiprocessing.get_context("fork")
    url = str(tmp_path / "ckpt")
    numbers: list[int] = []
    for _ in range(6):
        barrier, results = context.Barrier(6), context.Queue()
        workers = [context.Process(target=_register_after, args=(barrier, url, results)) for _ in range(6)]
        for worker in workers:
            worker.start()
        numbers += [results.get(timeout=30) for _ in workers]
        for worker in workers:
            worker.join(timeout=30)
            assert worker.exitcode == 0
    assert len(numbers) == 36
    assert len(set(numbers)) == len(numbers), sorted(numbers)


def test_threads_registering_on_a_store_without_rename_each_get_their_own_attempt() -> None:
    url = f"memory://fence-{uuid.uuid4().hex}"
    numbers: list[int] = []
    lock = threading.Lock()
    barrier = threading.Barrier(8)

    def register() -> None:
        barrier.wait()
        number = Fence(open_store(url)).register(world_size=1)
        with lock:
            numbers.append(number)

    threads = [threading.Thread(target=register) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(numbers) == sorted(set(numbers)) and len(numbers) == 8


def test_a_registered_attempt_fences_every_older_one(tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "ckpt"))
    old, new = Fence(store), Fence(store)
    old.register(world_size=2)
    new.register(world_size=2)

    new.check()
    with pytest.raises(StaleWriterError, match=f"attempt {old.attempt} is stale"):
        old.check()


def test_attempt_files_of_earlier_versions_still_count(tmp_path: Path) -> None:
    """Runs started before claims carried a token keep their numbers: the next attempt is newer."""
    attempts = tmp_path / "ckpt" / "attempts"
    attempts.mkdir(parents=True)
    (attempts / "attempt-00000007.json").write_text('{"attempt": 7}')

    assert Fence(open_store(str(tmp_path / "ckpt"))).register(world_size=1) == 8


def test_a_winner_deletes_the_claims_far_below_its_own_and_numbers_stay_unique_and_rising(
    tmp_path: Path,
) -> None:
    """A run that regroups for days keeps a bounded attempts/ (a save lists it), and nothing changes for the
    fence: older writers stay refused, the next number is still past every one handed out."""
    attempts = tmp_path / "ckpt" / "attempts"
    attempts.mkdir(parents=True)
    (attempts / "attempt-00000001.json").write_text('{"attempt": 1}')  # an earlier version's claim
    store = open_store(str(tmp_path / "ckpt"))
    first = Fence(store)
    numbers = [first.register(world_size=1)] + [
        Fence(store).register(world_size=1) for _ in range(KEPT_CLAIMS + 20)
    ]
    assert numbers == list(range(2, KEPT_CLAIMS + 23))
    kept = sorted(int(path.name[8:16]) for path in attempts.iterdir())
    assert kept == list(range(numbers[-1] - KEPT_CLAIMS, numbers[-1] + 1))
    with pytest.raises(StaleWriterError):
        first.check()  # its claim is gone, and it is still refused
    assert Fence(store).register(world_size=1) == numbers[-1] + 1
