"""Offline pre-tokenisation: a memory-mapped feature cache keyed by a hash of input and settings.

Tokenising once instead of at every (re)start keeps restarts cheap. The cache is a directory of
`.npy` columns that every rank maps read-only (the page cache shares them between processes). Several
processes may ask for the same cache at once: one builds it under an exclusive file lock while the others
wait on the lock, and the finished directory appears in one rename, so a reader never sees half a cache.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import fsspec
import numpy as np

from elastic_qa.config import Config, DataConfig
from elastic_qa.data import synthetic
from elastic_qa.data.features import BuiltinFeaturizer, Features
from elastic_qa.data.squad import Answer, DataError, QAExample, decode_json, parse_squad, read_bytes
from elastic_qa.observe.log import get_logger

# Bump when features.py, tokenizer.py, squad.py or synthetic.py change what they produce.
# 5: int32 answer positions; duplicate question ids refused (or skipped).
# 6: a `lengths` column (padding ids are the tokenizer's own); features built by the model family.
CACHE_FORMAT = 6


@dataclass
class PreparedData:
    key: str
    path: Path
    train: Features
    eval: Features | None
    eval_examples: list[QAExample]
    vocab_size: int
    skipped: dict[str, int] = field(default_factory=dict)  # malformed records skipped, per split


class Featurizer(Protocol):
    """What turns examples into a model's windows (a `models.ModelFamily` is one); see its fields."""

    tokenizer: Any
    features: Any
    cache_identity: Any


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


def _load_sources(cfg: DataConfig) -> tuple[dict, dict[str, list[QAExample]], dict[str, int]]:
    """Identity of the inputs (for the key), the parsed examples and the skipped records per split."""
    if cfg.source == "synthetic":
        syn = cfg.synthetic
        identity = {"synthetic": asdict(syn)}
        splits = {
            "train": synthetic.generate("train", syn.train_examples, syn.seed, syn.unanswerable_fraction),
            "eval": synthetic.generate("eval", syn.eval_examples, syn.seed, syn.unanswerable_fraction),
        }
        return identity, splits, {}
    identity, splits, skipped = {}, {}, {}
    for split, url in (("train", cfg.source), ("eval", cfg.eval_source)):
        if not url:
            continue
        raw = read_bytes(url)
        identity[split] = hashlib.sha256(raw).hexdigest()
        splits[split], skipped[split] = parse_squad(decode_json(raw, url), url, cfg.skip_malformed)
    return identity, splits, skipped


def content_hash(url: str, root: Path) -> str:
    """sha256 of a file's bytes, remembered per (url, the filesystem's ukey: size+mtime, or an ETag).

    Every worker (re)start asks for the cache key; without this index a restart would read the whole
    input again, from S3 if that is where it lives, just to find the cache it already has.
    """
    index_path = root / "content-hashes.json"
    try:
        fs, path = fsspec.core.url_to_fs(url)
        ukey = f"{url}|{fs.ukey(path)}"
    except FileNotFoundError:
        raise DataError(f"{url}: file not found") from None
    except (OSError, ValueError, ImportError, NotImplementedError):
        ukey = None
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    if ukey is not None and ukey in index:
        return index[ukey]
    digest = hashlib.sha256(read_bytes(url)).hexdigest()
    if ukey is not None:
        index[ukey] = digest
        staging = index_path.with_name(f"{index_path.name}.{os.getpid()}")
        staging.write_text(json.dumps(index))
        os.replace(staging, index_path)
    return digest


def cache_key(config: Config | DataConfig, featurizer: Featurizer | None = None) -> str:
    """Hash of the input content and every setting that changes the features."""
    full, featurizer = _resolve(config, featurizer)
    cfg = full.data
    if cfg.source == "synthetic":
        identity = {"synthetic": asdict(cfg.synthetic)}
    else:
        root = Path(cfg.cache_dir).expanduser()
        root.mkdir(parents=True, exist_ok=True)
        identity = {
            split: content_hash(url, root)
            for split, url in (("train", cfg.source), ("eval", cfg.eval_source))
            if url
        }
    blob = json.dumps({"inputs": identity, "settings": _settings(full, featurizer)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def _write_split(directory: Path, features: Features) -> None:
    directory.mkdir(parents=True)
    for column in Features.COLUMNS:
        np.save(directory / f"{column}.npy", getattr(features, column))


def _read_split(directory: Path) -> Features:
    return Features(**{c: np.load(directory / f"{c}.npy", mmap_mode="r") for c in Features.COLUMNS})


def _examples_to_json(examples: list[QAExample]) -> list[dict]:
    return [
        {
            "id": e.id,
            "question": e.question,
            "context": e.context,
            "answers": [[a.text, a.start] for a in e.answers],
        }
        for e in examples
    ]


def _examples_from_json(rows: list[dict]) -> list[QAExample]:
    return [
        QAExample(r["id"], r["question"], r["context"], tuple(Answer(t, s) for t, s in r["answers"]))
        for r in rows
    ]


def _build(full: Config, featurizer: Featurizer, key: str, final: Path) -> None:
    """Build under the key's lock: any `<key>.tmp-*` left is from a builder that died (SIGKILL)."""
    started = time.perf_counter()
    cfg = full.data
    identity, splits, skipped = _load_sources(cfg)
    tokenizer = featurizer.tokenizer(full)
    for stale in final.parent.glob(f"{final.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    staging = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    staging.mkdir(parents=True)
    counts = {}
    try:  # whatever stops the build (bad data, a full disk, Ctrl-C) takes its half-written files along
        for split, examples in splits.items():
            features = featurizer.features(examples, full)
            _write_split(staging / split, features)
            counts[split] = {
                "examples": len(examples),
                "windows": len(features),
                "skipped": skipped.get(split, 0),
            }
        if "eval" in splits:
            (staging / "eval_examples.json").write_text(json.dumps(_examples_to_json(splits["eval"])))
        meta = {
            "key": key,
            "inputs": identity,
            "settings": _settings(full, featurizer),
            "counts": counts,
            "vocab_size": tokenizer.vocab_size,
        }
        (staging / "meta.json").write_text(json.dumps(meta, indent=1))
        os.replace(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    get_logger().info(
        "cache_built",
        path=str(final),
        seconds=round(time.perf_counter() - started, 3),
        **{f"{s}_windows": c["windows"] for s, c in counts.items()},
    )


def prepare(config: Config | DataConfig, featurizer: Featurizer | None = None) -> PreparedData:
    """Return the cached features for `config`, building them first if no process has yet.

    `featurizer` is the model family's (`models.family_for(cfg.model)`); without one, the built-in
    tokenizers of the native model (a bare DataConfig means that too).
    """
    full, featurizer = _resolve(config, featurizer)
    cfg = full.data
    key = cache_key(full, featurizer)
    root = Path(cfg.cache_dir).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    final = root / key
    if not (final / "meta.json").exists():
        with open(root / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the first process builds; the others wait here
            if not (final / "meta.json").exists():
                if final.exists():  # the rename is atomic, so only an outside hand leaves this state
                    raise DataError(
                        f"feature cache {final} is damaged (no meta.json); delete that directory to rebuild"
                    )
                _build(full, featurizer, key, final)
    try:
        meta = json.loads((final / "meta.json").read_text())
        eval_examples = []
        if (final / "eval_examples.json").exists():
            eval_examples = _examples_from_json(json.loads((final / "eval_examples.json").read_text()))
        return PreparedData(
            key=key,
            path=final,
            train=_read_split(final / "train"),
            eval=_read_split(final / "eval") if (final / "eval").exists() else None,
            eval_examples=eval_examples,
            vocab_size=int(meta["vocab_size"]),
            skipped={split: int(c.get("skipped", 0)) for split, c in meta.get("counts", {}).items()},
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise DataError(
            f"feature cache {final} is damaged ({err}); delete that directory to rebuild"
        ) from None
