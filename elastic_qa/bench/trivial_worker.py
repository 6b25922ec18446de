"""The recovery benchmark's baseline: the least a torchrun worker can do, restarted by the same agents.

    python -m elastic_qa.launcher.local start --agents 2 --module elastic_qa.bench.trivial_worker \\
        --config tiny run.dir=DIR

It takes the product's command line (--config and overrides; only run.dir and dist.timeout are used), joins
the process group (gloo) and loops: all-reduce a small tensor, sleep a little, append a JSON line (event
`step`, ts, restart count) to <run.dir>/logs/, the same place and shape as the product's step events. A dead
peer fails the all-reduce, the process exits non-zero and the agents regroup, as for the product, but with
nothing to load or restore. Like the product (elastic_qa.elastic.watchdog), it leaves once its agent is gone
(its parent changed), rather than all-reducing on for ever with the orphans of the other agents.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from elastic_qa.config import resolve_config
from elastic_qa.exits import EXIT_AGENT_LOST
from elastic_qa.observe.log import node_name

SLEEP_S = 0.02


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m elastic_qa.bench.trivial_worker", description=__doc__)
    parser.add_argument("--config", default="default")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    agent = os.getppid()
    cfg = resolve_config(args.config, args.overrides)
    dist.init_process_group("gloo", timeout=cfg.dist.timeout)
    identity = {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "pid": os.getpid(),
        "node": f"{node_name()}/{os.environ.get('GROUP_RANK', 0)}",
        "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
    }
    logs = Path(cfg.run.dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / f"trivial.rank-{identity['rank']:03d}.pid-{os.getpid()}.jsonl", "a") as out:

        def emit(event: str, **fields: object) -> None:
            out.write(json.dumps({"event": event, **fields, **identity, "ts": time.time()}) + "\n")
            out.flush()  # a SIGKILL must not lose what was already done

        emit("worker_start")
        tensor = torch.ones(4)
        step = 0
        while os.getppid() == agent:
            dist.all_reduce(tensor)
            tensor.fill_(1.0)
            step += 1
            emit("step", step=step)
            time.sleep(SLEEP_S)
        emit("agent_lost")
        return EXIT_AGENT_LOST


if __name__ == "__main__":
    sys.exit(main())
