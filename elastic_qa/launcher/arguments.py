"""The local launcher's command line: its help (with the exit codes), its options, and the run directory
given either way (`--run-dir DIR`, primary, or the config override `run.dir=DIR`)."""

from __future__ import annotations

import argparse

from elastic_qa import __version__
from elastic_qa.config import config_help
from elastic_qa.launcher.rendezvous import MAX_RESTARTS

WORKER_MODULE = "elastic_qa.train"

HELP = """Elastic torchrun agents on this host.

    {prog} start --agents 2 [--min 1 --max 4] [--config CFG] [section.key=value ...]
    {prog} join   --run-dir DIR            one more agent: the job regroups larger
    {prog} leave  --run-dir DIR [--agent N]  SIGTERM one agent (preemption): it saves and leaves
    {prog} stop   --run-dir DIR            SIGTERM every agent: each saves first
    {prog} status --run-dir DIR            the job's agents

The run directory is `--run-dir DIR` for every command; `run.dir=DIR` is accepted as well (it is the
config key that `start` takes with the other overrides). `start` waits for the job and shows its progress;
Ctrl-C (or SIGTERM) stops it after every agent saved, and prints the command that resumes it.

Exit codes of start: 0 the job completed, or `stop` stopped it and its last step was saved; 1 it failed
or ended early; 2 bad input (config, data, a
checkpoint of another model shape, a crash loop on bad input), nothing started; 130 stopped by Ctrl-C
(SIGINT) and 143 by SIGTERM, after saving. join, leave, stop, status: 0 ok, 2 bad input.
"""


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=HELP.format(prog=prog),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"elastic-qa {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    start = sub.add_parser("start", help="start a job with N agents and wait for it")
    start.add_argument("--agents", type=int, default=2, help="agents to start now (default 2)")
    start.add_argument("--min", type=int, default=1, help="fewest agents the job runs with (default 1)")
    start.add_argument("--max", type=int, default=4, help="most agents the job accepts (default 4)")
    start.add_argument("--nproc-per-node", type=int, default=1, help="workers per agent (default 1)")
    start.add_argument(
        "--max-restarts",
        type=int,
        default=MAX_RESTARTS,
        help=f"regroups each agent allows (default {MAX_RESTARTS})",
    )
    start.add_argument("--port", type=int, default=0, help="rendezvous port (default: a free one)")
    start.add_argument("--config", default="default", help=config_help())
    start.add_argument("--run-dir", help="the run directory (the same as the override run.dir=DIR)")
    start.add_argument(
        "--module",
        default=WORKER_MODULE,
        help=f"worker module the agents run, given --config and the overrides (default {WORKER_MODULE}; "
        "the recovery benchmark runs a trivial baseline worker this way)",
    )
    start.add_argument("overrides", nargs="*", help="section.key=value, e.g. train.max_steps=200")
    for name, helptext in (
        ("join", "add one agent to a running job"),
        ("leave", "SIGTERM one agent (preemption): it saves and leaves"),
        ("stop", "SIGTERM every agent: each saves first"),
        ("status", "list the job's agents"),
    ):
        command = sub.add_parser(name, help=helptext)
        command.add_argument("--run-dir", help="the job's run directory (or give run.dir=DIR)")
        command.add_argument("overrides", nargs="*", metavar="run.dir=DIR", help="the same as --run-dir DIR")
        if name == "leave":
            command.add_argument("--agent", type=int, help="agent index (default: the newest non-host)")
    return parser


def run_dir_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`--run-dir DIR` and `run.dir=DIR` name the same thing: reconcile them (exit 2 when they differ).

    start: the run directory travels as the override run.dir=DIR (it may also come from the config);
    join/leave/stop/status: args.run_dir is set, and run.dir=DIR is the only override they take.
    """
    given = [o.partition("=")[2] for o in args.overrides if o.partition("=")[0].strip() == "run.dir"]
    named = {*given, *([args.run_dir] if args.run_dir else [])}
    if len(named) > 1:
        parser.error(f"--run-dir and run.dir= name different directories: {', '.join(sorted(named))}")
    if args.command == "start":
        if args.run_dir and not given:
            args.overrides = [*args.overrides, f"run.dir={args.run_dir}"]
        return
    others = [o for o in args.overrides if o.partition("=")[0].strip() != "run.dir"]
    if others:
        parser.error(f"{args.command} takes only --run-dir DIR (or run.dir=DIR), not {' '.join(others)}")
    if not named:
        parser.error(f"{args.command} needs the job's run directory: --run-dir DIR")
    args.run_dir = named.pop()
