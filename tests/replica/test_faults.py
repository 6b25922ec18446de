"""The replica mode's own faults, with real Lighthouses, real torchrun jobs and real signals by pid.

- A partition: group 1 asks a second Lighthouse (through a TCP proxy the test switches) while group 0
  keeps the job's, so each side forms quorums of its own and trains steps 11-20 in a lineage of its own; the
  proxy then sends group 1 back. Only one lineage may end in the final model and in the checkpoints.
- A whole job SIGKILLed, then SIGTERMed, then left without a quorum (its Lighthouse SIGSTOPped): each next
  job resumes where the last one saved, and nothing saved is trained again.
- The Lighthouse SIGKILLed mid-run, twice: the launcher starts it again at the same address and the job ends
  with every window trained once; the quorum ids of a restarted Lighthouse cost no step. Then, in the same
  job, a stalled replica: group 0's worker SIGSTOPped past the collective timeout while group 1 trains on,
  then SIGCONTed: it must not commit a step the quorum moved past, nor leave a checkpoint of its own lineage;
  and a kill during a heal: the sender SIGKILLed while it serves a restarted group its state.

Every test ends with the same checks: the ledger's chain of lineages holds (every window of the final
model once), every checkpoint left in the rotation is a state of that chain, and the groups end bitwise
equal.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from elastic_qa.checkpoint.backends import open_store
from elastic_qa.config import resolve_config
from elastic_qa.launcher.processes import kill_trees
from elastic_qa.liveness import is_forkserver, parent_pid
from elastic_qa.observe.follow import read_events
from elastic_qa.replica.ft import lighthouse_command
from elastic_qa.replica.launch import ReplicaJob
from elastic_qa.replica.shares import Verdict, read_replica_ledger
from elastic_qa.report.live import LiveRun
from elastic_qa.step_holds import arm, release, release_all, release_heal
from tests.replica.test_replica_job import (
    MAX_STEPS,
    final_digests,
    finished,
    group_pid,
    held,
    ledger_verdict,
    overrides,
    start,
    started_again,
    wait_for,
)

pytest.importorskip("torchft")
pytestmark = pytest.mark.integration

LOOPBACK = "127.0.0.1"
WORKERS = "replica.nproc_per_group=2"


def launcher_records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "agents" / "replicas.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def launcher_record(run_dir: Path, job: Any, check: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The first line of the launcher's own record that passes `check`, waiting for it (the job must live)."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        found = next((record for record in launcher_records(run_dir) if check(record)), None)
        if found is not None:
            return found
        assert job.poll() is None, "the job ended"
        time.sleep(0.05)
    raise TimeoutError(f"no such launcher record in {run_dir}")


def worker_pid(run_dir: Path, group: int) -> int:
    """The pid of group `group`'s newest worker."""
    starts = [
        e for e in read_events(run_dir) if e.get("event") == "worker_start" and e["replica_group"] == group
    ]
    return starts[-1]["pid"]


def check_the_end(run_dir: Path, cache: Path, max_steps: int = MAX_STEPS, workers: int = 1) -> Verdict:
    """The checks every fault test ends with: the ledger, the rotation, the final parameters (every worker
    of both groups, `workers` a group, ends bitwise equal)."""
    verdict = ledger_verdict(run_dir, cache, steps=max_steps, workers=workers)
    assert verdict.ok, verdict.problems
    store = open_store(str(run_dir / "checkpoints"))
    steps = store.list_steps()
    assert steps and steps[-1].step == max_steps
    for info in steps:
        manifest = store.read_manifest(info.path)
        assert verdict.on_chain(manifest["attempt"], info.step), (info.step, manifest["attempt"], verdict)
    digests = final_digests(run_dir)
    assert set(digests) == {0, 1} and len(set(digests.values())) == 1, digests
    done = [e for e in read_events(run_dir) if e.get("event") == "train_done"]
    assert len(done) == 2 * workers and len({e["params_sha256"] for e in done}) == 1, done
    return verdict


# ---- a partition ----------------------------------------------------------------------------------


class SwitchingProxy:
    """A TCP proxy on the loopback to one port, then (switch) to another: the connections open at the
    switch are cut, so a gRPC client reconnects, to the new port. Real sockets, one thread per direction."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.listener = socket.create_server((LOOPBACK, 0))
        self.port = self.listener.getsockname()[1]
        self.open: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection((LOOPBACK, self.target), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self.lock:
                self.open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)

    def switch(self, target: int) -> None:
        with self.lock:
            self.target, cut, self.open = target, self.open, []
        for connection in cut:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
            connection.close()

    def close(self) -> None:
        self.listener.close()
        self.switch(self.target)


class PartitionedJob(ReplicaJob):
    """The launcher, with group 1 asking for its quorums through `proxy_port`."""

    proxy_port = 0

    def lighthouse_for(self, group: int) -> str:
        return f"http://{LOOPBACK}:{self.proxy_port}" if group == 1 else self.lighthouse_address


def start_lighthouse(port: int, settings: Any, log: Path) -> subprocess.Popen:
    with log.open("ab") as out:
        process = subprocess.Popen(lighthouse_command(port, settings, LOOPBACK), stdout=out, stderr=out)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex((LOOPBACK, port)) == 0:
                return process
        assert process.poll() is None, log.read_text()
        time.sleep(0.02)
    raise TimeoutError("the second Lighthouse did not listen")


class Running:
    """A job run by this process's own launcher object in a thread, as `wait_for` expects a process."""

    def __init__(self, job: ReplicaJob) -> None:
        self.returncode: int | None = None
        self.stdout = None
        self.thread = threading.Thread(target=self._run, args=(job,), daemon=True)
        self.thread.start()

    def _run(self, job: ReplicaJob) -> None:
        self.returncode = job.run()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float) -> int | None:
        self.thread.join(timeout)
        return self.returncode


def test_a_partition_trains_two_lineages_and_only_one_survives(tmp_path: Path, cache_dir: Path) -> None:
    run_dir, holds = tmp_path / "run", tmp_path / "holds"
    arm(holds, [10, 20])
    extra = (f"debug.hold_dir={holds}", "checkpoint.every_steps=5", "replica.quorum_timeout=120s")
    cfg = resolve_config("tiny", overrides(run_dir, cache_dir, *extra))
    (run_dir / "agents").mkdir(parents=True)
    job = PartitionedJob(cfg, "tiny", overrides(run_dir, cache_dir, *extra))
    proxy = SwitchingProxy(job.port)
    job.proxy_port = proxy.port
    second_port = job.port
    while second_port == job.port:
        with socket.socket() as free:
            free.bind((LOOPBACK, 0))
            second_port = free.getsockname()[1]
    second = start_lighthouse(second_port, cfg.replica, tmp_path / "second-lighthouse.log")
    running = Running(job)
    try:
        held(run_dir, running, 10)
        proxy.switch(second_port)  # the partition: group 1 now sees only the second Lighthouse
        release(holds, 10)
        held(run_dir, running, 20)  # each side trained 11..20 in quorums of its own
        proxy.switch(job.port)  # the partition heals
        release(holds, 20)
        assert running.wait(timeout=240) == 0
    finally:
        release_all(holds)
        proxy.close()
        second.kill()
        second.wait()
        if running.poll() is None:
            job.stopping.set()
            for process in job.groups.values():
                process.kill()
    events = read_events(run_dir)
    alone = {e["replica_group"] for e in events if e.get("event") == "quorum" and e["step"] == 10}
    assert alone == {0, 1}  # both sides formed quorums after the partition
    verdict = check_the_end(run_dir, cache_dir)
    # The losing side's steps 11..20, and any it committed alone after the release at 20 before the other
    # side's quorum reached it (a loaded machine has seen it reach step 24 first): all of them discarded.
    lost = sorted({
        (row["lineage"], row["step"]) for row in read_replica_ledger(run_dir)
        if row.get("kind") == "commit" and row.get("committed") is True
        and row["lineage"] not in verdict.lineages
    })  # fmt: skip
    (loser,) = {lineage for lineage, _ in lost}
    last = lost[-1][1]
    assert [step for _, step in lost] == list(range(11, last + 1)) and last >= 20, lost
    assert verdict.discarded == last - 10, verdict
    winner = verdict.segments[-2][0]  # the lineage that continues from step 10 in the final model
    assert loser < winner  # the older lineage lost
    healed = [e for e in events if e.get("event") == "heal" and e["step"] >= 20]
    assert len(healed) == 1 and healed[0]["lineage"] >= winner, healed
    # The losing side's saves past step 10: refused by the fence, or discarded by the winner's first save.
    assert {e["event"] for e in events} & {"checkpoint_fenced", "lineage_fenced", "lineage_discarded"}
    # The dashboard's view of it, from the same logs.
    dashboard = LiveRun(run_dir)
    dashboard.refresh()
    state = dashboard.state()
    assert state["status"] == "finished"
    replicas = state["replicas"]
    assert replicas["groups"] == 2 and replicas["participants"] == 2 and replicas["heals"] >= 2
    assert replicas["lineage"] == verdict.lineages[0] and replicas["lineages"] >= 3
    texts = [row["text"] for row in state["timeline"]]
    heal = f"healed from a live peer: step {healed[0]['from_step']} -> {healed[0]['step']}"
    assert any(heal in t for t in texts), texts
    assert texts[0] == "replica group 0 worker started" or texts[0] == "replica group 1 worker started", texts


# ---- the Lighthouse killed, a stalled replica ---------------------------------------------------


def test_a_killed_lighthouse_quorum_ids_given_again_a_stalled_replica_and_a_kill_during_a_heal(
    tmp_path: Path, cache_dir: Path
) -> None:
    """Four faults of one 60-step job (four tests of one job each before; a job start costs seconds of
    CPU):

    - After step 10 the Lighthouse is SIGKILLed: the launcher starts it again at the same address (its
      standby takes over) and the job goes on whole.
    - After step 20 it is SIGKILLed again, with group 1 stopped while it is: a restarted Lighthouse numbers
      its quorums from 1 again, so the new one first gives group 0 a quorum of its own (id 1), then both
      groups one (id 2): whichever of those ids a group last had under the old Lighthouse, torchft alone
      would keep that group's process group wired to its old peers and the step would hang to the
      collective timeout (3 of 10 kills cost 11-51 s). With ids unique per Lighthouse start, no step fails
      and no worker restarts.
    - After step 30 group 0's worker is SIGSTOPped past the collective timeout while group 1 trains on, then
      SIGCONTed: it must not commit a step the quorum moved past, nor leave a checkpoint of its own lineage.
    - After step 45 group 1's worker is SIGKILLed; group 0 trains on alone (held after step 47 until group 1
      is back, if it is not back sooner) and is held while it serves the restarted group its state, then
      SIGKILLed there. Neither group holds a state any more: both restart with none, one restores the
      newest checkpoint in a new lineage (not step 0), the other heals from it, and they finish; the
      receiver never trained on half a state (the ledger), and the steps after that checkpoint are the
      discarded work.
    """
    run_dir, holds, steps = tmp_path / "run", tmp_path / "holds", 60
    arm(holds, [10, 20, 30, 45, 47], heals=[45])
    job = start(
        run_dir, cache_dir, f"train.max_steps={steps}", f"debug.hold_dir={holds}", "checkpoint.every_steps=3",
        "debug.save_delay=50ms", "replica.collective_timeout=3s",
    )  # fmt: skip
    stopped = 0
    try:
        held(run_dir, job, 10)
        launcher_record(run_dir, job, lambda r: r["event"] == "lighthouse_standby")  # the next one, imported
        first = next(e for e in launcher_records(run_dir) if e["event"] == "lighthouse_started")
        os.kill(first["pid"], signal.SIGKILL)
        again = launcher_record(
            run_dir, job, lambda r: r["event"] == "lighthouse_started" and r["pid"] != first["pid"]
        )
        release(holds, 10)

        held(run_dir, job, 20)
        # The standby started after the first kill, ready: the second kill is taken over the same way.
        launcher_record(run_dir, job, lambda r: r["event"] == "lighthouse_standby" and r["ts"] > again["ts"])
        stopped = stopped_1 = worker_pid(run_dir, 1)
        os.kill(stopped, signal.SIGSTOP)
        os.kill(again["pid"], signal.SIGKILL)
        restarted = launcher_record(
            run_dir, job, lambda r: r["event"] == "lighthouse_started" and r["incarnation"] == 3
        )["ts"]
        release(holds, 20)
        wait_for(
            run_dir, job, "group 0 training alone under the new Lighthouse",
            lambda e: e.get("event") == "step" and e.get("replica_group") == 0 and e["participants"] == 1
            and e["ts"] > restarted,
        )  # fmt: skip
        os.kill(stopped, signal.SIGCONT)
        stopped = 0

        held(run_dir, job, 30)
        stalled_at = time.time()
        stalled = stopped = worker_pid(run_dir, 0)
        os.kill(stalled, signal.SIGSTOP)
        release(holds, 30)
        wait_for(
            run_dir, job, "group 1 training alone",
            lambda e: e.get("event") == "step" and e.get("replica_group") == 1 and e["participants"] == 1
            and e["step"] >= 36,
        )  # fmt: skip
        woken = time.time()
        os.kill(stalled, signal.SIGCONT)
        stopped = 0

        held(run_dir, job, 45)
        killed = worker_pid(run_dir, 1)
        os.kill(killed, signal.SIGKILL)
        release(holds, 45)
        # Group 0 trains on alone and is held after step 47 until group 1 is back; a warm worker can be back
        # sooner, in time for group 0's next quorum, and is then healed from the state of step 45 itself.
        started_again(run_dir, job, 1, {killed})  # and about to ask for its first quorum
        release(holds, 47)
        sending = wait_for(
            run_dir, job, "group 0 held while it sends its state",
            lambda e: e.get("event") == "hold" and e.get("heal") is True,
        )  # fmt: skip
        assert sending["replica_group"] == 0
        os.kill(sending["pid"], signal.SIGKILL)
        release_heal(holds, 45)
        assert finished(job) == 0
    finally:
        release_all(holds)
        if stopped:
            os.kill(stopped, signal.SIGCONT)
        if job.poll() is None:
            job.kill()
    verdict = check_the_end(run_dir, cache_dir, steps)
    events = read_events(run_dir)
    # The Lighthouse killed twice.
    started = [e for e in launcher_records(run_dir) if e["event"] == "lighthouse_started"]
    assert [e["port"] for e in started] == [first["port"]] * 3
    assert [e["standby"] for e in started] == [False, True, True]  # the standby took over: no start-up
    together = [e for e in events if e.get("event") == "step" and 10 < e["step"] <= 20]
    assert together and together[-1]["participants"] == 2  # whole again after the first kill
    # The quorum ids of the third Lighthouse.
    failed = [
        e for e in events if e.get("event") == "step_not_committed" and restarted < e["ts"] < stalled_at
    ]
    assert not failed, failed
    woken_1 = [
        e for e in events if e.get("event") == "heal" and e["replica_group"] == 1 and e["ts"] > restarted
    ]
    assert woken_1 and woken_1[0]["pid"] == stopped_1  # healed in the same process: no restart
    quorums = {e["quorum"] for e in events if e.get("event") == "quorum" and e["ts"] > restarted}
    assert quorums and min(quorums) > 2 * 10**9, quorums  # the third Lighthouse's ids
    # The stalled replica.
    heal = [e for e in events if e.get("event") == "heal" and e["pid"] == stalled and e["ts"] > woken]
    assert heal and heal[0]["step"] >= 36  # the same process, healed from the lineage that moved on
    for event in events:
        if event.get("event") == "checkpoint_committed" and event["pid"] == stalled and event["ts"] > woken:
            assert verdict.on_chain(event["attempt"], event["step"]), event
    together = [e for e in events if e.get("event") == "step" and 30 < e["step"] <= 45]
    assert together and together[-1]["participants"] == 2
    # The kill during a heal: one restore, of the newest checkpoint, in a new lineage; nothing before it
    # trained again.
    resumed = [e["step"] for e in events if e.get("event") == "resume"]
    assert len(resumed) == 1 and resumed[0] >= 45, resumed
    restored = [e for e in events if e.get("event") == "lineage" and e.get("restored")]
    assert len(restored) == 1 and restored[0]["step"] == resumed[0], restored
    again = [e["step"] for e in events if e.get("event") == "step" and e["ts"] > restored[0]["ts"]]
    assert again and min(again) == resumed[0] + 1 and max(again) == steps, again
    # The stalled group committed nothing of its own: the only discarded steps are those after the
    # checkpoint the groups restored.
    assert verdict.discarded == sending["step"] - resumed[0], verdict


# ---- a killed worker of a group of two ------------------------------------------------------------


def test_a_killed_worker_of_a_two_worker_group_is_started_again_with_its_peer_and_both_heal(
    tmp_path: Path, cache_dir: Path
) -> None:
    """Groups of 2 workers; group 1's rank 1 SIGKILLed while both groups are held after step 10: its torchrun
    stops its peer and starts both again, and they heal from group 0 while it trains on. The agent keeps its
    store across the restart: before the workers' keys went under a prefix of their attempt and the manager
    address left by the attempt before was deleted, the restarted workers reached for the dead attempt's
    gloo peer or torchft manager and hung."""
    run_dir, holds, steps = tmp_path / "run", tmp_path / "holds", 20
    arm(holds, [10, 12])
    job = start(run_dir, cache_dir, f"debug.hold_dir={holds}", WORKERS, f"train.max_steps={steps}")
    try:
        held(run_dir, job, 10)
        before = {e["pid"] for e in read_events(run_dir) if e.get("event") == "worker_start"}
        victim = next(
            e["pid"] for e in read_events(run_dir)
            if e.get("event") == "worker_start" and e["replica_group"] == 1 and e["rank"] == 1
        )  # fmt: skip
        os.kill(victim, signal.SIGKILL)
        release(holds, 10)
        # Group 0 is held 2 steps later until group 1 is back: a group alone gets no quorum from the
        # Lighthouse while its peer is alive and asks for none.
        restarted = [started_again(run_dir, job, 1, before, rank)["pid"] for rank in (0, 1)]
        # Warm workers: each restarted worker is a fork of its group's forkserver, which imported the
        # replica worker and torchft before the fault (while they wait at the hold, both are alive).
        for pid in restarted:
            forkserver = parent_pid(pid)
            assert forkserver is not None and is_forkserver(forkserver), (pid, forkserver)
            assert b"torchft.manager" in Path(f"/proc/{forkserver}/cmdline").read_bytes()
        release(holds, 12)
        assert finished(job) == 0, job.stdout.read() if job.stdout else ""
    finally:
        release_all(holds)
        if job.poll() is None:
            job.kill()
    events = read_events(run_dir)
    # One torchrun restart: the new workers are its first (before, that attempt failed to connect to the dead
    # worker's gloo address, and the next one hung for minutes).
    again = [e for e in events if e.get("event") == "worker_start" and e["pid"] not in before]
    assert sorted((e["replica_group"], e["rank"], e["restart_count"]) for e in again) == [
        (1, 0, 1),
        (1, 1, 1),
    ]
    healed = [
        e for e in events if e.get("event") == "heal" and e["replica_group"] == 1 and e["pid"] not in before
    ]
    assert sorted(e["rank"] for e in healed) == [0, 1] and all(e["step"] >= 10 for e in healed), healed
    check_the_end(run_dir, cache_dir, steps, workers=2)  # every window once, every worker bitwise equal


# ---- a whole job killed, stopped, without a quorum ------------------------------------------------


def test_a_killed_a_stopped_and_a_quorumless_job_each_resume_where_they_saved_losing_nothing_saved(
    tmp_path: Path, cache_dir: Path
) -> None:
    """Three ways a whole job ends early, one after another on one run (three tests of 6 job starts before,
    now 4; every start costs seconds of CPU), with 2 workers in each group (DDP inside it), whose workers
    must agree on the step they stop at, save or leave:

    1. The launcher, the Lighthouse and every group SIGKILLed after step 12 (checkpoints every 5 steps): a
       second `elastic-qa replicas` on the run resumes at step 10; steps 11-12 of the killed job are the
       discarded work.
    2. That second launcher SIGTERMed (preemption, Ctrl-C) while both groups are held after step 14, with no
       checkpoint due before 15: it stops every group at once, each leaves at that step boundary, and one
       commits step 14 (reason sigterm; the other finds it committed). A third resumes at 14.
    3. The third job's Lighthouse SIGSTOPped (alive, so never restarted, and silent) while both groups are
       held after step 22: their next quorum requests time out, each group commits the state it holds (an
       emergency save) and exits; torchrun starts them again, and once the Lighthouse answers they resume at
       step 22.

    No committed step is trained again: the final model's chain of lineages trains every window once, and
    nothing but steps 11-12 was discarded."""
    run_dir, holds, stop_holds = tmp_path / "run", tmp_path / "holds", tmp_path / "stop-holds"
    arm(holds, [12])
    first = start(run_dir, cache_dir, f"debug.hold_dir={holds}", "checkpoint.every_steps=5", WORKERS)
    try:
        held(run_dir, first, 12)
        wait_for(
            run_dir, first, "the checkpoint of step 10",
            lambda e: e.get("event") == "checkpoint_committed" and e.get("step") == 10,
        )  # fmt: skip
        kill_trees([first.pid, group_pid(run_dir, 0), group_pid(run_dir, 1)])
        first.wait(timeout=60)
    finally:
        release_all(holds)
        if first.poll() is None:
            first.kill()
    killed_at = time.time()
    arm(stop_holds, [14])
    second = start(run_dir, cache_dir, f"debug.hold_dir={stop_holds}", "checkpoint.every_steps=5", WORKERS)
    try:
        held(run_dir, second, 14)
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=120) == 128 + signal.SIGTERM
    finally:
        release_all(stop_holds)
        if second.poll() is None:
            second.kill()
    events = read_events(run_dir)
    resumed = [(e["replica_group"], e["step"]) for e in events if e.get("event") == "resume"]
    assert len(resumed) == 2 and len(set(resumed)) == 1 and resumed[0][1] == 10, (
        resumed
    )  # one group's workers
    stopping = [e for e in events if e.get("event") == "stopping"]
    assert sorted(e["replica_group"] for e in stopping) == [0, 0, 1, 1] and {e["step"] for e in stopping} == {
        14
    }
    saved = [e for e in events if e.get("event") == "checkpoint_committed" and e["ts"] > killed_at]
    # One group writes it; the other finds it committed, or, when it looks while that write is still under way
    # (a loaded machine), writes the same state again.
    assert saved and {(e["step"], e["reason"]) for e in saved} == {(14, "sigterm")}, saved

    quorumless = tmp_path / "no-quorum-holds"
    arm(quorumless, [22])
    third = start(
        run_dir, cache_dir, f"debug.hold_dir={quorumless}", "checkpoint.every_steps=5",
        "replica.quorum_retries=0", "replica.quorum_timeout=3s", WORKERS,
    )  # fmt: skip
    lighthouse = 0
    try:
        held(run_dir, third, 22)
        lighthouse = [e for e in launcher_records(run_dir) if e["event"] == "lighthouse_started"][-1]["pid"]
        os.kill(lighthouse, signal.SIGSTOP)
        release(quorumless, 22)
        emergency = wait_for(
            run_dir, third, "the state of step 22 committed",
            lambda e: e.get("event") == "checkpoint_committed" and e["reason"] == "emergency",
        )  # fmt: skip
        assert emergency["step"] == 22
        # Both groups must have asked the silent Lighthouse before it answers again: a group slowed by the
        # machine's load could otherwise ask after the SIGCONT and get a quorum.
        for group in (0, 1):
            timed_out = {"event": "no_quorum", "replica_group": group, "step": 22}
            wait_for(run_dir, third, str(timed_out), lambda e, want=timed_out: want.items() <= e.items())
        os.kill(lighthouse, signal.SIGCONT)
        assert finished(third) == 0, third.stdout.read() if third.stdout else ""
    finally:
        release_all(quorumless)
        if lighthouse:
            with contextlib.suppress(ProcessLookupError):
                os.kill(lighthouse, signal.SIGCONT)
        if third.poll() is None:
            third.kill()
    events = read_events(run_dir)
    assert {e["replica_group"] for e in events if e.get("event") == "no_quorum" and e["step"] == 22} == {0, 1}
    resumes = [e["step"] for e in events if e.get("event") == "resume"]
    assert resumes == [10, 10, 14, 14, 22, 22], resumes  # each time, both workers of the group that restored
    verdict = check_the_end(run_dir, cache_dir, workers=2)  # the ledger, the rotation, every worker equal
    assert verdict.discarded == 2, verdict  # the killed job's 11-12; the stop and the emergency lost nothing
    assert len(verdict.lineages) == 4, verdict  # one more at each of the 3 restores
