"""Axis ticks a person can read: round 1-2-5 steps, 4 to 8 of them, labels without float noise.

Linear axes step by 1, 2 or 5 times a power of ten and widen the range to the outer ticks; log axes put
ticks at powers of ten (with 2 and 5 between them when the range spans few decades). Labels are plain
decimals, or SI-prefixed (`1.5k`, `20m`, `5µ`) when the values are very small or very large. A degenerate
range (one value) is padded first, so a single point sits in the middle of a sensible axis.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

MIN_TICKS, MAX_TICKS, TARGET_TICKS = 4, 8, 6
_SI = {-12: "p", -9: "n", -6: "µ", -3: "m", 0: "", 3: "k", 6: "M", 9: "G", 12: "T"}


def _decimal(mantissa: int, exponent: int) -> float:
    """mantissa * 10**exponent as the float nearest that decimal (so 3 * 10**-1 is exactly 0.3)."""
    return mantissa * 10**exponent if exponent >= 0 else mantissa / 10**-exponent


def padded_range(lo: float, hi: float, log: bool = False) -> tuple[float, float]:
    """The range to draw: a single value (or a log range within 0.1%) widened around itself."""
    if lo > hi:
        lo, hi = hi, lo
    if log:
        return (lo / 2, hi * 2) if hi / lo < 1.001 else (lo, hi)
    if hi - lo > 1e-9 * max(abs(lo), abs(hi)) and hi > lo:
        return lo, hi
    pad = abs(lo) * 0.1 if lo else 1.0
    return lo - pad, hi + pad


def _steps(span: float) -> list[tuple[int, int]]:
    """1-2-5 steps as (mantissa, exponent), from one above the span down to a thousandth of it."""
    top = math.floor(math.log10(span)) + 1
    return [(m, e) for e in range(top, top - 4, -1) for m in (5, 2, 1)]


def nice_ticks(
    lo: float, hi: float, inside: bool = False, integer: bool = False
) -> tuple[list[float], float]:
    """Ticks of a linear axis and their step: 4 to 8 multiples of a 1-2-5 step (one always fits: each
    smaller step gives at most 2.5 times as many, plus two). They cover [lo, hi], the axis then ending
    at the outer ticks, or with `inside` lie within it where 4 to 8 can (an axis that ends where the
    data does). `integer`: no step below 1 (counts)."""
    lo, hi = padded_range(lo, hi)
    if integer:
        hi = max(hi, lo + MIN_TICKS - 1)
    candidates = []
    for mantissa, exponent in _steps(hi - lo):
        if integer and exponent < 0:
            continue
        step = _decimal(mantissa, exponent)
        if inside:
            first, last = math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9)
        else:
            first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
        candidates.append((last - first + 1, mantissa, exponent, first, last))
    fitting = [c for c in candidates if MIN_TICKS <= c[0] <= MAX_TICKS]
    if not fitting:  # inside, a step can jump from 3 ticks to 10: cover the range instead
        return nice_ticks(lo, hi, integer=integer)
    _, mantissa, exponent, first, last = min(fitting, key=lambda c: abs(c[0] - TARGET_TICKS))
    return [_decimal(k * mantissa, exponent) for k in range(first, last + 1)], _decimal(mantissa, exponent)


def log_ticks(lo: float, hi: float) -> tuple[list[float], float | None]:
    """Ticks of a log axis covering [lo, hi] (both > 0), and their linear step if they have one: powers
    of ten (every second or more over many decades), with 2 and 5, then every digit, between them over
    few; within about a decade, where neither fits, linear 1-2-5 ticks. The range widens to the outer
    ticks."""
    lo, hi = padded_range(lo, hi, log=True)
    low, high = math.floor(math.log10(lo) + 1e-9), math.ceil(math.log10(hi) - 1e-9)
    if high - low >= MAX_TICKS:  # every second power of ten or fewer, at multiples of the stride
        stride = next(s for s in itertools.count(2) if math.ceil(high / s) - math.floor(low / s) < MAX_TICKS)
        return [_decimal(1, e) for e in range(math.floor(low / stride) * stride, high + stride, stride)], None
    for mantissas in ((1,), (1, 2, 5), (1, 2, 3, 4, 5, 6, 7, 8, 9)):
        ticks = [_decimal(m, e) for e in range(low, high) for m in mantissas] + [_decimal(1, high)]
        # Only the ticks inside, plus one on each side: the axis ends near the data.
        first = max(i for i, t in enumerate(ticks) if t <= lo * (1 + 1e-9))
        last = min(i for i, t in enumerate(ticks) if t >= hi * (1 - 1e-9))
        if MIN_TICKS <= last - first + 1 <= MAX_TICKS:
            return ticks[first : last + 1], None
    ticks, step = nice_ticks(lo, hi)
    return [t for t in ticks if t > 0], step


def _decimals(step: float) -> int:
    """Digits after the point that a multiple of `step` (a 1-2-5 step) needs."""
    return max(0, -math.floor(math.log10(step) + 1e-9))


def tick_labels(ticks: Sequence[float], step: float | None = None) -> list[str]:
    """Labels for one axis: plain decimals, or SI prefixes when every tick is below 0.01 or one reaches
    10,000. `step` is the linear step (None on a log axis: each tick is then labelled on its own)."""
    magnitudes = [abs(t) for t in ticks if t]
    if not magnitudes:
        return ["0" for _ in ticks]
    use_si = max(magnitudes) >= 1e4 or max(magnitudes) < 0.01 or min(magnitudes) < 1e-3
    labels = []
    for tick in ticks:
        if not tick:
            labels.append("0")
            continue
        exponent = 0
        if use_si:
            exponent = max(-12, min(12, 3 * math.floor(math.log10(abs(tick)) / 3 + 1e-9)))
        unit = _decimal(1, exponent)
        resolution = step if step else abs(tick) / 100  # a log tick: up to two significant digits kept
        text = f"{tick / unit:.{_decimals(resolution / unit)}f}"
        if "." in text:
            text = text.rstrip("0").rstrip(".")
        labels.append(("-" if text.startswith("-") else "") + text.lstrip("-") + _SI[exponent])
    return labels
