"""Streaming, parallel feature building: files in, `.npy` columns out, memory bounded by a few chunks.

The reading process cuts the input into chunks of raw records (prep.sources); each chunk is validated and
turned into windows with the model family's `features` (a pure function of a batch of examples); the
reading process drops repeated question ids and appends the windows to the columns in chunk order. Chunks
depend on the input alone, so any number of workers gives byte-identical files.

With N workers the reading process is one of them: it hands chunks to N-1 helper processes while they
have room and tokenises the next one itself when they have none, so N workers keep N cores busy (not N
helpers competing with a reader for the same cores). At most two chunks per helper are in flight, and
results are written in chunk order: the reader never runs far ahead of the writer. Chunks and results
travel through one pipe per helper and direction, handled by the reading process's only thread; each
pipe is widened to hold a few results, so a helper that finished never waits for the reader to take its
result, and the reader never waits for a helper to take a chunk.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import multiprocessing
import os
import pickle
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from elastic_qa.data.examples import QAExample
from elastic_qa.data.features import Features
from elastic_qa.prep.columns import ColumnWriter, ExampleWriter
from elastic_qa.prep.duplicates import IdAdmission
from elastic_qa.prep.sources import Chunk, parse_chunk

IN_FLIGHT_PER_WORKER = 2
F_SETPIPE_SZ = 1031  # fcntl's name for it on Linux (Python 3.10+ has fcntl.F_SETPIPE_SZ)
PIPE_BYTES = 1 << 20  # Linux's default ceiling for an unprivileged process (/proc/sys/fs/pipe-max-size)
INLINE_CHUNKS = 4  # done in the reading process before worker processes are worth starting

# Columns written per split: training never reads the character offsets (by far the largest column).
TRAIN_COLUMNS = tuple(c for c in Features.COLUMNS if c != "offsets")
EVAL_COLUMNS = Features.COLUMNS


def default_workers() -> int:
    """Processes that tokenise: one per CPU core this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def ids_dtype(vocab_size: int) -> np.dtype:
    """The narrowest type that holds every token id of a vocabulary."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.int32)


@dataclass
class SplitCounts:
    examples: int = 0
    windows: int = 0
    tokens: int = 0  # real (non-padding) tokens over all windows


@dataclass
class Done:
    """A chunk's result, as sent back to the reading process."""

    url: str
    names: list[tuple[str, str]]  # (record name, question id) per example
    skipped: int
    error: str | None
    features: Features | None
    examples: list[QAExample] | None  # only when the split keeps them (evaluation)


def work(chunk: Chunk, featurizer: Any, cfg: Any, evaluation: bool) -> Done:
    """Validate a chunk and build its windows (in a worker process, or inline)."""
    parsed = parse_chunk(chunk, cfg.data.skip_malformed)
    examples = [example for _, example in parsed.records]
    features = featurizer.features(examples, cfg) if examples else None
    if features is not None and not evaluation:
        features.offsets = None  # not stored: not worth sending back
    return Done(
        chunk.url, parsed.names(), parsed.skipped, parsed.error, features, examples if evaluation else None
    )


class _Failed:
    """What a helper sends back instead of a Done when `work` raised: the exception, or its text when it
    does not pickle."""

    def __init__(self, error: BaseException) -> None:
        try:
            pickle.dumps(error)
            self.error: BaseException = error
        except Exception:  # noqa: BLE001 - whatever stops it pickling, the text still goes
            self.error = RuntimeError(f"in a tokenising worker: {error!r}")


def _serve(tasks: Connection, results: Connection, featurizer: Any, cfg: Any, inherited: list) -> None:
    """A helper process: chunks in, results out, in order, until told to stop or its parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent decides
    # A fork inherits the parent's SIGTERM handler (a benchmark's turns SIGTERM into KeyboardInterrupt):
    # the parent's terminate() at the end of a build must end a helper quietly, not with a traceback.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for connection in inherited:  # the parent's ends (a fork copies them): EOF must reach us when it dies
        connection.close()
    while True:
        try:
            message = tasks.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        chunk, evaluation = message
        try:
            outcome: Done | _Failed = work(chunk, featurizer, cfg, evaluation)
        except BaseException as err:  # noqa: BLE001 - sent back, raised by the parent as if it did the chunk
            outcome = _Failed(err)
        try:
            results.send(outcome)
        except OSError:  # the parent is gone
            return


def _widen(connection: Connection) -> None:
    """Give a pipe room for a few chunks' results (Linux; elsewhere the default stays), so that a helper
    that finished never waits for the reading process to be free to take its result."""
    with contextlib.suppress(OSError, AttributeError):
        fcntl.fcntl(connection.fileno(), F_SETPIPE_SZ, PIPE_BYTES)


class _Helper:
    """One helper process with its two pipes; results come back in the order the chunks went out."""

    def __init__(self, context: Any, featurizer: Any, cfg: Any, parents_ends: list[Connection]) -> None:
        task_out, task_in = context.Pipe(duplex=False)
        result_out, result_in = context.Pipe(duplex=False)
        for end in (task_in, result_in):
            _widen(end)
        inherited = [*parents_ends, task_in, result_out] if context.get_start_method() == "fork" else []
        self.process = context.Process(
            target=_serve, args=(task_out, result_in, featurizer, cfg, inherited), daemon=True
        )
        self.process.start()
        task_out.close()
        result_in.close()
        self.tasks, self.results = task_in, result_out
        self.sent = 0  # chunks sent and not yet received
        self.received: collections.deque[Done] = collections.deque()

    def send(self, chunk: Chunk, evaluation: bool) -> None:
        self.tasks.send((chunk, evaluation))
        self.sent += 1

    def collect(self) -> None:
        """Take every result already waiting in the pipe, without blocking."""
        while self.sent and self.results.poll():
            self.receive()

    def receive(self) -> None:
        try:
            outcome = self.results.recv()
        except (EOFError, OSError):
            self.process.join(1.0)
            raise RuntimeError(
                f"a tokenising worker process died (exit code {self.process.exitcode})"
            ) from None
        self.sent -= 1
        if isinstance(outcome, _Failed):
            raise outcome.error
        self.received.append(outcome)

    def next_result(self) -> Done:
        while not self.received:
            self.receive()
        return self.received.popleft()

    def stop(self) -> None:
        for connection in (self.tasks, self.results):
            connection.close()
        if self.process.is_alive():
            self.process.terminate()
        self.process.join()


class Workers:
    """`work` on each chunk, results in chunk order: in this process, and in N-1 helpers when N > 1.

    Everything runs in this process's one thread: chunks go out and results come back through a pipe per
    helper and direction. (A multiprocessing.Pool moves them with threads of its own, which here wait for
    the interpreter lock while this thread tokenises: a helper sat idle 45% of a build.)
    """

    def __init__(
        self, featurizer: Any, cfg: Any, workers: int, beat: Callable[[], None] = lambda: None
    ) -> None:
        self.featurizer, self.cfg, self.workers = featurizer, cfg, workers
        self.beat = beat  # called once per chunk (the build lease's heartbeat)
        self.helpers: list[_Helper] = []
        self.inline = 0

    def _start_helpers(self) -> None:
        # fork shares the featurizer without pickling it and starts in milliseconds; with other threads
        # alive (a fork would copy their locks mid-use), a fresh interpreter per worker.
        method = "fork" if threading.active_count() == 1 and os.name == "posix" else "spawn"
        context = multiprocessing.get_context(method)
        for _ in range(self.workers - 1):
            ends = [end for helper in self.helpers for end in (helper.tasks, helper.results)]
            self.helpers.append(_Helper(context, self.featurizer, self.cfg, ends))

    def _with_room(self) -> _Helper | None:
        helper = min(self.helpers, key=lambda h: h.sent, default=None)
        return helper if helper is not None and helper.sent < IN_FLIGHT_PER_WORKER else None

    def map(self, chunks: Iterable[Chunk], evaluation: bool) -> Iterator[Done]:
        # In chunk order: the helper that has the chunk, or the Done this process made itself.
        pending: collections.deque[Done | _Helper] = collections.deque()
        room = (IN_FLIGHT_PER_WORKER + 1) * self.workers
        for chunk in chunks:
            self.beat()
            if self.workers > 1 and self.inline >= INLINE_CHUNKS and not self.helpers:
                self._start_helpers()
            for helper in self.helpers:
                helper.collect()
            chosen = self._with_room()
            if chosen is not None:
                chosen.send(chunk, evaluation)
                pending.append(chosen)
            else:  # one worker, the first few chunks (not worth a process), or every helper is busy
                self.inline += 1
                pending.append(work(chunk, self.featurizer, self.cfg, evaluation))
            while pending and (isinstance(pending[0], Done) or pending[0].received):
                yield _result(pending.popleft())
            if len(pending) > room:  # a slow chunk at the head: wait for it (memory stays bounded)
                yield _result(pending.popleft())
        while pending:
            yield _result(pending.popleft())

    def close(self) -> None:
        for helper in self.helpers:  # also on error: nothing is left running
            helper.stop()
        self.helpers = []


def _result(item: Done | _Helper) -> Done:
    return item if isinstance(item, Done) else item.next_result()


def _kept(features: Features, keep: list[bool]) -> Features:
    """The windows of the kept examples, `example_index` renumbered over them."""
    mask = np.asarray(keep)
    renumber = np.cumsum(mask) - 1
    rows = mask[features.example_index]
    columns: dict[str, Any] = {  # the Features fields: arrays, or None for absent offsets
        c: None if getattr(features, c) is None else getattr(features, c)[rows] for c in Features.COLUMNS
    }
    columns["example_index"] = renumber[features.example_index[rows]].astype(np.int32)
    return Features(**columns)


def build_split(
    admission: IdAdmission | None,
    chunks: Iterable[Chunk],
    workers: Workers,
    directory: Path,
    vocab_size: int,
    evaluation: bool,
) -> SplitCounts:
    """Write one split's columns (and, for evaluation, its examples) into `directory`.

    `admission` drops repeated ids and counts what was skipped (None: the examples are known valid).
    """
    directory.mkdir(parents=True)
    columns = EVAL_COLUMNS if evaluation else TRAIN_COLUMNS
    writers: dict[str, ColumnWriter] = {}
    stored = ExampleWriter(directory) if evaluation else None
    counts = SplitCounts()
    id_type = ids_dtype(vocab_size)
    try:
        for done in workers.map(chunks, evaluation):
            keep = [True] * len(done.names)
            if admission is not None:
                keep = admission.admit(done.url, done.names, done.skipped, done.error)
            if done.features is None or not any(keep):
                continue
            features = done.features if all(keep) else _kept(done.features, keep)
            if len(features) and int(features.input_ids.max()) >= vocab_size:
                raise ValueError(f"a token id is >= the tokenizer's vocab_size {vocab_size}")
            shifted = {"example_index": features.example_index + counts.examples}
            for name in columns:
                rows = shifted.get(name, getattr(features, name))
                if name not in writers:
                    dtype = id_type if name == "input_ids" else rows.dtype
                    writers[name] = ColumnWriter(directory / f"{name}.npy", dtype, rows.shape[1:])
                writers[name].append(rows)
            if stored is not None and done.examples is not None:
                stored.append([e for e, k in zip(done.examples, keep, strict=True) if k])
            counts.examples += sum(keep)
            counts.windows += len(features)
            counts.tokens += int(features.lengths.sum())
        if admission is not None:
            admission.finish()
    finally:
        for writer in writers.values():
            writer.close()
        if stored is not None:
            stored.close()
    return counts
