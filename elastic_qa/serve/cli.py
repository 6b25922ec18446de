"""`elastic-qa serve MODEL`: answer questions over HTTP with a model loaded once (docs/serve.md).

The model loads as `elastic-qa ask` loads it (a run directory, a checkpoints directory, a step directory or
an export); then one line says where it serves, and the server runs until SIGTERM or SIGINT: it stops
accepting, answers the requests in flight and exits 0. A model that does not load, or an address that
cannot be bound: one line, exit 2.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from datetime import timedelta

from elastic_qa.argtypes import positive_duration, whole_number
from elastic_qa.checkpoint.errors import CheckpointError
from elastic_qa.config import ConfigError
from elastic_qa.elastic.signals import SignalWait
from elastic_qa.exits import EXIT_BAD_INPUT, EXIT_OK, UsageError
from elastic_qa.observe.log import configure_terminal_logging
from elastic_qa.serve.batcher import Batcher
from elastic_qa.serve.http import QAServer, ServeSettings
from elastic_qa.serve.schema import Limits

LOOPBACK = ("127.0.0.1", "::1", "localhost")


def _milliseconds(text: str) -> timedelta:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 60_000:
        raise argparse.ArgumentTypeError(f"{text!r}: expected milliseconds from 0 to 60000")
    return timedelta(milliseconds=value)


def build_parser() -> argparse.ArgumentParser:
    limits = Limits()
    p = argparse.ArgumentParser(
        prog="elastic-qa serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("model", metavar="MODEL", help="a run, checkpoints or step directory, or an export")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1, this machine only). There is no authentication and "
        "no TLS: to serve other machines, bind here and put a proxy in front (docs/serve.md)",
    )
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0: any free port)")
    p.add_argument(
        "--max-batch", type=whole_number, default=32, help="questions answered in one model call (32)"
    )
    p.add_argument(
        "--max-wait-ms",
        type=_milliseconds,
        default=timedelta(0),
        help="how long the first waiting question waits for others to join its batch (default 0: a call "
        "takes what is queued; under load, requests queue while the model runs)",
    )
    p.add_argument("--no-batching", action="store_true", help="one question per model call (--max-batch 1)")
    p.add_argument(
        "--null-threshold", type=float, help="no answer when null_odds exceed this (eval.null_threshold)"
    )
    p.add_argument(
        "--request-timeout",
        type=positive_duration,
        default=timedelta(seconds=30),
        help="a request not answered within this gets 504 (default 30s)",
    )
    p.add_argument(
        "--queue-size",
        type=whole_number,
        default=256,
        help="requests waiting for the model; beyond: 503 (256)",
    )
    p.add_argument(
        "--socket-timeout",
        type=positive_duration,
        default=timedelta(seconds=10),
        help="a client silent this long, mid-request or between requests, is disconnected (default 10s)",
    )
    p.add_argument(
        "--read-timeout",
        type=positive_duration,
        default=timedelta(seconds=30),
        help="a request not arrived whole this long after its first byte gets 408 and is disconnected, "
        "however steadily it trickles (default 30s)",
    )
    p.add_argument(
        "--max-connections",
        type=whole_number,
        default=128,
        help="open connections, one thread each; beyond: 503 and closed (default 128)",
    )
    p.add_argument(
        "--max-body-bytes", type=whole_number, default=limits.max_body_bytes, help="413 beyond (1 MiB)"
    )
    p.add_argument(
        "--max-questions",
        type=whole_number,
        default=limits.max_questions,
        help="questions in one request (64)",
    )
    p.add_argument(
        "--max-context-chars",
        type=whole_number,
        default=limits.max_context_chars,
        help="context length (20000)",
    )
    p.add_argument(
        "--max-question-chars",
        type=whole_number,
        default=limits.max_question_chars,
        help="question length (1000)",
    )
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    configure_terminal_logging()
    if not 0 <= args.port <= 65535:
        print(f"elastic-qa serve: --port {args.port}: expected 0 to 65535", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        server = build_server(args)
    except (UsageError, ConfigError, CheckpointError, FileNotFoundError) as err:
        print(f"elastic-qa: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.host not in LOOPBACK:
        print(
            f"elastic-qa serve: listening on {args.host}: anyone who can reach it may ask, with no "
            "authentication and no TLS; put a proxy in front (docs/serve.md)",
            file=sys.stderr,
        )
    with SignalWait((signal.SIGTERM, signal.SIGINT)) as signals:
        serving = threading.Thread(target=server.serve_forever, name="accept")
        serving.start()
        print(
            f"elastic-qa serve: {server.settings.model['source']} on {server.url} "
            "(POST /v1/answer, GET /healthz; SIGTERM or Ctrl-C stops)",
            flush=True,
        )
        signals.wait()
        # Still inside: a second signal while the requests in flight are answered is ignored.
        print("elastic-qa serve: stopping: answering the requests in flight", flush=True)
        cut = server.stop()
        serving.join()
    if cut:
        print(
            f"elastic-qa serve: {cut} connections still open after {server.stop_bound} were cut",
            file=sys.stderr,
        )
    if server.model_stuck:
        print(
            f"elastic-qa serve: the model call still running {server.settings.request_timeout} after the "
            "stop was left behind",
            file=sys.stderr,
        )
    stats = server.batcher.stats
    print(f"elastic-qa serve: stopped ({stats.questions} questions in {stats.batches} batches)", flush=True)
    return EXIT_OK


def build_server(args: argparse.Namespace) -> QAServer:
    """Load the model, start its batcher and bind the address (UsageError: the model or the address)."""
    import torch

    from elastic_qa.evaluation import answer_questions, answer_record
    from elastic_qa.export import load_for_prediction

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    loaded = load_for_prediction(args.model, device)
    threshold = loaded.cfg.eval.null_threshold if args.null_threshold is None else args.null_threshold

    def answer(pairs: list[tuple[str, str]]) -> list[dict[str, object]]:
        return [answer_record(p, threshold) for p in answer_questions(loaded, pairs, device, threshold)]

    max_batch = 1 if args.no_batching else args.max_batch
    batcher = Batcher(answer, max_batch, args.max_wait_ms, args.queue_size)
    limits = Limits(args.max_body_bytes, args.max_questions, args.max_question_chars, args.max_context_chars)
    model = {"source": loaded.source, "step": loaded.step, "kind": loaded.cfg.model.kind,
             "null_threshold": threshold}  # fmt: skip
    settings = ServeSettings(
        limits, args.request_timeout, args.socket_timeout, model, args.max_connections, args.read_timeout
    )
    try:
        return QAServer((args.host, args.port), batcher, settings)
    except OSError as err:
        batcher.close()
        raise UsageError(
            f"--host {args.host} --port {args.port}: cannot listen: {err.strerror or err}"
        ) from None
