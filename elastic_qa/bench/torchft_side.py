"""The torchft side of `elastic-qa bench goodput`: the product's model and data trained with torchft 0.2.0.

    python -m elastic_qa.bench.torchft_side --replica 0 --lighthouse http://HOST:PORT --config tiny \\
        run.dir=DIR [key=value ...]

One process per replica group (2 groups), CPU and gloo. Each builds the config's model from the config's
seed, opens the same feature cache, and trains with torchft's own pieces: a Lighthouse (run by the
bench, min_replicas 1), a torchft.Manager with torchft's reconfigurable ProcessGroupGloo, gradients
flattened into one tensor and averaged through `manager.allreduce` (not torchft's DDP wrapper, which
crashed the survivor when a peer died), the optimizer stepped only when `manager.should_commit()`. A
replica reads its shard with torchft.data.DistributedSampler (global batch / 2 windows a step); torchft
keeps no data position, so a restarted replica starts its shard again from the beginning, as a torchft
script does. What differs from the product: the LR is constant (the optimizer is the product's AdamW, no
warm-up or decay), and a step with one live replica trains half the global batch.

Every step appends a JSON line (event `step`: ts, manager step, committed, participants, whether this
replica trained in it, its position in its shard stream and the windows it read) to
<run.dir>/logs/torchft.replica-R.pid-P.jsonl. The bench (TorchftSide) runs the Lighthouse, starts the two
replicas, restarts a replica whose process ended (as torchrun would; it heals from the live peer), and
kills replicas for the faults: kill-worker and kill-node SIGKILL a replica group's process (a group is
one process on one node), term-node SIGTERMs it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from elastic_qa.bench.goodput_figures import Step
from elastic_qa.chaos.faults import NoTarget
from elastic_qa.launcher.processes import alive, python_env, tied_to_this_process
from elastic_qa.observe.events import Event
from elastic_qa.observe.follow import LogFollower

REPLICAS = 2
# Lighthouse and Manager settings, low for a loopback job (torchft's defaults: heartbeat timeout 5 s,
# join timeout 60 s, collectives 60 s). A dead replica is dropped from the quorum once its heartbeat is
# HEARTBEAT_TIMEOUT old; a quorum waits JOIN_TIMEOUT for replicas that are not yet there.
HEARTBEAT_TIMEOUT = timedelta(seconds=1)
HEARTBEAT_INTERVAL = timedelta(milliseconds=100)
QUORUM_TICK = timedelta(milliseconds=50)
JOIN_TIMEOUT = timedelta(milliseconds=500)
COLLECTIVE_TIMEOUT = timedelta(seconds=10)
QUORUM_TIMEOUT = timedelta(seconds=30)
CONNECT_TIMEOUT = timedelta(seconds=10)
SETTINGS = {
    "lighthouse_min_replicas": 1,
    "heartbeat_timeout_s": HEARTBEAT_TIMEOUT.total_seconds(),
    "heartbeat_interval_s": HEARTBEAT_INTERVAL.total_seconds(),
    "quorum_tick_s": QUORUM_TICK.total_seconds(),
    "join_timeout_s": JOIN_TIMEOUT.total_seconds(),
    "collective_timeout_s": COLLECTIVE_TIMEOUT.total_seconds(),
    "quorum_timeout_s": QUORUM_TIMEOUT.total_seconds(),
}


# ---- one replica group (its own process) ----------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m elastic_qa.bench.torchft_side", description=__doc__)
    parser.add_argument("--replica", type=int, required=True)
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--config", default="tiny")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    return train(args.replica, args.lighthouse, args.config, args.overrides)


def train(replica: int, lighthouse: str, config: str, overrides: list[str]) -> int:
    import numpy as np
    import torch
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.data import DistributedSampler

    from elastic_qa.config import resolve_config
    from elastic_qa.data.loader import collate
    from elastic_qa.dist import flush_denormals
    from elastic_qa.models import family_for, model_inputs
    from elastic_qa.optim import build_optimizer
    from elastic_qa.prep import prepare

    parent = os.getppid()
    torch.set_num_threads(1)  # two replicas share the host, as the product's two workers do
    cfg = resolve_config(config, overrides)
    flush_denormals(cfg.train.flush_denormals)  # the same arithmetic as the product's workers
    family = family_for(cfg.model)
    data = prepare(cfg, family)
    torch.manual_seed(cfg.run.seed)
    model = family.build_model(cfg, data.vocab_size)
    optimizer = build_optimizer(model, cfg)
    params = [p for p in model.parameters() if p.requires_grad]

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=COLLECTIVE_TIMEOUT),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        timeout=COLLECTIVE_TIMEOUT,
        quorum_timeout=QUORUM_TIMEOUT,
        connect_timeout=CONNECT_TIMEOUT,
        rank=0,
        world_size=1,
        store_addr="localhost",
        store_port=store.port,
        lighthouse_addr=lighthouse,
        replica_id=f"replica-{replica}",
        heartbeat_interval=HEARTBEAT_INTERVAL,
    )
    sampler = DistributedSampler(
        data.train, replica_rank=replica, num_replica_groups=REPLICAS, group_rank=0, num_replicas=1,
        shuffle=True, seed=cfg.run.seed,
    )  # fmt: skip
    batch = cfg.train.global_batch_size // REPLICAS
    logs = Path(cfg.run.dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / f"torchft.replica-{replica}.pid-{os.getpid()}.jsonl", "a") as out:
        position, epoch = 0, 0
        while os.getppid() == parent:
            sampler.set_epoch(epoch)
            order = list(sampler)
            for first in range(0, len(order) - batch + 1, batch):
                if os.getppid() != parent:
                    break
                rows = order[first : first + batch]
                manager.start_quorum()
                tensors = collate(data.train, np.asarray(rows))
                start_logits, end_logits = model(**model_inputs(tensors, torch.device("cpu")))
                loss = family.span_loss(
                    start_logits,
                    end_logits,
                    tensors["start_positions"],
                    tensors["end_positions"],
                    torch.ones(len(rows)),
                ) / len(rows)
                loss.backward()
                grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
                flat = torch.cat([g.reshape(-1) for g in grads])
                manager.allreduce(flat).wait()  # averaged over the participants; zeros while healing
                offset = 0
                for p in params:
                    p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
                    offset += p.numel()
                trained = manager.is_participating()
                committed = manager.should_commit()
                if committed:
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                record = {
                    "event": Event.STEP,
                    "ts": time.time(),
                    "step": manager.current_step(),
                    "committed": committed,
                    "participants": manager.num_participants(),
                    "trained": trained,
                    "replica": replica,
                    "pid": os.getpid(),
                    "epoch": epoch,
                    "position": position,
                    "samples": [int(r) for r in rows],
                }
                out.write(json.dumps(record) + "\n")
                out.flush()
                position += 1
            epoch += 1
    manager.shutdown(wait=False)
    return 0


def _ms(delta: timedelta) -> int:
    return int(delta.total_seconds() * 1000)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def quiet_env() -> dict[str, str]:
    """torchft's Rust side logs every quorum at INFO: warnings only (it costs CPU on a small host)."""
    return python_env({**os.environ, "RUST_LOG": "warn"})


# ---- the bench's side -----------------------------------------------------------------------------------
class TorchftSide:
    """Runs the Lighthouse and two replica processes, restarts a replica whose process ended, kills one for
    each fault, and reads the replicas' step lines back."""

    name = "torchft"

    def __init__(
        self, run_dir: Path, config: str, overrides: list[str], seed: int, timeout: float = 60
    ) -> None:
        self.run_dir, self.config, self.timeout = run_dir, config, timeout
        self.overrides = [*overrides, f"run.dir={run_dir}"]
        self.rng = random.Random(seed)
        self.follower = LogFollower(run_dir / "logs")
        self.events: list[dict[str, Any]] = []
        self.processes: dict[int, subprocess.Popen] = {}
        self.signalled: set[int] = set()  # pids a fault signalled
        self.restarts: list[dict[str, Any]] = []
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.lighthouse: subprocess.Popen | None = None
        self.lighthouse_address = ""
        self.monitor: threading.Thread | None = None

    def start(self) -> None:
        (self.run_dir / "torchft").mkdir(parents=True, exist_ok=True)
        self.lighthouse_address = self._start_lighthouse()
        started = threading.Event()
        # Replicas are started by the monitor thread: tied to the thread that starts them, they must not
        # outlive it, and it lives until stop().
        self.monitor = threading.Thread(target=self._watch, args=(started,), name="torchft-replicas")
        self.monitor.start()
        started.wait(self.timeout)

    def _start_lighthouse(self) -> str:
        """torchft's own `torchft_lighthouse` server in a process of its own (its log in a file, not on the
        bench's output); its address once it listens."""
        port = free_port()
        command = [
            str(Path(sys.executable).parent / "torchft_lighthouse"), "--bind", f"127.0.0.1:{port}",
            "--min_replicas", "1", "--join_timeout_ms", str(_ms(JOIN_TIMEOUT)),
            "--quorum_tick_ms", str(_ms(QUORUM_TICK)), "--heartbeat_timeout_ms", str(_ms(HEARTBEAT_TIMEOUT)),
        ]  # fmt: skip
        with open(self.run_dir / "torchft" / "lighthouse.log", "ab") as log:
            self.lighthouse = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=quiet_env(),
                preexec_fn=tied_to_this_process(),
            )
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.lighthouse.poll() is not None:
                raise RuntimeError(f"torchft_lighthouse exited {self.lighthouse.returncode}: see {log.name}")
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    return f"http://127.0.0.1:{port}"
            time.sleep(0.05)
        raise RuntimeError(f"torchft_lighthouse did not listen within {self.timeout:.0f} s")

    def _launch(self, replica: int) -> None:
        log = open(self.run_dir / "torchft" / f"replica-{replica}.log", "ab")  # noqa: SIM115 - the child's
        command = [
            sys.executable, "-m", "elastic_qa.bench.torchft_side", "--replica", str(replica),
            "--lighthouse", self.lighthouse_address, "--config", self.config, *self.overrides,
        ]  # fmt: skip
        # A session of its own, as torchrun starts every worker of the other sides: with the kernel's
        # autogroup scheduling (on by default) the CPU is shared between sessions first, so each side's
        # training processes must sit in sessions alike for their step rates to compare.
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=quiet_env(),
            preexec_fn=tied_to_this_process(), start_new_session=True,
        )  # fmt: skip
        log.close()
        with self.lock:
            self.processes[replica] = process

    def _watch(self, started: threading.Event) -> None:
        for replica in range(REPLICAS):
            self._launch(replica)
        started.set()
        while not self.stopping.is_set():
            for replica, process in list(self.processes.items()):
                if process.poll() is not None and not self.stopping.is_set():
                    self.restarts.append({"replica": replica, "exit": process.returncode, "ts": time.time()})
                    self._launch(replica)  # as torchrun would: the new process heals from the live peer
            time.sleep(0.02)
        with self.lock:
            for process in self.processes.values():
                if process.poll() is None:
                    process.kill()
                process.wait()

    def steps(self) -> list[Step]:
        self.events.extend(row for row in self.follower.new_events() if row.get("event") == Event.STEP)
        return [
            Step(row["ts"], row["step"], f"pid-{row['pid']}", row["participants"] / REPLICAS)
            for row in self.events
            if row["committed"]
        ]

    def node_pids(self) -> list[int]:
        """The live replica processes, replica 0 first."""
        with self.lock:
            return [p.pid for _, p in sorted(self.processes.items()) if p.poll() is None]

    def inject(self, kind: str) -> dict[str, Any]:
        with self.lock:
            # A process the bench signalled is not a target, whether or not it has exited yet: a fault that
            # waited for the job to be whole fires right after the one it waited for, and a SIGKILLed
            # replica's poll() can still say alive then (the same pid was killed twice 60 ms apart, at load
            # 13): the second fault would be lost, which the replica side's rule does not allow either.
            live = [
                (replica, p)
                for replica, p in sorted(self.processes.items())
                if p.poll() is None and p.pid not in self.signalled
            ]
        if not live:
            raise NoTarget("no live replica")
        # The rule the product's node faults follow: a fault waits until the job is whole again (both
        # replica processes alive and each has committed a step), so that no fault ever leaves the job
        # without a live replica to heal from (torchft keeps no checkpoint here: that would lose all).
        trained = {step.group for step in self.steps()}
        healing = [replica for replica, process in live if f"pid-{process.pid}" not in trained]
        if len(live) < REPLICAS or healing:
            raise NoTarget("a replica is still restarting or healing from the previous fault")
        replica, process = self.rng.choice(live)
        sig = signal.SIGTERM if kind == "term-node" else signal.SIGKILL
        self.signalled.add(process.pid)
        try:
            os.kill(process.pid, sig)
        except ProcessLookupError:
            raise NoTarget(f"replica {replica} (pid {process.pid}) is gone") from None
        return {"target": f"replica {replica} (pid {process.pid})", "signal": sig.name}

    def stop(self) -> None:
        self.stopping.set()
        if self.monitor is not None:
            self.monitor.join(timeout=60)
        if self.lighthouse is not None and self.lighthouse.poll() is None:
            self.lighthouse.kill()
            self.lighthouse.wait()
        self.steps()

    def lost(self, steps: list[Step], faults: list[float]) -> list[int]:
        """Per fault: the steps a replica did not commit (should_commit said no), and, when a restarted
        replica found no live peer to heal from (it starts again from its initial state, step 1: torchft
        keeps no checkpoint here), every step the job had reached. A replica that healed loses nothing."""
        lost = [0] * len(faults)

        def charge(ts: float, count: int) -> None:
            earlier = [i for i, fault in enumerate(faults) if fault < ts]
            if earlier:
                lost[earlier[-1]] += count

        for row in self.events:
            if not row["committed"]:
                charge(row["ts"], 1)
        firsts: dict[str, Step] = {}
        for step in sorted(steps, key=lambda r: r.ts):
            firsts.setdefault(step.group, step)
        for first in firsts.values():
            reached = max((r.step for r in steps if r.ts < first.ts and r.group != first.group), default=0)
            if first.step < reached:
                charge(first.ts, reached - first.step + 1)
        return lost

    def report(self, steps: list[Step], faults: list[float]) -> dict[str, Any]:
        return {
            "samples": sample_accounting(self.events),
            "restarts": len(self.restarts),
            "alive_at_end": [pid for pid in (p.pid for p in self.processes.values()) if alive(pid)],
            "torchft_settings": SETTINGS,
        }


def sample_accounting(events: list[dict[str, Any]]) -> dict[str, int]:
    """Per replica, its shard stream position by position (epoch, batch) across its processes: a batch
    trained again (a restarted process starts its shard over) is repeated; one read but never trained (a
    step not committed, or read while the replica was healing and not participating) is skipped."""
    repeated = skipped = trained_total = 0
    for replica in sorted({row["replica"] for row in events}):
        rows = sorted((r for r in events if r["replica"] == replica), key=lambda r: r["ts"])
        trained: set[tuple[int, int]] = set()
        read: set[tuple[int, int]] = set()
        for row in rows:
            key = (row["epoch"], row["position"])
            read.add(key)
            if row["committed"] and row["trained"]:
                trained_total += len(row["samples"])
                if key in trained:
                    repeated += len(row["samples"])
                trained.add(key)
        batch = len(rows[0]["samples"]) if rows else 0
        skipped += batch * len(read - trained)
    return {"trained": trained_total, "repeated": repeated, "skipped": skipped}


if __name__ == "__main__":
    sys.exit(main())
