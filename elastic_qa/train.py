"""Worker entry point: `python -m elastic_qa.train --config CFG [section.key=value ...]`.

Runs under torchrun (any number of agents and processes per agent) or alone as a single process.
Exit codes: 0 done, 2 bad input (config, data, checkpoint that does not fit), 75 stopped to let the group
regroup (SIGTERM), 1 anything else (the torchrun agent restarts the group).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

from elastic_qa.checkpoint.store import CheckpointError
from elastic_qa.config import Config, ConfigError, load_config, packaged_config
from elastic_qa.data.cache import prepare
from elastic_qa.data.squad import DataError
from elastic_qa.dist import exit_process, init_distributed, set_threads, shutdown
from elastic_qa.elastic.watchdog import AgentWatchdog
from elastic_qa.observe.log import configure_logging, get_logger
from elastic_qa.trainer import EXIT_REGROUP, PeerFailure, ResumeError, Trainer

EXIT_BAD_INPUT = 2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m elastic_qa.train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config",
        default="default",
        help="YAML file, or the name of a packaged config (default, squad, tiny)",
    )
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. train.max_steps=200")
    return parser.parse_args(argv)


def resolve_config(name: str, overrides: list[str]) -> Config:
    path = Path(name)
    if not path.suffix and not path.exists():
        path = packaged_config(name)
        if not path.exists():
            raise ConfigError(f"--config {name}: no such file or packaged config")
    return load_config(path, overrides)


def write_resolved_config(cfg: Config) -> None:
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    target = run_dir / "config.yaml"
    staging = run_dir / f".config.yaml.{id(cfg)}"
    staging.write_text(cfg.to_yaml())
    staging.replace(target)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = resolve_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"elastic-qa: config error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    watchdog = AgentWatchdog(cfg.dist.agent_check_interval)
    configure_logging(Path(cfg.run.dir) / "logs", cfg.log.level)
    log = get_logger()
    try:
        data = prepare(cfg.data)  # before the process group: a long first build cannot time it out
        ctx = init_distributed(cfg.dist)
        watchdog.start()
        threads = set_threads(cfg.train.threads, ctx)
        trainer = Trainer(cfg, ctx, data)
        attempt = trainer.register_attempt()
        log.info(
            "worker_start",
            attempt=attempt,
            world_size=ctx.world_size,
            backend=ctx.backend,
            device=str(ctx.device),
            threads=threads,
            restart_count=_restart_count(),
            config_hash=cfg.digest(),
        )
        trainer.restore()
        if ctx.is_main:  # only once the run's checkpoint fits: a bad config must not replace a good one
            write_resolved_config(cfg)
        result = trainer.train()
        if result["stopped"]:
            return EXIT_REGROUP
        if ctx.is_main and "em" in result:
            print(f"final: step {result['step']}  EM {result['em']:.4f}  F1 {result['f1']:.4f}", flush=True)
        return 0
    except (DataError, ResumeError, ConfigError) as err:
        log.error("bad_input", error=str(err))
        print(f"elastic-qa: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except PeerFailure as err:
        log.error("peer_failure", error=str(err).splitlines()[0][:300])
        return 1
    except CheckpointError as err:
        log.error("checkpoint_fatal", error=str(err))
        print(f"elastic-qa: {err}", file=sys.stderr)
        return 1
    except Exception as err:
        # Logged so that a launcher can tell a crash loop (the same error every attempt) from bad luck.
        log.error(
            "worker_crash",
            error=f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}",
            traceback=traceback.format_exc(limit=8),
        )
        raise
    finally:
        watchdog.stop()
        shutdown()


def _restart_count() -> int:
    import os

    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


if __name__ == "__main__":
    exit_process(main())
