"""The overhead benchmark's arithmetic: the rotation of the sides and the comparison of two sides' blocks."""

from __future__ import annotations

import itertools

import pytest

from elastic_qa.bench.interleaved import order
from elastic_qa.bench.overhead import compare, pairs


def test_each_side_runs_first_and_follows_each_other_side_equally_often() -> None:
    sides = ["skeleton", "recipe", "product"]
    rounds = [order(sides, r) for r in range(6)]
    assert rounds[0] == sides and rounds[1] == ["recipe", "product", "skeleton"]
    assert {side: sum(r[0] == side for r in rounds) for side in sides} == dict.fromkeys(sides, 2)
    sequence = [side for r in rounds for side in r]
    after = {(a, b) for a, b in itertools.pairwise(sequence) if a != b}
    assert after == {(a, b) for a in sides for b in sides if a != b}


def test_compare_is_the_ratio_of_totals_with_an_interval_around_it() -> None:
    same = compare([2.0, 2.0, 2.0], [1.0, 1.0, 1.0])
    assert same == {"ratio_of_totals": 2.0, "ci95": [2.0, 2.0], "median_round_ratio": 2.0, "rounds": 3}
    # One slow block of side a: the total moves, the median of the rounds' ratios does not.
    burst = compare([1.0, 1.0, 1.0, 1.0, 3.0], [1.0] * 5)
    assert burst["ratio_of_totals"] == pytest.approx(7 / 5) and burst["median_round_ratio"] == 1.0
    assert burst["ci95"][0] == pytest.approx(1.0) and burst["ci95"][1] > 7 / 5
    assert compare([1.0, 3.0], [1.0, 1.0], seed=5) == compare([1.0, 3.0], [1.0, 1.0], seed=5)  # seeded
    with pytest.raises(ValueError, match="rounds differ"):
        compare([1.0], [1.0, 1.0])
    with pytest.raises(ValueError):
        compare([], [])


def test_pairs_put_each_side_over_every_side_before_it() -> None:
    assert pairs(["skeleton", "recipe", "product"]) == [
        ("recipe", "skeleton"),
        ("product", "skeleton"),
        ("product", "recipe"),
    ]
