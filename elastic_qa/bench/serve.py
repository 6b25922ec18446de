"""serve: latency and throughput of `elastic-qa serve` with dynamic batching against one question per call.

Each variant is a real `elastic-qa serve MODEL --port 0` process on loopback; N client threads each send M
requests of one question (keep-alive connections, a fixed rotation of questions, short and long contexts),
all started together. Per variant: p50 and p99 request latency, requests/s over the whole load, and the
server's RSS after one warm-up request and after the load. Variants run alternately, --reps times; medians
(min..max) are shown. Every answer is checked against the single-request answer of the same question
(answer text and spans equal; the largest score difference is shown): a batch must not change answers.
Without --model, a tiny model is trained first (seconds).
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from elastic_qa.bench.common import (
    BenchError,
    UsageError,
    alternate,
    new_parser,
    positive_int,
    print_table,
    show,
    summary,
)

LONG_CONTEXT = " ".join(
    f"in {1900 + year} the river town of vell{year} built a stone bridge of {year + 3} arches ."
    for year in range(40)
)  # some 600 words: many windows of any model here
SHORT = [
    ("where does bako live ?", "bako lives in rome . bako owns a red car ."),
    ("what does bako own ?", "bako lives in rome . bako owns a red car ."),
    ("who wrote the letter ?", "the letter was written by mara in the spring of 1921 ."),
    ("what colour is the door ?", "the house has a green door and two small windows ."),
    ("when did the train leave ?", "the train left at noon and reached the coast at six ."),
    ("what is the capital of peru ?", "the cat slept on the warm roof all afternoon ."),
    ("who found the key ?", "after an hour of searching , tomas found the key under a stone ."),
]
QUESTIONS = [
    *({"question": q, "context": c} for q, c in SHORT),
    {"question": "how many arches did vell12 build ?", "context": LONG_CONTEXT},
]
LABELS = {
    "p50_ms": "p50 latency ms",
    "p99_ms": "p99 latency ms",
    "requests_per_s": "requests/s",
    "rss_before_mib": "RSS before MiB",
    "rss_after_mib": "RSS after MiB",
    "mean_batch": "questions per model call",
}
WAIT_S = 300.0  # how long a server may take to load its model on a loaded machine


@dataclass
class ServerProcess:
    """A running `elastic-qa serve` subprocess and its URL."""

    process: subprocess.Popen[str]
    url: str
    stderr_path: Path

    def rss_bytes(self) -> int:
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        found = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
        return int(found.group(1)) * 1024 if found else 0

    def stop(self) -> int:
        """SIGTERM, then its exit code (it answers what is in flight first)."""
        if self.process.poll() is None:
            self.process.terminate()
        try:
            return self.process.wait(timeout=WAIT_S)
        finally:
            if self.process.stdout is not None:
                self.process.stdout.close()


def start_server(
    model: str, flags: Sequence[str], stderr_path: Path, cwd: Path | None = None
) -> ServerProcess:
    """Start `elastic-qa serve MODEL --port 0 FLAGS`; return once it says where it listens."""
    command = [sys.executable, "-m", "elastic_qa.cli", "serve", model, "--port", "0", *flags]
    with stderr_path.open("w") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=cwd)
    assert process.stdout is not None
    line = process.stdout.readline()  # the first line is "... on URL ..." once it listens (or EOF)
    found = re.search(r" on (http://\S+/) ", line)
    if found is None:
        process.kill()
        process.wait()
        said = stderr_path.read_text().strip().splitlines()
        raise BenchError(f"elastic-qa serve did not start: {said[-1] if said else line.strip()}")
    return ServerProcess(process, found.group(1), stderr_path)


def request(
    connection: http.client.HTTPConnection, method: str, path: str, body: Any = None
) -> tuple[int, Any, dict[str, str]]:
    """One request on a keep-alive connection: status, decoded JSON (or text) body, headers."""
    data = json.dumps(body).encode() if body is not None and not isinstance(body, bytes) else body
    headers = {"Content-Type": "application/json"} if data is not None else {}
    connection.request(method, path, body=data, headers=headers)
    reply = connection.getresponse()
    raw = reply.read()
    try:
        value: Any = json.loads(raw)
    except ValueError:
        value = raw.decode(errors="replace")
    return reply.status, value, dict(reply.getheaders())


def connect(url: str, timeout: float = WAIT_S) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    return http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)


@dataclass
class Load:
    """What one load left: per request (client, index, question number, latency s, status, reply)."""

    rows: list[tuple[int, int, int, float, int, Any]] = field(default_factory=list)
    wall_s: float = 0.0

    def latencies_ms(self) -> list[float]:
        return sorted(row[3] * 1000 for row in self.rows)

    def percentile_ms(self, share: float) -> float:
        values = self.latencies_ms()
        return values[min(len(values) - 1, math.ceil(share * len(values)) - 1)]

    def errors(self) -> list[str]:
        return [f"client {r[0]} request {r[1]}: {r[4]} {r[5]}" for r in self.rows if r[4] != 200]


def drive(url: str, clients: int, requests: int, questions: Sequence[dict[str, str]]) -> Load:
    """`clients` threads, each sending `requests` one-question requests on its own connection, started
    together; client c's request i asks questions[(c + i) % len(questions)]."""
    load = Load()
    lock = threading.Lock()
    ready = threading.Barrier(clients + 1)

    def client(number: int) -> None:
        connection = connect(url)
        rows = []
        ready.wait()
        try:
            for i in range(requests):
                asked = (number + i) % len(questions)
                began = time.perf_counter()
                try:
                    status, reply, _ = request(connection, "POST", "/v1/answer", questions[asked])
                except (OSError, http.client.HTTPException) as err:
                    status, reply = 0, f"{type(err).__name__}: {err}"
                    connection.close()
                    connection = connect(url)
                rows.append((number, i, asked, time.perf_counter() - began, status, reply))
        finally:
            connection.close()
            with lock:
                load.rows.extend(rows)

    threads = [threading.Thread(target=client, args=(n,)) for n in range(clients)]
    for thread in threads:
        thread.start()
    ready.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    load.wall_s = time.perf_counter() - began
    return load


def answer_differences(load: Load, reference: Sequence[dict[str, Any]]) -> tuple[list[str], float]:
    """Answers of the load that differ from the reference in text or span, and the largest score or
    null_odds difference among the rest."""
    wrong, largest = [], 0.0
    for client, index, asked, _, status, reply in load.rows:
        if status != 200:
            continue
        expected = reference[asked]
        exact = ("answer", "start", "end", "best_span", "null_threshold")
        if any(reply.get(key) != expected[key] for key in exact):
            wrong.append(f"client {client} request {index}: {reply} != {expected}")
            continue
        for key in ("score", "null_odds"):
            largest = max(largest, abs(reply[key] - expected[key]))
    return wrong, largest


def single_answers(url: str, questions: Sequence[dict[str, str]]) -> list[dict[str, Any]]:
    """Each question asked alone, one request at a time."""
    connection = connect(url)
    try:
        answers = []
        for question in questions:
            status, reply, _ = request(connection, "POST", "/v1/answer", question)
            if status != 200:
                raise BenchError(f"{question['question']!r}: {status} {reply}")
            answers.append(reply)
        return answers
    finally:
        connection.close()


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser("serve", __doc__, reps=3)
    parser.add_argument(
        "--model", help="a run, checkpoints or step directory, or an export (default: train tiny)"
    )
    parser.add_argument("--clients", type=positive_int, default=8, help="concurrent clients (default 8)")
    parser.add_argument(
        "--requests", type=positive_int, default=200, help="requests per client (default 200)"
    )
    parser.add_argument("--max-batch", type=positive_int, default=32, help="the batching variant's (32)")
    parser.add_argument("--max-wait-ms", type=float, default=0.0, help="the batching variant's (0)")
    return parser


def train_tiny(work: Path) -> str:
    run_dir = work / "tiny-run"
    command = [sys.executable, "-m", "elastic_qa.train", "--config", "tiny", f"run.dir={run_dir}",
               f"data.cache_dir={work / 'cache'}", "log.console=none", "train.max_steps=30"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise BenchError(f"training the tiny model failed: {done.stderr.strip().splitlines()[-1:]}")
    return str(run_dir)


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    if args.model is not None and not Path(args.model).exists():
        raise UsageError(f"--model {args.model}: no such file or directory")
    if not 0 <= args.max_wait_ms <= 60_000:
        raise UsageError(f"--max-wait-ms {args.max_wait_ms:g}: expected milliseconds from 0 to 60000")
    model = args.model or train_tiny(work)
    variants = {
        "batching": ["--max-batch", str(args.max_batch), "--max-wait-ms", str(args.max_wait_ms)],
        "no batching": ["--max-batch", "1"],
    }
    figures: dict[str, dict[str, list[float]]] = {name: {} for name in variants}
    reference: list[dict[str, Any]] = []
    largest_diff = 0.0
    for rep, name in alternate(args.reps, list(variants)):
        server = start_server(model, variants[name], work / f"serve-{rep}-{name.replace(' ', '-')}.err")
        try:
            answers = single_answers(server.url, QUESTIONS)  # also the warm-up
            reference = reference or answers
            rss_before = server.rss_bytes()
            load = drive(server.url, args.clients, args.requests, QUESTIONS)
            rss_after = server.rss_bytes()
            connection = connect(server.url)
            _, health, _ = request(connection, "GET", "/healthz")
            connection.close()
        finally:
            code = server.stop()
        if code != 0:
            raise BenchError(f"{name}: elastic-qa serve exited {code} on SIGTERM (see {server.stderr_path})")
        errors = load.errors()
        wrong, diff = answer_differences(load, reference)
        if errors or wrong:
            raise BenchError(
                f"{name}: {len(errors)} errors, {len(wrong)} wrong answers: {(errors + wrong)[0]}"
            )
        largest_diff = max(largest_diff, diff)
        batches = max(health["batches"], 1)
        measured = {
            "p50_ms": load.percentile_ms(0.50),
            "p99_ms": load.percentile_ms(0.99),
            "requests_per_s": len(load.rows) / load.wall_s,
            "rss_before_mib": rss_before / 2**20,
            "rss_after_mib": rss_after / 2**20,
            "mean_batch": health["questions"] / batches,
        }
        for key, value in measured.items():
            figures[name].setdefault(key, []).append(value)
    stats = {name: {key: summary(values) for key, values in f.items()} for name, f in figures.items()}
    rows = []
    for key, label in LABELS.items():
        batched, single = stats["batching"][key]["median"], stats["no batching"][key]["median"]
        ratio = f"{batched / single:.2f}" if single else "-"
        rows.append(
            [label, show(stats["batching"][key], ".1f"), show(stats["no batching"][key], ".1f"), ratio]
        )
    print(f"model {model}; {args.clients} clients x {args.requests} requests, {args.reps} reps")
    print_table(
        ["", f"batching (max {args.max_batch}, {args.max_wait_ms:g} ms)", "no batching", "ratio"], rows
    )
    print(f"answers equal the single-request answers; largest score difference {largest_diff:.3g}")
    return {
        "model": model,
        "clients": args.clients,
        "requests": args.requests,
        "reps": args.reps,
        "max_batch": args.max_batch,
        "max_wait_ms": args.max_wait_ms,
        "largest_score_difference": largest_diff,
        "figures": stats,
        "median_p50_ms": {name: statistics.median(f["p50_ms"]) for name, f in figures.items()},
    }
