"""Run a command under a synthetic CPU load: `python -m tests.under_load [--burners N] -- COMMAND...`.

`make test-loaded` runs the suite this way: N (2) busy processes compete for the cores for as long as the
command runs, as other jobs do on a shared CI box, so that a test which waits on luck rather than on an
event fails here rather than there. The burners die with this process however it ends: they are killed
when the command exits or on Ctrl-C/SIGTERM, and are tied to this process (PR_SET_PDEATHSIG) should it be
killed outright. Their pids are in the command's environment as UNDER_LOAD_BURNERS. Exit code: the
command's (130 on Ctrl-C).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from elastic_qa.launcher.processes import tied_to_this_process

BURN = "while True: pass"
INTERRUPT_GRACE_S = 5.0


def start_burners(count: int) -> list[subprocess.Popen]:
    return [
        subprocess.Popen([sys.executable, "-c", BURN], preexec_fn=tied_to_this_process())
        for _ in range(count)
    ]


def stop(burners: list[subprocess.Popen]) -> None:
    for burner in burners:
        burner.kill()
    for burner in burners:
        burner.wait()


def interrupt(process: subprocess.Popen) -> None:
    """Pass the interrupt on (a SIGTERM reached only this process; a Ctrl-C the whole terminal group, so
    this is the command's second) and give it a few seconds to clean up before it is killed."""
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=INTERRUPT_GRACE_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _terminate(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM ends the run like Ctrl-C: through the `finally` that stops burners


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.under_load", description=__doc__.splitlines()[0])
    parser.add_argument("--burners", type=int, default=2, help="busy processes to run alongside (2)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.burners < 0:
        parser.error("give --burners >= 0 and a command after --")
    signal.signal(signal.SIGTERM, _terminate)
    started = time.monotonic()
    burners = start_burners(args.burners)
    try:
        print(f"under load: {args.burners} busy processes {[b.pid for b in burners]}", flush=True)
        env = {**os.environ, "UNDER_LOAD_BURNERS": " ".join(str(b.pid) for b in burners)}
        process = subprocess.Popen(command, env=env)
        try:
            code = process.wait()
        except KeyboardInterrupt:
            code = 130
            interrupt(process)
    finally:
        stop(burners)
    print(f"under load: exit {code} after {time.monotonic() - started:.0f} s", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
