"""A data source: one or several files (paths or fsspec URLs, globs), SQuAD JSON or JSON Lines, read as a
stream of validated examples.

`data.source` is a comma-separated list; each entry may be a glob (its matches in sorted order). A file
whose name ends in `.jsonl` or `.ndjson` (optionally compressed, e.g. `.jsonl.gz`) holds one question a
line: `{"id", "question", "context", "answers": [{"text", "answer_start"}], "is_impossible"?}`; any other
file is SQuAD v1.1/v2.0 JSON, read one article at a time (data.stream). Compression is inferred from the
name. Question ids are unique over all files of a source.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
from collections.abc import Iterator
from typing import IO, Any

import fsspec

from elastic_qa.data.squad import (
    DataError,
    QAExample,
    Tally,
    named,
    parse_qa,
    require_text,
    squad_records,
    unique,
    warn_skipped,
)
from elastic_qa.data.stream import JSONStreamError, squad_articles

_JSONL_SUFFIXES = (".jsonl", ".ndjson")


def source_urls(source: str) -> list[str]:
    """The files of a source, in order: comma-separated entries, a glob's matches sorted."""
    urls: list[str] = []
    for entry in (part.strip() for part in source.split(",")):
        if not entry:
            continue
        if not glob.has_magic(entry):
            urls.append(entry)
            continue
        try:
            fs, pattern = fsspec.core.url_to_fs(entry)
            matches = sorted(fs.glob(pattern))
        except (OSError, ValueError, ImportError) as err:
            raise DataError(f"{entry}: cannot list ({err})") from None
        if not matches:
            raise DataError(f"{entry}: no file matches")
        local = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
        urls += [m if local else fs.unstrip_protocol(m) for m in matches]
    if not urls:
        raise DataError(f"{source!r}: names no file")
    return urls


def is_jsonl(url: str) -> bool:
    name = url.lower()
    for compressed in (".gz", ".bz2", ".xz", ".zst", ".lz4"):
        name = name.removesuffix(compressed)
    return name.endswith(_JSONL_SUFFIXES)


@contextlib.contextmanager
def open_source(url: str) -> Iterator[IO[bytes]]:
    """The file's bytes (decompressed if its name says so); unreadable -> DataError naming it."""
    try:
        with fsspec.open(url, "rb", compression="infer") as handle:
            yield handle
    except FileNotFoundError:
        raise DataError(f"{url}: file not found") from None
    except (OSError, EOFError, ImportError) as err:
        raise DataError(f"{url}: cannot read ({err})") from None


def file_digest(url: str) -> str:
    """sha256 of a file's stored bytes, read in chunks."""
    digest = hashlib.sha256()
    try:
        with fsspec.open(url, "rb") as handle:
            while chunk := handle.read(1 << 22):
                digest.update(chunk)
    except FileNotFoundError:
        raise DataError(f"{url}: file not found") from None
    except (OSError, ValueError, ImportError) as err:
        raise DataError(f"{url}: cannot read ({err})") from None
    return digest.hexdigest()


def _squad_file(url: str, skip_malformed: bool, tally: Tally) -> Iterator[tuple[str, QAExample]]:
    with open_source(url) as handle:
        try:
            yield from squad_records(url, squad_articles(handle), skip_malformed, tally)
        except JSONStreamError as err:
            raise DataError(f"{url}: {err}") from None


def _jsonl_record(line: bytes) -> QAExample:
    try:
        text = line.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise ValueError(f"not UTF-8 text (byte {err.start} of the line)") from None
    try:
        raw: Any = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"not valid JSON (column {err.colno}: {err.msg})") from None
    except RecursionError:
        raise ValueError("JSON nested too deeply to read") from None
    context = raw.get("context") if isinstance(raw, dict) else None
    if not isinstance(context, str) or not context.strip():
        raise ValueError("expected an object with a non-empty string 'context'")
    require_text(context, "'context'")
    return parse_qa(raw, context)


def _jsonl_file(url: str, skip_malformed: bool, tally: Tally) -> Iterator[tuple[str, QAExample]]:
    with open_source(url) as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                yield f"line {number}", _jsonl_record(line)
            except (ValueError, RecursionError) as err:
                if not skip_malformed:
                    raw = _loose(line)
                    raise DataError(f"{url}: {named(f'line {number}', raw)}: {err}") from None
                tally.skipped += 1


def _loose(line: bytes) -> Any:
    """The line's object if it decodes (for the id in an error message), else None."""
    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        return None


class ExampleReader:
    """Validated examples of one source, in order, read as a stream; iterate once per pass.

    A malformed record raises DataError naming the file and the record (SQuAD: `data[a].paragraphs[p]
    .qas[q]`, JSON Lines: `line n`), or with skip_malformed is counted in `tally` and left out.
    """

    def __init__(self, source: str, skip_malformed: bool = False) -> None:
        self.source, self.urls = source, source_urls(source)
        self.skip_malformed = skip_malformed
        self.tally = Tally()
        self.kept = 0

    def _records(self, skip: bool, tally: Tally) -> Iterator[tuple[str, str, QAExample]]:
        for url in self.urls:
            records = (_jsonl_file if is_jsonl(url) else _squad_file)(url, skip, tally)
            for record, example in records:
                yield url, record, example

    def _first_place(self, qid: str) -> str | None:
        for url, record, example in self._records(True, Tally()):
            if example.id == qid:
                return record if len(self.urls) == 1 else f"{url}: {record}"
        return None

    def __iter__(self) -> Iterator[QAExample]:
        self.tally, self.kept = Tally(), 0
        records = self._records(self.skip_malformed, self.tally)
        for example in unique(records, self.skip_malformed, self.tally, self._first_place):
            self.kept += 1
            yield example
        warn_skipped(self.source, self.tally, self.kept)
        if not self.kept:
            raise DataError(f"{self.source}: no usable questions")
