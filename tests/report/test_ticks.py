"""Axis ticks: round 1-2-5 steps, 4 to 8 of them, log decades, labels without float noise."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from elastic_qa.report.ticks import log_ticks, nice_ticks, padded_range, tick_labels


def random_ranges(count: int, seed: int = 5) -> list[tuple[float, float]]:
    """Ranges from 1e-9 to 1e9 wide, anywhere from -1e9 to 1e9, some far from zero relative to width."""
    rng = random.Random(seed)
    ranges = []
    for _ in range(count):
        lo = rng.uniform(-1, 1) * 10 ** rng.uniform(-9, 9)
        ranges.append((lo, lo + 10 ** rng.uniform(-9, 9) * rng.random()))
    return ranges


def read_label(label: str) -> float:
    scale = {"p": 1e-12, "n": 1e-9, "µ": 1e-6, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    return float(label[:-1]) * scale[label[-1]] if label[-1] in scale else float(label)


def mantissa(step: float) -> int:
    return int(f"{step:e}"[0])


@pytest.mark.parametrize("inside", [False, True])
def test_linear_ticks_step_by_1_2_or_5_and_number_4_to_8_over_many_ranges(inside: bool) -> None:
    for lo, hi in random_ranges(3000):
        ticks, step = nice_ticks(lo, hi, inside=inside)
        assert 4 <= len(ticks) <= 8, (lo, hi, ticks)
        assert mantissa(step) in (1, 2, 5) and f"{step:e}"[1:].startswith(".000000e")
        assert all(math.isclose(b - a, step, rel_tol=1e-6) for a, b in itertools.pairwise(ticks))
        assert all(math.isclose(t / step, round(t / step), abs_tol=1e-6) for t in ticks)
        lo, hi = padded_range(lo, hi)
        slack = 1e-6 * step  # data within a millionth of a step of a tick is drawn on it
        covers = ticks[0] <= lo + slack and ticks[-1] >= hi - slack
        within = ticks[0] >= lo - slack and ticks[-1] <= hi + slack
        assert covers or (inside and within), (lo, hi, ticks)


def test_ticks_are_the_decimals_they_look_like_and_labels_carry_no_float_noise() -> None:
    ticks, step = nice_ticks(0.1, 0.30000000000000004)
    assert ticks == [0.1, 0.15, 0.2, 0.25, 0.3] and step == 0.05
    assert tick_labels(ticks, step) == ["0.1", "0.15", "0.2", "0.25", "0.3"]
    for lo, hi in random_ranges(2000, seed=9):
        ticks, step = nice_ticks(lo, hi)
        for tick, label in zip(ticks, tick_labels(ticks, step), strict=True):
            assert "e" not in label and "00000" not in label and "99999" not in label, (lo, hi, label)
            assert math.isclose(read_label(label), tick, abs_tol=step / 1000), (tick, label)


@pytest.mark.parametrize(
    ("lo", "hi", "labels"),
    [
        (0.000123, 0.001575, ["0", "500µ", "1m", "1.5m", "2m"]),
        (1e-05, 5.579e-05, ["10µ", "20µ", "30µ", "40µ", "50µ", "60µ"]),
        (1234, 98765, ["0", "20k", "40k", "60k", "80k", "100k"]),
        (0, 600, ["0", "100", "200", "300", "400", "500", "600"]),
        (-3, 7, ["-4", "-2", "0", "2", "4", "6", "8"]),
        (0, 0.002, ["0", "500µ", "1m", "1.5m", "2m"]),
        (1.2e6, 1.5e6, ["1.2M", "1.25M", "1.3M", "1.35M", "1.4M", "1.45M", "1.5M"]),
    ],
)
def test_labels_are_plain_decimals_or_si_prefixed_when_tiny_or_huge(
    lo: float, hi: float, labels: list[str]
) -> None:
    assert tick_labels(*nice_ticks(lo, hi)) == labels


def test_a_single_value_or_constant_series_gets_a_padded_axis_around_it() -> None:
    ticks, _ = nice_ticks(60, 60)  # one evaluation at step 60: not a 59.5..60.5 axis
    assert ticks[0] < 60 < ticks[-1] and ticks[-1] - ticks[0] >= 10 and 60 in ticks
    ticks, _ = nice_ticks(0, 0)
    assert ticks[0] < 0 < ticks[-1] and 0 in ticks
    ticks, _ = nice_ticks(0.0023, 0.0023)
    assert ticks[0] < 0.0023 < ticks[-1] and 4 <= len(ticks) <= 8
    assert padded_range(-5, -5) == (-5.5, -4.5)
    ticks, _ = log_ticks(0.5, 0.5)
    assert ticks[0] < 0.5 < ticks[-1]


def test_count_axes_step_by_whole_numbers() -> None:
    for top in range(1, 40):
        ticks, step = nice_ticks(0, top, integer=True)
        assert step >= 1 and all(t == int(t) for t in ticks) and 4 <= len(ticks) <= 8
    assert nice_ticks(0, 2, integer=True)[0] == [0, 1, 2, 3]


def test_log_ticks_sit_at_powers_of_ten_with_2_and_5_between_over_few_decades() -> None:
    ticks, step = log_ticks(1e-5, 0.8)  # five decades: powers of ten only
    assert step is None and ticks == [1e-05, 1e-4, 1e-3, 0.01, 0.1, 1]
    assert tick_labels(ticks) == ["10µ", "100µ", "1m", "10m", "100m", "1"]
    ticks, _ = log_ticks(0.3, 4)  # one decade and a bit: 1-2-5
    assert ticks == [0.2, 0.5, 1, 2, 5]
    assert tick_labels(ticks) == ["0.2", "0.5", "1", "2", "5"]
    ticks, _ = log_ticks(1.5, 4)  # within a decade: every digit
    assert ticks == [1, 2, 3, 4]


def test_log_ticks_over_many_decades_are_thinned_to_at_most_8_and_narrow_ranges_get_4() -> None:
    rng = random.Random(3)
    for _ in range(3000):
        lo = 10 ** rng.uniform(-15, 10)
        hi = lo * 10 ** rng.uniform(0.01, 25)
        ticks, step = log_ticks(lo, hi)
        assert 4 <= len(ticks) <= 8, (lo, hi, ticks)
        assert ticks[0] <= lo * (1 + 1e-9) and ticks[-1] >= hi * (1 - 1e-9), (lo, hi, ticks)
        if math.log10(hi / lo) >= 3:
            assert all(mantissa(t) == 1 for t in ticks)
        assert len(set(tick_labels(ticks, step))) == len(ticks), ticks
