"""`elastic-qa node --replicas`: one host's replica group of a replica-group job that spans several hosts.

    elastic-qa node --replicas --group N --endpoint HOST0:29510 [--store-host] [--local-addr ADDR]
                    [--interface IF] [--rdzv-id ID] [--config CFG] [overrides ...]

Run one command on every host, each with its own --group (0 .. replica.groups - 1). The endpoint is the job's
Lighthouse (torchft's): the host that owns its address adds --store-host and runs the Lighthouse beside its
group, supervised as `elastic-qa replicas` does (started again at the same address when it exits). Each host
runs one replica group: a torchrun job of its own over `replica.nproc_per_group` workers (torchrun's own
restarts; a group whose torchrun agent died is started again here, up to `replica.max_group_restarts` times,
as the local launcher does). What each group is given: the Lighthouse's address, its group number, the address
the other hosts reach it at (the one that routes to the endpoint, as `elastic-qa node` finds it: the group's
heal server, torchft's manager and its store are published there, gloo listens on its interface) and the job's
heal key.

The heal key is ELASTIC_QA_REPLICA_KEY when set (the same on every host), else `<run.dir>/replica/heal.key`:
created by the store host (mode 0600, this user's) and only ever read by the others, which refuse one that
is not a regular file of this user with no access for group or others (replica/heal.py).

Shared storage: run.dir must be a directory every host mounts (the heal key, the logs, the ledger; each
group writes files of its own), checkpoint.dir the same or an object store URL. Before its Lighthouse
starts, the store host writes `<run.dir>/replica/job.json`: the job's id, its own group and a check of the
heal key (an HMAC under the key, not the key). A host that reaches the Lighthouse but finds no such file,
another job's, another key's, or no hold of the store host's group in its checkpoint.dir, is refused (exit
2): its run.dir or checkpoint.dir is not the store host's.

The run's hold (session/hold.py): each group holds the run as `<job>.group-<N>` in
`<checkpoint.dir>/holders/`, this command being its process. Another job on the same checkpoints is refused
(and refuses this one); the groups of this job do not refuse each other; a command for a group that a live
command already runs is refused (exit 2). A group whose command is gone (killed, its host lost) is taken
over at once on the same machine, and from another machine once its heartbeat is stale (STALE_S).

Each decision is one JSON line on stderr and in `<run.dir>/nodes/<host>@<address>.jsonl` (`node_start`,
`waiting_for_lighthouse`, `lighthouse_started`, `lighthouse_exit`, `group_started`, `group_exit`,
`node_end`). Exit codes: 0 when this host's group finished, 2 for a setting that cannot work across hosts
(one line), 128 + the signal when stopped by one, else 1.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from elastic_qa.checkpoint.errors import CheckpointError
from elastic_qa.config import Config, ConfigError, resolve_config
from elastic_qa.exits import EXIT_BAD_INPUT, EXIT_FAILED, UsageError
from elastic_qa.launcher.netplan import Endpoint, NetworkPlan, parse_endpoint, plan_network
from elastic_qa.launcher.node import (
    WORKER_MODULE,
    NodeLog,
    build_parser,
    default_rdzv_id,
    port_in_use,
    store_answers,
)
from elastic_qa.liveness import this_process
from elastic_qa.network import is_local_address, is_loopback
from elastic_qa.observe.log import NODE_ENV
from elastic_qa.replica.ft import require_torchft
from elastic_qa.replica.launch import KEY_ENV, ReplicaJob, not_in_this_mode
from elastic_qa.session.hold import HoldRecord, RunHeldError, RunHold

DEFAULT_PORT = 29510  # the Lighthouse's, when --endpoint gives none
JOB_FILE = Path("replica") / "job.json"
JOB_FILE_WAIT_S = 30.0  # a shared file system may show a new file to the other hosts this late (NFS)
# What a group is told through its environment (replica/worker.py reads them).
HEAL_HOST_ENV = "ELASTIC_QA_HEAL_HOST"
GROUPS_HERE_ENV = "ELASTIC_QA_GROUPS_ON_HOST"


def key_check(key: bytes, job: str) -> str:
    """What job.json says of the heal key: an HMAC under it of the job's id (tells keys apart, shows none)."""
    return hmac.new(key, b"elastic-qa replica job:" + job.encode(), hashlib.sha256).hexdigest()


def url_host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


# ---- checks before anything starts ------------------------------------------------------------------
def check_arguments(args: argparse.Namespace, cfg: Config) -> None:
    """UsageError (exit 2, one line) for a setting this mode cannot honour across hosts."""
    replica = cfg.replica
    if args.rdzv_backend != "c10d":
        raise UsageError(
            f"--rdzv-backend {args.rdzv_backend}: --replicas has no rendezvous across hosts; its endpoint is "
            "the job's Lighthouse (on the --store-host host)"
        )
    if args.nnodes != "1:4":
        raise UsageError(
            f"--nnodes {args.nnodes}: with --replicas each host runs one replica group; the job's groups "
            "are replica.groups (the same on every host)"
        )
    if args.nproc_per_node not in (1, replica.nproc_per_group):
        raise UsageError(
            f"--nproc-per-node {args.nproc_per_node}: with --replicas a host's workers are "
            f"replica.nproc_per_group (now {replica.nproc_per_group}): set replica.nproc_per_group="
            f"{args.nproc_per_node} on every host"
        )
    if args.module != WORKER_MODULE:
        raise UsageError(f"--module {args.module}: --replicas runs the replica worker only")
    if args.group is None:
        raise UsageError(
            f"--replicas needs --group N: this host's replica group, 0 .. {replica.groups - 1} "
            "(replica.groups), a different one on each host"
        )
    if not 0 <= args.group < replica.groups:
        raise UsageError(
            f"--group {args.group}: the job has replica.groups={replica.groups} groups, numbered 0 .. "
            f"{replica.groups - 1} (raise replica.groups on every host for more hosts)"
        )
    if "://" in cfg.run.dir:
        raise UsageError(
            f"run.dir={cfg.run.dir}: must be a directory every host mounts (the heal key, logs, ledger); "
            "checkpoint.dir may be an object store URL"
        )
    if (refusal := not_in_this_mode(cfg)) is not None:
        raise UsageError(refusal)


def check_endpoint(args: argparse.Namespace, endpoint: Endpoint, cfg: Config) -> NetworkPlan:
    """This host's network plan, with the Lighthouse's rules: --store-host exactly on the host that owns the
    endpoint address, whose port must be free there; a port in replica.lighthouse_port must be the same."""
    port = cfg.replica.lighthouse_port
    if port and port != endpoint.port:
        raise UsageError(
            f"replica.lighthouse_port={port} but --endpoint {endpoint}: the Lighthouse listens at the "
            "endpoint (leave replica.lighthouse_port at 0, or give the same port)"
        )
    # "replicas": the c10d store checks do not apply (they name the c10d store); the Lighthouse's are here.
    plan = plan_network(endpoint, args.store_host, "replicas", args.local_addr, args.interface)
    if not is_loopback(plan.endpoint_address):
        here = is_local_address(plan.endpoint_address)
        if args.store_host and not here:
            raise UsageError(
                f"--store-host, but {plan.endpoint_address} (the endpoint) is not an address of this host: "
                "the Lighthouse runs where the endpoint points. Give --store-host on that host only"
            )
        if here and not args.store_host:
            raise UsageError(
                f"the endpoint {endpoint} is this host's own address but --store-host is not given: nobody "
                "would run the Lighthouse. Add --store-host here (and on no other host)"
            )
    if args.store_host and port_in_use(endpoint.port):
        raise UsageError(
            f"--store-host: port {endpoint.port} of --endpoint {endpoint} is already in use on this host "
            "(another Lighthouse or job): stop it, or give another port"
        )
    return plan


class GroupHold(RunHold):
    """The run's hold by one replica group of a job across hosts: `<job>.group-<N>` (see the module's
    docstring). The records of the job's other groups are not "others": they never refuse this one."""

    def __init__(self, url: str, job: str, group: int, run_dir: str) -> None:
        super().__init__(url, f"{job}.group-{group}", run_dir)
        self.sibling = f"{job}.group-"

    def others(self) -> list[tuple[str, HoldRecord | None]]:
        return [
            (path, record)
            for path, record in super().others()
            if record is None or not record.run_id.startswith(self.sibling)
        ]

    def record_of(self, group: int) -> HoldRecord | None:
        """Group `group`'s record, when there is one."""
        try:
            return HoldRecord.from_json(self._read(self._path(f"{self.sibling}{group}")))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def refuse_running(self, group: int) -> None:
        """UsageError when a live command other than this one runs this group already."""
        record = self.record_of(group)
        if record is None:
            return
        me = this_process()
        if any(p.get("host") == me.host and p.get("pid") == me.pid for p in record.processes):
            return
        verdict = record.judge()
        if not verdict.gone:
            raise UsageError(
                f"--group {group}: group {group} of this job already runs ({record.describe()}; alive "
                f"because {verdict.why}): give each host its own --group"
            )


def job_file(run_dir: Path) -> Path:
    return run_dir / JOB_FILE


def write_job_file(run_dir: Path, job: str, group: int, key: bytes, lighthouse: str) -> None:
    """The store host's record of the job, for the other hosts to check their run.dir and key against."""
    path = job_file(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    record = {"job": job, "store_group": group, "lighthouse": lighthouse, "key_check": key_check(key, job)}
    staging.write_text(json.dumps(record) + "\n")
    os.replace(staging, path)


def read_job_file(run_dir: Path, wait_s: float, log: NodeLog) -> dict[str, Any]:
    """The store host's job.json, waiting up to `wait_s` for a shared file system to show it."""
    path, deadline, said = job_file(run_dir), time.monotonic() + wait_s, False
    while True:
        try:
            record = json.loads(path.read_text())
            if isinstance(record, dict) and {"job", "store_group", "key_check"} <= set(record):
                return record
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise UsageError(
                f"the Lighthouse answers but {path} does not exist (or holds no job): run.dir is not the "
                "store host's. Put run.dir on storage every host mounts, at the same path"
            )
        if not said:
            said = True
            log("waiting_for_job_file", path=str(path), timeout_s=wait_s)
        time.sleep(0.5)


def peer_key(run_dir: Path) -> bytes:
    """A host other than the store host reads the key, never makes one: a key file it would create here
    would be a key of its own, and every heal with the others would be refused."""
    from elastic_qa.replica.heal import KEY_FILE, heal_key  # imports torch

    if KEY_ENV not in os.environ and not (run_dir / KEY_FILE).exists():
        raise UsageError(
            f"no heal key: {KEY_ENV} is not set and {run_dir / KEY_FILE} does not exist (the store host "
            f"makes it): put run.dir on storage every host mounts, or set {KEY_ENV} alike on every host"
        )
    return heal_key(run_dir)


def check_job(record: dict[str, Any], job: str, key: bytes, hold: GroupHold, path: Path) -> None:
    """UsageError when the store host's job is another job, has another key, or holds other checkpoints."""
    from elastic_qa.replica.heal import KEY_FILE

    if record["job"] != job:
        raise UsageError(
            f"{path} names job {record['job']}, this host's is {job}: give the same --rdzv-id on every "
            "host (by default it comes from run.dir, which must then be spelled the same on every host)"
        )
    if not hmac.compare_digest(str(record["key_check"]), key_check(key, job)):
        raise UsageError(
            f"this host's heal key is not the store host's ({KEY_ENV} set differently, or on one side "
            f"only): set it alike on every host, or unset it everywhere to use {KEY_FILE} in run.dir"
        )
    if hold.record_of(int(record["store_group"])) is None:
        raise UsageError(
            f"checkpoint.dir={hold.url}: the store host's group {record['store_group']} holds no run there: "
            "it is not the store host's checkpoint.dir. Use storage every host reaches (a shared path at "
            "the same place, or an object store URL)"
        )


def wait_for_lighthouse(endpoint: Endpoint, address: str, timeout_s: float, log: NodeLog) -> bool:
    """A peer's wait for the store host's Lighthouse to accept connections: whether it did."""
    deadline, said = time.monotonic() + timeout_s, False
    while not store_answers(address, endpoint.port):
        if time.monotonic() > deadline:
            return False
        if not said:
            said = True
            log("waiting_for_lighthouse", endpoint=str(endpoint), timeout_s=timeout_s)
        time.sleep(1.0)
    return True


# ---- the group --------------------------------------------------------------------------------------
class NodeGroup(ReplicaJob):
    """This host's replica group (and, on the store host, the Lighthouse), started and supervised by the
    local launcher's code with the addresses of a job across hosts."""

    def __init__(
        self,
        cfg: Config,
        args: argparse.Namespace,
        plan: NetworkPlan,
        port: int,
        hold: GroupHold,
        key: bytes,
        log: NodeLog,
    ) -> None:
        super().__init__(cfg, args.config, args.overrides)
        self.group, self.store_host, self.log = int(args.group), bool(args.store_host), log
        self.job_id = hold.run_id  # the group's torchrun run id: `<job>.group-<N>`
        self.max_restarts = int(args.max_restarts)
        self.port = port
        self.lighthouse_host = plan.endpoint_address
        self.lighthouse_address = f"http://{url_host(plan.endpoint_address)}:{port}"
        self.local_addr = plan.local_addr
        self.hold = hold
        self.env.update(plan.env)  # gloo and nccl on the interface that leads to the other hosts
        self.env.update({
            KEY_ENV: key.hex(), NODE_ENV: log.node, HEAL_HOST_ENV: plan.local_addr, GROUPS_HERE_ENV: "1",
        })  # fmt: skip

    def record(self, event: str, **fields: Any) -> None:
        self.log(event, **fields)

    def run(self) -> int:
        """Hold the run for this group, start the Lighthouse (store host) and the group, wait; exit code."""
        self.hold.refuse_running(self.group)
        self.hold.acquire([this_process().to_dict()])  # RunHeldError: another live job holds the run
        self.hold.refuse_running(self.group)  # two commands for one group at one moment: the later write won
        self.hold.start_heartbeat()
        code = EXIT_FAILED
        try:
            code = self._run()
        finally:
            if code == 0:
                self.hold.release()
            else:  # left behind: this process gone, a command started again takes the group over at once
                self.hold.stop_heartbeat()
        return code

    def _run(self) -> int:
        (self.run_dir / "agents").mkdir(parents=True, exist_ok=True)
        codes = self.supervise([self.group], lighthouse=self.store_host)
        return 0 if codes.get(self.group) == 0 else EXIT_FAILED


# ---- the command ------------------------------------------------------------------------------------
def run_replica_node(args: argparse.Namespace) -> int:
    """`elastic-qa node --replicas`: this host's replica group; the exit code (UsageError: exit 2)."""
    try:
        cfg = resolve_config(args.config, args.overrides)
        require_torchft()
    except ConfigError as err:
        raise UsageError(f"config error: {err}") from None
    check_arguments(args, cfg)
    endpoint = parse_endpoint(args.endpoint, DEFAULT_PORT)
    plan = check_endpoint(args, endpoint, cfg)
    run_dir = Path(cfg.run.dir)
    job = args.rdzv_id or default_rdzv_id(str(run_dir))
    hold = GroupHold(cfg.checkpoint_dir, job, args.group, str(run_dir))
    try:
        hold.check()  # another live job holds these checkpoints
        hold.refuse_running(args.group)
    except RunHeldError as err:
        raise UsageError(str(err)) from None
    except CheckpointError as err:  # holders/ is no real directory of the store (checkpoint/confined.py)
        raise UsageError(f"checkpoint.dir={cfg.checkpoint_dir}: {err}") from None
    node = f"{socket.gethostname()}@{plan.local_addr}"
    log = NodeLog(run_dir, node)
    lighthouse = f"{url_host(plan.endpoint_address)}:{endpoint.port}"
    log(
        "node_start", mode="replicas", job=job, group=args.group, groups=cfg.replica.groups,
        store_host=args.store_host, lighthouse=lighthouse, local_addr=plan.local_addr,
        interface=plan.interface, notes=list(plan.notes),
    )  # fmt: skip
    from elastic_qa.launcher.local import check_inputs  # imports torch: after the checks that need none

    # Before the wait for the Lighthouse, as a peer of the default mode does: the store host checks its
    # own inputs meanwhile, and bad config or data is refused at once.
    cfg = check_inputs(args.config, args.overrides)  # exit 2 on bad config or data; builds the cache
    wait_s = args.store_timeout
    answered = args.store_host or wait_for_lighthouse(endpoint, plan.endpoint_address, wait_s, log)
    if not answered:
        log("node_end", exit=EXIT_FAILED, lighthouse_answered=False)
        print(
            f"elastic-qa node: no Lighthouse answered at {endpoint} within {args.store_timeout:g} s: start "
            "`elastic-qa node --replicas --store-host` on the host that owns that address first (or check "
            "the address, the port and any firewall)",
            file=sys.stderr,
        )
        return EXIT_FAILED
    from elastic_qa.replica.heal import HealError, heal_key

    try:
        if args.store_host:
            key = heal_key(run_dir)  # made here when neither the variable nor the file gives one
            hold.acquire([this_process().to_dict()])  # before job.json: the peers look for it
            write_job_file(run_dir, job, args.group, key, lighthouse)
        else:
            key = peer_key(run_dir)
            check_job(read_job_file(run_dir, JOB_FILE_WAIT_S, log), job, key, hold, job_file(run_dir))
    except (HealError, RunHeldError) as err:
        raise UsageError(str(err)) from None
    except CheckpointError as err:
        raise UsageError(f"checkpoint.dir={cfg.checkpoint_dir}: {err}") from None
    except OSError as err:  # job.json: run.dir not writable here
        raise UsageError(f"run.dir={cfg.run.dir}: cannot write {err.filename}: {err.strerror}") from None
    group = NodeGroup(cfg, args, plan, endpoint.port, hold, key, log)
    stopped_by: list[int] = []

    def stop(signum: int, _frame: Any) -> None:
        stopped_by.append(signum)
        sys.exit(128 + signum)  # raised in the main thread: the group is stopped on the way out

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, stop)
    try:
        code = group.run()
    except RunHeldError as err:
        raise UsageError(str(err)) from None
    except CheckpointError as err:
        raise UsageError(f"checkpoint.dir={cfg.checkpoint_dir}: {err}") from None
    except SystemExit:
        code = 128 + stopped_by[0] if stopped_by else EXIT_FAILED
    log("node_end", exit=code, group=args.group)
    return code


def replica_node_parser() -> argparse.ArgumentParser:
    """`elastic-qa node`'s arguments (the network ones mean the same here), and the mode's own two."""
    parser = build_parser()
    parser.prog, parser.description = "elastic-qa node --replicas", __doc__
    parser.add_argument(
        "--replicas",
        action="store_true",
        required=True,
        help="the replica-group mode (docs/replica-groups.md)",
    )
    parser.add_argument("--group", type=int, help="this host's replica group, 0 .. replica.groups - 1")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = replica_node_parser().parse_args(argv)
    try:
        return run_replica_node(args)
    except UsageError as err:
        print(f"elastic-qa node: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:  # Ctrl-C before the group started (checking inputs, building the cache)
        print("elastic-qa node: interrupted before the group started; nothing was started", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
