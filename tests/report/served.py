"""`elastic-qa dashboard` as a real subprocess for the tests: started on a free port, stopped after."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SHOTS = os.environ.get("DASHBOARD_SHOTS")  # a directory to keep the page tests' screenshots in


@contextmanager
def dashboard(run_dir: Path, *args: str) -> Iterator[str]:
    """The dashboard of `run_dir`, serving; yields its address (http://127.0.0.1:PORT/)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "elastic_qa.cli", "dashboard", str(run_dir), "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        first = process.stdout.readline()  # the address, once it listens (or nothing: it exited)
        found = re.search(r"http://\S+/", first)
        if found is None:
            process.kill()
            raise AssertionError(f"dashboard did not start: {first!r} {process.communicate()[1][-2000:]}")
        yield found[0]
    finally:
        process.terminate()
        process.wait(timeout=60)


def screenshot_path(tmp_path: Path, name: str) -> Path:
    """Where a screenshot goes: $DASHBOARD_SHOTS/dash-NAME.png when set (for a person to look at)."""
    folder = Path(SHOTS) if SHOTS else tmp_path
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"dash-{name}.png"
