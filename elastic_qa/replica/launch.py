"""`elastic-qa replicas`: the replica-group mode on this host, a Lighthouse and one torchrun job per group.

    elastic-qa replicas --config tiny run.dir=runs/replicas replica.groups=2 [key=value ...]

Each replica group is a torchrun job of its own (one node, `replica.nproc_per_group` workers, DDP inside,
torchrun's own restarts), so a fault restarts one group while the others keep training (a group whose torchrun
agent itself died is started again here, as a scheduler would replace a lost node, up to
`replica.max_group_restarts` times); the groups form a quorum per step through torchft's Lighthouse, which
this launcher runs and supervises: a Lighthouse that exits is replaced at the same address by a standby
started ahead (loaded and waiting, so it serves within milliseconds), and the groups retry their quorum
requests meanwhile (`replica.quorum_retries`). The job's heal key (the secret a group proves it belongs to the
job with when it asks a peer for the training state) is made here and given to every group in the environment.

What the launcher writes, one JSON line each, to <run.dir>/agents/replicas.jsonl: `job_start` (groups,
lighthouse), `lighthouse_started` (pid, incarnation, standby), `lighthouse_standby` (pid: the next
Lighthouse, loaded, waiting to take over), `group_started` (group, pid), `group_exit` (group, code),
`job_end` (exit_codes). It exits 0 when every group finished, 2 on bad input (a live job already holding
the run's checkpoints among it: the launcher holds the run for the whole job, session/hold.py), else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from elastic_qa.checkpoint.errors import CheckpointError
from elastic_qa.config import Config, ConfigError, config_help, resolve_config
from elastic_qa.exits import EXIT_BAD_INPUT, EXIT_FAILED
from elastic_qa.launcher import LOOPBACK_FILE, ON_LOOPBACK, PRELOAD_FLAG
from elastic_qa.launcher.arguments import WORKER_MODULE
from elastic_qa.launcher.local import LOOPBACK, free_port, warm_preload
from elastic_qa.launcher.processes import end_process, python_env, tied_to_this_process
from elastic_qa.launcher.rendezvous import MONITOR_INTERVAL_S
from elastic_qa.liveness import this_process
from elastic_qa.observe.events import Event
from elastic_qa.observe.trackers import check_installed
from elastic_qa.replica.ft import (
    INCARNATION_ENV,
    LighthouseIncarnation,
    lighthouse_command,
    require_torchft,
)
from elastic_qa.session.hold import RunHeldError, RunHold

WORKER = "elastic_qa.replica.worker"
KEY_ENV = "ELASTIC_QA_REPLICA_KEY"
MAX_RESTARTS = 100  # a group's torchrun restarts its workers this often before it gives up


class StandbyLighthouse:
    """A Lighthouse process with its imports done, waiting to bind the job's address: promoted when the one
    that serves dies, so a restart costs milliseconds instead of an interpreter's start-up."""

    def __init__(self, command: list[str], log: Path, env: dict[str, str]) -> None:
        with open(log, "ab") as out:
            self.process = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=out, env=env,
                preexec_fn=tied_to_this_process(),
            )  # fmt: skip
        self.ready = threading.Event()
        threading.Thread(target=self._wait_ready, name="standby-lighthouse", daemon=True).start()

    def _wait_ready(self) -> None:
        assert self.process.stdout is not None
        if self.process.stdout.readline().strip() == b"ready":
            self.ready.set()
        for _ in self.process.stdout:  # anything it prints once it serves: never left to fill the pipe
            pass

    def serve(self) -> bool:
        """Tell it to bind; False when it is not ready (still importing, or dead)."""
        if not self.ready.is_set() or self.process.poll() is not None or self.process.stdin is None:
            return False
        try:
            self.process.stdin.write(b"serve\n")
            self.process.stdin.flush()
        except OSError:
            return False
        return True


def warm_modules(cfg: Config) -> list[str]:
    """What each group's forkserver imports for its warm workers: what a default-mode agent's imports
    (launcher/local.py `warm_preload`: torch, the trainer, transformers for a pretrained encoder), and the
    replica worker and torchft's manager. A worker the group's torchrun starts again after a fault is then a
    fork that has all of it, instead of a new interpreter paying its imports while the survivors wait to
    heal it. None (each worker a new interpreter) with ELASTIC_QA_COLD_WORKERS=1, as in the default mode."""
    default = warm_preload(cfg, WORKER_MODULE)
    return [*default, WORKER, "torchft.manager"] if default else []


class ReplicaJob:
    """The Lighthouse and the groups' torchrun jobs of one run, started and supervised from this process."""

    def __init__(self, cfg: Config, config: str, overrides: list[str]) -> None:
        self.cfg, self.config, self.overrides = cfg, config, overrides
        self.run_dir = Path(cfg.run.dir)
        self.job_id = f"replicas-{os.getpid()}-{int(time.time())}"  # every group's torchrun run id
        self.port = cfg.replica.lighthouse_port or free_port()
        self.lighthouse_host = LOOPBACK  # where it listens (`node --replicas`: the store host's address)
        self.local_addr = LOOPBACK  # the groups' workers listen here (`node --replicas`: the host's address)
        self.max_restarts = MAX_RESTARTS  # torchrun's restarts of a group's workers
        self.lighthouse_address = f"http://{LOOPBACK}:{self.port}"
        self.lighthouse: subprocess.Popen | None = None
        self.standby: StandbyLighthouse | None = None  # the next Lighthouse, started ahead
        self.groups: dict[int, subprocess.Popen] = {}
        self.stopping = threading.Event()
        self._records = self.run_dir / "agents" / "replicas.jsonl"
        self._lock = threading.Lock()
        self.incarnation_file = self.run_dir / "agents" / "lighthouse.json"
        self.incarnation = 0  # how often the Lighthouse was started
        self.env = python_env({
            **os.environ, KEY_ENV: os.environ.get(KEY_ENV) or secrets.token_hex(32),
            INCARNATION_ENV: str(self.incarnation_file),
        })  # fmt: skip
        self.env.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at INFO otherwise

    def record(self, event: str, **fields: Any) -> None:
        line = json.dumps({"event": event, "ts": round(time.time(), 6), **fields})
        with self._lock, open(self._records, "a") as out:
            out.write(line + "\n")

    # ---- the Lighthouse ------------------------------------------------------------------------------
    def start_lighthouse(self, within_s: float | None = 30.0) -> None:
        """Start torchft's Lighthouse at the job's address and wait until it listens: RuntimeError when it
        exits first, or does not listen within `within_s` (None: as long as it lives)."""
        self.incarnation += 1  # before it starts: every quorum it gives is read with its incarnation
        LighthouseIncarnation.write(self.incarnation_file, self.incarnation)
        log = open(self.run_dir / "agents" / "lighthouse.log", "ab")  # noqa: SIM115 (the child's)
        standby, self.standby = self.standby, None
        promoted = standby is not None and standby.serve()
        if standby is not None and promoted:
            self.lighthouse = lighthouse = standby.process
            log.close()
        else:
            if standby is not None:
                end_process(standby.process, grace_s=0)
            with log:
                self.lighthouse = lighthouse = subprocess.Popen(
                    lighthouse_command(self.port, self.cfg.replica, self.lighthouse_host),
                    stdout=log, stderr=subprocess.STDOUT, env=self.env, preexec_fn=tied_to_this_process(),
                )  # fmt: skip
        deadline = None if within_s is None else time.monotonic() + within_s
        while deadline is None or time.monotonic() < deadline:
            if lighthouse.poll() is not None:
                raise RuntimeError(f"the Lighthouse exited {lighthouse.returncode}: see {log.name}")
            with socket.socket() as probe:
                if probe.connect_ex((self.lighthouse_host, self.port)) == 0:
                    self.record(
                        Event.LIGHTHOUSE_STARTED, pid=lighthouse.pid, port=self.port,
                        incarnation=self.incarnation, standby=promoted,
                    )  # fmt: skip
                    self._start_standby()
                    return
            if self.stopping.wait(0.02):
                return
        raise RuntimeError(
            f"the Lighthouse did not listen on {self.lighthouse_host}:{self.port} within {within_s:.0f} s"
        )

    def _start_standby(self) -> None:
        """Start the next Lighthouse ahead of need; its `lighthouse_standby` record says when it is ready."""
        if self.stopping.is_set():
            return
        command = lighthouse_command(self.port, self.cfg.replica, self.lighthouse_host, standby=True)
        standby = self.standby = StandbyLighthouse(
            command, self.run_dir / "agents" / "lighthouse.log", self.env
        )

        def announce() -> None:
            if standby.ready.wait(timeout=600) and not self.stopping.is_set():
                self.record(Event.LIGHTHOUSE_STANDBY, pid=standby.process.pid)

        threading.Thread(target=announce, name="standby-ready", daemon=True).start()

    def supervise_lighthouse(self) -> None:
        """Start the Lighthouse again, at the same address, whenever it exits before the job ends. A start
        on a loaded host may take long: it is waited for as long as the new Lighthouse lives; one that exits
        at once (its port not free yet) is started again after a short pause."""
        while not self.stopping.is_set():
            lighthouse = self.lighthouse
            if lighthouse is not None and lighthouse.poll() is not None and not self.stopping.is_set():
                self.record(Event.LIGHTHOUSE_EXIT, pid=lighthouse.pid, code=lighthouse.returncode)
                try:
                    self.start_lighthouse(within_s=None)
                except RuntimeError:  # it exited: the next turn records it and starts another
                    self.stopping.wait(0.5)
                    continue
            self.stopping.wait(0.05)

    # ---- the groups ----------------------------------------------------------------------------------
    def group_command(self, group: int) -> list[str]:
        """torchrun for one group: its own rendezvous on loopback (one node); its workers' store and
        collectives on `local_addr` (loopback here; the address the other hosts reach, `node --replicas`)."""
        replica = self.cfg.replica
        modules = warm_modules(self.cfg)
        preload = [f"{PRELOAD_FLAG}{','.join(modules)}"] if modules else []
        worker = (
            ["--start-method=forkserver", "--run-path", str(LOOPBACK_FILE)]
            if modules
            else ["--module", ON_LOOPBACK]
        )
        return [
            sys.executable, "-m", ON_LOOPBACK, *preload, "torch.distributed.run",
            "--nnodes=1", f"--nproc_per_node={replica.nproc_per_group}",
            "--rdzv_backend=c10d", f"--rdzv_endpoint={LOOPBACK}:{free_port()}",
            f"--rdzv_id={self.job_id}", "--rdzv_conf=is_host=1",
            f"--max-restarts={self.max_restarts}", f"--monitor-interval={MONITOR_INTERVAL_S}",
            f"--local_addr={self.local_addr}", *worker, WORKER,
            "--config", self.config, *self.overrides,
        ]  # fmt: skip

    def lighthouse_for(self, group: int) -> str:
        """The Lighthouse address group `group` asks for its quorums (the job's one; a test of a partition
        gives a group another)."""
        return self.lighthouse_address

    def start_group(self, group: int) -> subprocess.Popen:
        env = {
            **self.env,
            "ELASTIC_QA_REPLICA_GROUP": str(group),
            "TORCHFT_LIGHTHOUSE": self.lighthouse_for(group),
        }
        out = open(self.run_dir / "agents" / f"group-{group}.log", "ab")  # noqa: SIM115 (the child's)
        with out:
            process = subprocess.Popen(
                self.group_command(group), stdout=out, stderr=subprocess.STDOUT, env=env,
                preexec_fn=tied_to_this_process(), start_new_session=True,
            )  # fmt: skip
        self.record(Event.GROUP_STARTED, group=group, pid=process.pid)
        return process

    def run(self) -> int:
        """Hold the run, start the Lighthouse and the groups, wait for the groups; the exit code."""
        hold = RunHold(self.cfg.checkpoint_dir, self.job_id, str(self.run_dir))
        hold.acquire([this_process().to_dict()])  # RunHeldError: another live job holds the run
        hold.start_heartbeat()
        code = EXIT_FAILED
        try:
            code = self._run()
        finally:
            if code == 0:
                hold.release()
            else:  # left behind: this process gone, a restart takes the run over at once
                hold.stop_heartbeat()
        return code

    def _run(self) -> int:
        (self.run_dir / "agents").mkdir(parents=True, exist_ok=True)
        self.record(Event.JOB_START, groups=self.cfg.replica.groups, lighthouse=self.lighthouse_address)
        codes: dict[int, int] = {}
        try:
            codes = self.supervise(list(range(self.cfg.replica.groups)), lighthouse=True)
        finally:
            self.record(Event.JOB_END, exit_codes={str(g): c for g, c in codes.items()})
        return 0 if codes and all(code == 0 for code in codes.values()) else EXIT_FAILED

    def supervise(self, groups: list[int], lighthouse: bool) -> dict[int, int]:
        """Start the Lighthouse (with its standby and supervisor, when this process runs it) and `groups`,
        supervise them until the job is done, then end every process it started; each group's last exit
        code."""
        supervisor = None
        if lighthouse:
            self.start_lighthouse()
            supervisor = threading.Thread(target=self.supervise_lighthouse, name="lighthouse", daemon=True)
            supervisor.start()
        try:
            self.groups = {group: self.start_group(group) for group in groups}
            return self.supervise_groups()
        finally:
            self.stopping.set()
            end_groups(list(self.groups.values()), grace_s=30)
            if self.lighthouse is not None:
                end_process(self.lighthouse, grace_s=5)
            if self.standby is not None:
                end_process(self.standby.process, grace_s=0)
            if supervisor is not None:
                supervisor.join(timeout=5)

    def supervise_groups(self) -> dict[int, int]:
        """Wait for every group; start a group whose torchrun agent died (killed, or out of restarts) again,
        as a cluster scheduler would replace a lost node, unless the job is done (a group finished), the
        group refused its input (exit 2), or it was started `replica.max_group_restarts` times in a row
        already (a group that ran `replica.restarts_reset_after` before it died counts from 0 again). The
        started group holds no state: it heals from a live peer, or restores the newest checkpoint when none
        is left. Returns each group's last exit code."""
        codes: dict[int, int] = {}
        restarts = dict.fromkeys(self.groups, 0)
        started = dict.fromkeys(self.groups, time.monotonic())
        reset_after = self.cfg.replica.restarts_reset_after.total_seconds()
        while len(codes) < len(self.groups):
            for group, process in list(self.groups.items()):
                code = process.poll()
                if group in codes or code is None:
                    continue
                ran_s = time.monotonic() - started[group]
                if ran_s >= reset_after:
                    restarts[group] = 0
                self.record(Event.GROUP_EXIT, group=group, code=code, ran_s=round(ran_s, 3))
                done = 0 in codes.values() or code in (0, EXIT_BAD_INPUT) or self.stopping.is_set()
                if done or restarts[group] >= self.cfg.replica.max_group_restarts:
                    codes[group] = code
                else:
                    restarts[group] += 1
                    started[group] = time.monotonic()
                    self.groups[group] = self.start_group(group)
            self.stopping.wait(MONITOR_INTERVAL_S)
        return codes


def end_groups(processes: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM every group's torchrun agent at once, then SIGKILL any still running after `grace_s`. At once:
    each group saves the step it completed last as it stops, and groups stopped one after another would
    each save a step of their own (the later ones training alone in new lineages meanwhile)."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + grace_s
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def not_in_this_mode(cfg: Config) -> str | None:
    """The line refusing a setting the replica mode cannot honour (exit 2), or None: TensorBoard, whose
    per-rank files are not kept per group, and a tracker that is not installed (observe/trackers)."""
    if "tensorboard" in cfg.log.tracker_names:
        return (
            "log.trackers lists tensorboard (or log.tensorboard=true): the replica-group mode sends to "
            "mlflow and wandb only"
        )
    try:
        check_installed(cfg)
    except ConfigError as err:
        return str(err)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="elastic-qa replicas", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--config", default="default", help=config_help())
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. replica.groups=3")
    args = parser.parse_args(argv)
    try:
        cfg = resolve_config(args.config, args.overrides)
        require_torchft()
        if (refusal := not_in_this_mode(cfg)) is not None:
            raise ConfigError(refusal)
        Path(cfg.run.dir, "agents").mkdir(parents=True, exist_ok=True)
    except ConfigError as err:
        print(f"elastic-qa: config error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as err:
        print(f"elastic-qa: run.dir={cfg.run.dir}: cannot create it ({err.strerror})", file=sys.stderr)
        return EXIT_BAD_INPUT
    job = ReplicaJob(cfg, args.config, args.overrides)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda got, _frame: sys.exit(128 + got))
    try:
        return job.run()
    except RunHeldError as err:
        print(f"elastic-qa: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except CheckpointError as err:  # holders/ is no real directory of the store (checkpoint/confined.py)
        print(f"elastic-qa: checkpoint.dir={cfg.checkpoint_dir}: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
