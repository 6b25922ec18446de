"""Each step's global batch split over a quorum's places, and the ledger's proof (replica/shares.py)."""

from __future__ import annotations

import copy
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from elastic_qa.data.cursor import GlobalBatch, GlobalCursor
from elastic_qa.data.features import Features
from elastic_qa.prep.synthetic import generate
from elastic_qa.prep.tokenizer import WordTokenizer
from elastic_qa.prep.windows import build_features
from elastic_qa.replica.shares import ReplicaLedger, read_replica_ledger, share_batch, share_of, verify

# loader.py silences this at import, but pytest restores the warning filters around every test
pytestmark = pytest.mark.filterwarnings("ignore:.*set_vital.*:UserWarning")

Row = dict[str, Any]


def places(participants: int, workers: int) -> list[tuple[int, int]]:
    """Every (rank, worker) of a quorum, in place order (rank major)."""
    return [(rank, worker) for rank in range(participants) for worker in range(workers)]


def epoch_batches(num_samples: int, global_batch_size: int, seed: int) -> list[GlobalBatch]:
    """All the global batches of the first epoch, and the first of the second."""
    walker = GlobalCursor(num_samples, global_batch_size, seed).batches(1)
    steps = -(-num_samples // global_batch_size) + 1
    return list(itertools.islice(walker, steps))


# ---- share_of -----------------------------------------------------------------------------------------


NUM_SAMPLES = 23  # a prime: every global batch size below but 1 leaves a short last batch in the epoch


@pytest.mark.parametrize("global_batch_size", [1, 2, 5, 7, 12, 16])
@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("participants", [1, 2, 3, 4])
def test_the_shares_of_all_places_are_the_global_batch_split_in_place_order(
    participants: int, workers: int, global_batch_size: int
) -> None:
    batches = epoch_batches(NUM_SAMPLES, global_batch_size, seed=11)
    virtual_ranks = participants * workers
    if global_batch_size > 1:
        assert any(b.global_count < global_batch_size for b in batches)  # the short last batch is covered
    for batch in batches:
        shares = [share_of(batch, participants, r, workers, w) for r, w in places(participants, workers)]
        assert [i for share in shares for i in share] == batch.global_indices
        seen: set[int] = set()
        position = 0
        for share in shares:
            assert not seen & set(share), "shares overlap"
            seen |= set(share)
            assert share == batch.global_indices[position : position + len(share)], "not contiguous"
            position += len(share)
        sizes = [len(share) for share in shares]
        assert max(sizes) - min(sizes) <= 1
        assert sorted(sizes, reverse=True) == sizes  # the lower places take the extra windows
        if batch.global_count < virtual_ranks:
            assert sizes.count(0) == virtual_ranks - batch.global_count  # fewer windows than places


def test_fewer_windows_than_virtual_ranks_are_covered() -> None:
    batch = epoch_batches(NUM_SAMPLES, 5, seed=11)[-2]  # the last of epoch 0: 23 = 4 * 5 + 3
    assert (batch.epoch, batch.global_count) == (0, 3)
    shares = [share_of(batch, 3, r, 2, w) for r, w in places(3, 2)]  # 6 places, 3 windows
    assert shares == [[i] for i in batch.global_indices] + [[], [], []]


# ---- the ledger and verify ----------------------------------------------------------------------------

SAMPLES, BATCH, SEED, WORKERS = 23, 5, 4, 2


@dataclass
class Attempt:
    quorum: int
    groups: list[int]  # the quorum's replica groups, in replica-rank order
    committed: bool
    lineage: int  # the lineage the attempt commits in (each quorum claims its own)
    held: int = 0  # the lineage its groups held while training it


# Quorums change: 2 participants, then a failed attempt at step 3, retried by 1, then 3 participants.
# 23 windows in batches of 5: steps 1..4 take 5 each, step 5 the 3 left (epoch 0), steps 6.. epoch 1.
PLAN = [
    Attempt(1, [0, 1], True, 1),  # step 1
    Attempt(1, [0, 1], True, 1),  # step 2
    Attempt(2, [1, 0], False, 2),  # step 3, not committed: a peer failed during the sum
    Attempt(3, [0], True, 3),  # step 3 again, the same windows
    Attempt(3, [0], True, 3),  # step 4
    Attempt(4, [0, 2, 3], True, 4),  # step 5 (the short last batch of epoch 0)
    Attempt(4, [0, 2, 3], True, 4),  # step 6 (epoch 1)
    Attempt(4, [0, 2, 3], True, 4),  # step 7
]
STEPS = 7
# lineage -> (parent, the step it continues from), as each quorum's rank 0 group claims them
LINEAGES = {1: (0, 0), 2: (1, 2), 3: (1, 2), 4: (3, 4)}


class Job:
    """Simulates the replica loop's ledger writes: the real ReplicaLedger, one per (group, worker)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.cursor = GlobalCursor(SAMPLES, BATCH, SEED)
        self.step = 0
        self.ledgers: dict[tuple[int, int], ReplicaLedger] = {}
        self.attempts: list[tuple[int, int, list[int]]] = []  # (step, quorum, windows of all its shares)
        self.claimed: set[int] = set()

    def ledger(self, group: int, worker: int) -> ReplicaLedger:
        if (group, worker) not in self.ledgers:
            self.ledgers[group, worker] = ReplicaLedger(self.run_dir, group, worker)
        return self.ledgers[group, worker]

    def attempt(self, plan: Attempt, batch: GlobalBatch | None = None) -> GlobalBatch:
        """One step attempt by a quorum: every worker's share line, then every worker's commit line. The
        cursor moves only when it commits. `batch`: trains that batch instead (a lineage of its own)."""
        batch = batch or next(self.cursor.batches(self.step + 1))
        participants = len(plan.groups)
        if plan.lineage not in self.claimed and plan.lineage in LINEAGES:
            self.claimed.add(plan.lineage)
            self.ledger(plan.groups[0], 0).lineage(plan.lineage, *LINEAGES[plan.lineage])
        windows = []
        for rank, group in enumerate(plan.groups):
            for worker in range(WORKERS):
                share = share_of(batch, participants, rank, WORKERS, worker)
                windows += share
                self.ledger(group, worker).share(
                    batch.step, batch.epoch, plan.quorum, participants, rank, share, held=plan.held
                )
        for group in plan.groups:
            for worker in range(WORKERS):
                self.ledger(group, worker).commit(batch.step, plan.quorum, plan.committed, plan.lineage)
        self.attempts.append((batch.step, plan.quorum, windows))
        if plan.committed:
            self.cursor.advance_to(batch.epoch, batch.global_count)
            self.step = batch.step
        return batch

    def close(self) -> None:
        for ledger in self.ledgers.values():
            ledger.close()


def run_job(run_dir: Path, extra: Callable[[Job], None] | None = None) -> Job:
    job = Job(run_dir)
    for plan in PLAN:
        job.attempt(plan)
    if extra:
        extra(job)
    job.close()
    return job


@pytest.fixture
def job(tmp_path: Path) -> Job:
    return run_job(tmp_path / "run")


@pytest.fixture
def rows(job: Job) -> list[Row]:
    return read_replica_ledger(job.run_dir)


def check(rows: list[Row], steps: int = STEPS) -> list[str]:
    return verify(rows, SAMPLES, BATCH, SEED, steps, WORKERS).problems


def assert_one_problem(problems: list[str], prefix: str, *words: str) -> None:
    assert len(problems) == 1, problems
    assert problems[0].startswith(prefix), problems
    for word in words:
        assert word in problems[0], problems


def lines(rows: list[Row], kind: str, step: int, quorum: int | None = None) -> list[Row]:
    return [r for r in rows if r["kind"] == kind and r["step"] == step and quorum in (None, r["quorum"])]


def test_the_simulated_job_is_what_the_plan_says(job: Job, rows: list[Row]) -> None:
    assert job.step == STEPS
    files = sorted(p.name for p in (job.run_dir / "ledger").iterdir())
    assert len(files) == 4 * WORKERS  # groups 0..3, two workers each
    assert all(f".pid-{os.getpid()}." in name and name.endswith(".jsonl") for name in files)
    # the attempt that did not commit and its retry by another quorum trained the same windows
    (step_a, quorum_a, failed), (step_b, quorum_b, retried) = job.attempts[2:4]
    assert (step_a, step_b) == (3, 3) and quorum_a != quorum_b
    assert failed == retried
    share_rows = [r for r in rows if r["kind"] == "share"]
    assert len(share_rows) == (3 * 2 + 2 * 1 + 3 * 3) * WORKERS  # one per place of every attempt
    assert {r["epoch"] for r in lines(rows, "share", 5)} == {0}
    assert {r["epoch"] for r in lines(rows, "share", 6)} == {1}


def test_a_job_with_changing_quorums_and_a_retried_step_verifies(rows: list[Row]) -> None:
    verdict = verify(rows, SAMPLES, BATCH, SEED, STEPS, WORKERS)
    assert verdict.ok, verdict.problems
    assert verdict.steps == STEPS
    assert verdict.retried == 1


def test_the_failed_attempt_alone_would_not_count_as_the_step(rows: list[Row]) -> None:
    committing = [r for r in rows if not (r["kind"] == "commit" and r["step"] == 3 and r["quorum"] == 3)]
    assert_one_problem(check(committing), "step 3:", "committed by 0 quorums")


def test_a_step_committed_by_two_quorums_in_one_lineage(tmp_path: Path) -> None:
    def same_lineage(job: Job) -> None:
        # a group that restarted alone trains step 2 again in a quorum of its own, and commits it in the
        # lineage it had (no claim: what the lineages exist to prevent)
        step_2 = epoch_batches(SAMPLES, BATCH, SEED)[1]
        job.attempt(Attempt(9, [3], True, 1), batch=step_2)

    job = run_job(tmp_path / "run", same_lineage)
    verdict = verify(read_replica_ledger(job.run_dir), SAMPLES, BATCH, SEED, STEPS, WORKERS)
    assert_one_problem(verdict.problems, "step 2:", "committed by 2 quorums", "[1, 9]", "lineage 1")


def test_a_step_committed_again_in_a_discarded_lineage_is_counted_not_a_fault(tmp_path: Path) -> None:
    """Two quorums at once (a restarted Lighthouse): the side that claimed lineage 9 after step 1 commits
    step 2 again; the final model descends from the other side, so that step is discarded work."""

    def split(job: Job) -> None:
        LINEAGES[9] = (1, 1)
        try:
            step_2 = epoch_batches(SAMPLES, BATCH, SEED)[1]
            job.attempt(Attempt(9, [3], True, 9), batch=step_2)
        finally:
            del LINEAGES[9]

    job = run_job(tmp_path / "run", split)
    verdict = verify(read_replica_ledger(job.run_dir), SAMPLES, BATCH, SEED, STEPS, WORKERS)
    assert verdict.ok, verdict.problems
    assert verdict.discarded == 1 and verdict.lineages == [4, 3, 1]


def test_a_chain_through_a_lineage_without_its_record(rows: list[Row]) -> None:
    without = [r for r in rows if not (r["kind"] == "lineage" and r["lineage"] == 3)]
    assert "lineage 3 has no lineage line" in check(without)


def test_the_final_model_must_descend_from_step_zero(rows: list[Row]) -> None:
    rows = copy.deepcopy(rows)
    next(r for r in rows if r["kind"] == "lineage" and r["lineage"] == 1)["from_step"] = 1
    problems = check(rows)
    assert any("start at step 1, not 0" in p for p in problems), problems


def test_a_step_never_committed(rows: list[Row]) -> None:
    without = [r for r in rows if not (r["kind"] == "commit" and r["step"] == 4)]
    assert_one_problem(check(without), "step 4:", "committed by 0 quorums")


def test_a_step_past_the_last_commit_was_never_committed(rows: list[Row]) -> None:
    problems = check(rows, steps=STEPS + 1)
    assert_one_problem(problems, f"step {STEPS + 1}:", "committed by 0 lineages")


def test_a_missing_share_line_of_the_committing_quorum(rows: list[Row]) -> None:
    missing = lines(rows, "share", 6, quorum=4)[-1]
    assert (missing["rank"], missing["worker"]) == (2, 1)
    assert_one_problem(check([r for r in rows if r is not missing]), "step 6:", "shares of")


def test_a_missing_share_line_of_the_attempt_that_failed_does_not_matter(rows: list[Row]) -> None:
    failed = lines(rows, "share", 3, quorum=2)
    assert len(failed) == 4
    assert check([r for r in rows if r is not failed[0]]) == []


def test_a_share_line_written_twice(rows: list[Row]) -> None:
    again = lines(rows, "share", 2, quorum=1)[0]
    assert_one_problem(check([*rows, dict(again)]), "step 2:", "written twice")


def test_a_window_of_another_step_in_a_share(rows: list[Row]) -> None:
    """A share trained a window of the next step instead of its own: one window skipped, one repeated."""
    rows = copy.deepcopy(rows)
    step_5, step_6 = lines(rows, "share", 5, quorum=4), lines(rows, "share", 6, quorum=4)
    step_5[0]["samples"][0] = step_6[0]["samples"][0]
    assert_one_problem(check(rows), "step 5:", "not its batch")


def test_a_window_trained_twice_within_a_step(rows: list[Row]) -> None:
    """Every window of the batch is there, and one of them twice."""
    rows = copy.deepcopy(rows)
    step_1 = lines(rows, "share", 1)
    step_1[1]["samples"].append(step_1[0]["samples"][0])
    assert_one_problem(check(rows), "step 1:", "not its batch")


def test_a_window_of_the_step_skipped(rows: list[Row]) -> None:
    rows = copy.deepcopy(rows)
    lines(rows, "share", 4, quorum=3)[1]["samples"].pop()
    assert_one_problem(check(rows), "step 4:", "not its batch")


def test_a_share_line_of_a_place_the_quorum_does_not_have(rows: list[Row]) -> None:
    """As many lines as places, the right windows, but two claim one place and one place has none."""
    rows = copy.deepcopy(rows)
    share = lines(rows, "share", 6, quorum=4)[-1]
    assert (share["rank"], share["worker"]) == (2, 1)
    share["rank"] = 1
    assert_one_problem(check(rows), "step 6:", "shares of")


def test_shares_of_the_right_step_in_the_wrong_places_still_verify(rows: list[Row]) -> None:
    """Which place trained which windows does not change the summed gradient: the proof is the multiset."""
    rows = copy.deepcopy(rows)
    step_7 = lines(rows, "share", 7, quorum=4)
    step_7[0]["samples"], step_7[-1]["samples"] = step_7[-1]["samples"], step_7[0]["samples"]
    assert check(rows) == []


def test_a_share_line_of_the_wrong_epoch(rows: list[Row]) -> None:
    rows = copy.deepcopy(rows)
    share = lines(rows, "share", 6, quorum=4)[3]
    assert share["epoch"] == 1
    share["epoch"] = 0
    assert_one_problem(check(rows), "step 6:", "another epoch")


def test_participants_disagreeing(rows: list[Row]) -> None:
    rows = copy.deepcopy(rows)
    lines(rows, "share", 7, quorum=4)[2]["participants"] = 2
    assert_one_problem(check(rows), "step 7:", "participants")


def test_steps_committed_beyond_the_end(rows: list[Row]) -> None:
    assert_one_problem(check(rows, steps=STEPS - 2), "steps beyond 5 committed", "[6, 7]")


def test_a_torn_last_line_is_skipped(job: Job, rows: list[Row]) -> None:
    path = sorted((job.run_dir / "ledger").glob("replica-group-002.worker-001.*.jsonl"))[0]
    whole = path.read_bytes()
    assert whole.endswith(b"\n")
    with path.open("ab") as file:
        file.write(b'{"group":2,"worker":1,"kind":"share","step":8,"epoch":1,"quorum":4,"participants":3,"ra')
    assert read_replica_ledger(job.run_dir) == rows
    assert check(read_replica_ledger(job.run_dir)) == []


def test_a_killed_writer_leaves_only_its_torn_line_behind(tmp_path: Path) -> None:
    """A torn line of a writer killed mid-line costs that line only, not the ones before it."""
    run_dir = tmp_path / "run"
    ledger = ReplicaLedger(run_dir, 0, 0)
    ledger.share(1, 0, 1, 1, 0, [3, 1])
    ledger.commit(1, 1, True, 1)
    ledger.close()
    path = next((run_dir / "ledger").iterdir())
    text = path.read_text()
    path.write_text(text[: len(text) - 5])  # the commit line torn
    assert read_replica_ledger(run_dir) == [
        {"group": 0, "worker": 0, "kind": "share", "step": 1, "epoch": 0, "quorum": 1, "participants": 1,
         "rank": 0, "samples": [3, 1], "attempt": 1, "held": 0, "file": path.name},
    ]  # fmt: skip


def test_a_line_appended_after_a_torn_line_is_kept(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = ReplicaLedger(run_dir, 0, 0)
    first.share(1, 0, 1, 1, 0, [3, 1])
    first.close()
    path = next((run_dir / "ledger").iterdir())
    path.write_text(path.read_text()[:-7])  # killed mid-line
    again = ReplicaLedger(run_dir, 0, 0)  # the same pid (a restarted container): a file of its own
    again.share(1, 0, 2, 1, 0, [3, 1])
    again.close()
    assert [row["quorum"] for row in read_replica_ledger(run_dir)] == [2]


# ---- share_batch --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def features() -> Features:
    return build_features(generate("train", 20, 7, 0.15), WordTokenizer(4096), 64, 24, 32)


def test_an_empty_share_trains_one_padding_window_with_weight_zero(features: Features) -> None:
    lengths = np.asarray(features.lengths)
    batch = epoch_batches(len(features), 3, seed=2)[0]
    assert batch.global_count == 3
    shares = [share_of(batch, 2, r, 2, w) for r, w in places(2, 2)]  # 4 places, 3 windows
    assert shares[3] == []
    empty = share_batch(features, batch, shares[3], lengths, full_width=False)
    assert empty.indices == []
    assert empty.rows == 1
    assert torch.equal(empty.tensors["weights"], torch.zeros(1))
    assert (empty.step, empty.epoch, empty.global_count) == (batch.step, batch.epoch, 3)
    assert empty.global_tokens == int(lengths[batch.global_indices].sum())
    first = batch.global_indices[0]  # the padding window is a real window of the batch
    width = int(lengths[first])
    assert empty.tensors["input_ids"].shape == (1, width)
    assert torch.equal(
        empty.tensors["input_ids"][0], torch.from_numpy(features.input_ids[first, :width]).long()
    )

    full = share_batch(features, batch, shares[0], lengths, full_width=True)
    assert full.indices == shares[0] and len(shares[0]) == 1
    assert torch.equal(full.tensors["weights"], torch.ones(1))
    assert full.tensors["input_ids"].shape == (1, features.input_ids.shape[1])
    assert full.global_tokens == empty.global_tokens


def test_the_shares_of_a_step_carry_every_window_of_its_batch_once(features: Features) -> None:
    lengths = np.asarray(features.lengths)
    for batch in epoch_batches(len(features), 7, seed=5):
        built = [share_batch(features, batch, share_of(batch, 3, r, 1, 0), lengths, False) for r in range(3)]
        assert [i for b in built for i in b.indices] == batch.global_indices
        assert sum(float(b.tensors["weights"].sum()) for b in built) == batch.global_count
        assert {b.global_count for b in built} == {batch.global_count}


def test_a_worker_killed_after_the_vote_leaves_no_commit_line_and_the_step_still_verifies(
    rows: list[Row],
) -> None:
    """Its share was in the sum the others committed: the step's shares are still the whole batch."""
    commit = next(r for r in rows if r["kind"] == "commit" and r["step"] == 6 and r["group"] == 2)
    assert check([r for r in rows if r is not commit]) == []


def test_a_group_whose_vote_said_no_after_the_sum_went_through_still_trained_its_share(
    rows: list[Row],
) -> None:
    """torchft's vote is per group: group 3 said no at step 7 (it then heals from the others), but its share
    was in the gradient they committed."""
    rows = copy.deepcopy(rows)
    for row in rows:
        if row["kind"] == "commit" and row["step"] == 7 and row["group"] == 3:
            row["committed"] = False
    assert check(rows) == []


def test_quorum_ids_that_start_over_with_a_new_lighthouse_are_told_apart(tmp_path: Path) -> None:
    """The whole job started again (a new Lighthouse hands out quorum 1 again) and trains steps 1..7 in
    lineage 9, restored from nothing: the first job's steps are discarded, and a worker of the second job
    killed after its sum (no commit line at step 3) is still found by the lineage it held, not mixed up
    with the first job's shares of step 3 in quorum 1."""
    run_dir = tmp_path / "run"
    run_job(run_dir)
    LINEAGES[9] = (0, 0)
    try:
        again = Job(run_dir)
        for _ in range(STEPS):
            again.attempt(Attempt(1, [0, 1], True, 9, held=9))
        again.close()
    finally:
        del LINEAGES[9]
    rows = read_replica_ledger(run_dir)
    verdict = verify(rows, SAMPLES, BATCH, SEED, STEPS, WORKERS)
    assert verdict.ok, verdict.problems
    assert verdict.lineages == [9] and verdict.discarded == STEPS
    killed = [r for r in rows if r["kind"] == "commit" and r["step"] == 3 and r["lineage"] == 9][-1]
    assert check([r for r in rows if r is not killed]) == []
