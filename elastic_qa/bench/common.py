"""What the benchmarks share: argument errors, alternating repetitions, medians with spread, tables, JSON.

The machine the benchmarks run on is shared and noisy, so every figure is a median over repetitions with
its min..max shown, and compared variants run alternately (A B A B ...) so that a slow spell hits all of
them rather than one.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from elastic_qa.argtypes import positive_duration, whole_number
from elastic_qa.exits import UsageError


class BenchError(RuntimeError):
    """A measured run failed; the message names the run and where its output is."""


class BenchParser(argparse.ArgumentParser):
    """argparse that reports a bad argument as one line (UsageError) instead of usage text and exit."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{self.prog}: {message}")


def new_parser(name: str, description: str, reps: int | None, reps_note: str = "") -> BenchParser:
    """A benchmark's parser with the options all of them share (--reps unless reps is None: a
    deterministic benchmark; --json, --work-dir). `reps_note` replaces "default N" in --reps' help."""
    parser = BenchParser(
        prog=f"elastic-qa bench {name}",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if reps is not None:
        parser.add_argument(
            "--reps", type=positive_int, default=reps, help=f"repetitions ({reps_note or f'default {reps}'})"
        )
    parser.add_argument("--json", type=Path, help="write the figures and settings to this JSON file")
    parser.add_argument(
        "--work-dir",
        type=Path,
        help="keep run directories and logs here (default: a temporary directory, removed at the end)",
    )
    return parser


def add_config_arguments(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--config", default=default, help=f"config file or packaged name (default {default})")
    parser.add_argument("overrides", nargs="*", help="config overrides section.key=value (all variants)")


# The benchmarks' argument types, as every command's.
positive_int = whole_number
duration = positive_duration


def int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values:
        raise argparse.ArgumentTypeError("empty list")
    return values


def choice_list(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """argparse type: a comma-separated subset of `choices`, in the order given."""

    def parse(text: str) -> list[str]:
        values = [part.strip() for part in text.split(",") if part.strip()]
        unknown = [v for v in values if v not in choices]
        if unknown or not values:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {','.join(choices)}")
        return values

    return parse


def alternate(reps: int, variants: Sequence[Any]) -> Iterator[tuple[int, Any]]:
    """(rep, variant) in the order A B A B ...: drift on a shared machine hits every variant alike."""
    for rep in range(reps):
        for variant in variants:
            yield rep, variant


def summary(values: Sequence[float]) -> dict[str, Any]:
    """Median and spread of one figure over the repetitions (the raw values are kept for the JSON)."""
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "values": list(values),
    }


def show(stat: dict[str, Any], spec: str = ".3f") -> str:
    """`median (min..max)`; only the median when there was one repetition."""
    if len(stat["values"]) == 1:
        return format(stat["median"], spec)
    return f"{stat['median']:{spec}} ({stat['min']:{spec}}..{stat['max']:{spec}})"


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=True)]
    for i, row in enumerate([headers, *rows]):
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
        if i == 0:
            print("  ".join("-" * width for width in widths))


def goal_line(name: str, value: float, limit: float, spec: str = ".3f") -> str:
    verdict = "met" if value <= limit else "NOT met"
    return f"goal {name} <= {limit:{spec}}: {value:{spec}} ({verdict})"


def write_json(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
