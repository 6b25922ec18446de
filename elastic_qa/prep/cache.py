"""Offline pre-tokenisation: the feature cache keyed by a hash of input and settings, built once.

Tokenising once instead of at every (re)start keeps restarts cheap. The cache is a directory of `.npy`
columns that every rank maps read-only (data.cache opens it), built as a stream by several processes
(prep.build) and published in one rename, so a reader never sees half a cache. A vocabulary the windows
need (data.tokenizer=wordpiece) is trained first and published with the columns. Ranks of one host queue
on a file lock; hosts sharing the directory meet at a lease file (prep.lease). `prepare` returns the
opened cache, building it first when no process has yet.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import itertools
import json
import os
import shutil
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any, Protocol

import fsspec

from elastic_qa.config import Config, DataConfig
from elastic_qa.data.cache import PreparedData, open_cache
from elastic_qa.data.examples import DataError, QAExample
from elastic_qa.data.features import Features
from elastic_qa.observe.log import get_logger
from elastic_qa.prep import synthetic
from elastic_qa.prep.build import Workers, build_split, default_workers
from elastic_qa.prep.duplicates import IdAdmission
from elastic_qa.prep.files import read_small
from elastic_qa.prep.lease import HOST, Lease, clean_stale_staging, lease, publish, read_holder
from elastic_qa.prep.sources import CHUNK_LINES, Chunk, ExampleReader, file_digest, parse_chunk, source_urls
from elastic_qa.prep.tables import hub_identity, is_hub
from elastic_qa.prep.tokenizer import Tokenizer
from elastic_qa.prep.windows import BuiltinFeaturizer

# Bump when windows.py, tokenizer.py, squad.py, sources.py, synthetic.py or the file layout (data/cache.py,
# data/examples.py's stored line) change.
# 5: int32 answer positions; duplicate question ids refused (or skipped).
# 6: a `lengths` column (padding ids are the tokenizer's own); features built by the model family.
# 7: streamed build; uint16 token ids when the vocabulary allows; offsets for the eval split only; eval
#    examples as indexed JSON Lines; token counts in meta.json; inputs may be several files.
CACHE_FORMAT = 7
WAIT_POLL_S = 0.2
WAIT_SAY_S = 30.0  # how often a wait for another builder says so again
INDEX_BYTES = 16 << 20  # content_hash's index: about 200 bytes a file version; larger is not one


class Featurizer(Protocol):
    """What turns examples into a model's windows (a `models.ModelFamily` is one); see its fields, and
    its optional `store_vocabulary`."""

    # Read-only: a ModelFamily is a frozen dataclass, and BuiltinFeaturizer has static methods.
    @property
    def tokenizer(self) -> Callable[[Config], Tokenizer]: ...
    @property
    def features(self) -> Callable[[list[QAExample], Config], Features]: ...
    @property
    def cache_identity(self) -> Callable[[Config], dict[str, Any]]: ...


def _resolve(config: Config | DataConfig, featurizer: Featurizer | None) -> tuple[Config, Featurizer]:
    """A bare data config, or no featurizer, stands for the built-in tokenizers (the native model)."""
    full = config if isinstance(config, Config) else Config(data=config)
    if featurizer is None:
        if full.model.kind != "native":
            raise ValueError(f"model.kind={full.model.kind!r}: prepare() needs the family's featurizer")
        featurizer = BuiltinFeaturizer()
    return full, featurizer


def _settings(cfg: Config, featurizer: Featurizer) -> dict:
    return {
        "format": CACHE_FORMAT,
        "model_kind": cfg.model.kind,
        "features": featurizer.cache_identity(cfg),
        # A cache built while skipping malformed records must not silence a strict run's error.
        "skip_malformed": cfg.data.skip_malformed if cfg.data.source != "synthetic" else None,
    }


def _split_sources(cfg: DataConfig) -> dict[str, str]:
    return {split: url for split, url in (("train", cfg.source), ("eval", cfg.eval_source)) if url}


def _chunks(cfg: DataConfig, split: str) -> tuple[IdAdmission | None, Iterator[Chunk]]:
    """A split's duplicate-id admission (None for the generator, whose examples are valid) and its
    chunks."""
    if cfg.source == "synthetic":
        syn = cfg.synthetic
        count = syn.train_examples if split == "train" else syn.eval_examples
        examples = synthetic.iter_examples(split, count, syn.seed, syn.unanswerable_fraction)
        batches = iter(lambda: list(itertools.islice(examples, CHUNK_LINES)), [])
        return None, (Chunk("synthetic", "examples", batch) for batch in batches)
    reader = ExampleReader(_split_sources(cfg)[split], cfg.skip_malformed)
    return reader.admission(), reader.chunks()


def _training_texts(cfg: DataConfig, beat: Callable[[], None]) -> Iterator[str]:
    """The training split's texts for a vocabulary: each distinct context once, and every question.

    Read chunk by chunk like the build (`beat` once per chunk); malformed records are left out here and
    reported by the build.
    """
    seen: set[bytes] = set()  # 16-byte digests: a few MB for millions of contexts
    for chunk in _chunks(cfg, "train")[1]:
        beat()
        for _, example in parse_chunk(chunk, skip_malformed=True).records:
            digest = hashlib.blake2b(example.context.encode(), digest_size=16).digest()
            if digest not in seen:
                seen.add(digest)
                yield example.context
            yield example.question


def content_hash(url: str, root: Path) -> str:
    """sha256 of a file's bytes, remembered per (url, the filesystem's ukey: size+mtime, or an ETag).

    Every worker (re)start asks for the cache key; without this index a restart would read the whole
    input again, from S3 if that is where it lives, just to find the cache it already has. A hub dataset
    is known by the hub's revision of it instead (a local directory, by its files' digests).
    """
    if is_hub(url):
        return hub_identity(url, file_digest)
    index_path = root / "content-hashes.json"
    try:
        fs, path = fsspec.core.url_to_fs(url)
        ukey = f"{url}|{fs.ukey(path)}"
    except FileNotFoundError:
        raise DataError(f"{url}: file not found") from None
    except (OSError, ValueError, ImportError, NotImplementedError):
        ukey = None
    index = _hash_index(index_path)
    if ukey is not None and ukey in index:
        return index[ukey]
    digest = file_digest(url)
    if ukey is not None:  # another process may have added entries meanwhile: merge, do not overwrite
        index = {**_hash_index(index_path), ukey: digest}
        staging = index_path.with_name(f"{index_path.name}.{HOST}-{os.getpid()}")
        try:  # only a shortcut: a read-only cache directory still serves the caches published in it
            staging.write_text(json.dumps(index))
            os.replace(staging, index_path)
        except OSError:
            with contextlib.suppress(OSError):
                staging.unlink()
    return digest


def _hash_index(path: Path) -> dict[str, str]:
    """content_hash's index ({} when it is missing or not one: a regular file of string pairs)."""
    try:
        index = json.loads(read_small(str(path), INDEX_BYTES))
    except (OSError, ValueError):
        return {}
    valid = isinstance(index, dict) and all(isinstance(v, str) for v in index.values())
    return index if valid else {}


def _identity(cfg: DataConfig, root: Path) -> dict:
    """What the inputs are, by content: the generator's settings, or each file's sha256 in order."""
    if cfg.source == "synthetic":
        return {"synthetic": asdict(cfg.synthetic)}
    root.mkdir(parents=True, exist_ok=True)
    return {
        split: [content_hash(url, root) for url in source_urls(spec)]
        for split, spec in _split_sources(cfg).items()
    }


def cache_key(config: Config | DataConfig, featurizer: Featurizer | None = None) -> str:
    """Hash of the input content and every setting that changes the features."""
    full, featurizer = _resolve(config, featurizer)
    identity = _identity(full.data, Path(full.data.cache_dir).expanduser())
    blob = json.dumps({"inputs": identity, "settings": _settings(full, featurizer)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def _build(full: Config, featurizer: Featurizer, key: str, final: Path, workers: int, held: Lease) -> None:
    """Build into a private staging directory and publish it with one rename (see publish)."""
    started = time.perf_counter()
    cfg = full.data
    staging = final.with_name(f"{final.name}.tmp-{HOST}-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    held.touched.append(staging)  # its age tells builders on other hosts that it is alive
    counts = {}
    pool = None
    try:  # whatever stops the build (bad data, a full disk, Ctrl-C) takes its half-written files along
        # A vocabulary the windows need is stored first, in this process: forked workers inherit it.
        store = getattr(featurizer, "store_vocabulary", None)
        built_with = store(full, lambda: _training_texts(cfg, held.beat), staging) if store else full
        tokenizer = featurizer.tokenizer(built_with)
        pool = Workers(featurizer, built_with, workers, held.beat)
        splits = ("train", "eval") if cfg.source == "synthetic" else tuple(_split_sources(cfg))
        for split in splits:
            admission, chunks = _chunks(cfg, split)
            evaluation = split == "eval"
            built = build_split(admission, chunks, pool, staging / split, tokenizer.vocab_size, evaluation)
            counts[split] = {**asdict(built), "skipped": admission.skipped if admission else 0}
        meta = {
            "key": key,
            "inputs": _identity(cfg, final.parent),
            "settings": _settings(full, featurizer),
            "counts": counts,
            "vocab_size": tokenizer.vocab_size,
        }
        (staging / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
        pool.close()
        published = publish(staging, final)
    except BaseException:
        if pool is not None:
            pool.close()
        shutil.rmtree(staging, ignore_errors=True)
        raise
    get_logger().info(
        "cache_built" if published else "cache_built_by_another",
        path=str(final),
        seconds=round(time.perf_counter() - started, 3),
        workers=workers,
        **{f"{s}_windows": c["windows"] for s, c in counts.items()},
    )


def _ready(final: Path) -> bool:
    return (final / "meta.json").exists()


def _build_once(
    full: Config, featurizer: Featurizer, key: str, final: Path, workers: int, waiting: BuildWait
) -> None:
    """Until the cache is published: build it if this process gets the lease, else wait for who has it
    (for data.build_wait at most, saying whom it waits for when it starts waiting and every WAIT_SAY_S)."""
    root = final.parent
    while not _ready(final):
        if final.exists():  # published caches are complete, so only an outside hand leaves this state
            raise DataError(
                f"feature cache {final} is damaged (no meta.json); delete that directory to rebuild"
            )
        with lease(waiting.path) as held:
            if held is not None and not _ready(final):
                clean_stale_staging(root, key)
                _build(full, featurizer, key, final, workers, held)
        if held is None:
            waiting.tick()
            time.sleep(WAIT_POLL_S)  # a Ctrl-C (KeyboardInterrupt) ends the wait here


class BuildWait:
    """A wait for another process's build of one cache: bounded, and said (who holds the lease, since when,
    why it counts as alive) when it starts and every WAIT_SAY_S, as a warning (a line on stderr)."""

    def __init__(self, path: Path, limit_s: float) -> None:
        self.path, self.limit_s = path, limit_s
        self.started: float | None = None
        self.say_at = 0.0  # seconds into the wait

    def tick(self) -> None:
        """Called after each try that found the lease held: raises DataError once data.build_wait is over."""
        now = time.monotonic()
        self.started = now if self.started is None else self.started
        waited = now - self.started
        if waited < self.say_at and waited < self.limit_s:
            return
        holder = read_holder(self.path)
        if holder is None or holder.verdict.gone:  # released, or broken by the next try: no wait to tell
            return
        if waited >= self.limit_s:
            raise DataError(
                f"waited {waited:.0f} s (data.build_wait) for the feature cache that {holder.describe()} "
                f"builds (lease {self.path}); that builder is alive, so its lease stands: let it finish, "
                "stop it, or raise data.build_wait"
            )
        get_logger().warning(
            "waiting_for_cache_build",
            holder=holder.describe(),
            lease=str(self.path),
            waited_s=round(waited),
            gives_up_in_s=round(self.limit_s - waited),
        )
        self.say_at = waited + WAIT_SAY_S


def prepare(
    config: Config | DataConfig, featurizer: Featurizer | None = None, workers: int | None = None
) -> PreparedData:
    """Return the cached features for `config`, building them first if no process has yet.

    `featurizer` is the model family's (`models.family_for(cfg.model)`); without one, the built-in
    tokenizers of the native model (a bare DataConfig means that too). `workers`: tokenising processes
    of a build (default data.prepare_workers; 0 there means one per CPU core); never part of the key.
    Opening an existing cache reads meta.json and maps the columns: its cost does not grow with the data.
    """
    full, featurizer = _resolve(config, featurizer)
    cfg = full.data
    root = Path(cfg.cache_dir).expanduser()
    try:
        key = cache_key(full, featurizer)
        root.mkdir(parents=True, exist_ok=True)
        final = root / key
        if not _ready(final):
            workers = workers or cfg.prepare_workers or default_workers()
            waiting = BuildWait(root / f"{key}.lease", full.data.build_wait.total_seconds())
            with _lock_file(root / f"{key}.lock") as lock:
                _queue_on(lock, waiting)
                _build_once(full, featurizer, key, final, workers, waiting)
    except OSError as err:
        if not _unwritable(err, root):
            raise
        raise DataError(
            f"data.cache_dir={cfg.cache_dir}: cannot write {err.filename} ({err.strerror}), and the "
            f"cache of these inputs and settings is not there yet"
        ) from None
    return open_cache(final, key)


# Errors that mean "this directory cannot be written as configured", not a passing storage fault.
_UNWRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR)
# flock that the filesystem does not provide: NFS without lockd (ENOLCK), some FUSE mounts (EOPNOTSUPP).
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)


def _unwritable(err: OSError, root: Path) -> bool:
    """The cache directory (or a file in it, or a parent being created) cannot be written; an input file
    that cannot be read is not this."""
    if err.errno not in _UNWRITABLE or err.filename is None:
        return False
    path, base = os.path.abspath(err.filename), os.path.abspath(root)
    return path == base or path.startswith(base + os.sep) or base.startswith(path + os.sep)


def _lock_file(path: Path) -> IO[bytes]:
    """The host's queue file, created or opened without following a link or waiting on a FIFO (O_NONBLOCK
    opens one at once); DataError unless it is a regular file."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as err:
        if err.errno != errno.ELOOP:
            raise
        fd = None
    if fd is None or not stat.S_ISREG(os.fstat(fd).st_mode):
        if fd is not None:
            os.close(fd)
        raise DataError(f"data.cache_dir: {path} is not a regular file, so never a build's lock (remove it)")
    return os.fdopen(fd, "r+b")


def _queue_on(lock: IO[bytes], waiting: BuildWait) -> None:
    """Ranks of one host queue here; hosts sharing the directory meet at the lease (see lease.py). Where
    the filesystem has no flock, the lease alone keeps a second builder out, as it does across hosts.

    The queue is polled, not a blocking flock: whoever is ahead holds the lease while it builds, so the
    wait is told and bounded by `waiting` (data.build_wait) like a wait at the lease, and Ctrl-C ends it."""
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            waiting.tick()
            time.sleep(WAIT_POLL_S)
        except OSError as err:
            if err.errno not in _NO_FLOCK:
                raise
            get_logger().info("cache_flock_unsupported", error=err.strerror, fallback="lease")
            return
