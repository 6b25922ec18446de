"""The `startup` event: one per worker process, its phases from the process's birth to its first step."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_qa.observe.follow import read_events
from elastic_qa.observe.startup import StartupClock
from tests.conftest import train_tiny

PHASES = [
    "interpreter",
    "imports",
    "config",
    "cache_open",
    "process_group",
    "model_build",
    "probe",
    "optimizer",
    "trainer_init",
    "restore_read",
    "restore_apply",
    "register",
    "first_step",
]


def test_process_birth_is_when_the_process_was_created() -> None:
    before = time.time()
    child = [
        sys.executable,
        "-c",
        "from elastic_qa.observe.startup import process_birth; print(process_birth())",
    ]
    born = float(subprocess.run(child, capture_output=True, text=True, check=True).stdout)
    after = time.time()
    # /proc counts in 10 ms ticks: the birth may read up to two ticks early.
    assert before - 0.05 <= born <= after


def test_marks_close_phases_in_order_and_a_phase_marked_twice_adds_up() -> None:
    clock = StartupClock()
    clock.begin(born=time.time() - 2.0)
    clock.mark("imports")
    clock.mark("model_build")
    clock.mark("probe")
    clock.mark("model_build")
    fields = clock.fields()
    assert list(fields) == ["interpreter_s", "imports_s", "model_build_s", "probe_s", "total_s"]
    assert fields["interpreter_s"] >= 2.0
    assert abs(fields["total_s"] - sum(v for k, v in fields.items() if k != "total_s")) < 1e-3


def test_a_worker_logs_one_startup_event_with_every_phase_after_its_first_step(
    tmp_path: Path, cache_dir: Path
) -> None:
    every = ("train.threads=1", "log.every_steps=1")
    train_tiny(tmp_path, cache_dir, "train.max_steps=3", *every)
    train_tiny(tmp_path, cache_dir, "train.max_steps=5", *every)  # a restart: it restores
    events = read_events(tmp_path)
    startups = [event for event in events if event["event"] == "startup"]
    assert [event["step"] for event in startups] == [1, 4]
    for event in startups:
        assert [key.removesuffix("_s") for key in event if key.endswith("_s")] == [*PHASES, "total"]
        assert all(event[f"{phase}_s"] >= 0 for phase in PHASES)
        assert event["restart_count"] == 0
        first_step = next(e for e in events if e["event"] == "step" and e["pid"] == event["pid"])
        born = event["ts"] - event["total_s"]
        assert born <= first_step["ts"] <= event["ts"]


RICH_INSTALLED = importlib.util.find_spec("rich") is not None


@pytest.mark.skipif(not RICH_INSTALLED, reason="rich is not installed here: nothing for structlog to import")
def test_a_worker_process_imports_structlog_without_rich_and_rich_still_imports_later() -> None:
    # A worker (elastic_qa.train run as the main module) never loads rich through structlog.dev; the same
    # module imported by another program (the Python API) leaves structlog as it is.
    probe = (
        "import runpy, sys\n"
        "sys.argv = ['elastic_qa.train', '--help']\n"
        "try:\n"
        "    runpy.run_module('elastic_qa.train', run_name='__main__', alter_sys=True)\n"
        "except SystemExit:\n"
        "    pass\n"
        "import structlog.dev\n"
        "print('worker', 'rich' in sys.modules, structlog.dev.rich is None)\n"
        "import rich\n"
        "print('later', rich.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert "worker False True" in out
    assert "later rich" in out
    imported = "import sys, elastic_qa.train, structlog.dev; print('api', structlog.dev.rich is not None)"
    out = subprocess.run([sys.executable, "-c", imported], capture_output=True, text=True, check=True).stdout
    assert "api True" in out
