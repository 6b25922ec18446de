"""Exit codes, once: what a worker, a command or the launcher tells the process that started it.

Workers (`python -m elastic_qa.train`):
    0   done: the final state is committed and verified
    1   anything else, including a final state that could not be committed (torchrun restarts the group)
    2   bad input: config, data, a checkpoint that does not fit, an unwritable run or checkpoint directory
    75  stopped under torchrun (SIGTERM, SIGINT, SIGHUP) after saving: the agents regroup
    76  its torchrun agent died (after saving, or once dist.agent_lost_grace ran out)
    128 + n  a single process stopped by signal n after saving (130 SIGINT, 129 SIGHUP, 143 SIGTERM)
Commands (`elastic-qa ...`, `python -m chaos ...`, the launcher): 0 ok, 1 a check failed, 2 bad input;
the launcher's `start` stopped by a signal after saving: 128 + n (130 Ctrl-C, 143 SIGTERM); `elastic-qa`
whose output's reader left early (`| head`): 141, as a Unix tool that SIGPIPE ends.
"""

from __future__ import annotations

import os
import select
import signal
import sys
from collections.abc import Callable

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_REGROUP = 75
EXIT_AGENT_LOST = 76


class UsageError(Exception):
    """Bad input on a command line: printed as one line, exit code 2."""


def quiet_when_stdout_closes(command: Callable[[], int]) -> int:
    """Run `command`; one whose stdout's reader left early (`elastic-qa ckpt show RUN | head -1`,
    `launch/local.sh status | head -1`) ends quietly, as Unix tools do, with the status of a process that
    SIGPIPE ended (141)."""
    try:
        try:
            return command()
        finally:  # output still buffered (and `--help`'s, on its way out as SystemExit) meets the pipe here
            sys.stdout.flush()
    except BrokenPipeError:
        if not stdout_gone():  # another pipe (a socket, a subprocess's): an error of its own
            raise
        # Nothing more reaches the reader; stdout on /dev/null keeps the interpreter's own flush at exit
        # from saying so once more. SIGPIPE itself stays ignored: it would kill a command mid-write.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE


def stdout_gone() -> bool:
    """Whether stdout is a pipe whose reader has left, seen without writing to it."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError):  # no descriptor (a captured stdout): not a pipe
        return False
