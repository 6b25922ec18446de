"""`elastic-qa node`: one host's part of a multi-node job, a thin layer over torchrun's own agent.

    elastic-qa node --endpoint HOST0:29400 --nnodes 1:4 --nproc-per-node N [--store-host]
                    [--rdzv-backend c10d|etcd-v2] [--rdzv-id ID] [--interface IF] [--local-addr ADDR]
                    [--config CFG] [overrides ...]

Run the same command on every host. With c10d (the default) the endpoint is one training host's address
and exactly that host adds --store-host: its agent holds the rendezvous store, and losing it ends the job
(rerun the command everywhere to resume). With etcd-v2 the endpoint is an etcd server (3.4 with
--enable-v2) off the training hosts, and the job survives the loss of any of them.

`elastic-qa node --replicas --group N` runs one replica group of the replica-group mode on this host
instead, the endpoint being the job's Lighthouse: elastic_qa.replica.node, which takes these arguments too.

What it adds to `torchrun ... -m elastic_qa.train`, and nothing else (torchrun restarts, regroups and
stops the workers):
- the network settings decided and checked first (elastic_qa.launcher.netplan): --local_addr, and
  GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME for the interface that routes to the endpoint, unless set;
  is_host from --store-host rather than from hostname resolution. A plan that would put a multi-host job
  on loopback is refused with the fix, exit 2, as is bad config or data;
- a crash loop (the same error at every attempt, no step trained) stops this host's agent, exit 2 when
  the error is bad input, else 1, instead of burning every restart;
- a peer (c10d, no --store-host) waits for the store to answer before its agent starts, bounded by
  --store-timeout and saying what it waits for; a loopback endpoint with nothing serving it, and a store
  host whose port is already taken, are refused at once (exit 2);
- SIGTERM (a scheduler's preemption or time limit), SIGINT and SIGHUP stop torchrun with SIGTERM (an agent
  started from a script may ignore SIGINT), which stops the workers; they save. The wait for it is bounded:
  STOP_GRACE_IDLE_S when no worker runs (an agent waiting for peers), STOP_GRACE_TRAINING_S (torchrun's
  30 s for the workers to save, and a margin) when they do; then the agent's tree is killed. This command
  exits 0 when the job had finished, else 128 + the signal (143 for SIGTERM: "stopped by a signal, may be
  retried", which SLURM and Kubernetes read as such);
- when the agent fails and the c10d endpoint no longer answers, it says the store host is gone.
Each decision is one JSON line on stderr and in <run.dir>/nodes/<host>.jsonl.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import importlib.util
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from elastic_qa.exits import EXIT_BAD_INPUT, EXIT_FAILED, UsageError
from elastic_qa.launcher import LOOPBACK_FILE, ON_LOOPBACK, PRELOAD_FLAG
from elastic_qa.launcher.netplan import Endpoint, NetworkPlan, parse_endpoint, plan_network
from elastic_qa.launcher.processes import kill_trees, python_env, tied_to_this_process, workers_of
from elastic_qa.launcher.rendezvous import (
    JOIN_TIMEOUT_S,
    LAST_CALL_TIMEOUT_S,
    MAX_RESTARTS,
    MONITOR_INTERVAL_S,
    rdzv_conf,
)
from elastic_qa.network import is_loopback
from elastic_qa.observe.follow import CRASH_LOOP_ATTEMPTS, CrashLoopDetector, LogFollower
from elastic_qa.observe.log import NODE_ENV, file_safe

DEFAULT_PORTS = {"c10d": 29400, "etcd-v2": 2379}
WORKER_MODULE = "elastic_qa.train"
STORE_PROBE_TIMEOUT_S = 2.0
# How long a stopped agent may take to exit before its tree is killed. Idle (waiting for peers): nothing to
# save, torchrun exits at once unless a blocking store call holds its main thread. Training: torchrun gives
# the workers 30 s to save before its own SIGKILL; the margin covers its exit after that.
STOP_GRACE_IDLE_S = 5.0
STOP_GRACE_TRAINING_S = 45.0


class NodeLog:
    """One JSON line per decision, on stderr and in this host's own file under <run.dir>/nodes/."""

    def __init__(self, run_dir: Path, node: str) -> None:
        self.path = run_dir / "nodes" / f"{file_safe(node)}.jsonl"
        self.node = node

    def __call__(self, event: str, **fields: Any) -> None:
        line = json.dumps({"event": event, "ts": round(time.time(), 3), "node": self.node, **fields})
        print(line, file=sys.stderr, flush=True)
        with contextlib.suppress(OSError):  # the console line is said; a shared disk may be full
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as handle:
                handle.write(line + "\n")


def parse_nnodes(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    try:
        bounds = int(low), int(high or low)
    except ValueError:
        raise UsageError(f"--nnodes {text!r}: expected N or MIN:MAX (e.g. 1:4)") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise UsageError(f"--nnodes {text!r}: need 1 <= MIN <= MAX")
    return bounds


def default_rdzv_id(run_dir: str) -> str:
    """Every host computes the same id from the same run.dir: one run directory, one job."""
    return "eqa-" + hashlib.sha256(run_dir.encode()).hexdigest()[:12]


def rendezvous_conf(backend: str, store_host: bool) -> str:
    if backend == "c10d":
        return rdzv_conf(store_host)
    # etcd-v2 has no store host and no heartbeat settings (its keys expire on etcd's TTLs).
    return f"last_call_timeout={LAST_CALL_TIMEOUT_S}"


def torchrun_command(
    args: argparse.Namespace, plan: NetworkPlan, rdzv_id: str, preload: Sequence[str] = ()
) -> list[str]:
    """torchrun for this node; with `preload` (warm workers, launcher/local.py `warm_preload`) the agent
    runs through the loopback wrapper, which gives its forkserver those imports, and each worker is a fork
    of it running the wrapper's file (which leaves stores on any address but a loopback one as torch has
    them)."""
    agent = [sys.executable, "-m", "torch.distributed.run"]
    worker = ["-m", args.module]
    if preload:
        modules = f"{PRELOAD_FLAG}{','.join(preload)}"
        agent = [sys.executable, "-m", ON_LOOPBACK, modules, "torch.distributed.run"]
        worker = ["--start-method=forkserver", "--run-path", str(LOOPBACK_FILE), args.module]
    return [
        *agent,
        f"--nnodes={args.nnodes}",
        f"--nproc_per_node={args.nproc_per_node}",
        f"--rdzv_backend={args.rdzv_backend}",
        f"--rdzv_endpoint={args.endpoint}",
        f"--rdzv_id={rdzv_id}",
        f"--rdzv_conf={rendezvous_conf(args.rdzv_backend, args.store_host)}",
        f"--max-restarts={args.max_restarts}",
        f"--monitor-interval={MONITOR_INTERVAL_S}",
        f"--local_addr={plan.local_addr}",
        *worker,
        "--config",
        args.config,
        *args.overrides,
    ]


def store_answers(host: str, port: int) -> bool:
    """Whether something accepts connections at the c10d endpoint."""
    try:
        with socket.create_connection((host, port), timeout=STORE_PROBE_TIMEOUT_S):
            return True
    except OSError:
        return False


def port_in_use(port: int) -> bool:
    """Whether a listening socket already holds `port` on this host. Checked on the wildcard address,
    dual stack where there is IPv6, as torch's TCPStore server binds it: any listener on the port clashes."""
    for family, address in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 here: the IPv4 wildcard then
            continue
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's bind: TIME_WAIT is fine
            try:
                probe.bind((address, port))
            except OSError as err:
                if err.errno == errno.EADDRINUSE:
                    return True
                continue
            return False
    return False


def check_store_endpoint(endpoint: Endpoint, endpoint_address: str, store_host: bool) -> None:
    """Refuse, before anything starts, a store host whose port is taken and a loopback peer nobody serves."""
    if store_host and port_in_use(endpoint.port):
        raise UsageError(
            f"--store-host: port {endpoint.port} of --endpoint {endpoint} is already in use on this host: "
            "another c10d store or job is serving it (stop it, or give another port)"
        )
    if not store_host and is_loopback(endpoint_address) and not store_answers(endpoint.host, endpoint.port):
        raise UsageError(
            f"--endpoint {endpoint} is a loopback address, only reachable from this host, and no store "
            "answers there, so this node must host the store: add --store-host"
        )


def wait_for_store(endpoint: Endpoint, timeout_s: float, stopped_by: list[int], log: NodeLog) -> bool:
    """A peer's wait for the store host's agent to serve the c10d store: whether it answered. Bounded and
    said: without it torchrun retries the connection and dies in a C++ frame dump minutes later."""
    deadline = time.monotonic() + timeout_s
    said = False
    while not stopped_by:
        if store_answers(endpoint.host, endpoint.port):
            return True
        if time.monotonic() > deadline:
            return False
        if not said:
            said = True
            log("waiting_for_store", endpoint=str(endpoint), timeout_s=timeout_s)
        time.sleep(1.0)
    return False


def watch_for_peers(endpoint: Endpoint, agent: subprocess.Popen, nnodes: str, log: NodeLog) -> None:
    """Say once that the agent waits for its peers: its store answers and no worker has started."""
    while agent.poll() is None:
        if workers_of(agent.pid):
            return
        if store_answers(endpoint.host, endpoint.port):
            log("waiting_for_peers", endpoint=str(endpoint), nnodes=nnodes, join_timeout_s=JOIN_TIMEOUT_S)
            return
        time.sleep(1.0)


def wait_for_agent(agent: subprocess.Popen, stopped_by: list[int], log: NodeLog) -> int:
    """The agent's exit code. Once a stop was asked for, the wait is bounded (STOP_GRACE_*): an agent
    blocked in a store call, or one that ignores the signal, is killed with its workers."""
    deadline = None
    while True:
        try:
            return agent.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass
        if stopped_by and deadline is None:
            training = bool(workers_of(agent.pid))
            grace = STOP_GRACE_TRAINING_S if training else STOP_GRACE_IDLE_S
            deadline = time.monotonic() + grace
            log("stopping", signal=signal.Signals(stopped_by[0]).name, training=training, grace_s=grace)
        if deadline is not None and time.monotonic() > deadline:
            log("agent_killed", reason="did not exit in time after the stop", pid=agent.pid)
            kill_trees([agent.pid])
            return agent.wait()


def watch_for_crash_loop(
    run_dir: Path, agent: subprocess.Popen, crash: dict, log: NodeLog, since: float = 0.0
) -> None:
    """Stop this host's agent when attempts keep failing the same way without training a step.

    Only events from `since` on count (LogFollower): a run directory run again still holds the errors of
    earlier runs (a crash loop that was fixed since), which must not stop this one."""
    follower, detector = LogFollower(run_dir / "logs", since=since), CrashLoopDetector()
    while agent.poll() is None:
        detector.feed(follower.new_events())
        verdict = detector.verdict()
        if verdict:
            crash.update(error=verdict[0], bad_input=verdict[1])
            log("crash_loop", error=verdict[0], attempts=CRASH_LOOP_ATTEMPTS)
            with contextlib.suppress(ProcessLookupError):
                agent.send_signal(signal.SIGTERM)
            return
        time.sleep(1.0)


def run_node(args: argparse.Namespace) -> int:
    endpoint = parse_endpoint(args.endpoint, DEFAULT_PORTS[args.rdzv_backend])
    low, high = parse_nnodes(args.nnodes)
    if args.rdzv_backend == "etcd-v2":
        if args.store_host:
            raise UsageError("--store-host applies to the c10d backend only (etcd-v2 has no store host)")
        if importlib.util.find_spec("etcd") is None:
            raise UsageError(
                "--rdzv-backend etcd-v2 needs the python-etcd client: pip install 'elastic-qa[etcd]'"
            )
    plan = plan_network(endpoint, args.store_host, args.rdzv_backend, args.local_addr, args.interface)
    if args.rdzv_backend == "c10d":
        check_store_endpoint(endpoint, plan.endpoint_address, args.store_host)
    # Here, not at the top: it imports torch (seconds), and a refused network plan answers at once.
    from elastic_qa.checkpoint.errors import CheckpointError
    from elastic_qa.launcher.local import check_inputs, warm_preload
    from elastic_qa.session.hold import RunHeldError, check_before_start

    cfg = check_inputs(args.config, args.overrides)  # exit 2 on bad config or data; builds the cache
    run_dir = Path(cfg.run.dir)
    node = f"{socket.gethostname()}@{plan.local_addr}"
    log = NodeLog(run_dir, node)
    rdzv_id = args.rdzv_id or default_rdzv_id(str(run_dir))
    try:  # a live job of another run id holds these checkpoints: each of our workers would be refused
        check_before_start(cfg.checkpoint_dir, rdzv_id, str(run_dir))
    except RunHeldError as err:
        raise UsageError(str(err)) from None
    except CheckpointError as err:  # holders/ is no real directory of the store (checkpoint/confined.py)
        raise UsageError(f"checkpoint.dir={cfg.checkpoint_dir}: {err}") from None
    command = torchrun_command(args, plan, rdzv_id, warm_preload(cfg, args.module))
    env = {
        **python_env(),
        **plan.env,
        NODE_ENV: node,
        # Without it a joining agent dies in RendezvousStoreInfo.build (torch 2.13), and etcd-v2 needs it.
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    log(
        "node_start",
        endpoint=str(endpoint),
        backend=args.rdzv_backend,
        store_host=args.store_host,
        nnodes=f"{low}:{high}",
        rdzv_id=rdzv_id,
        local_addr=plan.local_addr,
        interface=plan.interface,
        notes=list(plan.notes),
    )
    started = time.time()
    stopped_by: list[int] = []
    agents: list[subprocess.Popen] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        # SIGTERM whatever the signal: torchrun stops its workers on each alike, but an agent started
        # from a script (`cmd &`) inherits SIGINT ignored and would wait out its join timeout.
        stopped_by.append(signum)
        for agent in agents:
            with contextlib.suppress(ProcessLookupError):
                agent.send_signal(signal.SIGTERM)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)
    peer = args.rdzv_backend == "c10d" and not args.store_host
    if peer and not wait_for_store(endpoint, args.store_timeout, stopped_by, log):
        if stopped_by:
            log("node_end", exit=128 + stopped_by[0], signal=signal.Signals(stopped_by[0]).name)
            return 128 + stopped_by[0]
        log("node_end", exit=EXIT_FAILED, store_answered=False)
        print(
            f"elastic-qa node: no c10d store answered at {endpoint} within {args.store_timeout:g} s: start "
            "`elastic-qa node --store-host` on the host that owns that address first (or check the "
            "address, the port and any firewall)",
            file=sys.stderr,
        )
        return EXIT_FAILED
    # Tied: SIGTERM reaches the agent when this launcher dies, so an agent is never left behind.
    agent = subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=tied_to_this_process())
    agents.append(agent)
    if stopped_by:  # a signal between the store's answer and the agent's start
        agent.send_signal(signal.SIGTERM)
    crash: dict = {}
    watch = (run_dir, agent, crash, log, started)
    threading.Thread(target=watch_for_crash_loop, args=watch, daemon=True).start()
    if args.rdzv_backend == "c10d":
        peers = (endpoint, agent, f"{low}:{high}", log)
        threading.Thread(target=watch_for_peers, args=peers, daemon=True).start()
    code = wait_for_agent(agent, stopped_by, log)
    return finish(args, endpoint, run_dir, code, stopped_by, crash, log)


def finish(
    args: argparse.Namespace,
    endpoint: Endpoint,
    run_dir: Path,
    code: int,
    stopped_by: list[int],
    crash: dict,
    log: NodeLog,
) -> int:
    """This command's exit code, and one plain sentence when the job did not finish."""
    if crash:
        log("node_end", exit=EXIT_BAD_INPUT if crash["bad_input"] else EXIT_FAILED, agent_exit=code)
        print(f"elastic-qa: the job stopped: every attempt fails with: {crash['error']}", file=sys.stderr)
        return EXIT_BAD_INPUT if crash["bad_input"] else EXIT_FAILED
    if code == 0:
        from elastic_qa.launcher.local import print_result

        log("node_end", exit=0, agent_exit=code)
        print_result(run_dir)
        return 0
    if stopped_by:  # the workers saved on the way out (torchrun waits 30 s for them before SIGKILL)
        exit_code = 128 + stopped_by[0]
        log("node_end", exit=exit_code, agent_exit=code, signal=signal.Signals(stopped_by[0]).name)
        return exit_code
    c10d_peer = args.rdzv_backend == "c10d" and not args.store_host
    gone = c10d_peer and not store_answers(endpoint.host, endpoint.port)
    log("node_end", exit=EXIT_FAILED, agent_exit=code, store_host_gone=gone)
    if gone:
        print(
            f"elastic-qa: the c10d store host {endpoint} is gone (nothing answers there): the job cannot "
            "regroup without it. The workers committed what they could; run the same command on every "
            "host again to resume, or use --rdzv-backend etcd-v2 to survive the loss of any host",
            file=sys.stderr,
        )
    return EXIT_FAILED


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="elastic-qa node", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--endpoint", required=True, help="c10d: HOST0:29400 (the store host); etcd-v2: ETCD:2379"
    )
    parser.add_argument("--nnodes", default="1:4", help="MIN:MAX hosts (default 1:4)")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="workers on this host (default 1)")
    parser.add_argument("--store-host", action="store_true", help="c10d: this host holds the store")
    parser.add_argument("--rdzv-backend", choices=sorted(DEFAULT_PORTS), default="c10d")
    parser.add_argument("--rdzv-id", help="the job's id, the same on every host (default: from run.dir)")
    parser.add_argument("--interface", help="network interface for gloo/nccl (default: routes to endpoint)")
    parser.add_argument("--local-addr", help="this host's address for its peers (default: from the route)")
    parser.add_argument("--max-restarts", type=int, default=MAX_RESTARTS, help=f"default {MAX_RESTARTS}")
    parser.add_argument(
        "--store-timeout",
        type=float,
        default=JOIN_TIMEOUT_S,
        help=f"c10d peers: seconds to wait for the store host's store to answer (default {JOIN_TIMEOUT_S})",
    )
    parser.add_argument("--config", default="default", help="config file or packaged config name")
    parser.add_argument("--module", default=WORKER_MODULE, help=f"worker module (default {WORKER_MODULE})")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.nproc_per_node < 1:
        print("elastic-qa node: --nproc-per-node must be >= 1", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        return run_node(args)
    except UsageError as err:
        print(f"elastic-qa node: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:  # Ctrl-C before the agent started (checking inputs, building the cache)
        print("elastic-qa node: interrupted before the agent started; nothing was started", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
