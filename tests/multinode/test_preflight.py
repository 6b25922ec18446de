"""Before anything starts, `elastic-qa node` refuses a network plan that would put a multi-host job on
loopback or leave the c10d store without a host (exit 2, with the fix), on a namespace host whose name
resolves to 127.0.1.1; a sound plan takes the interface and address that route to the endpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_qa.launcher.processes import python_env
from tests.multinode.cluster import Cluster, unavailable

pytestmark = pytest.mark.multinode

# Runs on host 0 (10.91.0.1); host 1 is 10.91.0.2. Prints case -> the plan, or the error's class.
PLANS = """
import json, sys
from elastic_qa.launcher.netplan import Endpoint, NetworkError, plan_network

cases = {
    "store host, own endpoint": (Endpoint("10.91.0.1", 29400), True, "c10d", None, None, {}),
    "own endpoint, no --store-host": (Endpoint("10.91.0.1", 29400), False, "c10d", None, None, {}),
    "--store-host, endpoint elsewhere": (Endpoint("10.91.0.2", 29400), True, "c10d", None, None, {}),
    "peer": (Endpoint("10.91.0.2", 29400), False, "c10d", None, None, {}),
    "endpoint named by the loopback hostname": (Endpoint("trainer", 29400), False, "c10d", None, None, {}),
    "loopback --local-addr": (Endpoint("10.91.0.2", 29400), False, "c10d", "127.0.0.1", None, {}),
    "GLOO_SOCKET_IFNAME=lo": (Endpoint("10.91.0.2", 29400), False, "c10d", None, None,
                              {"GLOO_SOCKET_IFNAME": "lo"}),
    "user's own NCCL_SOCKET_IFNAME": (Endpoint("10.91.0.2", 29400), False, "c10d", None, None,
                                      {"NCCL_SOCKET_IFNAME": "eth0"}),
    "etcd elsewhere": (Endpoint("10.91.0.2", 2379), False, "etcd-v2", None, None, {}),
    "single host on loopback": (Endpoint("127.0.0.1", 29400), True, "c10d", None, None, {}),
}
out = {}
for name, (endpoint, store_host, backend, local_addr, interface, environ) in cases.items():
    try:
        plan = plan_network(endpoint, store_host, backend, local_addr, interface, environ)
        out[name] = {"local_addr": plan.local_addr, "interface": plan.interface, "env": plan.env}
    except NetworkError as err:
        out[name] = {"error": type(err).__name__}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def cluster():
    reason = unavailable()
    if reason:
        pytest.skip(f"no network namespaces here: {reason}")
    made = Cluster(2)
    try:
        yield made.up()
    finally:
        made.down()


def on_host(cluster: Cluster, *argv: str) -> subprocess.CompletedProcess:
    command = cluster.command(0, [sys.executable, *argv])
    return subprocess.run(command, capture_output=True, text=True, env=python_env(), timeout=120)


def test_plans_take_the_routed_interface_and_refuse_loopback_and_a_missing_store_host(cluster) -> None:
    result = on_host(cluster, "-c", PLANS)
    assert result.returncode == 0, result.stderr
    plans = json.loads(result.stdout)
    eth0 = {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}
    assert plans["store host, own endpoint"] == {"local_addr": "10.91.0.1", "interface": "eth0", "env": eth0}
    assert plans["peer"] == {"local_addr": "10.91.0.1", "interface": "eth0", "env": eth0}
    assert plans["user's own NCCL_SOCKET_IFNAME"]["env"] == eth0
    assert plans["etcd elsewhere"]["local_addr"] == "10.91.0.1"
    assert plans["single host on loopback"]["interface"] == "lo"
    for refused in (
        "own endpoint, no --store-host",
        "--store-host, endpoint elsewhere",
        "endpoint named by the loopback hostname",
        "loopback --local-addr",
        "GLOO_SOCKET_IFNAME=lo",
    ):
        assert plans[refused] == {"error": "NetworkError"}, refused


def test_the_command_refused_by_its_network_plan_exits_2_and_starts_nothing(cluster, tmp_path: Path) -> None:
    result = on_host(
        cluster, "-m", "elastic_qa.launcher.node", "--endpoint=10.91.0.1:29400", "--config=tiny",
        f"run.dir={tmp_path / 'run'}",
    )  # fmt: skip
    assert result.returncode == 2
    assert "--store-host" in result.stderr
    assert not (tmp_path / "run").exists()


def test_a_peer_whose_store_never_answers_waits_a_bounded_time_and_says_for_what(
    cluster, tmp_path: Path, cache_dir: Path
) -> None:
    """Host 1 serves no store: host 0's node says it waits for it, and gives up after --store-timeout with
    one line naming the endpoint (its agent used to retry for minutes and die in a C++ frame dump)."""
    result = on_host(
        cluster, "-m", "elastic_qa.launcher.node", "--endpoint=10.91.0.2:29400", "--store-timeout=2",
        "--config=tiny", f"run.dir={tmp_path / 'run'}", f"data.cache_dir={cache_dir}",
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-2000:]
    events = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    assert [e["event"] for e in events] == ["node_start", "waiting_for_store", "node_end"]
    assert events[1]["endpoint"] == "10.91.0.2:29400"
    (said,) = [line for line in result.stderr.splitlines() if not line.startswith("{")]
    assert "no c10d store answered at 10.91.0.2:29400 within 2 s" in said
