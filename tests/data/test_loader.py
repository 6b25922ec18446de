"""The per-rank train loader: the same batches with or without workers, step-numbered, trimmed pads."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from elastic_qa.data.cursor import GlobalCursor, rank_slice
from elastic_qa.data.loader import StepBatch, build_train_loader, collate
from elastic_qa.prep.synthetic import generate
from elastic_qa.prep.tokenizer import PAD, WordTokenizer
from elastic_qa.prep.windows import build_features

# loader.py silences this at import, but pytest restores the warning filters around every test
pytestmark = pytest.mark.filterwarnings("ignore:.*set_vital.*:UserWarning")


@pytest.fixture(scope="module")
def features():
    return build_features(generate("train", 60, 7, 0.15), WordTokenizer(4096), 64, 24, 32)


def batches(features, cursor, first_step, last_step, rank=0, world_size=1, num_workers=0) -> list[StepBatch]:
    loader = build_train_loader(features, cursor, first_step, last_step, rank, world_size, num_workers)
    return list(loader)


def assert_same_batches(left: list[StepBatch], right: list[StepBatch]) -> None:
    assert len(left) == len(right)
    for a, b in zip(left, right, strict=True):
        assert isinstance(a, StepBatch) and isinstance(b, StepBatch)
        assert (a.step, a.epoch, a.global_count, a.global_tokens, a.indices) == (
            b.step,
            b.epoch,
            b.global_count,
            b.global_tokens,
            b.indices,
        )
        assert a.tensors.keys() == b.tensors.keys()
        for key, value in a.tensors.items():
            assert torch.equal(value, b.tensors[key]), key


@pytest.mark.parametrize(("rank", "world_size"), [(0, 1), (1, 3)])
def test_two_workers_yield_the_same_batches_as_the_training_process(features, rank, world_size):
    cursor = GlobalCursor(len(features), global_batch_size=8, seed=3)
    cursor.advance_to(0, 16)
    inline = batches(features, cursor, 3, 14, rank, world_size, num_workers=0)
    workers = batches(features, cursor, 3, 14, rank, world_size, num_workers=2)
    assert len(inline) == 12
    assert_same_batches(inline, workers)


def test_batches_carry_step_numbers_from_first_step_and_the_rank_share_of_the_cursor_order(features):
    cursor = GlobalCursor(len(features), global_batch_size=7, seed=9)
    expected = cursor.batches(first_step=11)
    got = batches(features, cursor, 11, 18, rank=1, world_size=2)
    assert [b.step for b in got] == list(range(11, 19))
    for batch in got:
        step_batch = next(expected)
        start, stop = rank_slice(step_batch.global_count, 2, 1)
        assert batch.indices == step_batch.global_indices[start:stop]
        assert batch.epoch == step_batch.epoch
        assert batch.global_count == step_batch.global_count
        assert torch.equal(batch.tensors["weights"], torch.ones(stop - start))


def test_the_loader_length_is_the_number_of_steps(features):
    cursor = GlobalCursor(len(features), 8, seed=1)
    assert len(build_train_loader(features, cursor, 5, 9, 0, 1, 0)) == 5
    assert len(build_train_loader(features, cursor, 5, 4, 0, 1, 0)) == 0


def test_the_loader_keeps_its_own_snapshot_of_the_cursor(features):
    cursor = GlobalCursor(len(features), 8, seed=1)
    loader = build_train_loader(features, cursor, 1, 3, 0, 1, 0)
    walker = GlobalCursor(len(features), 8, seed=1).batches(1)
    expected = [next(walker).global_indices for _ in range(3)]
    cursor.advance_to(0, 8)  # the trainer moves its cursor while the loader prefetches
    assert [b.indices for b in loader] == expected


def test_ranks_together_cover_each_global_batch_exactly(features):
    cursor = GlobalCursor(len(features), global_batch_size=10, seed=2)
    per_rank = [batches(features, cursor, 1, 6, rank, 4) for rank in range(4)]
    walker = cursor.batches(1)
    for step in range(6):
        expected = next(walker).global_indices
        assert [i for rank in range(4) for i in per_rank[rank][step].indices] == expected


def test_a_rank_with_an_empty_share_trains_one_sample_with_weight_zero(features):
    num_samples = 10
    cursor = GlobalCursor(num_samples, global_batch_size=4, seed=5)  # steps of 4, 4 and then 2 samples
    last = {rank: batches(features, cursor, 1, 3, rank, 4)[-1] for rank in range(4)}
    for rank in (0, 1):
        assert len(last[rank].indices) == 1
        assert torch.equal(last[rank].tensors["weights"], torch.ones(1))
    for rank in (2, 3):
        batch = last[rank]
        assert batch.indices == []
        assert batch.global_count == 2
        assert batch.rows == batch.tensors["input_ids"].shape[0] == 1
        assert torch.equal(batch.tensors["weights"], torch.zeros(1))
        assert batch.step == 3


def test_pads_are_trimmed_to_the_longest_sequence_in_the_batch(features):
    lengths = (np.asarray(features.input_ids) != PAD).sum(axis=1)
    rows = np.argsort(lengths)[:5]  # the shortest windows
    batch = collate(features, rows)
    width = int(lengths[rows].max())
    assert width < features.input_ids.shape[1]
    assert batch["input_ids"].shape == (5, width)
    assert batch["token_type_ids"].shape == batch["attention_mask"].shape == (5, width)
    assert torch.equal(batch["token_type_ids"], torch.from_numpy(features.segment_ids[rows, :width]).long())
    assert torch.equal(batch["attention_mask"], (batch["input_ids"] != PAD).long())
    assert torch.equal(batch["input_ids"], torch.from_numpy(features.input_ids[rows, :width]).long())
    assert (np.asarray(features.input_ids)[rows, width:] == PAD).all()  # only pads were cut
    assert int(batch["attention_mask"].sum()) == int(lengths[rows].sum())
    assert batch["input_ids"].dtype == torch.long
    assert torch.equal(batch["start_positions"], torch.from_numpy(features.start_positions[rows]).long())


def test_loader_batches_are_trimmed_per_batch(features):
    cursor = GlobalCursor(len(features), global_batch_size=6, seed=4)
    lengths = (np.asarray(features.input_ids) != PAD).sum(axis=1)
    for batch in batches(features, cursor, 1, 8):
        assert batch.tensors["input_ids"].shape[1] == int(lengths[batch.indices].max())


def test_a_step_batch_pickles_and_pins_into_a_step_batch(features):
    cursor = GlobalCursor(len(features), global_batch_size=4, seed=1)
    batch = batches(features, cursor, 1, 1)[0]
    again = pickle.loads(pickle.dumps(batch))  # loader workers send it to the training process
    assert_same_batches([batch], [again])
    if torch.cuda.is_available():  # pinning needs an accelerator
        pinned = batch.pin_memory()
        assert isinstance(pinned, StepBatch) and all(t.is_pinned() for t in pinned.tensors.values())
