"""Finding a torchrun agent's workers in the process table, with warm workers (a multiprocessing
forkserver between the agent and its workers, and a resource tracker beside it) and without; killing
such a tree without leaving its named semaphores behind."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

from elastic_qa.launcher.processes import (
    alive,
    children,
    cmdline,
    is_resource_tracker,
    kill_trees,
    workers_of,
)

# An "agent": starts two workers through a forkserver (as torchrun --start-method=forkserver does), says
# their pids and the names of its Event's semaphores (named ones, in /dev/shm, with a forkserver), then
# waits for its stdin to close.
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
        cond = stop._cond
        locks = [stop._flag, cond._lock, cond._sleeping_count, cond._woken_count, cond._wait_semaphore]
        print(" ".join(str(lock._semlock.name) for lock in locks), flush=True)
        sys.stdin.read()
        stop.set()
        for worker in workers:
            worker.join()
    """
)


def run_agent(start_method: str, tmp_path: Path) -> tuple[subprocess.Popen, list[int], list[Path]]:
    script = tmp_path / "agent.py"  # a file: the workers import `work` from it
    script.write_text(AGENT)
    agent = subprocess.Popen(
        [sys.executable, str(script), start_method], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert agent.stdout is not None
    workers = sorted(int(pid) for pid in agent.stdout.readline().split())
    names = agent.stdout.readline().split()  # "/mp-..." (named: not the fork start method)
    return agent, workers, [Path(f"/dev/shm/sem.{name[1:]}") for name in names if name != "None"]


def test_the_workers_of_an_agent_with_a_forkserver_are_its_forks_not_the_forkserver_or_tracker(
    tmp_path: Path,
) -> None:
    agent, workers, _ = run_agent("forkserver", tmp_path)
    try:
        kinds = [" ".join(cmdline(pid)) for pid in children(agent.pid)]
        assert any("multiprocessing.forkserver" in kind for kind in kinds)  # what the agent's children are
        assert sorted(workers_of(agent.pid)) == workers
    finally:
        agent.communicate("", timeout=60)
    assert agent.returncode == 0


def test_the_workers_of_an_agent_without_a_forkserver_are_its_children(tmp_path: Path) -> None:
    agent, workers, _ = run_agent("spawn", tmp_path)
    try:
        assert sorted(workers_of(agent.pid)) == workers
    finally:
        agent.communicate("", timeout=60)
    assert agent.returncode == 0


def test_killing_a_tree_with_a_forkserver_leaves_no_named_semaphore_behind(tmp_path: Path) -> None:
    agent, _, semaphores = run_agent("forkserver", tmp_path)
    try:
        assert semaphores and all(path.exists() for path in semaphores)
        (tracker,) = [pid for pid in children(agent.pid) if is_resource_tracker(pid)]
        killed = kill_trees([agent.pid, tracker])  # spared even when named
        assert tracker not in killed and agent.pid in killed
    finally:
        agent.kill()
        agent.communicate(timeout=60)
    # The tracker unlinks what was registered with it once the last process holding its pipe is dead,
    # then exits: wait for that exit (an upper bound only; it takes milliseconds).
    deadline = time.monotonic() + 60
    while alive(tracker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(tracker)
    assert not [path for path in semaphores if path.exists()]
