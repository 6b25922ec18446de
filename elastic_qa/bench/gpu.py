"""gpu: the CUDA path end to end on one GPU: nccl, bf16 and fp16, async saves, a killed worker resumed.

Each case is one job through the local launcher: one torchrun agent (c10d rendezvous), one worker,
dist.backend=nccl, async checkpoints every --checkpoint-every steps, the sample ledger on. Once the worker
has logged step --kill-at it is SIGKILLed; torchrun starts a new one, which resumes from the newest
checkpoint and trains to --steps. Read from the run's own logs: steps/s before and after the kill, the
async-save stall (`blocking_seconds` of each periodic `checkpoint_committed`: the copy of the state to CPU
memory, plus any wait for the previous save), kill to first step of the new worker, steps trained again,
final EM/F1. Checked: the job finished; the worker ran on the expected backend and device; the new worker
resumed from the newest checkpoint committed before the kill; every logged loss is finite; each sample
was used exactly once per epoch (the ledger); for fp16, the GradScaler state saved at the resumed step came
back in the new worker.

Without CUDA (or with --cpu) the same runs on gloo and the CPU, fp16 is left out, and the output says that
CUDA was not tested. Cases: native-bf16 (--config, default `default`), hf-bf16 (a tiny random BERT through
the hf-tiny config, or --hf-model), native-fp16. Exit codes: 0 every check passed, 1 a check or a run
failed (each named), 2 bad arguments or a missing package.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from elastic_qa.bench.common import (
    BenchError,
    UsageError,
    add_config_arguments,
    choice_list,
    new_parser,
    positive_int,
    print_table,
    write_json,
)
from elastic_qa.bench.gpu_evidence import analyse
from elastic_qa.chaos.job import Job
from elastic_qa.models import tiny

# case -> (model family, train.precision)
CASES = {
    "native-bf16": ("native", "bf16"),
    "hf-bf16": ("hf", "bf16"),
    "native-fp16": ("native", "fp16"),
}
CUDA_ONLY = {"native-fp16"}  # fp16 autocast with a GradScaler: the trainer refuses it on the CPU


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser("gpu", __doc__, reps=None)
    add_config_arguments(parser, "default")
    parser.add_argument(
        "--cases", type=choice_list(list(CASES)), default=list(CASES), help=f"from {','.join(CASES)} (all)"
    )
    parser.add_argument(
        "--cpu", action="store_true", help="gloo on the CPU even where CUDA is available (CUDA not tested)"
    )
    parser.add_argument("--steps", type=positive_int, default=300, help="steps per case (default 300)")
    parser.add_argument("--kill-at", type=positive_int, default=120, help="kill after this step (120)")
    parser.add_argument("--checkpoint-every", type=positive_int, default=40, help="save every N steps (40)")
    parser.add_argument("--log-every", type=positive_int, default=10, help="log.every_steps (default 10)")
    parser.add_argument("--hf-model", type=Path, help="QA model directory for hf-bf16 (default: tiny random)")
    parser.add_argument("--timeout", type=float, default=150, help="seconds per case (default 150)")
    return parser


def environment(cuda: bool) -> dict[str, Any]:
    """What this machine offers: torch, CUDA, the device, nccl, bf16."""
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cuda_tested": cuda,
        "nccl_available": dist.is_nccl_available(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        nccl = torch.cuda.nccl.version() if dist.is_nccl_available() else None
        env.update(
            gpus=torch.cuda.device_count(),
            device=props.name,
            capability=f"{props.major}.{props.minor}",
            memory_gib=round(props.total_memory / 2**30, 1),
            nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
            bf16_native=torch.cuda.is_bf16_supported(including_emulation=False),
        )
    return env


def print_environment(env: dict[str, Any]) -> None:
    print(f"gpu-check: Python {env['python']}, torch {env['torch']} (built for CUDA {env['torch_cuda']})")
    if env["cuda_available"]:
        print(
            f"gpu-check: {env['gpus']} GPU(s); cuda:0 is {env['device']} (compute capability "
            f"{env['capability']}, {env['memory_gib']} GiB); nccl {env['nccl']}; "
            f"native bf16: {'yes' if env['bf16_native'] else 'no'}"
        )
    if not env["cuda_tested"]:
        why = "--cpu" if env["cuda_available"] else "no CUDA device is available to torch"
        banner = "gpu-check: " + "*" * 90
        print(banner)
        print(f"gpu-check: CUDA IS NOT TESTED ({why}): the same checks run on the CPU with gloo")
        print(banner)


def case_overrides(
    args: argparse.Namespace, name: str, cuda: bool, work: Path, hf_model: Path | None
) -> tuple[str, list[str]]:
    """(config, overrides) of one case: the user's overrides first, then the settings the check needs."""
    family, precision = CASES[name]
    config = args.config if family == "native" else "hf-tiny"
    model = [f"model.name_or_path={hf_model}"] if family == "hf" else []
    return config, [
        f"data.cache_dir={work / 'cache'}",
        *model,
        *args.overrides,
        f"train.max_steps={args.steps}",
        "train.eval_every=0",
        f"train.precision={precision}",
        f"dist.backend={'nccl' if cuda else 'gloo'}",
        "checkpoint.async=true",
        f"checkpoint.every_steps={args.checkpoint_every}",
        # Every checkpoint stays: the resumed one is read back after the run.
        f"checkpoint.keep_last={args.steps // args.checkpoint_every + 1}",
        f"log.every_steps={args.log_every}",
        "log.console=none",
        "debug.sample_ledger=true",
    ]


def kill_and_finish(job: Job, kill_at: int, timeout: float) -> dict[str, Any]:
    """Start the job, SIGKILL its worker once step `kill_at` is logged, wait for the job's end; all of it
    within `timeout` seconds."""
    where = f"(agent logs: {job.run_dir / 'agents'})"
    deadline = time.monotonic() + timeout
    job.start()
    try:
        try:
            job.wait_for_step(kill_at, timeout)
        except RuntimeError as err:
            raise BenchError(
                f"{err} {where}; if it trained to the end before the kill, give it more --steps"
            ) from None
        except TimeoutError as err:
            raise BenchError(f"{err} {where}") from None
        agents = job.live_agents()
        workers = job.workers(agents[0]) if agents else []
        if len(workers) != 1:
            raise BenchError(f"expected one worker to kill, found {len(workers)} {where}")
        killed = time.time()
        os.kill(workers[0], signal.SIGKILL)
        try:
            code = job.wait(max(1.0, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - TimeoutExpired: wait() has killed everything already
            raise BenchError(f"the job did not end within {timeout:.0f} s {where}") from None
    except BaseException:
        job.kill_everything()
        raise
    return {"exit_code": code, "killed_pid": workers[0], "killed_ts": killed}


def run_case(name: str, args: argparse.Namespace, cuda: bool, work: Path, hf: Path | None) -> dict[str, Any]:
    run_dir = work / name
    config, overrides = case_overrides(args, name, cuda, work, hf)
    print(f"[gpu] {name}: {args.steps} steps, worker killed after step {args.kill_at} ...", flush=True)
    started = time.time()
    job = Job(run_dir, config, overrides, agents=1, min_nodes=1, max_nodes=1)
    kill = kill_and_finish(job, args.kill_at, args.timeout)
    result = analyse(run_dir, kill, cuda, CASES[name][1], args.steps)
    result["wall_s"] = round(time.time() - started, 1)
    result["run_dir"] = str(run_dir)
    return result


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    if not args.kill_at < args.steps:
        raise UsageError(f"--kill-at {args.kill_at} must be below --steps {args.steps}")
    if not args.checkpoint_every < args.kill_at:
        raise UsageError(f"--checkpoint-every {args.checkpoint_every} must be below --kill-at {args.kill_at}")
    cuda = torch.cuda.is_available() and not args.cpu
    env = environment(cuda)
    print_environment(env)
    cases = [c for c in args.cases if cuda or c not in CUDA_ONLY]
    not_run = [c for c in args.cases if c not in cases]
    if not_run:
        print(f"gpu-check: not run without CUDA: {', '.join(not_run)}")
    hf_cases = [c for c in cases if CASES[c][0] == "hf"]
    absent = [m for m in ("transformers", "tokenizers") if importlib.util.find_spec(m) is None]
    if hf_cases and absent:
        raise UsageError(
            f"{', '.join(hf_cases)} needs {' and '.join(absent)} (pip install 'elastic-qa[hf]'); "
            f"or leave it out: --cases {','.join(c for c in args.cases if c not in hf_cases)}"
        )
    hf = args.hf_model
    if hf is None and any(CASES[c][0] == "hf" for c in cases):
        hf = tiny.create(work / "hf-bert", "bert")
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not cuda:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the workers too: they would pick CUDA when they see it
    results: dict[str, dict[str, Any]] = {}
    try:
        for name in cases:
            try:
                results[name] = run_case(name, args, cuda, work, hf)
            except BenchError as err:  # the other cases still run: a GPU machine is a rare chance
                print(f"gpu-check: {name} did not complete: {err}", flush=True)
                results[name] = {"error": str(err), "checks": [], "failures": [f"the run failed: {err}"]}
    finally:
        if hidden is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = hidden
    print_summary(results, env)
    failures = [f"{name}: {failure}" for name, r in results.items() for failure in r["failures"]]
    figures = {
        "benchmark": "gpu",
        "environment": env,
        "cuda_tested": cuda,
        "settings": {
            "config": args.config,
            "overrides": args.overrides,
            "steps": args.steps,
            "kill_at": args.kill_at,
            "checkpoint_every": args.checkpoint_every,
            "log_every": args.log_every,
            "hf_model": str(hf) if hf else None,
        },
        "cases": results,
        "not_run": not_run,
        "failures": failures,
        "ok": not failures,
    }
    if failures:
        if args.json:
            write_json(args.json, figures)
            print(f"figures written to {args.json}")
        raise BenchError(f"{len(failures)} check(s) failed: " + "; ".join(failures))
    return figures


def print_summary(results: dict[str, dict[str, Any]], env: dict[str, Any]) -> None:
    def num(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    rows = []
    for name, r in results.items():
        if "error" in r:
            continue
        stall = r["async_stall_ms"] or {}
        passed = sum(row["ok"] for row in r["checks"])
        rows.append(
            [
                name,
                num(r["steps_per_s_before_kill"], ".1f"),
                num(r["steps_per_s_after_resume"], ".1f"),
                f"{num(stall.get('median'), '.1f')} / {num(stall.get('max'), '.1f')} ({r['async_saves']})",
                num(r["kill_to_first_step_s"], ".2f"),
                f"{r['resumed_step']} ({num(r['steps_trained_again'], 'd')})",
                f"{num(r['em'], '.3f')} / {num(r['f1'], '.3f')}",
                num(r["peak_memory_mb"], ".0f"),
                f"{passed}/{len(r['checks'])}",
            ]
        )
    print_table(
        [
            "case",
            "steps/s",
            "after resume",
            "stall ms median / max (saves)",
            "kill -> step s",
            "resumed at (redone)",
            "EM / F1",
            "peak MB",
            "checks",
        ],
        rows,
    )
    for name, r in results.items():
        for failure in r["failures"]:
            print(f"gpu-check: FAILED {name}: {failure}")
    where = f"CUDA ({env.get('device')})" if env["cuda_tested"] else "the CPU only: CUDA NOT TESTED"
    if not any(r["failures"] for r in results.values()):
        print(f"gpu-check: every check passed, on {where}")
