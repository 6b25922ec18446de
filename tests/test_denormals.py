"""train.flush_denormals: every thread of a worker treats denormal floats as zero, when set in time.

A pool thread keeps the floating-point flags it started with, so the flag must be set before torch's
first parallel operation (elastic_qa/dist.py: flush_denormals). Each case runs in a fresh interpreter
with 2 intra-op threads, since a thread pool that exists already cannot be changed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SCRIPT = """
import json, sys, torch
torch.set_num_threads(2)
from elastic_qa.dist import denormals_flushed, flush_denormals, set_denormals
warnings = []
if sys.argv[1] == "late":
    torch.ones(1 << 20).mul_(2.0)  # a parallel operation first: the pool's threads exist
before = denormals_flushed(every_thread=True) if sys.argv[1] == "late" else denormals_flushed()
every = set_denormals(True, warnings.append)
print(json.dumps({"before": before, "every": every, "main": denormals_flushed(),
                  "after_probe": denormals_flushed(every_thread=True), "warnings": warnings,
                  "off": flush_denormals(False), "main_off": denormals_flushed()}))
"""


def probe(when: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, when], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout.splitlines()[-1])


def test_set_before_the_first_parallel_operation_every_thread_flushes_and_off_puts_ieee_back() -> None:
    seen = probe("early")
    assert seen["before"] is False  # torch's default: IEEE denormals
    assert seen["every"] is True and seen["main"] is True and seen["after_probe"] is True
    assert seen["warnings"] == []
    assert seen["off"] is False and seen["main_off"] is False


@pytest.mark.parametrize("when", ["late"])
def test_set_after_the_pool_started_only_the_calling_thread_flushes_and_a_warning_says_so(when: str) -> None:
    seen = probe(when)
    assert seen["before"] is False
    # The probe splits a multiplication over both threads: the pool thread started earlier still computes
    # denormals, so "every thread" is false while the calling thread alone flushes.
    assert seen["every"] is False and seen["main"] is True and seen["after_probe"] is False
    [warning] = seen["warnings"]
    assert warning.startswith("denormals: train.flush_denormals is on, but not every CPU thread")
