"""argparse types shared by the commands: a whole number >= 1 and a duration above 0 (e.g. 30s, 5m)."""

from __future__ import annotations

import argparse
from datetime import timedelta

from elastic_qa.config import parse_duration


def whole_number(text: str) -> int:
    """A whole number >= 1 (argparse says which argument on error)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number >= 1")
    return value


def positive_duration(text: str) -> timedelta:
    """A duration above 0, in the config's syntax (30s, 5m, 1h, or seconds as a number)."""
    try:
        value = parse_duration(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if value <= timedelta(0):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a duration above 0, e.g. 30s")
    return value
