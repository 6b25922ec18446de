"""The lineage's two encodings: torchft's step counter (a position) and the cross-group sum's slots."""

from __future__ import annotations

import pytest
import torch

from elastic_qa.replica.durable import ReplicaPosition
from elastic_qa.replica.worker import DIGIT, lineage_slots, read_lineage_slots


@pytest.mark.parametrize(("lineage", "step"), [(0, 0), (1, 0), (1, 1), (7, 123_456), (2**31, 2**32 - 1)])
def test_a_position_round_trips_through_one_integer(lineage: int, step: int) -> None:
    assert ReplicaPosition.decode(ReplicaPosition(lineage, step).encode()) == ReplicaPosition(lineage, step)


def test_a_newer_lineage_is_ahead_of_an_older_one_whatever_their_steps() -> None:
    """What makes torchft heal the older lineage's groups from the newer one's."""
    assert ReplicaPosition(3, 0).encode() > ReplicaPosition(2, 2**32 - 1).encode()
    assert ReplicaPosition(3, 11).encode() > ReplicaPosition(3, 10).encode()


def test_a_step_past_the_position_s_range_is_refused() -> None:
    with pytest.raises(ValueError, match="no position"):
        ReplicaPosition(1, 2**32).encode()


@pytest.mark.parametrize("lineage", [0, 1, DIGIT - 1, DIGIT, DIGIT**2 + 5, DIGIT**3 - 2])
@pytest.mark.parametrize("groups", [1, 2, 7])
def test_the_slots_summed_over_the_groups_give_rank_0s_lineages_and_the_members_sum_exactly(
    lineage: int, groups: int
) -> None:
    summed = lineage_slots(lineage + 1, lineage, True)
    for _ in range(groups - 1):
        summed = summed + lineage_slots(0, lineage, False)  # float32 sums, as the all-reduce's
    assert summed.dtype == torch.float32
    assert read_lineage_slots(summed) == (lineage + 1, lineage, groups * lineage)


def test_a_member_of_another_lineage_shows_in_the_sum() -> None:
    summed = lineage_slots(9, 8, True) + lineage_slots(0, 5, False)
    claimed, first, every = read_lineage_slots(summed)
    assert (claimed, first) == (9, 8) and every != 2 * first


def test_a_lineage_past_the_slots_range_is_refused() -> None:
    with pytest.raises(ValueError, match="exactly"):
        lineage_slots(DIGIT**3, 1, True)
