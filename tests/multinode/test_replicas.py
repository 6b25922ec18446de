"""The replica-group mode on two hosts (network namespaces, see cluster.py), one `elastic-qa node --replicas`
each, the Lighthouse on the first: the job trains to its end with the groups bitwise equal, through the loss
of the second host.

Holds (elastic_qa/step_holds.py) pin the fault to its step however slow the machine: both groups wait after
step KILL_AT until every process of host 1 (its node command, torchrun agent and worker) is SIGKILLed; group
0 then trains alone and waits after ALONE_UNTIL until host 1's command, started again as an operator would,
has its new worker up, which heals from group 0 across the namespaces' network (group 0 waits after LATE
for it if need be: a fresh group's first quorum request may come a few steps late, and the job must not end
before it). Meanwhile a second command for group 0 is refused (exit 2). What is asserted is state: the
survivor's committed steps, the heal, the ledger (every window once), the parameters at the end.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from elastic_qa.config import resolve_config
from elastic_qa.launcher.processes import python_env
from elastic_qa.models import family_for
from elastic_qa.observe.follow import read_events
from elastic_qa.prep import prepare
from elastic_qa.replica.shares import read_replica_ledger, verify
from elastic_qa.step_holds import arm, release, release_all
from tests.multinode.cluster import Cluster, unavailable

pytest.importorskip("torchft")
pytestmark = [pytest.mark.integration, pytest.mark.multinode]

MAX_STEPS = 30
KILL_AT, ALONE_UNTIL, LATE = 6, 12, 24
LIGHTHOUSE_PORT = 29510


def overrides(run_dir: Path, cache: Path, holds: Path) -> list[str]:
    return [
        f"run.dir={run_dir}", f"data.cache_dir={cache}", f"train.max_steps={MAX_STEPS}", "model.dropout=0.0",
        "train.threads=1", "debug.sample_ledger=true", f"debug.hold_dir={holds}", "log.every_steps=1",
        "log.console=none", "replica.groups=2",
    ]  # fmt: skip


def start_node(cluster: Cluster, host: int, group: int, settings: list[str], out: Path) -> subprocess.Popen:
    """`elastic-qa node --replicas` on namespace host `host`; host 0 runs the Lighthouse."""
    argv = [
        sys.executable, "-m", "elastic_qa.cli", "node", "--replicas", f"--group={group}",
        f"--endpoint={cluster.address(0)}:{LIGHTHOUSE_PORT}", "--config=tiny",
        *(["--store-host"] if host == 0 else []), *settings,
    ]  # fmt: skip
    return cluster.spawn(host, argv, out, python_env())


def wait_for(
    run_dir: Path, nodes: list[subprocess.Popen], what: str, check: Callable[[dict[str, Any]], bool]
) -> dict[str, Any]:
    """The first worker event that passes `check`, waiting for it while a node command lives."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        for event in read_events(run_dir):
            if check(event):
                return event
        if all(node.poll() is not None for node in nodes):
            raise AssertionError(f"every node exited ({[n.returncode for n in nodes]}) before {what}")
        time.sleep(0.1)
    raise TimeoutError(f"no {what} in {run_dir}")


def held(run_dir: Path, nodes: list[subprocess.Popen], group: int, step: int) -> dict[str, Any]:
    return wait_for(
        run_dir, nodes, f"group {group} held at {step}",
        lambda e: e.get("event") == "hold" and e.get("replica_group") == group and e["step"] == step,
    )  # fmt: skip


@pytest.fixture(scope="module")
def namespaces() -> None:
    reason = unavailable()
    if reason:
        pytest.skip(f"no network namespaces here: {reason}")


def test_two_hosts_train_through_the_loss_of_one_and_end_bitwise_equal(
    namespaces: None, tmp_path: Path, cache_dir: Path
) -> None:
    run_dir, holds = tmp_path / "run", tmp_path / "holds"
    settings = overrides(run_dir, cache_dir, holds)
    cfg = resolve_config("tiny", settings)
    windows = len(prepare(cfg, family_for(cfg.model)).train)  # once, before two hosts would build it
    arm(holds, [KILL_AT, ALONE_UNTIL, LATE])
    cluster = Cluster(2)
    try:
        cluster.up()
        first = start_node(cluster, 0, 0, settings, tmp_path / "host-0.out")
        lost = start_node(cluster, 1, 1, settings, tmp_path / "host-1.out")
        nodes = [first, lost]
        for group in (0, 1):
            held(run_dir, nodes, group, KILL_AT)
        # A second command for group 0, on host 1: refused before it starts anything.
        twin = start_node(cluster, 1, 0, settings, tmp_path / "twin.out")
        assert twin.wait(timeout=120) == 2
        assert "group 0 of this job already runs" in (tmp_path / "twin.out").read_text()
        # Host 1 is lost: every process on it, its node command included.
        killed = {e["pid"] for e in read_events(run_dir) if e.get("replica_group") == 1}
        assert cluster.kill_host(1)
        lost.wait(timeout=30)
        release(holds, KILL_AT)
        held(run_dir, [first], 0, ALONE_UNTIL)
        # The operator starts host 1's command again: it takes group 1 over (its command is gone).
        again = start_node(cluster, 1, 1, settings, tmp_path / "host-1-again.out")
        nodes = [first, again]
        wait_for(
            run_dir, nodes, "group 1 back",
            lambda e: e.get("event") == "train_start" and e.get("replica_group") == 1
            and e["pid"] not in killed,
        )  # fmt: skip
        release(holds, ALONE_UNTIL)
        wait_for(
            run_dir, nodes, f"group 1 healed or group 0 held at {LATE}",
            lambda e: (e.get("event") == "heal" and e.get("replica_group") == 1 and e["pid"] not in killed)
            or (e.get("event") == "hold" and e.get("replica_group") == 0 and e["step"] == LATE),
        )  # fmt: skip
        release(holds, LATE)
        assert first.wait(timeout=150) == 0, (tmp_path / "host-0.out").read_text()[-3000:]
        assert again.wait(timeout=60) == 0, (tmp_path / "host-1-again.out").read_text()[-3000:]
    finally:
        release_all(holds)
        cluster.down()
    events = read_events(run_dir)
    # Group 0 committed every step from the fault to the hold alone, while host 1 was gone.
    alone = {
        e["step"]: e["participants"]
        for e in events
        if e.get("event") == "step" and KILL_AT < e["step"] <= ALONE_UNTIL
    }
    assert alone == dict.fromkeys(range(KILL_AT + 1, ALONE_UNTIL + 1), 1), alone
    # The restarted group held no state and healed from group 0, over the namespaces' network.
    heals = [
        e for e in events if e.get("event") == "heal" and e["replica_group"] == 1 and e["pid"] not in killed
    ]
    assert heals and heals[0]["step"] >= ALONE_UNTIL and heals[0]["from_step"] == 0, heals
    assert heals[0]["node"].startswith(f"trainer@{cluster.address(1)}/")
    done = {e["replica_group"]: e for e in events if e.get("event") == "train_done"}
    assert set(done) == {0, 1} and done[0]["params_sha256"] == done[1]["params_sha256"], done
    assert {e["step"] for e in done.values()} == {MAX_STEPS}
    verdict = verify(
        read_replica_ledger(run_dir), windows, cfg.train.global_batch_size, cfg.run.seed, MAX_STEPS, 1
    )
    assert verdict.ok, verdict.problems
