"""Worker entry point: `python -m elastic_qa.train --config CFG [section.key=value ...]`.

Runs under torchrun (any number of agents and processes per agent) or alone as a single process.
Exit codes: 0 done, 2 bad input (config, data, checkpoint that does not fit), 75 stopped under torchrun
(SIGTERM, SIGINT, SIGHUP) after saving, to let the agents regroup, 76 its torchrun agent died, 1 anything
else (the torchrun agent restarts the group). A single process without torchrun that a signal stopped
exits 128 + the signal's number after saving (130 SIGINT, 129 SIGHUP, 143 SIGTERM), as a shell expects.
"""

from __future__ import annotations

# isort: off
# First: the start-up clock's `interpreter` phase ends here, before the imports below (torch among them).
from elastic_qa.observe.startup import STARTUP, dynamo_warmup, structlog_without_rich

if __name__ == "__main__":  # a worker process of its own, not an import by the Python API
    STARTUP.begin()  # a warm worker (a fork of a forkserver that imported this) starts its clock now
    structlog_without_rich()
# isort: on
import argparse
import contextlib
import errno
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from elastic_qa.checkpoint.store import CheckpointError
from elastic_qa.config import Config, ConfigError, config_help, resolve_config
from elastic_qa.config_changes import suspicious_settings
from elastic_qa.data.examples import DataError
from elastic_qa.dist import (
    exit_process,
    finish_process,
    forked_worker,
    init_distributed,
    set_denormals,
    set_threads,
    shutdown,
    under_torchrun_agent,
)
from elastic_qa.elastic.control import PeerFailure
from elastic_qa.elastic.signals import StopRequest
from elastic_qa.elastic.superseded import SupersededWatch
from elastic_qa.elastic.watchdog import AgentWatchdog
from elastic_qa.exits import EXIT_AGENT_LOST, EXIT_BAD_INPUT, EXIT_REGROUP
from elastic_qa.metrics import em_f1_text
from elastic_qa.models import family_for
from elastic_qa.observe.console import UNDER_LAUNCHER, print_safely
from elastic_qa.observe.events import Event
from elastic_qa.observe.log import configure_logging, get_logger
from elastic_qa.prep import prepare
from elastic_qa.session.hold import RunHeldError, check_before_start
from elastic_qa.session.saver import FinalStateError
from elastic_qa.train_state import ResumeError
from elastic_qa.trainer import Trainer


def parse_args(argv: list[str] | None, prog: str = "python -m elastic_qa.train") -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config",
        default="default",
        help=config_help(),
    )
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. train.max_steps=200")
    return parser.parse_args(argv)


def write_resolved_config(cfg: Config) -> None:
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    target = run_dir / "config.yaml"
    staging = run_dir / f".config.yaml.{id(cfg)}"
    staging.write_text(cfg.to_yaml())
    staging.replace(target)


def main(argv: list[str] | None = None, prog: str = "python -m elastic_qa.train") -> int:
    STARTUP.mark("imports")
    args = parse_args(argv, prog)
    try:
        cfg = resolve_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"elastic-qa: config error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    stop = StopRequest()  # set by a signal (once the loop runs) or by the watchdog
    try:
        result = run(cfg, stop)
    except (RunHeldError, DataError, ResumeError, ConfigError) as err:
        print(f"elastic-qa: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except PeerFailure:
        return 1  # logged as peer_failure: failure_reason's line
    except (CheckpointError, FinalStateError) as err:
        print_safely(f"elastic-qa: {err}", sys.stderr)
        return 1
    except OSError as err:
        if err.errno not in _UNWRITABLE:
            raise
        print(f"elastic-qa: cannot write {err.filename or 'the run'}: {_reason(err)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if result["stopped"]:
        return stopped_exit_code(stop, result["agent_lost"])
    return 0


def run(cfg: Config, stop: StopRequest | None = None) -> dict[str, Any]:
    """Train `cfg` in this process, under torchrun or alone, until its end or a stop: the trainer's result
    ({"stopped", "step", and the final evaluation's "em", "f1" ...}) and "agent_lost".

    Raises what `main` turns into exit codes: RunHeldError, DataError, ResumeError, ConfigError (bad input),
    PeerFailure, CheckpointError, FinalStateError, an OSError of a path that cannot be written; each logged
    first, once logging is set up.
    """
    stop = stop or StopRequest()
    if STARTUP.reported or "imports" not in STARTUP.phases:  # in-process (the Python API): timed from here
        STARTUP.begin(born=time.time())
    if cfg.run.private:  # owner-only run, log and checkpoint files (0600/0700): before any is created
        os.umask(0o077)
    # Before this start writes anything into the run (its logs): a live job must not see it. A holders/
    # that is no real directory is left to the restore, which refuses it (ResumeError) with the path.
    with contextlib.suppress(CheckpointError):
        check_before_start(cfg.checkpoint_dir, os.environ.get("TORCHELASTIC_RUN_ID", ""), cfg.run.dir)
    superseded: SupersededWatch | None = None  # rank 0 under torchrun, once the attempt is registered
    watchdog = AgentWatchdog(
        cfg.dist.agent_check_interval, cfg.dist.agent_lost_grace, stop, cfg.checkpoint.emergency_retry_for
    )
    try:
        configure_logging(Path(cfg.run.dir) / "logs", cfg.log.level, fault_file=cfg.debug.log_fault_file)
    except OSError as err:
        raise ConfigError(f"run.dir={cfg.run.dir}: cannot create its logs ({_reason(err)})") from None
    log = get_logger()
    STARTUP.mark("config")
    try:
        # Before torch's first parallel operation: a pool thread keeps the flag it started with.
        denormals = set_denormals(
            cfg.train.flush_denormals, lambda said: log.warning(Event.DIAGNOSIS, finding=said)
        )
        # Before the process group: a long first build cannot time it out.
        data = prepare(cfg, family_for(cfg.model))
        STARTUP.mark("cache_open")
        warmup = dynamo_warmup()  # while the process group forms (observe/startup.py)
        ctx = init_distributed(cfg.dist)
        watchdog.start()
        threads = set_threads(cfg.train.threads, ctx)
        warmup.join()  # no other import runs beside it (two threads' imports can deadlock on their locks)
        STARTUP.mark("process_group")
        trainer = Trainer(cfg, ctx, data, stop_request=stop)
        attempt = trainer.start(
            threads=threads,
            restart_count=_restart_count(),
            config_hash=cfg.digest(),
            flush_denormals=denormals,
        )
        if ctx.is_main and under_torchrun_agent():  # a lone process is never superseded: the hold refuses
            fence = trainer.session.context.fence
            superseded = SupersededWatch(cfg.checkpoint.fence_check_every, attempt, fence.newest, stop)
            superseded.start()
        if ctx.is_main:  # only once the run's checkpoint fits: a bad config must not replace a good one
            write_resolved_config(cfg)
            if _restart_count() == 0:  # once the start is accepted: a refused start says only why
                warn_suspicious(cfg, len(data.train))
        result = trainer.train()
        if not result["stopped"] and ctx.is_main and "em" in result:  # stdout may be a closed pipe by now
            print_safely(f"final: step {result['step']}  {em_f1_text(result['em'], result['f1'])}")
        return {**result, "agent_lost": watchdog.lost}
    except RunHeldError as err:  # not bad_input: the live job's launcher must not count it as its own
        log.warning("run_held", error=str(err))
        raise
    except (DataError, ResumeError, ConfigError) as err:
        log.error(Event.BAD_INPUT, error=str(err))
        raise
    except PeerFailure as err:
        log.error(Event.PEER_FAILURE, error=str(err))  # failure_reason's line
        raise
    except (CheckpointError, FinalStateError) as err:
        log.error("checkpoint_fatal", error=str(err))
        raise
    except Exception as err:
        if isinstance(err, OSError) and err.errno in _UNWRITABLE:  # e.g. a read-only checkpoint.dir
            log.error(Event.BAD_INPUT, error=str(err))
            raise
        # Logged so that a launcher can tell a crash loop (the same error every attempt) from bad luck.
        log.error(
            Event.WORKER_CRASH,
            error=f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}",
            traceback=traceback.format_exc(limit=8),
        )
        raise
    finally:
        watchdog.stop()
        if superseded is not None:
            superseded.stop()
        shutdown()


def warn_suspicious(cfg: Config, train_windows: int) -> None:
    """Settings that are valid but likely mistakes: logged; said on stderr unless the launcher said so."""
    for warning in suspicious_settings(cfg, train_windows):
        get_logger().warning("config_warning", warning=warning)
        if not os.environ.get(UNDER_LAUNCHER):
            print_safely(f"elastic-qa: warning: {warning}", sys.stderr)


def stopped_exit_code(stop: StopRequest, agent_lost: bool) -> int:
    """The exit code of a run that stopped early and saved: 76 when its agent is gone; 75 under torchrun,
    so that the agents regroup; else 128 + the signal's number, the shell's convention."""
    if agent_lost:
        return EXIT_AGENT_LOST
    if under_torchrun_agent() or stop.signum is None:
        return EXIT_REGROUP
    return 128 + stop.signum


# Errors that mean "this path cannot be written as configured", not a passing storage fault.
_UNWRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EEXIST)


def _reason(err: OSError) -> str:
    return err.strerror or str(err)


def _restart_count() -> int:
    import os

    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


if __name__ == "__main__":
    code = main()
    if code != 0 or not forked_worker():
        exit_process(code)
    # A warm worker that ends well returns: torchrun waits for its function's return value, and
    # multiprocessing then ends the process with os._exit, past the finalisation exit_process avoids.
    finish_process()
