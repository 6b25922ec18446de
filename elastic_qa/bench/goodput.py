"""goodput: how much training a job keeps under a steady failure rate, against torchrun's floor and torchft.

    elastic-qa bench goodput --mtbf 30s --faults 30 --kinds kill-worker,kill-node,term-node \\
        [--sides product,bare,torchft,replicas] [--seed S] [--parallel] [--config tiny] [--out JSON] \\
        [key=value ...]

Fault times are drawn up front from --seed: exponential gaps of mean --mtbf, counted from each side's first
completed step, then one more gap marks the end of the run (so the run is N faults of a Poisson process,
not N faults and a long clean tail). Every side gets the same times and kinds. A kill-worker fires at
its time whatever the job is doing: one that falls while the job is still recovering from the previous
fault fires all the same (a steady rate does not wait) and shares its stall; it waits only while no worker
is alive at all (mid-regroup), retried every 0.2 s. A node fault on the launcher sides waits until the job
is back at 2 nodes and has trained since the previous fault: an agent lost between a rendezvous and the
publication of its ranks makes torch's store-host agent give up (DistStoreError after 60 s) and ends the
whole job. Each fault's delay is recorded (`late_s`). After the end time the bench waits until a group
started after the last fault has trained, then stops the job.

Sides (one after another, or at the same time with --parallel):
- product: two agents through the local launcher with the sample ledger on; faults injected by the chaos
  injectors (elastic_qa.chaos.faults): kill-worker SIGKILLs one worker; kill-node / term-node SIGKILL /
  SIGTERM a non-store-host agent (with its workers for kill-node), and once that agent is gone a
  replacement joins (`launcher join`, as a cluster scheduler would replace the node), so the job stays at
  2 nodes. The store host is never a target. Exactly-once is checked on the ledger by the chaos check
  (evidence.check_ledger) over every step of the final lineage; a failed check fails the run (exit 1).
- bare: the same launcher, agents and faults around elastic_qa.bench.trivial_worker, which has nothing
  to lose: all its steps are committed.
- torchft: elastic_qa.bench.torchft_side (2 replica groups of one process, torchft 0.2.0), skipped with
  the reason when torchft is not importable.
- replicas: the product's replica-group mode (`elastic-qa replicas`, 2 groups, on torchft):
  elastic_qa.bench.goodput_replicas. kill-worker SIGKILLs a worker of one group; kill-node / term-node
  SIGKILL / SIGTERM one group's torchrun agent (with its workers for kill-node), and the replica launcher
  starts that group again. Every fault waits until both groups are up and have trained together since the
  previous one. Skipped with the reason when torchft is not importable. Exactly-once is the replica
  ledger's check; a failed check fails the run (exit 1).

Figures per side: elastic_qa.bench.goodput_figures (effective training time, lost steps and time without
a step per fault).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from elastic_qa.bench.common import (
    BenchError,
    add_config_arguments,
    choice_list,
    duration,
    new_parser,
    positive_int,
    print_table,
    write_json,
)
from elastic_qa.bench.goodput_figures import Step, lost_per_fault, side_figures
from elastic_qa.bench.pinning import Pinner
from elastic_qa.bench.runs import bench_config
from elastic_qa.chaos.evidence import check_ledger, run_config
from elastic_qa.chaos.faults import FlagFile, Injector, NoTarget
from elastic_qa.chaos.job import Job
from elastic_qa.chaos.schedule import Fault
from elastic_qa.launcher.processes import alive
from elastic_qa.models import family_for
from elastic_qa.observe.events import StepProgressRecord, records
from elastic_qa.observe.follow import LogFollower
from elastic_qa.observe.ledger import read_ledger
from elastic_qa.prep import prepare

KINDS = ("kill-worker", "kill-node", "term-node")
NODE_KINDS = frozenset({"kill-node", "term-node"})
SIDES = ("product", "bare", "torchft", "replicas")
NEEDS_TORCHFT = ("torchft", "replicas")
TRIVIAL = "elastic_qa.bench.trivial_worker"
RETRY_EVERY_S = 0.2
# The product logs every step with the ledger on, and never ends on its own.
PRODUCT = (
    "debug.sample_ledger=true",
    "log.every_steps=1",
    "log.console=none",
    "train.max_steps=10000000",
    "train.eval_every=0",
)


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser("goodput", __doc__ or "", reps=None)
    parser.add_argument("--out", dest="json", type=Path, help="the same as --json")
    add_config_arguments(parser, "tiny")
    parser.add_argument("--mtbf", type=duration, required=True, help="mean time between faults, e.g. 30s")
    parser.add_argument("--faults", type=positive_int, required=True, help="faults to inject per side")
    parser.add_argument(
        "--kinds", type=choice_list(KINDS), default=list(KINDS), help=f"{','.join(KINDS)} (default all)"
    )
    parser.add_argument(
        "--sides",
        type=choice_list(SIDES),
        default=None,
        help=f"{','.join(SIDES)} (default all)",
    )
    parser.add_argument("--seed", type=int, default=0, help="draws the fault times and kinds (default 0)")
    parser.add_argument("--parallel", action="store_true", help="run the sides at the same time")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="each side's node i on a core of its own (CPU affinity), as on machines of their own",
    )
    parser.add_argument("--timeout", type=float, default=180, help="seconds to wait for any one phase")
    return parser


# ---- the plan -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    faults: list[tuple[float, str]]  # (seconds after the first step, kind)
    end_s: float  # seconds after the first step the run ends


def draw_plan(seed: int, mtbf_s: float, count: int, kinds: list[str]) -> Plan:
    """Exponential gaps of mean `mtbf_s` (one more after the last fault marks the end), kinds uniform."""
    rng = random.Random(seed)
    at, faults = 0.0, []
    for _ in range(count):
        at += rng.expovariate(1.0 / mtbf_s)
        faults.append((at, rng.choice(kinds)))
    return Plan(faults, at + rng.expovariate(1.0 / mtbf_s))


# ---- sides ----------------------------------------------------------------------------------------------
class Side(Protocol):
    """A job under faults. A side may also define `recovered(last_fault) -> bool` (the run's end: it is
    over the last fault); without it, a group that started after the last fault has trained."""

    name: str

    def start(self) -> None: ...
    def steps(self) -> list[Step]: ...
    def inject(self, kind: str) -> dict[str, Any]: ...  # raises NoTarget
    def node_pids(self) -> list[int]: ...  # the live node-level processes, in node order (--pin)
    def stop(self) -> None: ...
    def lost(self, steps: list[Step], faults: list[float]) -> list[int] | None: ...
    def report(self, steps: list[Step], faults: list[float]) -> dict[str, Any]: ...


class LauncherSide:
    """The product or the bare floor: two agents through the local launcher, faults by the chaos injector."""

    def __init__(
        self, name: str, run_dir: Path, config: str, overrides: list[str], seed: int, timeout: float = 60
    ) -> None:
        self.name, self.run_dir, self.timeout = name, run_dir, timeout
        extra = list(PRODUCT) if name == "product" else ["--module", TRIVIAL]  # --module goes last
        self.job = Job(run_dir, config, [*overrides, *extra], agents=2, min_nodes=1, max_nodes=4)
        self.follower = LogFollower(run_dir / "logs")
        self.rows: list[Step] = []
        self.bare_rows: list[tuple[float, str]] = []  # (ts, process) of every bare step
        self.world: dict[str, int] = {}  # group -> its world size
        self.last_fault = 0.0
        self.doomed: list[int] = []  # agents a node fault signalled
        self.replacements: list[threading.Thread] = []
        self.stopping = threading.Event()
        chaos = run_dir / "chaos"
        self.injector = Injector(
            self.job,
            random.Random(seed),
            run_dir / "checkpoints",  # unused: these kinds act on processes only
            FlagFile(chaos / "storage-fault", self.log),
            FlagFile(chaos / "log-fault", self.log),
            self.log,
            0,
        )

    def log(self, record: dict[str, Any]) -> None:
        path = self.run_dir / "chaos" / "faults.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as out:
            out.write(json.dumps({**record, "ts": record.get("ts", time.time())}) + "\n")

    def start(self) -> None:
        self.job.start(self.timeout)

    def steps(self) -> list[Step]:
        for row in records(self.follower.new_events(), StepProgressRecord):
            if row.get("rank") != 0 or "ts" not in row:
                continue
            group = f"attempt-{row.get('attempt', 0)}" if self.name == "product" else f"pid-{row['pid']}"
            self.world[group] = int(row.get("world_size") or 0)
            if self.name == "product":
                self.rows.append(Step(row["ts"], int(row["step"]), group))
            else:
                self.bare_rows.append((row["ts"], group))
        if self.name == "product":
            return self.rows
        # Every step of the bare worker is committed: one lineage across its processes, in time order (the
        # follower may read a new process's lines before the last lines of the one it replaced).
        self.bare_rows.sort()
        return [Step(ts, number, group) for number, (ts, group) in enumerate(self.bare_rows, start=1)]

    def inject(self, kind: str) -> dict[str, Any]:
        assert self.job.process is not None  # started
        if self.job.process.poll() is not None:
            raise BenchError(
                f"{self.name}: the job ended (launcher exit {self.job.process.returncode}); see "
                f"{self.run_dir / 'chaos' / 'launcher.log'} and {self.run_dir / 'agents'}"
            )
        if kind in NODE_KINDS and not self.regrouped():
            # An agent lost between a rendezvous and the publication of its ranks makes torch's store-host
            # agent give up after 60 s (DistStoreError in _assign_worker_ranks): the whole job ends.
            raise NoTarget("the job is not yet back at 2 nodes and training since the previous fault")
        outcome, _ = self.injector.inject(Fault(kind=kind, at_time=0.0))
        self.last_fault = time.time()
        self.log({"fault": kind, **outcome})
        if kind in NODE_KINDS:
            match = re.search(r"\(pid (\d+)\)", outcome["target"])
            if match:
                victim = int(match.group(1))
                self.doomed.append(victim)
                thread = threading.Thread(target=self._replace, args=(victim,), daemon=True)
                thread.start()
                self.replacements.append(thread)
        return outcome

    def node_pids(self) -> list[int]:
        """The live torchrun agents, in the order they started (the store host first)."""
        return [agent["pid"] for agent in self.job.live_agents()]

    def regrouped(self) -> bool:
        """The newest group has 2 nodes and started training after the previous fault (the replacement of
        a lost node has been admitted, no rendezvous is under way)."""
        starts = group_starts(self.steps())
        if not starts or any(alive(pid) for pid in self.doomed):
            return False
        newest = max(starts, key=lambda group: starts[group])
        return starts[newest] > self.last_fault and self.world.get(newest) == 2

    def _replace(self, victim: int) -> None:
        """Once the signalled agent is gone, a new agent joins (the scheduler's replacement node)."""
        while alive(victim) and not self.stopping.is_set():
            time.sleep(0.05)
        if self.stopping.is_set():
            return
        try:
            pid = self.job.join()
            self.log({"action": "replacement_joined", "replaced": victim, "pid": pid})
        except RuntimeError as err:
            self.log({"action": "replacement_failed", "replaced": victim, "error": str(err)})

    def stop(self) -> None:
        self.stopping.set()
        self.job.kill_everything()
        for thread in self.replacements:
            thread.join(timeout=30)
        self.job.kill_everything()  # an agent a replacement thread joined meanwhile
        self.job.remove_node_local_copy()

    def lost(self, steps: list[Step], faults: list[float]) -> list[int] | None:
        """The product's from its restores, each attempt's reach read from the sample ledger: a step line is
        written once the step's sums arrive with the next control all-reduce, so a killed group's last
        ~0.1 s of steps have ledger lines but no step line. A step every rank of the attempt had begun
        counts as reached (the one in flight at the kill was lost work too). The bare worker has nothing
        to lose."""
        if self.name != "product":
            return [0] * len(faults)
        ranks: dict[tuple[int, int], set[int]] = {}
        world: dict[int, int] = {}
        for row in read_ledger(self.run_dir):
            ranks.setdefault((row["attempt"], row["step"]), set()).add(row["rank"])
            world[row["attempt"]] = row["world_size"]
        reached: dict[str, int] = {}
        for (attempt, step), seen in ranks.items():
            if len(seen) == world[attempt]:
                group = f"attempt-{attempt}"
                reached[group] = max(step, reached.get(group, step))
        return lost_per_fault(steps, faults, reached)

    def report(self, steps: list[Step], faults: list[float]) -> dict[str, Any]:
        if self.name != "product":
            return {}
        last = max(row.step for row in steps)
        cfg = run_config(self.run_dir)
        checked = replace(cfg, train=replace(cfg.train, max_steps=last))
        verdict = check_ledger(self.run_dir, checked, len(prepare(cfg, family_for(cfg.model)).train))
        return {"ledger": {"ok": verdict.ok, "steps_checked": last, "problems": verdict.problems}}


def make_side(name: str, run_dir: Path, args: argparse.Namespace) -> Side:
    if name == "torchft":
        from elastic_qa.bench.torchft_side import TorchftSide

        return TorchftSide(run_dir, args.config, args.overrides, args.seed, args.timeout)
    if name == "replicas":
        from elastic_qa.bench.goodput_replicas import ReplicaSide

        return ReplicaSide(run_dir, args.config, args.overrides, args.seed, args.timeout, args.faults)
    return LauncherSide(name, run_dir, args.config, args.overrides, args.seed, args.timeout)


# ---- running one side -----------------------------------------------------------------------------------
def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise BenchError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.05)


def sleep_until(wall: float) -> None:
    time.sleep(max(0.0, wall - time.time()))


def fire(side: Side, kind: str, due: float, timeout: float) -> dict[str, Any]:
    """Inject `kind` now, retrying while there is nothing to hit; the record says when it landed."""
    first_miss, trying_since = None, time.time()  # `due` may be long past: the previous fault fired late
    while True:
        try:
            outcome = side.inject(kind)
            break
        except NoTarget as err:
            first_miss = first_miss or str(err)
            if time.time() - trying_since > timeout:
                return {"fault": kind, "due": due, "skipped": f"no target for {timeout:.0f} s: {err}"}
            time.sleep(RETRY_EVERY_S)
    landed = time.time()
    record = {"fault": kind, "due": due, "ts": landed, "late_s": round(landed - due, 3), **outcome}
    if first_miss:
        record["first_miss"] = first_miss
    return record


def drive(side: Side, plan: Plan, timeout: float) -> dict[str, Any]:
    """Start the side, fire the plan from its first step on, let it recover from the last fault, stop it,
    and compute its figures."""
    try:
        side.start()
        wait_for(lambda: bool(side.steps()), timeout, f"{side.name}: the first step")
        first = min(row.ts for row in side.steps())
        records = []
        for index, (offset, kind) in enumerate(plan.faults, start=1):
            sleep_until(first + offset)
            record = fire(side, kind, first + offset, timeout)
            side.steps()  # keeps the followers' reading short
            records.append(record)
            print(f"[goodput] {side.name}: fault {index}/{len(plan.faults)} {json.dumps(record)}", flush=True)
        sleep_until(first + plan.end_s)
        landed = [r["ts"] for r in records if "ts" in r]
        last = max(landed, default=first)
        recovered: Callable[[float], bool] = getattr(side, "recovered", None) or (
            lambda since: max(group_starts(side.steps()).values()) > since
        )
        wait_for(lambda: recovered(last), timeout, f"{side.name}: recovered from the last fault")
    finally:
        side.stop()
    steps = side.steps()
    figures = side_figures(steps, landed, side.lost(steps, landed))
    return {**figures, "faults": records, **side.report(steps, landed)}


def group_starts(steps: list[Step]) -> dict[str, float]:
    """group -> when it completed its first step."""
    starts: dict[str, float] = {}
    for row in steps:
        starts[row.group] = min(row.ts, starts.get(row.group, row.ts))
    return starts


# ---- the benchmark --------------------------------------------------------------------------------------
def torchft_missing() -> str | None:
    try:
        import torchft  # noqa: F401
    except ImportError as err:
        return f"torchft is not importable ({err}); install the extra: pip install 'elastic-qa[torchft]'"
    return None


def choose_sides(asked: list[str] | None) -> tuple[list[str], dict[str, str]]:
    """The sides to run and those skipped with why (every side takes every kind of KINDS; the torchft
    sides need torchft)."""
    names = list(SIDES if asked is None else asked)
    skipped: dict[str, str] = {}
    missing = torchft_missing()
    for name in NEEDS_TORCHFT:
        if name in names and missing is not None:
            skipped[name] = missing
            names.remove(name)
    return names, skipped


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    bench_config(args.config, args.overrides)  # bad config: one line now, not a launcher failure later
    mtbf_s = args.mtbf.total_seconds()
    plan = draw_plan(args.seed, mtbf_s, args.faults, args.kinds)
    names, skipped = choose_sides(args.sides)
    for name, why in skipped.items():
        print(f"[goodput] {name} side skipped: {why}", flush=True)
    print(
        f"[goodput] {len(plan.faults)} faults, mean gap {mtbf_s:g} s, run {plan.end_s:.0f} s per side "
        f"({'in parallel' if args.parallel else 'one after another'}): {', '.join(names)}",
        flush=True,
    )
    results: dict[str, dict[str, Any]] = {}
    errors: dict[str, BaseException] = {}
    sides = {name: make_side(name, work / name, args) for name in names}

    def one(name: str) -> None:
        try:
            results[name] = drive(sides[name], plan, args.timeout)
        except Exception as err:  # noqa: BLE001 - reported once every side has ended
            errors[name] = err

    pinner = Pinner({name: side.node_pids for name, side in sides.items()}) if args.pin else None
    try:
        if pinner is not None:
            pinner.start()
        if args.parallel:
            # Daemons: after Ctrl-C or SIGTERM the sides are stopped below and the process may exit.
            threads = [
                threading.Thread(target=one, args=(name,), name=f"goodput-{name}", daemon=True)
                for name in names
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                while thread.is_alive():
                    thread.join(timeout=0.5)  # short joins: Ctrl-C and SIGTERM still reach this thread
        else:
            for name in names:
                one(name)
    finally:
        if pinner is not None:
            pinner.stop()
        for side in sides.values():
            side.stop()
    print_summary(results, skipped)
    result = {
        "benchmark": "goodput",
        "settings": {
            "config": args.config,
            "overrides": args.overrides,
            "mtbf_s": mtbf_s,
            "faults": args.faults,
            "kinds": args.kinds,
            "seed": args.seed,
            "parallel": args.parallel,
            "agents": 2,
            "sides": names,
            # Linux shares the CPU between sessions first when this is 1: every side's training processes
            # run in sessions of their own, so that their step rates compare (None: not Linux).
            "sched_autogroup": autogroup(),
            "pin": args.pin,
        },
        "pinned": pinner.assignments if pinner is not None else [],
        "plan": {"faults": [{"at_s": at, "kind": kind} for at, kind in plan.faults], "end_s": plan.end_s},
        "sides": results,
        "skipped": skipped,
        "ratios": ratios(results),
        "failed": {name: str(err) for name, err in errors.items()},
    }
    failures = [f"{name}: {err}" for name, err in errors.items()]
    for name in ("product", "replicas"):
        ledger = results.get(name, {}).get("ledger")
        if ledger is not None and not ledger["ok"]:
            failures.append(
                f"{name}: the exactly-once check of the sample ledger failed: {ledger['problems']}"
            )
    if failures:
        if args.json:  # what was measured, and why it failed, stays on record
            write_json(args.json, result)
        raise BenchError("; ".join(failures))
    return result


def autogroup() -> int | None:
    """The kernel's autogroup scheduling setting (1: on, the default of most distributions)."""
    try:
        return int(Path("/proc/sys/kernel/sched_autogroup_enabled").read_text())
    except (OSError, ValueError):
        return None


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Each side's effective training time over the bare floor's."""
    bare = results.get("bare", {}).get("effective")
    if not bare:
        return {}
    return {f"{name}/bare": fig["effective"] / bare for name, fig in results.items() if name != "bare"}


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_summary(results: dict[str, dict[str, Any]], skipped: dict[str, str]) -> None:
    rows = []
    for name, fig in results.items():
        lost, gap = fig["lost_steps"], fig["no_step_s"]
        extra = ""
        if "ledger" in fig:
            extra = "ledger ok" if fig["ledger"]["ok"] else "LEDGER FAILED"
        if "samples" in fig:
            extra = f"repeated {fig['samples']['repeated']}, skipped {fig['samples']['skipped']}"
        if fig.get("params", {}).get("equal") is not None:
            extra += ", replicas equal" if fig["params"]["equal"] else ", REPLICAS DIFFER"
        rows.append(
            [
                name,
                str(fig["faults_injected"]),
                _fmt(fig["wall_s"], ".0f"),
                _fmt(fig["committed_steps"], ".0f"),
                _fmt(fig["clean_step_s"] and fig["clean_step_s"] * 1000, ".1f"),
                _fmt(fig["effective"], ".3f"),
                f"{_fmt(lost['mean'], '.2f')} / {_fmt(lost['max'], '.0f')}",
                f"{_fmt(gap['median'], '.2f')} / {_fmt(gap['p90'], '.2f')} / {_fmt(gap['max'], '.2f')}",
                extra,
            ]
        )
    print_table(
        [
            "side",
            "faults",
            "wall s",
            "committed steps",
            "clean step ms",
            "effective",
            "lost steps/fault mean / max",
            "no step s median / p90 / max",
            "data",
        ],
        rows,
    )
    for name, why in skipped.items():
        print(f"{name}: skipped ({why})")
    for name, value in ratios(results).items():
        print(f"effective training time {name}: {value:.3f}")
