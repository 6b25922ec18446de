"""Hosts as Linux network namespaces on one bridge: a multi-host job on one machine.

Each host is a namespace with one interface (`eth0`, 10.91.0.<i+1>/24) into a bridge that lives in a
namespace of its own, no default route, and a Debian-style /etc/hosts in which its name, the same on every
host ("trainer"), resolves to 127.0.1.1: the setting where torch's hostname-based defaults fail. The root
namespace is never touched except by `ip netns add/del` and the /etc/netns/<ns>/ files that `ip netns
exec` bind-mounts over /etc. Names carry a per-cluster tag, so parallel runs do not clash, and `down()`
removes everything even after a failure.

    python -m tests.multinode.cluster up|down TAG    (by hand, to look around; needs root)
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from elastic_qa.launcher.processes import is_resource_tracker

HOSTNAME = "trainer"
SUBNET = "10.91.0"
ETCD_INDEX = 99  # the etcd server's host, 10.91.0.100, off the training hosts
DEBIAN_HOSTS = f"127.0.0.1\tlocalhost\n127.0.1.1\t{HOSTNAME}\n"


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root (ip netns)"
    if not shutil.which("ip") or not shutil.which("unshare"):
        return "needs iproute2 (ip) and util-linux (unshare)"
    probe = f"eqprobe{os.getpid()}{secrets.token_hex(2)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Cluster:
    def __init__(self, hosts: int, tag: str | None = None) -> None:
        self.hosts = hosts
        self.tag = tag or f"eq{os.getpid()}{secrets.token_hex(2)}"
        self.processes: list[subprocess.Popen] = []
        self.namespaces: list[str] = []
        self.indices: list[int] = []

    def ns(self, index: int) -> str:
        return f"{self.tag}-h{index}"

    @staticmethod
    def address(index: int) -> str:
        return f"{SUBNET}.{index + 1}"

    def up(self, extra: tuple[int, ...] = ()) -> Cluster:
        bridge = f"{self.tag}-br"
        ip("netns", "add", bridge)
        self.namespaces.append(bridge)
        ip("-n", bridge, "link", "add", "br0", "type", "bridge")
        ip("-n", bridge, "link", "set", "br0", "up")
        for index in (*range(self.hosts), *extra):
            ns = self.ns(index)
            ip("netns", "add", ns)
            self.namespaces.append(ns)
            self.indices.append(index)
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(DEBIAN_HOSTS)
            # Created straight into the two namespaces: no name ever appears in the root namespace.
            veth = ("link", "add", f"p{index}", "netns", bridge, "type", "veth")
            ip(*veth, "peer", "name", "eth0", "netns", ns)
            ip("-n", bridge, "link", "set", f"p{index}", "master", "br0")
            ip("-n", bridge, "link", "set", f"p{index}", "up")
            ip("-n", ns, "addr", "add", f"{self.address(index)}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "link", "set", "lo", "up")
        return self

    def command(self, index: int, argv: list[str]) -> list[str]:
        """`argv` on host `index`: in its namespace, with its own UTS namespace named HOSTNAME."""
        return [
            "ip",
            "netns",
            "exec",
            self.ns(index),
            "unshare",
            "--uts",
            "sh",
            "-c",
            f'hostname {HOSTNAME} && exec "$@"',
            "sh",
            *argv,
        ]

    def spawn(self, index: int, argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            process = subprocess.Popen(
                self.command(index, argv),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self.processes.append(process)
        return process

    def pids(self, index: int) -> list[int]:
        listed = subprocess.run(["ip", "netns", "pids", self.ns(index)], capture_output=True, text=True)
        return [int(pid) for pid in listed.stdout.split()]

    def kill_host(self, index: int, sig: int = signal.SIGKILL) -> list[int]:
        """Every process of host `index` at once: the host is gone. Its multiprocessing resource trackers
        (no sockets) are spared: a real host's /dev/shm goes with it, this one's is the machine's, where
        they unlink the agents' named semaphores once the rest is dead, then exit."""
        pids = [pid for pid in self.pids(index) if not is_resource_tracker(pid)]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return pids

    def down(self) -> None:
        """Kill what runs in the namespaces, then remove them and their /etc/netns files."""
        for index in self.indices:
            self.kill_host(index)
        deadline = time.monotonic() + 10  # the trackers' clean-up (milliseconds), before the groups' kill
        while any(is_resource_tracker(pid) for i in self.indices for pid in self.pids(i)):
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
        time.sleep(0.2)
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        self.namespaces.clear()


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("up", "down"):
        print(__doc__, file=sys.stderr)
        return 2
    cluster = Cluster(3, argv[1])
    if argv[0] == "up":
        cluster.up((ETCD_INDEX,))
    else:
        cluster.indices = [0, 1, 2, ETCD_INDEX]
        cluster.namespaces = [f"{argv[1]}-br", *(cluster.ns(i) for i in cluster.indices)]
        cluster.down()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
