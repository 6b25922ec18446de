"""The world-size-free data position: exact once-per-epoch coverage across any sequence of restarts."""

from __future__ import annotations

import itertools
import random
from collections import defaultdict

import pytest
import torch

from elastic_qa.data import cursor as cursor_module
from elastic_qa.data.cursor import GlobalCursor, epoch_order, rank_slice


@pytest.mark.parametrize("world_size", range(1, 9))
def test_rank_slices_partition_every_batch_size_exactly(world_size):
    for batch_size in range(0, 50):
        slices = [rank_slice(batch_size, world_size, rank) for rank in range(world_size)]
        assert slices[0][0] == 0
        assert slices[-1][1] == batch_size
        for (_, stop), (start, _) in itertools.pairwise(slices):
            assert stop == start  # contiguous, no gap, no overlap
        sizes = [stop - start for start, stop in slices]
        assert max(sizes) - min(sizes) <= 1
        assert sizes == sorted(sizes, reverse=True)  # lower ranks take the extra samples


def test_epoch_order_is_a_seeded_permutation_that_changes_every_epoch():
    orders = [epoch_order(500, 11, epoch) for epoch in range(4)]
    for order in orders:
        assert sorted(order.tolist()) == list(range(500))
    assert len({tuple(order.tolist()) for order in orders}) == 4
    assert torch.equal(epoch_order(500, 11, 2), orders[2])
    assert not torch.equal(epoch_order(500, 12, 0), orders[0])


def test_iterating_walks_the_epoch_order_and_continues_into_the_next_epoch():
    cursor = GlobalCursor(num_samples=10, global_batch_size=4, seed=3)
    batches = cursor.batches(first_step=1)
    got = [next(batches) for _ in range(4)]
    order0, order1 = epoch_order(10, 3, 0).tolist(), epoch_order(10, 3, 1).tolist()
    assert [b.step for b in got] == [1, 2, 3, 4]
    assert [b.epoch for b in got] == [0, 0, 0, 1]
    assert [b.global_indices for b in got] == [order0[0:4], order0[4:8], order0[8:10], order1[0:4]]
    assert [b.global_count for b in got] == [4, 4, 2, 4]  # the short last batch of the epoch
    assert (cursor.epoch, cursor.samples_consumed) == (0, 0)  # iterating does not move the cursor


def walk(num_samples: int, epochs: int, batch_sizes, seed: int = 5) -> dict[int, list[int]]:
    """Train `epochs` epochs: restart from a state_dict at random points, with a random world size (1-4)
    and a global batch size from `batch_sizes` per restart; collect what every rank trained on per epoch."""
    rng = random.Random(seed)
    state = GlobalCursor(num_samples, batch_sizes[0], seed=99).state_dict()
    seen: dict[int, list[int]] = defaultdict(list)
    step = 1
    while state["epoch"] < epochs:
        fresh = GlobalCursor(num_samples, rng.choice(batch_sizes), seed=0)  # seed comes from the state
        fresh.load_state_dict(state)
        batches = fresh.batches(step)
        for _ in range(rng.randint(1, 4)):  # steps until the next restart
            world_size = rng.choice([1, 2, 3, 4])
            batch = next(batches)
            assert batch.step == step
            for rank in range(world_size):
                start, stop = rank_slice(batch.global_count, world_size, rank)
                seen[batch.epoch] += batch.global_indices[start:stop]
            fresh.advance_to(batch.epoch, batch.global_count)
            step += 1
            if fresh.epoch >= epochs:
                break
        state = fresh.state_dict()
    return seen


def test_each_sample_is_trained_once_per_epoch_across_restarts_and_world_size_changes():
    seen = walk(num_samples=103, epochs=3, batch_sizes=[8])  # 103 = 12 * 8 + 7: a short last batch
    assert sorted(seen) == [0, 1, 2]
    for epoch, indices in seen.items():
        assert sorted(indices) == list(range(103)), epoch
    assert seen[0] != seen[1]  # a new order each epoch


def test_coverage_holds_when_the_global_batch_size_changes_at_a_restart():
    seen = walk(num_samples=61, epochs=2, batch_sizes=[4, 7, 16], seed=8)
    for indices in seen.values():
        assert sorted(indices) == list(range(61))


def test_the_state_dict_records_the_position_and_seed():
    cursor = GlobalCursor(num_samples=20, global_batch_size=8, seed=4)
    cursor.advance_to(0, 8)
    cursor.advance_to(0, 8)
    assert cursor.state_dict() == {"epoch": 0, "samples_consumed": 16, "num_samples": 20, "seed": 4}
    cursor.advance_to(0, 4)  # the short last batch completes the epoch
    assert (cursor.epoch, cursor.samples_consumed) == (1, 0)
    cursor.advance_to(1, 8)
    assert (cursor.epoch, cursor.samples_consumed) == (1, 8)


def test_seeking_to_99_percent_gives_the_same_next_batch_as_iterating_there(monkeypatch):
    num_samples, batch_size, seed = 10_000, 32, 21
    walked = GlobalCursor(num_samples, batch_size, seed).batches(first_step=1)
    for _ in range(309):  # 309 * 32 = 9888 samples: 98.9% of the epoch
        expected = next(walked)
    expected = next(walked)

    orders = []
    real_order = cursor_module.epoch_order
    monkeypatch.setattr(cursor_module, "epoch_order", lambda *a: orders.append(a) or real_order(*a))
    seeked = GlobalCursor(num_samples, batch_size, seed=0)
    seeked.load_state_dict({"epoch": 0, "samples_consumed": 9888, "num_samples": num_samples, "seed": seed})
    batches = seeked.batches(first_step=310)
    assert (batches.epoch, batches.position, batches.step) == (0, 9888, 310)  # starts there: no walking
    assert orders == [(num_samples, seed, 0)]  # one permutation, whatever the position
    got = next(batches)
    assert (got.step, got.epoch, got.global_indices) == (
        expected.step,
        expected.epoch,
        expected.global_indices,
    )
    assert next(batches).global_indices == next(walked).global_indices


def test_load_state_dict_rejects_a_dataset_of_another_size():
    state = GlobalCursor(100, 8, seed=1).state_dict()
    cursor = GlobalCursor(101, 8, seed=1)
    with pytest.raises(ValueError) as info:
        cursor.load_state_dict(state)
    assert "100" in str(info.value) and "101" in str(info.value)
    assert (cursor.epoch, cursor.samples_consumed) == (0, 0)


def test_an_empty_dataset_is_rejected():
    with pytest.raises(ValueError):
        GlobalCursor(0, 8, seed=1)
