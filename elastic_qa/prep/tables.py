"""Tabular sources: Parquet and Arrow files, `datasets` save_to_disk directories, hub datasets.

Rows follow the SQuAD schema of the hub's squad/squad_v2 datasets: `id`, `title` (optional, unused),
`context`, `question`, `answers` as `{text: [...], answer_start: [...]}` (empty lists: unanswerable) or as a
list of `{text, answer_start}`; an `is_impossible` column, when present, says so explicitly.

Files are read one record batch at a time (Parquet: `iter_batches`; Arrow: the IPC stream format that
`datasets` writes, or the IPC file format), never a whole table. pyarrow and datasets are imported only
when such a source is read: `pip install 'elastic-qa[datasets]'`.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import re
from collections.abc import Callable, Iterator
from typing import IO, Any

import fsspec

from elastic_qa.data.examples import DataError, QAExample
from elastic_qa.prep.files import inside, is_local, read_small
from elastic_qa.prep.squad import parse_qa, require_text

TABLE_SUFFIXES = (".parquet", ".arrow", ".feather")
HUB_PREFIX = "hub:"
ROW_COLUMNS = ("id", "question", "context", "answers")
_SPLIT_NAME = re.compile(r"[\w.-]+")
_EXTRA = "pip install 'elastic-qa[datasets]'"
METADATA_BYTES = 16 << 20  # a state.json names a few files per GB of data: kilobytes


def needs(module: str, what: str) -> Any:
    """An optional dependency, imported now; absent -> DataError naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"{what}: reading it needs {module.split('.')[0]} ({_EXTRA})") from None


def is_table(url: str) -> bool:
    return url.lower().endswith(TABLE_SUFFIXES)


def is_hub(entry: str) -> bool:
    return entry.startswith(HUB_PREFIX)


def record_batches(url: str, handle: IO[bytes], rows: int) -> Iterator[Any]:
    """A Parquet or Arrow file's rows as pyarrow RecordBatches of at most `rows` rows, in file order."""
    if url.lower().endswith(".parquet"):
        parquet = needs("pyarrow.parquet", url)
        yield from parquet.ParquetFile(handle).iter_batches(batch_size=rows)
        return
    ipc = needs("pyarrow.ipc", url)
    magic = handle.read(6)
    handle.seek(0)
    if magic == b"ARROW1":  # the IPC file format (Feather v2); `datasets` writes the stream format
        reader = ipc.open_file(handle)
        batches: Iterator[Any] = (reader.get_batch(i) for i in range(reader.num_record_batches))
    else:
        batches = iter(ipc.open_stream(handle))
    for batch in batches:  # `datasets` writes 1,000-row batches, other writers any size
        for start in range(0, batch.num_rows, rows):
            yield batch.slice(start, rows)


def to_ipc(batch: Any) -> bytes:
    """A record batch as Arrow IPC stream bytes: what a chunk carries to a worker process. (Pickling a
    slice would carry its parent's whole buffers, four times the rows of a `datasets` batch.)"""
    import pyarrow

    sink = pyarrow.BufferOutputStream()
    with pyarrow.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return bytes(sink.getvalue())


def ipc_rows(data: bytes) -> list[dict[str, Any]]:
    """The rows of `to_ipc`'s bytes, as Python values."""
    import pyarrow

    return pyarrow.ipc.open_stream(data).read_all().to_pylist()


def read_errors() -> tuple[type[BaseException], ...]:
    """What pyarrow raises for a file that is not what its name says (pyarrow is installed by now)."""
    import pyarrow

    return (pyarrow.ArrowException, OSError, ValueError)


def row_example(row: dict[str, Any]) -> QAExample:
    """A SQuAD-schema row's example; ValueError says what is wrong with it."""
    for column in ROW_COLUMNS:
        if column not in row:
            raise ValueError(f"no '{column}' column (columns: {', '.join(row)})")
    context = row["context"]
    if not isinstance(context, str) or not context.strip():
        raise ValueError("'context' must be a non-empty string")
    require_text(context, "'context'")
    answers = row["answers"]
    if isinstance(answers, dict):  # the hub's layout: parallel lists
        texts, starts = answers.get("text"), answers.get("answer_start")
        if not isinstance(texts, list) or not isinstance(starts, list) or len(texts) != len(starts):
            raise ValueError("'answers' needs lists 'text' and 'answer_start' of one length")
        answers = [{"text": t, "answer_start": s} for t, s in zip(texts, starts, strict=True)]
    elif not isinstance(answers, list):
        raise ValueError(
            "'answers' must be {text: [...], answer_start: [...]} or a list of {text, answer_start}"
        )
    impossible = row.get("is_impossible")
    qa = {
        "id": row["id"],
        "question": row["question"],
        "answers": answers,
        "is_impossible": not answers if impossible is None else impossible,
    }
    return parse_qa(qa, context)


def saved_dataset_files(entry: str) -> list[str] | None:
    """The Arrow files of a `datasets` save_to_disk directory, `DIR` (a Dataset) or `DIR:SPLIT` (a split
    of a DatasetDict), in order; None when `entry` names no directory (a file, or nothing). The names its
    JSON files give (splits, data files) must stay inside it: they are the directory's, not this run's."""
    base, split = entry, None
    head, colon, tail = entry.rpartition(":")
    if colon and head and _SPLIT_NAME.fullmatch(tail):
        base, split = head, tail
    try:
        fs, path = fsspec.core.url_to_fs(base)
        if not fs.isdir(path):
            return None
        path = path.rstrip("/")
        if fs.exists(f"{path}/dataset_dict.json"):
            splits = _names(_json(fs, path, "dataset_dict.json", entry), "splits", entry)
            if split is None:
                raise DataError(
                    f"{entry}: a DatasetDict directory (splits: {_listed(splits)}): name one, "
                    f"e.g. {entry}:{_listed(splits[:1]) or 'train'}"
                )
            if split not in splits:
                raise DataError(f"{entry}: no split {split!r} (splits: {_listed(splits)})")
            where = f"{entry}: dataset_dict.json's splits[{splits.index(split)}]"
            path = inside(fs, path, split, where)
        elif split is not None:
            raise DataError(f"{entry}: {base} holds one dataset, not a DatasetDict: drop ':{split}'")
        if not fs.exists(f"{path}/state.json"):
            raise DataError(f"{entry}: a directory, not a file or a `datasets` save_to_disk directory")
        paths = _data_files(fs, path, _json(fs, path, "state.json", entry), entry)
    except DataError:
        raise
    except (OSError, ValueError, ImportError) as err:
        raise DataError(f"{entry}: cannot read ({err})") from None
    if not paths:
        raise DataError(f"{entry}: state.json lists no data files")
    return paths if is_local(fs) else [fs.unstrip_protocol(f) for f in paths]


def _names(document: dict[str, Any], key: str, entry: str) -> list[str]:
    """A list of names in dataset_dict.json (a string is not a list of its letters)."""
    names = document.get(key, [])
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise DataError(f"{entry}: dataset_dict.json's {key} is {_shown(names)}, not a list of names")
    return names


def _data_files(fs: Any, directory: str, state: dict[str, Any], entry: str) -> list[str]:
    """The paths of the Arrow files state.json lists, each checked to be a name inside `directory`."""
    files = state.get("_data_files", [])
    if not isinstance(files, list):
        raise DataError(f"{entry}: state.json's _data_files is {_shown(files)}, not a list of objects")
    paths = []
    for i, item in enumerate(files):
        field = f"state.json's _data_files[{i}]"
        if not isinstance(item, dict):
            raise DataError(f"{entry}: {field} is {_shown(item)}, not an object with a filename")
        paths.append(inside(fs, directory, item.get("filename"), f"{entry}: {field}.filename"))
    return paths


_JSON_KINDS = {str: "a string", dict: "an object", list: "a list", bool: "a boolean", int: "a number"}


def _shown(value: Any) -> str:
    """A JSON value in an error line: what kind it is, and the value itself when it is short."""
    kind = "null" if value is None else _JSON_KINDS.get(type(value), "a number")
    text = json.dumps(value)
    return f"{kind} ({text})" if value is not None and len(text) <= 40 else kind


def _listed(names: list[str]) -> str:
    """Split names for an error line (one line whatever the names hold)."""
    return ", ".join(name if name.isprintable() else repr(name) for name in names)


def _json(fs: Any, directory: str, name: str, entry: str) -> dict[str, Any]:
    """A `datasets` JSON file of `directory`: a regular file inside it, of at most METADATA_BYTES, holding
    an object."""
    path = inside(fs, directory, name, f"{entry}:")
    try:
        document = json.loads(read_small(fs.unstrip_protocol(path), METADATA_BYTES))
    except (OSError, ValueError) as err:
        raise DataError(f"{entry}: cannot read {name} ({err})") from None
    if not isinstance(document, dict):
        raise DataError(f"{entry}: {name} is not a JSON object")
    return document


def parse_hub(entry: str) -> tuple[str, str | None, str]:
    """`hub:PATH:SPLIT` or `hub:PATH:CONFIG:SPLIT` -> (path, config, split)."""
    parts = entry[len(HUB_PREFIX) :].split(":")
    if len(parts) not in (2, 3) or not all(parts):
        raise DataError(f"{entry}: expected hub:DATASET:SPLIT or hub:DATASET:CONFIG:SPLIT")
    return parts[0], parts[1] if len(parts) == 3 else None, parts[-1]


def _unreachable(entry: str, err: BaseException) -> DataError:
    reason = " ".join(f"{type(err).__name__}: {err}".split())
    return DataError(
        f"{entry}: could not load it from the Hugging Face hub ({reason[:300]}); where the hub cannot be "
        f"reached, save the dataset elsewhere (load_dataset(...).save_to_disk(DIR)), copy DIR here and set "
        f"the source to DIR (DIR:SPLIT for a DatasetDict)"
    )


def hub_rows(entry: str) -> Iterator[dict[str, Any]]:
    """A hub dataset's rows, streamed by `datasets.load_dataset(..., streaming=True)`. PATH may also be a
    local directory of data files, which `load_dataset` reads without the hub."""
    path, config, split = parse_hub(entry)
    datasets = needs("datasets", entry)
    try:
        yield from datasets.load_dataset(path, config, split=split, streaming=True)
    except Exception as err:  # noqa: BLE001 - the hub client raises its HTTP library's errors, not OSError
        raise _unreachable(entry, err) from None


def hub_identity(entry: str, file_digest: Callable[[str], str]) -> str:
    """What a hub source's content is: a local directory's files' digests, else the hub's revision."""
    path, config, split = parse_hub(entry)
    if os.path.isdir(path):
        digest = hashlib.sha256(f"{config}:{split}".encode())
        for root, dirs, files in os.walk(path):
            dirs.sort()
            for name in sorted(files):
                file = os.path.join(root, name)
                digest.update(f"{os.path.relpath(file, path)}:{file_digest(file)}\n".encode())
        return digest.hexdigest()
    hub = needs("huggingface_hub", entry)
    try:
        revision = hub.HfApi().dataset_info(path).sha
    except Exception as err:  # noqa: BLE001 - as in hub_rows
        raise _unreachable(entry, err) from None
    return f"{path}@{revision}:{config}:{split}"
