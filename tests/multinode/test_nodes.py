"""Three hosts (network namespaces on a bridge, each named "trainer" with that name resolving to 127.0.1.1,
the Debian default that breaks torchrun's hostname-based choices), one `elastic-qa node` each: the job
forms, survives losing a host, and, with an etcd rendezvous, survives losing the first host too.

Each job is one fixture that the tests read; the assertions are on state: the sample ledger (each sample
exactly once per epoch, no step missing), every checkpoint valid, the steps lost per regroup.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_qa.chaos.evidence import attempts, check_checkpoints, check_ledger, run_config
from elastic_qa.chaos.judge import steps_lost
from elastic_qa.config import resolve_config
from elastic_qa.models import family_for
from elastic_qa.observe.follow import read_events
from elastic_qa.prep import prepare
from tests.multinode.cluster import ETCD_INDEX, Cluster, unavailable
from tests.multinode.jobs import (
    MAX_STEPS,
    OVERRIDES,
    etcd_unavailable,
    start_etcd,
    start_nodes,
    wait_all,
    wait_for_step,
)

pytestmark = [pytest.mark.integration, pytest.mark.multinode]
KILL_AT_STEP = 8


@pytest.fixture(scope="module")
def namespaces() -> None:
    reason = unavailable()
    if reason:
        pytest.skip(f"no network namespaces here: {reason}")


def run_with_host_loss(run_dir: Path, cache: Path, backend: str, victim: int) -> dict:
    """Three hosts train; host `victim` loses every process at KILL_AT_STEP; the rest finish."""
    cfg = resolve_config("tiny", [f"run.dir={run_dir}", f"data.cache_dir={cache}", *OVERRIDES])
    prepare(cfg, family_for(cfg.model))  # once, before three hosts would build the same cache
    cluster = Cluster(3)
    try:
        cluster.up((ETCD_INDEX,) if backend == "etcd-v2" else ())
        if backend == "etcd-v2":
            start_etcd(cluster, run_dir.parent / "etcd-data")
        nodes = start_nodes(cluster, run_dir, cache, backend)
        wait_for_step(run_dir, KILL_AT_STEP, nodes, world_size=3)
        cluster.kill_host(victim)
        survivors = {i: node for i, node in nodes.items() if i != victim}
        return {"codes": wait_all(survivors), "events": read_events(run_dir), "run_dir": run_dir}
    finally:
        cluster.down()


def first_of_three(events: list[dict]) -> int:
    """The attempt of the first group of all three hosts. Hosts started together may first form a smaller
    group (those whose agents reached the rendezvous before its last call, on a loaded machine), which
    the late ones then join: the job's own regroup, not the fault under test."""
    starts = [e for e in events if e.get("event") == "worker_start"]
    return min(e["attempt"] for e in starts if e["world_size"] == 3)


def first_group(events: list[dict]) -> list[dict]:
    first = first_of_three(events)
    return [e for e in events if e.get("event") == "worker_start" and e["attempt"] == first]


def world_sizes(events: list[dict]) -> list[int]:
    """The world size of each group from the first of three on (see `first_of_three`)."""
    first = first_of_three(events)
    starts = [e for e in events if e.get("event") == "worker_start" and e.get("rank") == 0]
    return [e["world_size"] for e in starts if e["attempt"] >= first]


def assert_exactly_once(run_dir: Path, max_lost: int) -> list[dict]:
    cfg = run_config(run_dir)
    ledger = check_ledger(run_dir, cfg, len(prepare(cfg, family_for(cfg.model)).train))
    assert ledger.ok, ledger.problems
    assert ledger.steps == MAX_STEPS
    assert check_checkpoints(cfg) == []
    events = read_events(run_dir)
    runs = attempts(events)
    regroups = [{"attempt": run["attempt"], "lost": steps_lost(runs, run)} for run in runs[1:]]
    assert all(r["lost"] <= max_lost for r in regroups), regroups  # the late hosts' joins too
    regroups = [r for r in regroups if r["attempt"] > first_of_three(events)]
    assert len(regroups) == 1, regroups  # the host's loss
    return regroups


@pytest.fixture(scope="module")
def c10d_job(namespaces, tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> dict:
    return run_with_host_loss(tmp_path_factory.mktemp("c10d") / "run", cache_dir, "c10d", victim=2)


def test_three_hosts_sharing_a_loopback_hostname_form_one_world_of_three(c10d_job: dict) -> None:
    group = first_group(c10d_job["events"])
    assert sorted(e["rank"] for e in group) == [0, 1, 2]
    assert {e["world_size"] for e in group} == {3}
    # Every host has its own address in its node field and its log file name, though all are "trainer".
    hosts = {e["node"].rsplit("/", 1)[0] for e in group}
    assert hosts == {f"trainer@{Cluster.address(i)}" for i in range(3)}
    names = [p.name for p in (c10d_job["run_dir"] / "logs").glob("rank-*.jsonl")]
    assert {name.split(".pid-")[0].split(".", 1)[1] for name in names} == hosts
    assert {e["threads"] for e in group} == {1}


def test_losing_a_host_regroups_at_two_and_sees_each_sample_once(c10d_job: dict) -> None:
    assert c10d_job["codes"] == {0: 0, 1: 0}
    assert world_sizes(c10d_job["events"]) == [3, 2]
    assert_exactly_once(c10d_job["run_dir"], max_lost=1)


def test_with_etcd_losing_the_first_host_leaves_the_others_to_finish(
    namespaces, tmp_path: Path, cache_dir: Path
) -> None:
    reason = etcd_unavailable()
    if reason:
        pytest.skip(reason)
    job = run_with_host_loss(tmp_path / "run", cache_dir, "etcd-v2", victim=0)
    assert job["codes"] == {1: 0, 2: 0}
    assert world_sizes(job["events"]) == [3, 2]
    assert_exactly_once(job["run_dir"], max_lost=1)
