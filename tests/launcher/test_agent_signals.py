"""torchrun's agent stops on SIGTERM by raising SignalException from its handler: a signal that lands while
the agent writes a log record must still stop it, not be swallowed by logging's error handler."""

from __future__ import annotations

import io
import logging
import signal
import subprocess
import sys

import pytest
from torch.distributed.elastic.multiprocessing.api import SignalException

from elastic_qa.launcher.loopback import keep_signals_through_logging


class Interrupted(io.StringIO):
    """A stream whose write is interrupted by torchrun's SIGTERM handler (it raises there)."""

    def write(self, text: str) -> int:
        raise SignalException("Process 1 got signal: 15", sigval=signal.SIGTERM)


def test_a_stop_signal_inside_a_log_write_reaches_the_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logging.Handler, "handleError", logging.Handler.handleError)  # undone after
    logger = logging.getLogger("agent-under-test")
    monkeypatch.setattr(logger, "handlers", [logging.StreamHandler(Interrupted())])
    monkeypatch.setattr(logger, "propagate", False)
    monkeypatch.setattr(logging, "raiseExceptions", True)
    logger.warning("before: logging swallows it")  # the stop is lost (prints "--- Logging error ---")
    keep_signals_through_logging()
    with pytest.raises(SignalException):
        logger.warning("failed (exitcode: %s)", 75)


# torchrun's agent, as the local launcher starts it, logs a worker failure with its traceback: in a fresh
# interpreter, so that nothing imported torch._dynamo before.
AGENT_FAILURE_LINE = """
import logging, sys
import torch.distributed.run
from elastic_qa.launcher import loopback
if sys.argv[1] == "filtered":
    loopback.exceptions_without_dynamo()
log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
try:
    raise RuntimeError("worker 0 died")
except RuntimeError:
    log.exception("failed (exitcode: %s) local_rank: %s", -9, 0)
print("dynamo imported:", "torch._dynamo" in sys.modules)
"""


@pytest.mark.parametrize("filtered", [False, True])
def test_the_agents_failure_line_keeps_its_traceback_without_importing_dynamo(filtered: bool) -> None:
    # torch's formatter imports torch._dynamo (1.3-1.6 s) for the first record with an exception: between a
    # warm worker's failure and its group's restart. Unfiltered shows that the check can fail.
    result = subprocess.run(
        [sys.executable, "-c", AGENT_FAILURE_LINE, "filtered" if filtered else "plain"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == f"dynamo imported: {not filtered}"
    lines = [line for line in result.stderr.splitlines() if "] " in line]
    assert [line.split("] ", 1)[1] for line in lines] == [
        "failed (exitcode: -9) local_rank: 0",
        "Traceback (most recent call last):",
        '  File "<string>", line 9, in <module>',
        "RuntimeError: worker 0 died",
    ]
    assert all(line.startswith("E") for line in lines)  # torch's own prefix on every line, as before


def test_a_torch_without_its_logs_formatter_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    # The filter only saves time: where torch has no TorchLogsFormatter to import, the agent starts as is.
    from elastic_qa.launcher import loopback

    handler = logging.StreamHandler(io.StringIO())
    logger = logging.getLogger("torch-without-the-formatter")
    monkeypatch.setattr(logger, "handlers", [handler])
    monkeypatch.setitem(sys.modules, "torch._logging._internal", None)  # its import raises ImportError
    loopback.exceptions_without_dynamo()
    assert handler.filters == []
