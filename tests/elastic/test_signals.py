"""Stop signals: the handler is a flag, never a lock, so a signal that lands inside a log write cannot hang;
SIGHUP stops and saves like SIGTERM; a stopped run's exit code says who should act on it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from elastic_qa.checkpoint.backends import open_store
from elastic_qa.elastic.signals import StopRequest
from elastic_qa.exits import EXIT_AGENT_LOST, EXIT_REGROUP
from elastic_qa.observe.follow import read_events
from tests.conftest import tiny_overrides

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


def test_a_closed_terminal_stops_a_single_process_run_which_saves_its_step_and_exits_129(
    tmp_path: Path, cache_dir: Path
) -> None:
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(
        run_dir, cache_dir, "train.max_steps=300", "log.every_steps=1", "debug.step_delay=100ms"
    )
    # Its own session, as under a terminal; a loader worker too, since the hang-up reaches the whole job.
    worker = subprocess.Popen(
        [sys.executable, "-m", "elastic_qa.train", "--config", "tiny", *overrides, "data.num_workers=1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        seen, deadline = 0, time.monotonic() + 60
        while seen < 3:
            assert worker.poll() is None and time.monotonic() < deadline, "no step 3"
            seen = max([e["step"] for e in read_events(run_dir) if e.get("event") == "step"], default=0)
            time.sleep(0.05)
        os.killpg(worker.pid, signal.SIGHUP)  # what the shell does to its jobs when the terminal closes
        _, stderr = worker.communicate(timeout=60)
    finally:
        worker.kill()
    store = open_store(str(run_dir / "checkpoints"))
    saved = [info.step for info in store.list_steps() if store.verify(info.path).ok]
    assert len(saved) == 1 and seen <= saved[0] < 300, (saved, stderr[-2000:])
    assert worker.returncode == 128 + signal.SIGHUP


@pytest.mark.parametrize(
    ("signum", "torchrun", "agent_lost", "code"),
    [
        (signal.SIGINT, False, False, 130),
        (signal.SIGHUP, False, False, 129),
        (signal.SIGTERM, False, False, 143),
        (signal.SIGTERM, True, False, EXIT_REGROUP),  # the agents regroup
        (signal.SIGHUP, True, False, EXIT_REGROUP),
        (None, True, True, EXIT_AGENT_LOST),  # the watchdog asked for the stop: no agent is left
    ],
)
def test_a_stopped_run_exits_128_plus_the_signal_alone_and_75_under_torchrun(
    monkeypatch: pytest.MonkeyPatch, signum: int | None, torchrun: bool, agent_lost: bool, code: int
) -> None:
    if torchrun:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    else:
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    from elastic_qa.train import stopped_exit_code

    stop = StopRequest()
    if signum is None:
        stop.request("agent_lost")
    else:
        stop.install()
        try:
            os.kill(os.getpid(), signum)
            time.sleep(0.01)  # the handler runs between two bytecodes of this thread
        finally:
            stop.uninstall()
    assert stop.requested and stopped_exit_code(stop, agent_lost) == code


def test_installing_the_handlers_keeps_a_broken_pipe_from_killing_the_worker() -> None:
    previous = signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # as a library might leave it
    stop = StopRequest()
    try:
        stop.install()
        assert signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN
        assert all(signal.getsignal(s) == stop._handle for s in (signal.SIGTERM, signal.SIGHUP))
    finally:
        stop.uninstall()
        signal.signal(signal.SIGPIPE, previous)


def test_a_sigterm_during_a_save_only_marks_the_stop_and_a_hard_exit_waits_for_the_save() -> None:
    stop = StopRequest()
    stop.install()
    try:
        with stop.saving():
            os.kill(os.getpid(), signal.SIGTERM)  # the dying agents' SIGTERM, mid-save
            time.sleep(0.01)
            assert stop.requested and stop.signal_name == "SIGTERM"
            assert not stop.wait_for_save(0.01)  # a hard exit would wait here
        assert stop.wait_for_save(0)
    finally:
        stop.uninstall()


# A wait for a stop signal, with a signal raised at each line the wait runs in turn (a tracer counts them)
# and a first one at its start: two signals close together, the second at every point of the wait.
WAIT_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    from elastic_qa.elastic.signals import SignalWait

    fire_at, count = [], 0

    def local(frame, event, arg):
        global count
        if event == "line":
            if count in fire_at:
                os.kill(os.getpid(), signal.SIGTERM if count % 2 else signal.SIGINT)
            count += 1
        return local

    with SignalWait((signal.SIGTERM, signal.SIGINT)) as waiter:
        for second in range(1, 60):
            count, fire_at = 0, [0, second]
            sys.settrace(lambda frame, event, arg: local)
            received = waiter.wait(timeout_s=60)
            sys.settrace(None)
            assert received in (signal.SIGTERM, signal.SIGINT), (fire_at, received)
        assert waiter.wait(timeout_s=0.01) in (None, signal.SIGTERM, signal.SIGINT)
    print("ok")
    """
)


def test_a_second_signal_at_any_point_of_a_signal_wait_cannot_deadlock_it(tmp_path: Path) -> None:
    # `elastic-qa serve` waited on an Event that its handler set: this script with that wait hangs for
    # good (a SIGTERM cannot end it either) when the second signal lands while `wait` holds the Event's lock.
    process = subprocess.Popen([sys.executable, "-c", WAIT_SCRIPT], stdout=subprocess.PIPE, text=True)
    try:
        out, _ = process.communicate(timeout=300)
    finally:
        process.kill()
    assert process.returncode == 0 and out.strip() == "ok"


def test_a_signal_wait_gives_back_the_handlers_it_replaced() -> None:
    from elastic_qa.elastic.signals import SignalWait

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with SignalWait((signal.SIGTERM,)) as waiter:
        assert signal.getsignal(signal.SIGTERM) is not before[0]
        assert waiter.wait(timeout_s=0.01) is None
        signal.raise_signal(signal.SIGTERM)  # handled: the test process lives on
        assert waiter.wait(timeout_s=10) == signal.SIGTERM
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
    assert signal.set_wakeup_fd(-1) == -1  # no wakeup fd left behind
