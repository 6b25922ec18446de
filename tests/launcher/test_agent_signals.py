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


# An agent ended by a stop signal, its rendezvous keep-alive left running (torchrun does not shut the
# rendezvous down on a signal): torch's own timer, calling a real c10d store back to back, so that a call
# is in flight whenever the interpreter exits. Then the SignalException that torchrun's agent exits with.
KEEP_ALIVE_AT_EXIT = """
import signal, sys
from datetime import timedelta
from torch.distributed import TCPStore
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.rendezvous.utils import _PeriodicTimer
from elastic_qa.launcher import loopback
if sys.argv[1] == "stopped":
    loopback.stop_heartbeats_at_exit()
store = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
keep_alive = _PeriodicTimer(timedelta(0), store.compare_set, "keep-alive", "", "alive")  # held, as torch's is
keep_alive.start()
# The keep-alive is running: waited for on a client of its own, since a wait on `store` would hold the
# client the timer's calls go through (one call at a time) until the wait's timeout.
TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=60)).wait(["keep-alive"])
raise SignalException("Process got signal: 15", sigval=signal.SIGTERM)
"""


@pytest.mark.parametrize("stopped", [False, True])
def test_an_agent_ended_by_a_signal_with_a_keep_alive_in_flight_exits_without_aborting(stopped: bool) -> None:
    result = subprocess.run(
        [sys.executable, "-c", KEEP_ALIVE_AT_EXIT, "stopped" if stopped else "running"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    aborted = result.returncode == -signal.SIGABRT
    assert aborted == ("terminate called without an active exception" in result.stderr), result.stderr[-2000:]
    # Left running, the keep-alive shows that the check can fail; stopped at exit, the agent exits as
    # torchrun's agent does on a stop signal: 1, with the SignalException's traceback.
    assert aborted is not stopped
    if stopped:
        assert result.returncode == 1 and "SignalException: Process got signal: 15" in result.stderr
