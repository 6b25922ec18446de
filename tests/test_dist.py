"""How a worker process ends: without interpreter finalisation, but losing nothing a normal exit keeps."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import atexit, sys, threading, time
    from pathlib import Path
    from elastic_qa.dist import exit_process

    out = Path(sys.argv[1])

    def slow_write():  # like a checkpoint still being written when main returns
        time.sleep(0.5)
        (out / "thread-finished").write_text("yes")

    threading.Thread(target=slow_write, daemon=False).start()
    atexit.register(lambda: (out / "atexit-ran").write_text("yes"))
    print("buffered line, never flushed by hand")  # stdout is a pipe: block-buffered
    exit_process(3)
    (out / "after-exit").write_text("must not run")
    """
)


def test_exit_process_waits_for_threads_runs_atexit_flushes_and_keeps_the_code(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=60
    )

    assert result.returncode == 3, result.stderr
    assert result.stdout == "buffered line, never flushed by hand\n"
    assert (tmp_path / "thread-finished").read_text() == "yes"
    assert (tmp_path / "atexit-ran").read_text() == "yes"
    assert not (tmp_path / "after-exit").exists()
