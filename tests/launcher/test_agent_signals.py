"""torchrun's agent stops on SIGTERM by raising SignalException from its handler: a signal that lands while
the agent writes a log record must still stop it, not be swallowed by logging's error handler."""

from __future__ import annotations

import io
import logging
import signal

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
