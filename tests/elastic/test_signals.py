"""The SIGTERM handler: a flag, never a lock, so a signal that lands inside a log write cannot hang."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

# The worker's situation, reduced: the signal arrives while the main thread holds the log writer's lock.
SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    from elastic_qa.observe import log as log_module
    from elastic_qa.elastic.signals import StopRequest

    log_module.configure_logging(sys.argv[1])
    stop = StopRequest()
    stop.install()
    with log_module._lock:  # as if the main thread were inside a log write
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # bytecodes: the handler runs here, with the lock held
            pass
    assert stop.requested and stop.signal_name == "SIGTERM"
    assert stop.notice(log_module.get_logger()) and stop.notice(log_module.get_logger())
    print("ok")
    """
)


def test_sigterm_during_a_log_write_sets_the_flag_without_deadlock(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "logs")],
        capture_output=True,
        text=True,
        timeout=60,  # the old handler, which logged, hung here forever
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
    files = (tmp_path / "logs").glob("*.jsonl")
    lines = [json.loads(line) for f in files for line in f.read_text().splitlines()]
    stops = [line for line in lines if line["event"] == "stop_requested"]
    assert len(stops) == 1 and stops[0]["signal"] == "SIGTERM" and stops[0]["received_ts"] > 0
