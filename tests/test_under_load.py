"""`make test-loaded`'s wrapper (tests/under_load.py): busy processes while the command runs, none after,
however the run ends (the command's exit, Ctrl-C, SIGTERM, the wrapper killed outright)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from elastic_qa.launcher.processes import alive

REPO = Path(__file__).resolve().parent.parent
DEADLINE_S = 60  # generous: each wait below ends on an event (a file, an exit), not on this

# The command: checks the burners run beside it, writes their pids and its own, then exits or waits.
COMMAND = """
import os, sys, time
from pathlib import Path
from elastic_qa.launcher.processes import alive
burners = [int(pid) for pid in os.environ["UNDER_LOAD_BURNERS"].split()]
assert len(burners) == 2 and all(alive(pid) for pid in burners), burners
Path(sys.argv[1]).write_text(" ".join(map(str, [os.getpid(), *burners])))
if sys.argv[2] == "wait":
    time.sleep(600)
sys.exit(int(sys.argv[2]) if sys.argv[2] != "wait" else 0)
"""


def start(tmp_path: Path, then: str) -> tuple[subprocess.Popen, Path]:
    pids = tmp_path / "pids"
    wrapper = subprocess.Popen(
        [sys.executable, "-m", "tests.under_load", "--", sys.executable, "-c", COMMAND, str(pids), then],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job has
    )
    return wrapper, pids


def wait_for_pids(wrapper: subprocess.Popen, pids: Path) -> list[int]:
    deadline = time.monotonic() + DEADLINE_S
    while not (pids.exists() and pids.read_text()):
        assert wrapper.poll() is None, wrapper.stdout.read()
        assert time.monotonic() < deadline, "the command never started"
        time.sleep(0.02)
    return [int(pid) for pid in pids.read_text().split()]


def gone(pids: list[int]) -> bool:
    deadline = time.monotonic() + DEADLINE_S
    while any(alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_the_command_runs_beside_two_burners_and_its_exit_code_is_the_wrappers(tmp_path: Path) -> None:
    wrapper, pids = start(tmp_path, "7")
    output, _ = wrapper.communicate(timeout=DEADLINE_S)
    assert wrapper.returncode == 7, output
    _command, *burners = [int(pid) for pid in pids.read_text().split()]
    assert not any(alive(pid) for pid in burners)  # stopped and reaped before the wrapper exits
    assert "under load: 2 busy processes" in output and "exit 7 after" in output


def test_ctrl_c_ends_the_command_and_the_burners(tmp_path: Path) -> None:
    wrapper, pids = start(tmp_path, "wait")
    everyone = wait_for_pids(wrapper, pids)
    os.killpg(wrapper.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
    assert wrapper.wait(timeout=DEADLINE_S) == 130
    assert gone(everyone)


def test_sigterm_of_the_wrapper_alone_ends_the_command_and_the_burners(tmp_path: Path) -> None:
    wrapper, pids = start(tmp_path, "wait")
    everyone = wait_for_pids(wrapper, pids)
    wrapper.send_signal(signal.SIGTERM)
    assert wrapper.wait(timeout=DEADLINE_S) == 130
    assert gone(everyone)


def test_burners_die_with_a_wrapper_killed_outright(tmp_path: Path) -> None:
    wrapper, pids = start(tmp_path, "wait")
    command, *burners = wait_for_pids(wrapper, pids)
    wrapper.kill()
    wrapper.wait()
    try:
        assert gone(burners)  # tied to the wrapper (PR_SET_PDEATHSIG)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the command is not tied: a suite cleans up itself
            os.kill(command, signal.SIGKILL)
