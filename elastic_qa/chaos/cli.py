"""`elastic-qa chaos`: break a training job on purpose, then prove from evidence that nothing was lost.

    elastic-qa chaos run --run-dir DIR [--agents 2 --min 1 --max 4] [--config tiny]
                         (--fault KIND@step=N | --fault KIND@time=20s[,for=5s] ... | --seed S --faults N)
                         [--min-gap 2s] [-- key=value ...]
    elastic-qa chaos run --replicas 2 --run-dir DIR [--config tiny]
                         (--fault KIND@step=N ... | --seed S --faults N [--kinds ...]) [key=value ...]
    elastic-qa chaos verify DIR [--reference REF_DIR]
    elastic-qa chaos schedule [--replicas 2] --seed S --faults N [--config tiny] [key=value ...]  # print it

(`python -m chaos ...` in a checkout.)

Fault kinds: kill-worker, kill-node, term-node, join-node, freeze-worker, kill-during-save,
corrupt-checkpoint, storage-errors, final-storage-errors, corrupt-replay, log-full, hup, second-job.
With --replicas N the job is `elastic-qa replicas` (N replica groups), and its faults are kill-worker,
kill-node, kill-lighthouse, stall-replica (for= required) and kill-during-heal, by step, 3 steps apart
(elastic_qa/chaos/replicas.py). A random schedule triggers its faults by step, one per slice of
train.max_steps, and (without --replicas, whose faults hold the job at their steps) slows the job down
(debug.step_delay) when a slice would pass in less than --min-gap. The verdict prints a table (one row per
fault: kind, step, lost steps, recovery seconds, verdict) and writes <DIR>/chaos/report.json and
report.html. Exit 0 only when every check holds; 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from elastic_qa.chaos.schedule import KINDS, Fault, fit_job, parse_fault, random_schedule, validate
from elastic_qa.config import Config, ConfigError, parse_duration, resolve_config

EXIT_FAILED, EXIT_BAD_INPUT = 1, 2


def _schedule(args: argparse.Namespace, cfg: Config) -> tuple[list[Fault], dict[str, str]]:
    """The faults, and the overrides that fit the job to a random schedule (none for explicit ones)."""
    if args.fault and args.faults:
        raise ValueError("give either --fault ... or --faults N, not both")
    if cfg.train.epochs:  # faults, the verdict and the reference run count steps: the job must too
        raise ValueError(f"train.epochs={cfg.train.epochs}: chaos runs take a train.max_steps, not epochs")
    if args.gone_mean_interval or args.gone_first_at:
        raise ValueError(
            "--mean-interval/--first-at are gone: random faults fire by step, one per slice of "
            "train.max_steps (see --min-gap)"
        )
    if args.fault:
        faults = [parse_fault(text) for text in args.fault]
        validate(faults, args.agents, args.min, args.max, cfg.train.max_steps)
        return faults, {}
    if args.faults:
        kinds = tuple(args.kinds.split(",")) if args.kinds else KINDS
        unknown = set(kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"--kinds: unknown fault kinds {sorted(unknown)}")
        faults = random_schedule(
            args.seed, args.faults, cfg.train.max_steps, args.agents, args.min, args.max, kinds
        )
        return faults, fit_job(cfg, faults, parse_duration(args.min_gap).total_seconds())
    return [], {}


def cmd_run(args: argparse.Namespace) -> int:
    from elastic_qa.chaos.present import format_table, write_report
    from elastic_qa.chaos.runner import reference_run, run_schedule
    from elastic_qa.chaos.verify import verify_run

    run_dir = Path(args.run_dir)
    overrides = [*args.overrides, f"run.dir={run_dir}"]
    cfg = resolve_config(args.config, overrides)  # bad config: exit 2 before anything starts
    if (run_dir / "launch.json").exists():
        print(f"chaos: {run_dir} already holds a job; use a new --run-dir", file=sys.stderr)
        return EXIT_BAD_INPUT
    schedule, fitted = _schedule(args, cfg)
    print("schedule: " + " ".join(f.describe() for f in schedule), flush=True)
    if fitted:
        print("fitted to the schedule: " + " ".join(f"{k}={v}" for k, v in fitted.items()), flush=True)
    reference = None
    if not args.no_reference:
        cache_root = Path(args.reference_cache).expanduser()
        reference = reference_run(args.config, args.overrides, args.agents, cache_root, args.timeout)
    code = run_schedule(
        run_dir,
        args.config,
        overrides,
        schedule,
        args.agents,
        args.min,
        args.max,
        args.seed,
        args.timeout,
        fitted,
    )
    print(f"job ended with exit code {code}", flush=True)
    verdict = verify_run(run_dir, reference)
    json_path, page = write_report(run_dir, verdict, reference)
    print(format_table(verdict))
    print(f"report: {json_path}  picture: {page}")
    return 0 if verdict.ok else EXIT_FAILED


def cmd_verify(args: argparse.Namespace) -> int:
    from elastic_qa.chaos.present import format_table, write_report
    from elastic_qa.chaos.verify import verify_run

    reference = Path(args.reference) if args.reference else None
    verdict = verify_run(Path(args.run_dir), reference)
    json_path, page = write_report(Path(args.run_dir), verdict, reference)
    print(format_table(verdict))
    print(f"report: {json_path}  picture: {page}")
    return 0 if verdict.ok else EXIT_FAILED


def cmd_schedule(args: argparse.Namespace) -> int:
    faults, fitted = _schedule(args, resolve_config(args.config, args.overrides))
    for fault in faults:
        print(fault.describe())
    if fitted:
        print("fitted to the schedule: " + " ".join(f"{k}={v}" for k, v in fitted.items()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="elastic-qa chaos", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("run", "schedule"):
        p = sub.add_parser(name, help="run a job with faults" if name == "run" else "print a schedule")
        p.add_argument("--config", default="tiny", help="config file or packaged name (default tiny)")
        p.add_argument(
            "--replicas",
            type=int,
            help="the replica-group mode: `elastic-qa replicas` with this many groups (faults: "
            "kill-worker, kill-node, kill-lighthouse, stall-replica, kill-during-heal)",
        )
        if name == "run":
            p.add_argument("--run-dir", required=True, help="a new directory for the job")
            p.add_argument("--timeout", type=float, default=3600, help="seconds before the job is killed")
            p.add_argument("--no-reference", action="store_true", help="skip the fault-free reference run")
            p.add_argument(
                "--reference-cache",
                default="~/.cache/elastic_qa/chaos-reference",
                help="where reference runs are kept, keyed by config",
            )
        p.add_argument("overrides", nargs="*", help="config overrides (section.key=value)")
        # No defaults for --agents/--min/--max/--min-gap: --replicas refuses them given (main fills them in
        # for the default mode).
        p.add_argument("--agents", type=int, help="agents at the start (default 2)")
        p.add_argument("--min", type=int, help="fewest agents (default 1)")
        p.add_argument("--max", type=int, help="most agents (default 4)")
        p.add_argument("--fault", action="append", default=[], help=f"KIND@step=N or KIND@time=20s; {KINDS}")
        p.add_argument("--seed", type=int, default=0, help="seed of the random schedule and target choices")
        p.add_argument("--faults", type=int, default=0, help="random schedule: number of faults")
        p.add_argument(
            "--min-gap",
            help="random schedule: least training time per fault (default 2s); a faster job gets a "
            "debug.step_delay",
        )
        p.add_argument("--kinds", default="", help="random schedule: comma-separated kinds (default all)")
        for gone in ("--mean-interval", "--first-at"):  # wall-time triggers: faults now fire by step
            p.add_argument(gone, dest="gone_" + gone[2:].replace("-", "_"), help=argparse.SUPPRESS)
    p = sub.add_parser("verify", help="verify a finished run from its evidence")
    p.add_argument("run_dir")
    p.add_argument("--reference", help="run dir of the fault-free reference run")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "verify":
            return cmd_verify(args)
        if args.replicas is not None:
            from elastic_qa.chaos.replicas import cmd_run_replicas, cmd_schedule_replicas

            return cmd_run_replicas(args) if args.command == "run" else cmd_schedule_replicas(args)
        args.agents = 2 if args.agents is None else args.agents
        args.min = 1 if args.min is None else args.min
        args.max = 4 if args.max is None else args.max
        args.min_gap = "2s" if args.min_gap is None else args.min_gap
        if not 1 <= args.min <= args.agents <= args.max:
            raise ValueError(
                f"need 1 <= --min ({args.min}) <= --agents ({args.agents}) <= --max ({args.max})"
            )
        return cmd_run(args) if args.command == "run" else cmd_schedule(args)
    except (ValueError, ConfigError) as err:
        print(f"chaos: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
