"""denormals: what denormal floats cost the optimizer step on a CPU, train.flush_denormals off against on.

An embedding of --vocab x --dim (the squad config's 65536 x 256 by default) and the product's optimizer
(elastic_qa.optim: fused AdamW, no weight decay on embeddings). A share --rare of its rows (the long tail of a
vocabulary) gets a gradient at the first step and then only every --period steps (default 2000: about once
an epoch of the squad config); the other rows get one every step. After ~740 steps without a hit, Adam's
first moment of a rare row (0.1 of a 1e-3 gradient, times 0.9 a step) is below float32's smallest normal
number, and stays there until the row's next hit (at 4 times the smallest denormal, 0.9 x rounds back to x).

Two copies of the same weights and optimizer get the same gradients every step, one stepped with the flag
off and one with it on (the main thread's flag set before each; one intra-op thread, so it is the only
thread). Each optimizer step is timed in CPU time (time.thread_time), alternately, in one process. The
table gives the median step of each window of --window steps; the JSON keeps every window, the denormal
count in the unflushed copy's moments at the end, and whether the two copies' weights ended bitwise equal.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from elastic_qa.bench.common import new_parser, positive_int, print_table


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser("denormals", __doc__, reps=None)
    parser.add_argument("--vocab", type=positive_int, default=65536, help="embedding rows (default 65536)")
    parser.add_argument("--dim", type=positive_int, default=256, help="embedding width (default 256)")
    parser.add_argument("--steps", type=positive_int, default=1000, help="optimizer steps (default 1000)")
    parser.add_argument("--period", type=positive_int, default=2000, help="steps between a rare row's hits")
    parser.add_argument("--rare", type=share, default=0.5, help="share of the rows that are rare (0.5)")
    parser.add_argument("--window", type=positive_int, default=100, help="steps per reported window (100)")
    return parser


def share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a share of the rows, in (0, 1]")
    return value


def run(args: argparse.Namespace, work_dir: Path) -> dict[str, Any]:
    import torch

    from elastic_qa.dist import denormals_flushed

    threads, flushed = torch.get_num_threads(), denormals_flushed()  # the caller's, put back at the end
    torch.set_num_threads(1)  # the flag is per thread: with one, the main thread's is the only one
    try:
        return _compare(args)
    finally:
        torch.set_num_threads(threads)
        torch.set_flush_denormal(flushed)


def _compare(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from elastic_qa.config import TrainConfig
    from elastic_qa.optim import decay_groups

    torch.manual_seed(0)
    weights = torch.randn(args.vocab, args.dim) * 0.02
    common = int(args.vocab * (1 - args.rare))
    sides: dict[bool, tuple[torch.nn.Embedding, torch.optim.Optimizer]] = {}
    for flush in (False, True):
        embedding = torch.nn.Embedding(args.vocab, args.dim)
        embedding.weight.data.copy_(weights)
        decay, no_decay = decay_groups(embedding)
        groups = [{"params": no_decay, "weight_decay": 0.0}]  # an embedding's weight: never decayed
        groups += [{"params": decay, "weight_decay": TrainConfig.weight_decay}] if decay else []
        sides[flush] = embedding, torch.optim.AdamW(groups, lr=TrainConfig.lr, fused=True)
    times: dict[bool, list[float]] = {False: [], True: []}
    for step in range(args.steps):
        grad = torch.randn(args.vocab, args.dim) * 1e-3
        if step % args.period:
            grad[common:] = 0.0  # the rare rows: no window of this step holds their word
        for flush in (step % 2 == 0, step % 2 == 1):  # alternate which side goes first
            embedding, optimizer = sides[flush]
            embedding.weight.grad = grad.clone()
            torch.set_flush_denormal(flush)
            began = time.thread_time()
            optimizer.step()
            times[flush].append(time.thread_time() - began)
    torch.set_flush_denormal(False)  # the counts below must see denormals as what they are
    windows: list[dict[str, Any]] = []
    rows: list[list[str]] = []
    for first in range(0, args.steps - args.window + 1, args.window):
        off = statistics.median(times[False][first : first + args.window]) * 1e3
        on = statistics.median(times[True][first : first + args.window]) * 1e3
        steps = f"{first + 1}-{first + args.window}"
        windows.append({"steps": steps, "off_ms": off, "on_ms": on})
        rows.append([steps, f"{off:.1f}", f"{on:.1f}", f"{off / on:.2f}"])
    moment = sides[False][1].state[sides[False][0].weight]["exp_avg"]
    tiny = torch.finfo(torch.float32).tiny
    denormals = int(((moment != 0) & (moment.abs() < tiny)).sum())
    equal = torch.equal(sides[False][0].weight, sides[True][0].weight)
    print_table(["steps", "flag off: step ms", "flag on: step ms", "off / on"], rows)
    print(f"denormals in the unflushed copy's first moment at the end: {denormals:,} of {moment.numel():,}")
    print(f"weights bitwise equal at the end: {equal}")
    return {
        "settings": {k: getattr(args, k) for k in ("vocab", "dim", "steps", "period", "rare", "window")},
        "torch": torch.__version__,
        "windows": windows,
        "denormals_at_end": denormals,
        "weights_equal": equal,
    }
