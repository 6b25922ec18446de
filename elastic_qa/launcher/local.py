"""Elastic torchrun agents on this host: start a job, add an agent, stop one gracefully, stop all.

In a checkout `launch/local.sh` runs this module with the checkout's .venv; installed, it is
`python -m elastic_qa.launcher.local`. The commands and their exit codes: arguments.py (its HELP).

Every agent runs `torchrun --nnodes=MIN:MAX --nproc_per_node=P --rdzv_backend=c10d` on a free port with
its own log file under <run.dir>/agents/, with the settings of `elastic_qa.launcher.rendezvous`. Two torch
2.13 traps are handled here (see docs/running.md): joiners need TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, and
exactly one same-host agent is `is_host=1` (it holds the c10d store). The job description is kept in
<run.dir>/launch.json so that join/leave/stop find it. Each action is logged as one JSON line in
<run.dir>/agents/launch.jsonl; the terminal gets the job's progress and sentences (launcher/terminal.py).
The agents `start` launches are tied to it: if it dies, however it dies, they get SIGTERM and stop.

Every agent is on this host, so everything the job listens on is kept on loopback (see `loopback_env`
and elastic_qa.launcher.loopback). With run.private=true the launcher, its agents and their workers
create files readable by their owner only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from elastic_qa.checkpoint.errors import CheckpointError
from elastic_qa.config import Config, ConfigError, resolve_config
from elastic_qa.config_changes import config_changes, data_refusal, refusal, suspicious_settings
from elastic_qa.data.examples import DataError
from elastic_qa.exits import EXIT_BAD_INPUT, quiet_when_stdout_closes
from elastic_qa.launcher import LOOPBACK_FILE, ON_LOOPBACK, PRELOAD_FLAG
from elastic_qa.launcher.arguments import WORKER_MODULE, build_parser, run_dir_from_args
from elastic_qa.launcher.processes import alive, python_env, tied_to_this_process
from elastic_qa.launcher.rendezvous import MONITOR_INTERVAL_S, rdzv_conf
from elastic_qa.launcher.terminal import (
    DEFAULT_PROG,
    PROG_ENV,
    JobMonitor,
    newest_saved_step,
    resume_command,
    stop_sentence,
    wait_quietly,
)
from elastic_qa.metrics import em_f1_text
from elastic_qa.observe.console import UNDER_LAUNCHER, ProgressView, print_safely
from elastic_qa.observe.events import Event
from elastic_qa.observe.follow import CRASH_LOOP_ATTEMPTS, read_events
from elastic_qa.observe.log import configure_terminal_logging
from elastic_qa.observe.tensorboard import TensorBoardScalars
from elastic_qa.observe.trackers import check_installed as check_trackers_installed
from elastic_qa.run_length import end_step, length_text
from elastic_qa.session.hold import RunHeldError, check_before_start

LOOPBACK = "127.0.0.1"
WARM_PRELOAD = "elastic_qa.launcher.warm_start"  # what each agent's forkserver imports for its workers
COLD_WORKERS_ENV = "ELASTIC_QA_COLD_WORKERS"  # 1: each worker is a new interpreter (no forkserver)
PRIVATE_UMASK = 0o077


def log_action(run_dir: Path | None, event: str, **fields: Any) -> None:
    """One JSON record in <run.dir>/agents/launch.jsonl (never on the terminal: that gets sentences)."""
    line = json.dumps({"event": event, "ts": round(time.time(), 3), **fields})
    if run_dir is not None:
        (run_dir / "agents").mkdir(parents=True, exist_ok=True)
        with open(run_dir / "agents" / "launch.jsonl", "a") as handle:
            handle.write(line + "\n")


def wait_for_agents(run_dir: Path, started: list[subprocess.Popen]) -> dict[int, int]:
    """Each agent's exit code, by index; `agent_exit` recorded as each one ends (not in index order: a
    dashboard sees an agent that a fault or a signal ended when it ends, not once all have)."""
    codes: dict[int, int] = {}

    def watch(index: int, process: subprocess.Popen) -> None:
        codes[index] = process.wait()
        log_action(run_dir, Event.AGENT_EXIT, agent=index, pid=process.pid, code=codes[index])

    watchers = [
        threading.Thread(target=watch, args=(index, process), name=f"agent-{index}", daemon=True)
        for index, process in enumerate(started)
    ]
    for watcher in watchers:
        watcher.start()
    for watcher in watchers:
        watcher.join()
    return dict(sorted(codes.items()))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def read_job(run_dir: Path) -> dict:
    path = run_dir / "launch.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        print(f"launch: {path} not found: no job was started with --run-dir {run_dir}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT) from None


def write_job(run_dir: Path, job: dict) -> None:
    staging = run_dir / "launch.json.tmp"
    staging.write_text(json.dumps(job, indent=1))
    staging.replace(run_dir / "launch.json")


def agent_command(job: dict, is_host: bool) -> list[str]:
    """torchrun, and each worker it starts, run through ON_LOOPBACK: their stores bind loopback.

    With warm workers (the default: `job["warm_preload"]`, see `warm_preload`) the agent's workers are
    forks of a forkserver that has imported torch and the trainer once (elastic_qa.launcher.warm_start),
    each running ON_LOOPBACK's file (`--run-path`); without, each worker is a new interpreter:
    `python -u -m ON_LOOPBACK MODULE`.
    """
    modules = job.get("warm_preload") or []  # launch.json files written before warm workers lack it
    preload = [f"{PRELOAD_FLAG}{','.join(modules)}"] if modules else []
    worker = ["--module", ON_LOOPBACK]
    if modules:
        worker = ["--start-method=forkserver", "--run-path", str(LOOPBACK_FILE)]
    return [
        sys.executable,
        "-m",
        ON_LOOPBACK,
        *preload,
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
        # Each worker runs ON_LOOPBACK MODULE ...: `python -m MODULE ...`, its store on loopback.
        *worker,
        job.get("module", WORKER_MODULE),  # launch.json files written before --module existed lack it
        "--config",
        job["config"],
        *job["overrides"],
    ]


def warm_preload(cfg: Config, module: str) -> list[str]:
    """What each agent's forkserver imports for its warm workers: torch and the trainer, and transformers
    for a pretrained encoder (~2 s of each restart otherwise). None (each worker a new interpreter, as
    torchrun starts one by default) with ELASTIC_QA_COLD_WORKERS=1, or for a worker module of the user's
    own (`--module`; the benchmarks' bare floor is one): what it imports is not known here."""
    if os.environ.get(COLD_WORKERS_ENV, "") not in ("", "0") or module != WORKER_MODULE:
        return []
    return [WARM_PRELOAD, *(["elastic_qa.models.hf"] if cfg.model.kind == "hf" else [])]


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


def start_agent(run_dir: Path, job: dict, tied: bool = False) -> subprocess.Popen:
    """One more agent of the job. `tied`: the agent gets SIGTERM (it stops its workers, which save) when
    this process dies, however it dies; `start` ties its own, `join` exits at once and cannot."""
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
        UNDER_LAUNCHER: "1",  # the launcher owns the terminal: workers print plain lines to their log
    }
    handle = open(log_path, "ab")  # noqa: SIM115 - owned by the agent process
    process = subprocess.Popen(
        agent_command(job, is_host),
        stdout=handle,
        stderr=handle,
        env=env,
        start_new_session=True,  # Ctrl-C reaches the launcher, which stops agents in order
        preexec_fn=tied_to_this_process() if tied else None,
    )
    agent = {
        "index": index,
        "pid": process.pid,
        "is_host": is_host,
        "log": str(log_path),
        "started": time.time(),
    }
    job["agents"].append(agent)
    write_job(run_dir, job)
    log_action(run_dir, Event.AGENT_STARTED, agent=index, pid=process.pid, is_host=is_host, log=str(log_path))
    return process


def check_inputs(cfg_name: str, overrides: list[str]) -> Config:
    """Fail fast with exit 2, before any agent starts, on a bad config or data, or on a checkpoint the
    config cannot resume (another model shape); build the data cache; warn once of unlikely settings."""
    # Here, not at the top: they import torch (seconds on a loaded host), which `join` (a new agent while
    # the job runs), `leave`, `stop` and `status` do not need.
    from elastic_qa.checkpoint.locate import newest_saved_trainer
    from elastic_qa.compile import compile_cache_dir, private_directory
    from elastic_qa.models import family_for
    from elastic_qa.prep import prepare

    configure_terminal_logging()  # in-process work (the cache build) speaks in sentences, if at all
    try:
        cfg = resolve_config(cfg_name, overrides)
    except ConfigError as err:
        print(f"elastic-qa: config error: {err}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT) from None
    try:
        if "tensorboard" in cfg.log.tracker_names:
            TensorBoardScalars.check_installed()
        check_trackers_installed(cfg)
        if cfg.train.compile:  # each worker checks it again; a bad one is refused here, not in a crash loop
            private_directory(compile_cache_dir(cfg))
        data = prepare(cfg, family_for(cfg.model))
        saved = newest_saved_trainer(cfg.checkpoint_dir) if cfg.checkpoint.resume else None
    except (DataError, ConfigError) as err:
        print(f"elastic-qa: {err}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT) from None
    if saved is not None:
        step, trainer = saved
        where = f"{cfg.checkpoint_dir} (step {step})"
        changes = config_changes(trainer["config"], cfg)
        problem = refusal(changes, where)
        saved_windows = (trainer.get("data") or {}).get("num_samples")
        if problem is None and isinstance(saved_windows, int):
            problem = data_refusal(changes, saved_windows, len(data.train), where)
        end = end_step(cfg.train, len(data.train), trainer.get("length"))
        if step > end:
            problem = (
                f"the newest checkpoint in {cfg.checkpoint_dir} is at step {step}, past "
                f"{length_text(cfg.train, end)}: nothing to train (raise it to continue)"
            )
        if problem:
            print(f"elastic-qa: {problem}", file=sys.stderr)
            raise SystemExit(EXIT_BAD_INPUT)
    for warning in suspicious_settings(cfg, len(data.train)):
        print(f"elastic-qa: warning: {warning}", file=sys.stderr)
    return cfg


def check_writable(run_dir: Path) -> None:
    """Create the run directory and its agents/ folder, and try the files the launcher writes there; exit 2
    with one line naming what cannot be written, before any agent starts (an agent started and then not
    recorded in launch.json could be neither stopped nor joined)."""
    probe = run_dir / "launch.json.tmp"  # write_job's staging file: launch.json is replaced from it
    try:
        (run_dir / "agents").mkdir(parents=True, exist_ok=True)
        for path in (run_dir / "agents" / "launch.jsonl", probe):
            with open(path, "a"):
                pass
        probe.unlink()
    except OSError as err:
        where, why = err.filename or run_dir, err.strerror or err
        line = f"elastic-qa: run.dir={run_dir}: cannot write {where} ({why}); nothing was started"
        print(line, file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT) from None


def cmd_start(args: argparse.Namespace) -> int:
    cfg = check_inputs(args.config, args.overrides)
    use_private_umask(cfg.run.private)  # before the run dir, launch.json and the agents' logs exist
    run_dir = Path(cfg.run.dir)
    # The refusals first: a start refused leaves nothing behind in the run directory.
    if (run_dir / "launch.json").exists() and any(alive(a["pid"]) for a in read_job(run_dir)["agents"]):
        print(f"launch: a job is already running in {run_dir} (use join/leave/stop)", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:  # a live job on the same checkpoints started elsewhere (by hand, another run.dir, another host)
        check_before_start(cfg.checkpoint_dir, "", str(run_dir))
    except RunHeldError as err:
        print(f"elastic-qa: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except CheckpointError as err:  # holders/ is no real directory of the store (checkpoint/confined.py)
        print(f"elastic-qa: checkpoint.dir={cfg.checkpoint_dir}: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    check_writable(run_dir)
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
        "warm_preload": warm_preload(cfg, args.module),
        "agents": [],
    }
    started_at = time.time()
    log_action(
        run_dir,
        Event.JOB_START,
        run_id=job["run_id"],
        port=job["port"],
        agents=args.agents,
        nnodes=f"{args.min}:{args.max}",
    )
    stops: list[int] = []  # the signals that asked this launcher to stop the job
    view = ProgressView(cfg.log.console)

    def stop_all(signum, _frame):
        if not stops:
            view.stopping = True
            # A handler that prints while its own thread was printing gets "reentrant call": the
            # sentence is dropped then, never the stop.
            with contextlib.suppress(RuntimeError):
                view.say(
                    f"stopping ({signal.Signals(signum).name}): every agent saves its step first",
                    always=True,
                )
        stops.append(signum)
        log_action(run_dir, Event.STOP_ALL, signal=signal.Signals(signum).name)
        for agent in current_agents(run_dir, job):
            if alive(agent["pid"]):
                os.kill(agent["pid"], signal.SIGTERM)

    # Before the agents: a Ctrl-C from now on stops them in order (they ignore the terminal's signals).
    signal.signal(signal.SIGINT, stop_all)
    signal.signal(signal.SIGTERM, stop_all)
    started: list[subprocess.Popen] = []
    try:
        for _ in range(args.agents):
            if stops:  # stopped while starting: the agents started so far were told to stop
                break
            started.append(start_agent(run_dir, job, tied=True))
    except BaseException:
        for process in started:  # never leave agents of a half-started job behind
            process.kill()
        raise
    say(
        f"started {args.agents} agent{'s' if args.agents > 1 else ''} for {run_dir} (the job runs with "
        f"{args.min} to {args.max}); their logs: {run_dir / 'agents'}"
    )

    def crash_loop(error: str, _bad_input: bool) -> None:
        log_action(run_dir, Event.CRASH_LOOP, error=error, attempts=CRASH_LOOP_ATTEMPTS)
        for agent in read_job(run_dir)["agents"]:
            if alive(agent["pid"]):
                os.kill(agent["pid"], signal.SIGTERM)

    monitor = JobMonitor(run_dir, started_at, view, crash_loop)
    monitor.start()
    codes = wait_for_agents(run_dir, started)
    # Agents added later by `join` are not our children: wait for them too.
    wait_quietly(lambda: any(alive(a["pid"]) for a in read_job(run_dir)["agents"] if a["index"] not in codes))
    monitor.stop()
    log_action(run_dir, Event.JOB_END, exit_codes=codes)
    if monitor.crash:
        error, bad_input = monitor.crash
        print(f"elastic-qa: the job stopped: every attempt fails with: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT if bad_input else 1
    resume = resume_command(os.environ.get(PROG_ENV) or DEFAULT_PROG, args.argv)
    if stops:
        name = signal.Signals(stops[0]).name
        say(stop_sentence(f"stopped by {name}", newest_saved_step(cfg.checkpoint_dir), resume))
        return 128 + stops[0]  # 130 for Ctrl-C, 143 for SIGTERM: what a shell expects of a stopped command
    # Agents of a c10d job finish together: one success means the job completed. Agents killed or
    # stopped on the way (exit codes != 0) do not make a completed job a failure.
    if print_result(run_dir, started_at) or 0 in codes.values():  # a --module worker logs no train_done
        return 0 if 0 in codes.values() else 1
    requested = read_job(run_dir).get("stop_requested")
    if requested is not None and requested >= started_at:  # `stop` asked for it: no failure if all was saved
        saved, last = newest_saved_step(cfg.checkpoint_dir), last_trained_step(run_dir, started_at)
        if last is None or (saved is not None and saved >= last):
            said = "stopped by `stop` and saved, resumable" if last else "stopped by `stop` before any step"
            say(stop_sentence(said, saved, resume))
            return 0
        reason = f"stopped by `stop`, but step {last} was not saved (see the agents' logs)"
        say(stop_sentence(reason, saved, resume))
        return 1
    reason = "the job ended before its last step (agents stopped or failed; see their logs)"
    say(stop_sentence(reason, newest_saved_step(cfg.checkpoint_dir), resume))
    return 1


def last_trained_step(run_dir: Path, since: float) -> int | None:
    """The newest step rank 0 said it trained or stopped after in this launch of the job, or None."""
    steps = [
        row["step"]
        for row in read_events(run_dir)
        if row["event"] in (Event.STEP, Event.STOPPING)
        and row.get("rank", 0) == 0
        and row.get("ts", 0.0) >= since
        and isinstance(row.get("step"), int)
    ]
    return max(steps, default=None)


def current_agents(run_dir: Path, job: dict) -> list[dict]:
    """The job's agents, those `join` added included; this launcher's own before launch.json is written."""
    try:
        return json.loads((run_dir / "launch.json").read_text())["agents"]
    except (OSError, ValueError, KeyError):
        return job["agents"]


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def say(text: str) -> None:
    print_safely(text)


def train_done(run_dir: Path, since: float = 0.0) -> dict[str, Any] | None:
    """Rank 0's `train_done` event of this launch of the job (logged at or after `since`), or None."""
    done = [
        row
        for row in read_events(run_dir)
        if row["event"] == Event.TRAIN_DONE and row.get("ts", 0.0) >= since and row.get("rank", 0) == 0
    ]
    return done[-1] if done else None


def print_result(run_dir: Path, since: float = 0.0) -> bool:
    """The final EM/F1 as rank 0 logged it, if the job (this launch of it) reached its end."""
    last = train_done(run_dir, since)
    if last is None:
        return False
    scores = f"  {em_f1_text(last['em'], last['f1'])}" if "em" in last else ""
    say(f"result: step {last['step']}{scores}  ({run_dir})")
    return True


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
    process = start_agent(run_dir, job)
    agent, world = job["agents"][-1], len(live) + 1
    workers = world * job["nproc_per_node"]
    print(
        f"joined: agent {agent['index']} (pid {process.pid}) on {socket.gethostname()}; the job regroups at "
        f"{plural(world, 'agent')} ({plural(workers, 'worker')}, max {job['max']}); its log: "
        f"{agent['log']}"
    )
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
    log_action(run_dir, Event.AGENT_LEAVE, agent=agent["index"], pid=agent["pid"])
    world = len(live) - 1
    workers = world * job["nproc_per_node"]
    print(
        f"leaving: agent {agent['index']} (pid {agent['pid']}) on {socket.gethostname()} got SIGTERM: its "
        f"workers save, and the job regroups at {plural(world, 'agent')} ({plural(workers, 'worker')})"
    )
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    job = read_job(run_dir)
    use_private_umask(job.get("private", False))
    live = [agent for agent in job["agents"] if alive(agent["pid"])]
    if live:  # before the signals: `start` reads it to tell a requested stop from a failure
        job["stop_requested"] = time.time()
        write_job(run_dir, job)
    for agent in live:
        os.kill(agent["pid"], signal.SIGTERM)
        log_action(run_dir, Event.AGENT_STOP, agent=agent["index"], pid=agent["pid"])
    pids = ", ".join(str(agent["pid"]) for agent in live)
    print(
        f"stopping: SIGTERM to {plural(len(live), 'agent')} (pid {pids}): each saves its step first"
        if live
        else f"no agent of {run_dir} is running: nothing to stop"
    )
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    job = read_job(Path(args.run_dir))
    for agent in job["agents"]:
        state = "running" if alive(agent["pid"]) else "exited"
        print(f"agent {agent['index']}  pid {agent['pid']}  {'host ' if agent['is_host'] else ''}{state}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    prog = os.environ.get(PROG_ENV) or DEFAULT_PROG
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    args.argv = argv
    run_dir_from_args(parser, args)
    if args.command == "start" and not 1 <= args.min <= args.agents <= args.max:
        parser.error(f"need 1 <= --min ({args.min}) <= --agents ({args.agents}) <= --max ({args.max})")
    handler = {
        "start": cmd_start,
        "join": cmd_join,
        "leave": cmd_leave,
        "stop": cmd_stop,
        "status": cmd_status,
    }[args.command]
    try:  # `status | head -1`: quiet, 141 (exits.py)
        return quiet_when_stdout_closes(lambda: handler(args))
    except KeyboardInterrupt:  # Ctrl-C before any agent started (checking inputs, building the cache)
        print("elastic-qa: interrupted before the job started; nothing was started", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
