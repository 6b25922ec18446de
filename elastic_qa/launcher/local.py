"""Elastic torchrun agents on this host: start a job, add an agent, stop one gracefully, stop all.

    python -m elastic_qa.launcher.local start --agents 2 [--min 1 --max 4] [--config CFG] [--module M]
                                              [overrides ...]
    python -m elastic_qa.launcher.local join --run-dir DIR      # one more agent: the group regroups larger
    python -m elastic_qa.launcher.local leave --run-dir DIR [--agent N]   # SIGTERM one: it saves and leaves
    python -m elastic_qa.launcher.local stop --run-dir DIR      # SIGTERM every agent
    python -m elastic_qa.launcher.local status --run-dir DIR

In a checkout, `launch/local.sh` runs the same with the checkout's .venv.

Every agent runs `torchrun --nnodes=MIN:MAX --nproc_per_node=P --rdzv_backend=c10d` on a free port with
its own log file under <run.dir>/agents/, with the settings of `elastic_qa.launcher.rendezvous`. Two torch
2.13 traps are handled here (see README): joiners need TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, and exactly
one same-host agent is `is_host=1` (it holds the c10d store). The job description is kept in
<run.dir>/launch.json so that join/leave/stop find it. Each action is logged as one JSON line on stderr
and in <run.dir>/agents/launch.jsonl.

Every agent is on this host, so everything the job listens on is kept on loopback (see `loopback_env`
and elastic_qa.launcher.loopback). With run.private=true the launcher, its agents and their workers
create files readable by their owner only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from elastic_qa.config import Config, ConfigError, resolve_config
from elastic_qa.data.cache import prepare
from elastic_qa.data.squad import DataError
from elastic_qa.exits import EXIT_BAD_INPUT
from elastic_qa.launcher.processes import alive, python_env
from elastic_qa.launcher.rendezvous import MAX_RESTARTS, MONITOR_INTERVAL_S, rdzv_conf
from elastic_qa.models import family_for
from elastic_qa.observe.follow import CrashLoopDetector, LogFollower, read_events
from elastic_qa.observe.tensorboard import TensorBoardScalars

CRASH_LOOP_ATTEMPTS = 3  # attempts in a row failing with the same error, none training a step
WORKER_MODULE = "elastic_qa.train"
LOOPBACK = "127.0.0.1"
# Runs a module (torchrun itself, then each worker) with the TCP stores it hosts bound to loopback.
ON_LOOPBACK = "elastic_qa.launcher.loopback"
PRIVATE_UMASK = 0o077


def log_action(run_dir: Path | None, event: str, **fields) -> None:
    line = json.dumps({"event": event, "ts": round(time.time(), 3), **fields})
    print(line, file=sys.stderr, flush=True)
    if run_dir is not None:
        (run_dir / "agents").mkdir(parents=True, exist_ok=True)
        with open(run_dir / "agents" / "launch.jsonl", "a") as handle:
            handle.write(line + "\n")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def read_job(run_dir: Path) -> dict:
    path = run_dir / "launch.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise SystemExit(f"launch: {path} not found: no job was started with --run-dir {run_dir}") from None


def write_job(run_dir: Path, job: dict) -> None:
    staging = run_dir / "launch.json.tmp"
    staging.write_text(json.dumps(job, indent=1))
    staging.replace(run_dir / "launch.json")


def agent_command(job: dict, is_host: bool) -> list[str]:
    """torchrun, and each worker it starts, run through ON_LOOPBACK: their stores bind loopback."""
    return [
        sys.executable,
        "-m",
        ON_LOOPBACK,
        "torch.distributed.run",
        f"--nnodes={job['min']}:{job['max']}",
        f"--nproc_per_node={job['nproc_per_node']}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint={LOOPBACK}:{job['port']}",
        f"--rdzv_id={job['run_id']}",
        f"--rdzv_conf={rdzv_conf(is_host)}",
        f"--max-restarts={job['max_restarts']}",
        f"--monitor-interval={MONITOR_INTERVAL_S}",
        # The workers' MASTER_ADDR (rank 0's store), instead of this host's name.
        f"--local_addr={LOOPBACK}",
        # Each worker is `python -u -m ON_LOOPBACK MODULE ...`: `python -m MODULE ...`, its store on loopback.
        "--module",
        ON_LOOPBACK,
        job.get("module", WORKER_MODULE),  # launch.json files written before --module existed lack it
        "--config",
        job["config"],
        *job["overrides"],
    ]


def loopback_env() -> dict[str, str]:
    """Environment that keeps the collectives' own listening sockets on loopback.

    gloo listens on the address of the interface GLOO_SOCKET_IFNAME names, else on the address this
    host's name resolves to (often a LAN address); nccl's bootstrap on NCCL_SOCKET_IFNAME, else on the
    first non-loopback interface. Every rank of a local job is on this host, so loopback serves them all.
    """
    names = {name for _, name in socket.if_nameindex()}
    interface = next((name for name in ("lo", "lo0") if name in names), None)
    if interface is None:  # no interface by a loopback name: leave the choice to gloo and nccl
        return {}
    return {"GLOO_SOCKET_IFNAME": interface, "NCCL_SOCKET_IFNAME": interface}


def use_private_umask(private: bool) -> None:
    """run.private: every file and directory this process and its children create is owner-only."""
    if private:
        os.umask(PRIVATE_UMASK)


def start_agent(run_dir: Path, job: dict, echo: bool) -> subprocess.Popen:
    index = len(job["agents"])
    is_host = index == 0
    log_path = run_dir / "agents" / f"agent-{index}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # python_env: the agents and their workers import the elastic_qa this launcher runs.
    env = {
        **python_env(),
        **loopback_env(),
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    handle = open(log_path, "ab")  # noqa: SIM115 - owned by the agent process
    process = subprocess.Popen(
        agent_command(job, is_host),
        stdout=subprocess.PIPE if echo else handle,
        stderr=handle,
        env=env,
        start_new_session=True,  # Ctrl-C reaches the launcher, which stops agents in order
    )
    if echo:
        threading.Thread(target=_tee, args=(process.stdout, handle), daemon=True).start()
    agent = {
        "index": index,
        "pid": process.pid,
        "is_host": is_host,
        "log": str(log_path),
        "started": time.time(),
    }
    job["agents"].append(agent)
    write_job(run_dir, job)
    log_action(run_dir, "agent_started", agent=index, pid=process.pid, is_host=is_host, log=str(log_path))
    return process


def _tee(stream, handle) -> None:
    """Worker stdout (rank 0's progress and result) to the console and the agent's log."""
    for line in iter(stream.readline, b""):
        sys.stdout.write(line.decode(errors="replace"))
        sys.stdout.flush()
        handle.write(line)
        handle.flush()


def check_inputs(cfg_name: str, overrides: list[str]) -> Config:
    """Fail fast with exit 2 on a bad config or data, before any agent starts; build the data cache."""
    try:
        cfg = resolve_config(cfg_name, overrides)
    except ConfigError as err:
        print(f"elastic-qa: config error: {err}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT) from None
    try:
        if cfg.log.tensorboard:
            TensorBoardScalars.check_installed()
        prepare(cfg, family_for(cfg.model))
    except (DataError, ConfigError) as err:
        print(f"elastic-qa: {err}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT) from None
    return cfg


def cmd_start(args: argparse.Namespace) -> int:
    cfg = check_inputs(args.config, args.overrides)
    use_private_umask(cfg.run.private)  # before the run dir, launch.json and the agents' logs exist
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if (run_dir / "launch.json").exists() and any(alive(a["pid"]) for a in read_job(run_dir)["agents"]):
        print(f"launch: a job is already running in {run_dir} (use join/leave/stop)", file=sys.stderr)
        return EXIT_BAD_INPUT
    job = {
        "run_id": f"eqa-{os.getpid()}-{int(time.time())}",
        "port": args.port or free_port(),
        "min": args.min,
        "max": args.max,
        "nproc_per_node": args.nproc_per_node,
        "max_restarts": args.max_restarts,
        "config": args.config,
        "overrides": args.overrides,
        "module": args.module,
        "private": cfg.run.private,  # join/leave/stop write files too
        "agents": [],
    }
    log_action(
        run_dir,
        "job_start",
        run_id=job["run_id"],
        port=job["port"],
        agents=args.agents,
        nnodes=f"{args.min}:{args.max}",
    )
    started: list[subprocess.Popen] = []
    try:
        for i in range(args.agents):
            started.append(start_agent(run_dir, job, echo=(i == 0)))
    except BaseException:
        for process in started:  # never leave agents of a half-started job behind
            process.kill()
        raise

    def stop_all(signum, _frame):
        log_action(run_dir, "stop_all", signal=signal.Signals(signum).name)
        for agent in read_job(run_dir)["agents"]:
            if alive(agent["pid"]):
                os.kill(agent["pid"], signal.SIGTERM)

    signal.signal(signal.SIGINT, stop_all)
    signal.signal(signal.SIGTERM, stop_all)
    crash = {}
    watcher = threading.Thread(target=watch_for_crash_loop, args=(run_dir, started, crash), daemon=True)
    watcher.start()
    codes = {index: process.wait() for index, process in enumerate(started)}
    # Agents added later by `join` are not our children: wait for them too.
    while any(alive(a["pid"]) for a in read_job(run_dir)["agents"] if a["index"] not in codes):
        time.sleep(0.5)
    log_action(run_dir, "job_end", exit_codes=codes)
    if crash:
        print(f"elastic-qa: the job stopped: every attempt fails with: {crash['error']}", file=sys.stderr)
        return EXIT_BAD_INPUT if crash.get("bad_input") else 1
    print_result(run_dir)
    # Agents of a c10d job finish together: one success means the job completed. Agents killed or
    # stopped on the way (exit codes != 0) do not make a completed job a failure.
    return 0 if 0 in codes.values() else 1


def watch_for_crash_loop(run_dir: Path, started: list[subprocess.Popen], crash: dict) -> None:
    """Stop the job when its attempts keep failing the same way without training (see CrashLoopDetector)."""
    follower, detector = LogFollower(run_dir / "logs"), CrashLoopDetector(CRASH_LOOP_ATTEMPTS)
    while any(process.poll() is None for process in started):
        detector.feed(follower.new_events())
        verdict = detector.verdict()
        if verdict:
            error, bad_input = verdict
            crash.update(error=error, bad_input=bad_input)
            log_action(run_dir, "crash_loop", error=error, attempts=CRASH_LOOP_ATTEMPTS)
            for agent in read_job(run_dir)["agents"]:
                if alive(agent["pid"]):
                    os.kill(agent["pid"], signal.SIGTERM)
            return
        time.sleep(1.0)


def print_result(run_dir: Path) -> None:
    """The final EM/F1 as rank 0 logged it."""
    done = [row for row in read_events(run_dir) if row["event"] == "train_done" and "em" in row]
    if done:
        last = done[-1]
        print(f"result: step {last['step']}  EM {last['em']:.4f}  F1 {last['f1']:.4f}  ({run_dir})")


def cmd_join(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    job = read_job(run_dir)
    use_private_umask(job.get("private", False))
    live = [a for a in job["agents"] if alive(a["pid"])]
    if not live:
        print(f"launch: no agent of {run_dir} is running", file=sys.stderr)
        return EXIT_BAD_INPUT
    if len(live) >= job["max"]:
        print(f"launch: the job already has its maximum of {job['max']} agents", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(start_agent(run_dir, job, echo=False).pid)
    return 0


def cmd_leave(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    job = read_job(run_dir)
    use_private_umask(job.get("private", False))
    live = [a for a in job["agents"] if alive(a["pid"])]
    candidates = (
        [a for a in live if a["index"] == args.agent]
        if args.agent is not None
        else [a for a in live if not a["is_host"]][-1:]
    )
    if not candidates:
        print("launch: no such running agent (the store host leaves only with `stop`)", file=sys.stderr)
        return EXIT_BAD_INPUT
    agent = candidates[0]
    os.kill(agent["pid"], signal.SIGTERM)
    log_action(run_dir, "agent_leave", agent=agent["index"], pid=agent["pid"])
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    job = read_job(run_dir)
    use_private_umask(job.get("private", False))
    for agent in job["agents"]:
        if alive(agent["pid"]):
            os.kill(agent["pid"], signal.SIGTERM)
            log_action(run_dir, "agent_stop", agent=agent["index"], pid=agent["pid"])
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    job = read_job(Path(args.run_dir))
    for agent in job["agents"]:
        state = "running" if alive(agent["pid"]) else "exited"
        print(f"agent {agent['index']}  pid {agent['pid']}  {'host ' if agent['is_host'] else ''}{state}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m elastic_qa.launcher.local",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start", help="start a job with N agents and wait for it")
    start.add_argument("--agents", type=int, default=2, help="agents to start now (default 2)")
    start.add_argument("--min", type=int, default=1, help="fewest agents the job runs with (default 1)")
    start.add_argument("--max", type=int, default=4, help="most agents the job accepts (default 4)")
    start.add_argument("--nproc-per-node", type=int, default=1, help="workers per agent (default 1)")
    start.add_argument(
        "--max-restarts",
        type=int,
        default=MAX_RESTARTS,
        help=f"regroups each agent allows (default {MAX_RESTARTS})",
    )
    start.add_argument("--port", type=int, default=0, help="rendezvous port (default: a free one)")
    start.add_argument("--config", default="default", help="config file or packaged config name")
    start.add_argument(
        "--module",
        default=WORKER_MODULE,
        help=f"worker module the agents run, given --config and the overrides (default {WORKER_MODULE}; "
        "the recovery benchmark runs a trivial baseline worker this way)",
    )
    start.add_argument("overrides", nargs="*", help="section.key=value")
    for name, helptext in (
        ("join", "add one agent to a running job"),
        ("leave", "SIGTERM one agent (preemption): it saves and leaves"),
        ("stop", "SIGTERM every agent"),
        ("status", "list the job's agents"),
    ):
        command = sub.add_parser(name, help=helptext)
        command.add_argument("--run-dir", required=True, help="run.dir of the job")
        if name == "leave":
            command.add_argument("--agent", type=int, help="agent index (default: the newest non-host)")
    args = parser.parse_args(argv)
    if args.command == "start" and not 1 <= args.min <= args.agents <= args.max:
        parser.error(f"need 1 <= --min ({args.min}) <= --agents ({args.agents}) <= --max ({args.max})")
    handler = {
        "start": cmd_start,
        "join": cmd_join,
        "leave": cmd_leave,
        "stop": cmd_stop,
        "status": cmd_status,
    }[args.command]
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
