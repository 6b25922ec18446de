"""Run a Python module with the TCP stores it hosts listening on loopback only.

    python -m elastic_qa.launcher.loopback MODULE [ARGS ...]   # `python -m MODULE ARGS ...`, plus this
    python -m elastic_qa.launcher.loopback --preload=M1,M2 torch.distributed.run ...   # an agent whose
        workers are forks of a forkserver that imported M1, M2 (torchrun --start-method=forkserver)

Run as a file (torchrun --run-path runs this file in each forked worker) it does the same.

Why: a torch 2.13 TCPStore server listens on every interface ("::", dual stack) whatever host it is
given: the host only tells clients where to connect, and no environment variable changes the bind. Its
protocol has no authentication, and torch's c10d rendezvous unpickles the state it reads from the store,
so anyone who can reach the port can read and write the job's keys. The one way torch offers to choose
the address is `master_listen_fd`: a socket the caller has already bound. The local launcher runs every
torchrun agent and every worker through this module, so the two stores of a local job, the c10d
rendezvous store in the `is_host=1` agent and rank 0's worker store at MASTER_ADDR:MASTER_PORT, are
bound to the loopback address they are given (the launcher gives 127.0.0.1 everywhere).

Only servers asked for on a loopback IP literal are changed; any other host keeps torch's behaviour, so
this changes nothing for a multi-node job. torch's installed files are not touched: the module globals
through which torch creates those two stores are pointed at a subclass (see `install`).
"""

from __future__ import annotations

import atexit
import errno
import importlib
import ipaddress
import logging
import multiprocessing
import runpy
import socket
import sys
import warnings
import weakref
from datetime import timedelta
from typing import TypedDict

from torch.distributed import TCPStore

from elastic_qa.launcher import PRELOAD_FLAG


def loopback_listener(host: str, port: int) -> socket.socket | None:
    """A socket bound to (host, port) when host is a loopback IP address; None for any other host."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:  # a name: which address clients reach it by is not ours to guess
        return None
    if not address.is_loopback:
        return None
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own bind does
        listener.bind((host, port))
    except OSError:
        listener.close()
        raise
    return listener


class _StoreOptions(TypedDict):
    """TCPStore's keyword arguments that both of LoopbackTCPStore's calls pass on unchanged."""

    world_size: int | None
    is_master: bool
    timeout: timedelta
    wait_for_workers: bool
    multi_tenant: bool
    use_libuv: bool


class LoopbackTCPStore(TCPStore):
    """A TCPStore whose server, when asked for on a loopback address, listens on that address only."""

    def __init__(
        self,
        host_name: str,
        port: int,
        world_size: int | None = None,
        is_master: bool = False,
        timeout: timedelta = timedelta(seconds=300),
        wait_for_workers: bool = True,
        multi_tenant: bool = False,
        master_listen_fd: int | None = None,
        use_libuv: bool = True,
    ) -> None:
        options: _StoreOptions = {
            "world_size": world_size,
            "is_master": is_master,
            "timeout": timeout,
            "wait_for_workers": wait_for_workers,
            "multi_tenant": multi_tenant,
            "use_libuv": use_libuv,
        }
        listener = None
        if is_master and master_listen_fd is None:
            try:
                listener = loopback_listener(host_name, port)
            except OSError as err:
                # In use: by a multi-tenant server of this process, which torch then reuses, or by
                # another process, and torch's own bind of the port on "::" fails as it always would.
                # Any other error is raised: falling back would listen on every interface.
                if err.errno != errno.EADDRINUSE:
                    raise
        if listener is None:
            super().__init__(host_name, port, master_listen_fd=master_listen_fd, **options)
            return
        try:
            super().__init__(host_name, port, master_listen_fd=listener.fileno(), **options)
        except BaseException:
            listener.close()
            raise
        listener.detach()  # the server owns the descriptor now and closes it when it stops


def install() -> None:
    """Make torch create the agent's c10d store and rank 0's worker store as `LoopbackTCPStore`s.

    torch 2.13 creates them with the names `TCPStore` that these two modules imported: the c10d
    rendezvous backend (`_create_tcp_store`, in the agent) and env:// rendezvous (`_create_c10d_store`,
    in the worker). A torch that moved them fails here rather than silently listening everywhere.
    """
    # By module name: the attribute torch.distributed.rendezvous is a function of that name.
    for name in (
        "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend",
        "torch.distributed.rendezvous",
    ):
        module = importlib.import_module(name)
        if getattr(module, "TCPStore", None) not in (TCPStore, LoopbackTCPStore):
            raise RuntimeError(f"{module.__name__} no longer creates its stores as TCPStore")
        setattr(module, "TCPStore", LoopbackTCPStore)  # noqa: B010 (ModuleType declares no TCPStore)


def keep_signals_through_logging() -> None:
    """Let torchrun's stop signal through a log write that it interrupts.

    torchrun's agent turns SIGTERM into a SignalException raised from its signal handler, and stops its
    workers when that reaches its run loop. If the signal lands while the agent writes a log record (its
    "failed (exitcode ...)" line with a traceback as a group ends, for instance), the exception is raised
    inside the handler's `emit`, and logging's `handleError` prints "--- Logging error ---" and carries on:
    the stop is lost. Seen here: `launcher stop` during a regroup, and the agent trained on to the last step.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException

    swallow = logging.Handler.handleError

    def handle_error(handler: logging.Handler, record: logging.LogRecord) -> None:
        if isinstance(sys.exc_info()[1], SignalException):
            raise  # the SignalException that emit's `except` is handling
        swallow(handler, record)

    logging.Handler.handleError = handle_error  # type: ignore[method-assign,assignment]


def stop_heartbeats_at_exit() -> None:
    """Stop torchrun's rendezvous keep-alive before the agent's interpreter is torn down.

    The keep-alive is a daemon thread (torch's `_PeriodicTimer`) that writes to the c10d store every
    keep-alive interval, in C++ with the interpreter lock released. An agent that a stop signal ends does
    not shut its rendezvous down (that would close the rendezvous for every agent), so the thread runs on
    while the interpreter exits; a store call that returns then finds the interpreter finalizing and the
    thread is ended inside C++ code that cannot be unwound: "terminate called without an active
    exception", "Fatal Python error: Aborted", the agent killed by SIGABRT (exit -6) after its workers had
    saved: now and then on Ctrl-C of `launch/local.sh start` (a call takes milliseconds every 2 s), always
    with calls back to back (tests/launcher/test_agent_signals.py).
    Each timer started from now on is cancelled at exit, before the interpreter is torn down (atexit runs
    first): the thread finishes the call in flight, if any, and ends.
    """
    from torch.distributed.elastic.rendezvous.utils import _PeriodicTimer

    started: weakref.WeakSet[_PeriodicTimer] = weakref.WeakSet()
    start = _PeriodicTimer.start

    def start_and_remember(timer: _PeriodicTimer) -> None:
        started.add(timer)
        start(timer)

    def cancel_all() -> None:
        for timer in list(started):
            timer.cancel()

    _PeriodicTimer.start = start_and_remember  # type: ignore[method-assign,assignment]
    atexit.register(cancel_all)


class _RenderedException(logging.Filter):
    """Render a record's exception as text before torch's formatter sees it (exceptions_without_dynamo)."""

    _plain = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info:
            if not record.exc_text:
                record.exc_text = self._plain.formatException(record.exc_info)
            record.exc_info = None  # the formatter appends exc_text as it is
        return True


def exceptions_without_dynamo() -> None:
    """Keep `import torch._dynamo` out of the agent's restart of a failed worker group.

    torch's log formatter (`TorchLogsFormatter`) imports torch._dynamo to read one setting the first time it
    formats a record that carries an exception. torchrun's agent logs such a record when a worker started
    with `--start-method=forkserver` (warm workers) fails, its "failed (exitcode ...)" line with the
    traceback, between noticing the failure and restarting the group: the import took 1.3-1.6 s there
    (sampled with py-spy: the agent's first failure line to its "will restart worker group" line), at the
    first worker failure of every agent. A filter on torch's handlers renders the traceback first, with the
    same `logging.Formatter.formatException` the formatter calls (the setting only matters for dynamo's own
    graph-break records), so the line reads the same and nothing is imported. A torch without that
    formatter is left as it is: this only saves time.
    """
    try:
        from torch._logging._internal import TorchLogsFormatter
    except ImportError:
        return

    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for logger in loggers:
        for handler in getattr(logger, "handlers", ()):
            if isinstance(handler.formatter, TorchLogsFormatter):
                handler.addFilter(_RenderedException())


def main(argv: list[str]) -> None:
    if argv and argv[0].startswith(PRELOAD_FLAG):
        # The agent of a job with warm workers: its forkserver, which forks every worker, imports these
        # first (elastic_qa.launcher.warm_start). Set before torchrun starts the forkserver.
        multiprocessing.set_forkserver_preload(argv[0].removeprefix(PRELOAD_FLAG).split(","))
        argv = argv[1:]
    if not argv:
        usage = f"python -m elastic_qa.launcher.loopback [{PRELOAD_FLAG}MODULES] MODULE [ARGS ...]"
        raise SystemExit(f"usage: {usage}")
    install()
    if argv[0] == "torch.distributed.run":
        keep_signals_through_logging()
        exceptions_without_dynamo()
        stop_heartbeats_at_exit()
    sys.argv = argv
    # A warm worker's forkserver imported the module already (as itself, not as __main__): runpy warns.
    warnings.filterwarnings("ignore", "'.*' found in sys.modules after import of package", RuntimeWarning)
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
