"""Finding a torchrun agent's workers in the process table, with warm workers (a multiprocessing
forkserver between the agent and its workers, and a resource tracker beside it) and without."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from elastic_qa.launcher.processes import children, cmdline, workers_of

# An "agent": starts two workers through a forkserver (as torchrun --start-method=forkserver does), says
# their pids, then waits for its stdin to close.
AGENT = textwrap.dedent(
    """
    import multiprocessing, sys, time

    def work(stop):
        stop.wait()

    if __name__ == "__main__":
        context = multiprocessing.get_context(sys.argv[1])
        stop = context.Event()
        workers = [context.Process(target=work, args=(stop,)) for _ in range(2)]
        for worker in workers:
            worker.start()
        print(" ".join(str(worker.pid) for worker in workers), flush=True)
        sys.stdin.read()
        stop.set()
        for worker in workers:
            worker.join()
    """
)


def run_agent(start_method: str, tmp_path: Path) -> tuple[subprocess.Popen, list[int]]:
    script = tmp_path / "agent.py"  # a file: the workers import `work` from it
    script.write_text(AGENT)
    agent = subprocess.Popen(
        [sys.executable, str(script), start_method], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert agent.stdout is not None
    return agent, sorted(int(pid) for pid in agent.stdout.readline().split())


def test_the_workers_of_an_agent_with_a_forkserver_are_its_forks_not_the_forkserver_or_tracker(
    tmp_path: Path,
) -> None:
    agent, workers = run_agent("forkserver", tmp_path)
    try:
        kinds = [" ".join(cmdline(pid)) for pid in children(agent.pid)]
        assert any("multiprocessing.forkserver" in kind for kind in kinds)  # what the agent's children are
        assert sorted(workers_of(agent.pid)) == workers
    finally:
        agent.communicate("", timeout=60)
    assert agent.returncode == 0


def test_the_workers_of_an_agent_without_a_forkserver_are_its_children(tmp_path: Path) -> None:
    agent, workers = run_agent("spawn", tmp_path)
    try:
        assert sorted(workers_of(agent.pid)) == workers
    finally:
        agent.communicate("", timeout=60)
    assert agent.returncode == 0
