"""Measure the multi-host scenarios of docs/several-hosts.md with `elastic-qa node` on namespace hosts
(needs root).

    python -m tests.multinode.measure [--scenarios formation,node-loss,...] [--out FILE.jsonl]

Scenarios (3 hosts, tiny config, the kill at step 8 of 30):
  node-loss       SIGKILL every process of host 2: kill -> first step of the world of 2
  preemption      SIGTERM host 2's `elastic-qa node`: SIGTERM -> first step of the world of 2; its exit code
  join            hosts 0 and 1 train, host 2 starts at step 8: its start -> first step of the world of 3
  store-loss      c10d: SIGKILL host 0 (the store host): kill -> survivors' exit, their message, the
                  emergency checkpoint; then the same commands again: start -> first step, steps lost
  etcd-loss       etcd-v2: SIGKILL host 0: kill -> first step of the world of 2
Formation (start of the three commands -> first step at world 3) is taken from every scenario that starts
three hosts at once. One JSON line per scenario on stdout (and in --out).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from elastic_qa.chaos.evidence import attempts
from elastic_qa.chaos.judge import steps_lost
from elastic_qa.config import resolve_config
from elastic_qa.models import family_for
from elastic_qa.observe.follow import read_events
from elastic_qa.prep import prepare
from tests.multinode.cluster import ETCD_INDEX, Cluster
from tests.multinode.jobs import OVERRIDES, start_etcd, start_nodes, wait_all, wait_for_step

KILL_AT_STEP = 8
SCENARIOS = ("node-loss", "preemption", "join", "store-loss", "etcd-loss")


def first_step_after(run_dir: Path, since: float, world_size: int | None = None) -> float | None:
    """Time of the first `step` event after `since` (of a group of `world_size`, when given)."""
    times = [
        e["ts"]
        for e in read_events(run_dir)
        if e.get("event") == "step"
        and e["ts"] > since
        and (world_size is None or e.get("world_size") == world_size)
    ]
    return min(times) if times else None


def regroups(run_dir: Path) -> list[dict]:
    """Each attempt after the first: its world size and the steps it lost."""
    runs = attempts(read_events(run_dir))
    return [{"world_size": r["world_size"], "lost_steps": steps_lost(runs, r)} for r in runs[1:]]


def scenario(name: str, base: Path, cache: Path) -> dict:
    run_dir = base / name / "run"
    backend = "etcd-v2" if name == "etcd-loss" else "c10d"
    cluster = Cluster(3)
    result: dict = {"scenario": name}
    try:
        cluster.up((ETCD_INDEX,) if backend == "etcd-v2" else ())
        if backend == "etcd-v2":
            start_etcd(cluster, base / name / "etcd-data")
        started = time.time()
        # The joiner's start (imports, cache check) takes seconds: the job must still run when it arrives.
        join_extra = ("train.max_steps=80", "debug.step_delay=500ms") if name == "join" else ()
        hosts = [0, 1] if name == "join" else None
        nodes = start_nodes(cluster, run_dir, cache, backend, *join_extra, hosts=hosts)
        wait_for_step(run_dir, KILL_AT_STEP, nodes)
        if name != "join":
            result["formation_s"] = round(first_step_after(run_dir, started, 3) - started, 2)
        event = time.time()
        if name in ("node-loss", "etcd-loss", "store-loss"):
            victim = 0 if name in ("etcd-loss", "store-loss") else 2
            cluster.kill_host(victim)
            survivors = {i: node for i, node in nodes.items() if i != victim}
        elif name == "preemption":
            nodes[2].send_signal(signal.SIGTERM)
            survivors = nodes
        else:
            nodes.update(start_nodes(cluster, run_dir, cache, backend, *join_extra, hosts=[2]))
            survivors = nodes
        result["codes"] = wait_all(survivors)
        if name == "store-loss":
            result.update(store_loss_evidence(run_dir, event))
            restarted = time.time()
            nodes = start_nodes(cluster, run_dir, cache, backend)
            result["rerun_codes"] = wait_all(nodes)
            first = first_step_after(run_dir, restarted)
            result["rerun_first_step_s"] = round(first - restarted, 2) if first else None
            result["rerun_lost_steps"] = regroups(run_dir)[-1]["lost_steps"]
        else:
            world = 3 if name == "join" else 2
            first = first_step_after(run_dir, event, world)
            result["recovery_s"] = round(first - event, 2) if first else None
        result["regroups"] = regroups(run_dir)
    finally:
        cluster.down()
    return result


def store_loss_evidence(run_dir: Path, killed: float) -> dict:
    ends = [
        json.loads(line)
        for path in (run_dir / "nodes").glob("*.jsonl")
        for line in path.read_text().splitlines()
        if '"node_end"' in line
    ]
    events = read_events(run_dir)
    emergency = [e for e in events if e.get("event") == "checkpoint_committed" and e["ts"] > killed]
    outs = " ".join(p.read_text(errors="replace") for p in (run_dir / "hosts").glob("*.out"))
    return {
        "survivors_exit_after_kill_s": sorted(round(e["ts"] - killed, 2) for e in ends),
        "store_host_gone_said": outs.count("store host") > 0,
        "emergency_commit_after_kill_s": [round(e["ts"] - killed, 2) for e in emergency],
        "emergency_commit_reason": [e.get("reason") for e in emergency],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="eq-measure-"))
    cache = base / "cache"
    cfg = resolve_config("tiny", [f"run.dir={base}/x", f"data.cache_dir={cache}", *OVERRIDES])
    prepare(cfg, family_for(cfg.model))
    results = []
    for round_ in range(args.repeat):
        for name in args.scenarios.split(","):
            result = scenario(name, base / f"r{round_}", cache)
            results.append(result)
            line = json.dumps(result)
            print(line, flush=True)
            if args.out:
                with open(args.out, "a") as handle:
                    handle.write(line + "\n")
    formation = [r["formation_s"] for r in results if "formation_s" in r]
    if formation:
        print(json.dumps({"formation_median_s": statistics.median(formation), "n": len(formation)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
