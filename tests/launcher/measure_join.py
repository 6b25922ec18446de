"""Where the time goes when `launch/local.sh join` adds a third agent to a running 2-agent job.

    python -m tests.launcher.measure_join [--runs 3]     (in a checkout; a few minutes)

For each run: a tiny 2-agent job (`start --agents 2`, max 4 as by default), `join` at step 10, and these
moments, in seconds from the join command: the new agent's start (launch.jsonl), the old group's stop
(rank 0's `stopping`), its last step, the first new worker's `worker_start` (its process group formed)
and the first step at world size 3 (the workers' logs). `idle` is the time no step ran: the last step at
world 2 to the first at world 3. Prints one JSON line per run
and the medians.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from elastic_qa.chaos.job import Job
from elastic_qa.launcher.processes import python_env
from elastic_qa.observe.follow import read_events

SETTINGS = (
    "train.max_steps=5000",
    "train.warmup_steps=2",
    "debug.step_delay=20ms",
    "log.every_steps=1",
    "log.console=plain",
    "train.threads=1",
)


def first(events: list[dict], since: float, test) -> float | None:
    return next((e["ts"] for e in events if e["ts"] >= since and test(e)), None)


def one_run(base: Path, cache: Path) -> dict:
    run_dir = base / "run"
    job = Job(run_dir, "tiny", [f"data.cache_dir={cache}", *SETTINGS], agents=2, max_nodes=4)
    job.start()
    try:
        job.wait_for_step(10, timeout=300)
        joined = time.time()
        subprocess.run(
            [sys.executable, "-m", "elastic_qa.launcher.local", "join", "--run-dir", str(run_dir)],
            check=True, capture_output=True, env=python_env(),
        )  # fmt: skip
        deadline = time.monotonic() + 300
        while True:
            events = read_events(run_dir)
            at_3 = first(events, joined, lambda e: e["event"] == "step" and e.get("world_size") == 3)
            if at_3 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    finally:
        job.kill_everything()
    old_steps = [e["ts"] for e in events if e["event"] == "step" and e.get("world_size") == 2]
    stopping = first(events, joined, lambda e: e["event"] == "stopping" and e.get("rank") == 0)
    actions = [json.loads(line) for line in (run_dir / "agents" / "launch.jsonl").read_text().splitlines()]
    agent = next(a["ts"] for a in actions if a["event"] == "agent_started" and a["agent"] == 2)
    started = first(events, joined, lambda e: e["event"] == "worker_start" and e.get("world_size") == 3)

    def rel(ts: float | None) -> float | None:
        return None if ts is None else round(ts - joined, 2)

    return {
        "agent_started": rel(agent),
        "stopping": rel(stopping),
        "last_step_at_2": rel(max(old_steps)),
        "worker_start_at_3": rel(started),
        "first_step_at_3": rel(at_3),
        "idle": None if at_3 is None else round(at_3 - max(old_steps), 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3)
    rows = []
    parser.add_argument("--keep", help="keep the run directories here (for the agents' logs)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() if not args.keep else contextlib.nullcontext(args.keep) as tmp:
        cache = Path(tmp) / "cache"
        for index in range(args.runs):
            row = one_run(Path(tmp) / f"run{index}", cache)
            print(json.dumps(row), flush=True)
            rows.append(row)
    medians = {
        key: statistics.median(r[key] for r in rows if r[key] is not None)
        for key in rows[0]
        if any(r[key] is not None for r in rows)
    }
    print(json.dumps({"median": medians}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
