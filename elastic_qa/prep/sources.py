"""A data source: files (paths or fsspec URLs, globs), `datasets` directories or hub datasets, read as a
stream of chunks of raw records that any process can turn into validated examples.

`data.source` is a comma-separated list; each entry may be a glob (its matches in sorted order). A file
whose name ends in `.jsonl` or `.ndjson` (optionally compressed, e.g. `.jsonl.gz`) holds one question a
line: `{"id", "question", "context", "answers": [{"text", "answer_start"}], "is_impossible"?}`; a
`.parquet`, `.arrow` or `.feather` file holds SQuAD-schema rows (prep.tables), as do a `datasets`
save_to_disk directory (`DIR`, or `DIR:SPLIT` for a DatasetDict) and a hub dataset (`hub:NAME:SPLIT`,
`hub:NAME:CONFIG:SPLIT`); any other file is SQuAD v1.1/v2.0 JSON, walked one paragraph at a time
(prep.stream). Compression is inferred from the name. Question ids are unique over all files of a source.

The reading process only cuts the input into chunks (paragraphs' JSON text, lines, record batches);
validating them (`parse_chunk`) is the heavier half and runs wherever the chunk is sent. Chunks depend on
the input only.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

import fsspec

from elastic_qa.data.examples import DataError, QAExample
from elastic_qa.prep.duplicates import IdAdmission
from elastic_qa.prep.files import is_local, open_regular
from elastic_qa.prep.squad import (
    Tally,
    bad_article,
    named,
    paragraph_records,
    parse_qa,
    require_text,
    squad_records,
)
from elastic_qa.prep.stream import JSONStreamError, squad_paragraphs
from elastic_qa.prep.tables import (
    hub_rows,
    ipc_rows,
    is_hub,
    is_table,
    read_errors,
    record_batches,
    row_example,
    saved_dataset_files,
    to_ipc,
)

_JSONL_SUFFIXES = (".jsonl", ".ndjson")
CHUNK_CHARS = 64 * 1024  # SQuAD paragraphs' text per chunk (about 200 questions)
CHUNK_LINES = 256  # JSON Lines (or table rows) per chunk


def source_urls(source: str) -> list[str]:
    """The files of a source, in order: comma-separated entries, a glob's matches sorted, a save_to_disk
    directory's Arrow files; a hub dataset stays one `hub:` entry."""
    urls: list[str] = []
    for entry in (part.strip() for part in source.split(",")):
        if not entry:
            continue
        if is_hub(entry):
            urls.append(entry)
            continue
        if not glob.has_magic(entry):
            urls += saved_dataset_files(entry) or [entry]
            continue
        try:
            fs, pattern = fsspec.core.url_to_fs(entry)
            matches = sorted(fs.glob(pattern))
        except (OSError, ValueError, ImportError) as err:
            raise DataError(f"{entry}: cannot list ({err})") from None
        if not matches:
            raise DataError(f"{entry}: no file matches")
        urls += [m if is_local(fs) else fs.unstrip_protocol(m) for m in matches]
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
    """The file's bytes (decompressed if its name says so); unreadable, or not a regular file -> DataError
    naming it."""
    try:
        with open_regular(url, infer=True) as handle:
            yield handle
    except FileNotFoundError:
        raise DataError(f"{url}: file not found") from None
    except (OSError, EOFError, ImportError) as err:
        raise DataError(f"{url}: cannot read ({err})") from None


def file_digest(url: str) -> str:
    """sha256 of a file's stored bytes, read in chunks."""
    digest = hashlib.sha256()
    try:
        with open_regular(url) as handle:
            while chunk := handle.read(1 << 22):
                digest.update(chunk)
    except FileNotFoundError:
        raise DataError(f"{url}: file not found") from None
    except (OSError, ValueError, ImportError) as err:
        raise DataError(f"{url}: cannot read ({err})") from None
    return digest.hexdigest()


@dataclass
class Chunk:
    """Raw records of one file, in order. SQuAD: (article, paragraph, JSON text) from prep.stream;
    JSON Lines: (line number, bytes); "table": (first row number, Arrow IPC bytes), one pair; "rows":
    (row number, dict); "examples": ready QAExamples (the synthetic generator)."""

    url: str
    kind: str  # "squad" | "jsonl" | "table" | "rows" | "examples"
    records: list
    error: str | None = None  # the file stopped being readable after these records (raised in order)


@dataclass
class Parsed:
    records: list[tuple[str, QAExample]]  # (record name, example)
    skipped: int
    error: str | None  # a DataError message, to raise after `records`

    def names(self) -> list[tuple[str, str]]:
        """(record name, question id) of each example: what the reading process needs of them."""
        return [(record, example.id) for record, example in self.records]


def chunks(url: str) -> Iterator[Chunk]:
    """One file's (or hub dataset's) records, cut into chunks."""
    if is_hub(url):
        yield from _hub_chunks(url)
        return
    with open_source(url) as handle:
        if is_table(url):
            yield from _table_chunks(url, handle)
            return
        if is_jsonl(url):
            lines: list[tuple[int, bytes]] = []
            for number, line in enumerate(handle, start=1):
                lines.append((number, line))
                if len(lines) == CHUNK_LINES:
                    yield Chunk(url, "jsonl", lines)
                    lines = []
            if lines:
                yield Chunk(url, "jsonl", lines)
            return
        paragraphs: list[Any] = []
        size = 0
        try:
            for item in squad_paragraphs(handle):
                paragraphs.append(item)
                size += len(item[2] or "")
                if size >= CHUNK_CHARS:
                    yield Chunk(url, "squad", paragraphs)
                    paragraphs, size = [], 0
        except JSONStreamError as err:
            yield Chunk(url, "squad", paragraphs, f"{url}: {err}")
            return
        if paragraphs:
            yield Chunk(url, "squad", paragraphs)


def _table_chunks(url: str, handle: IO[bytes]) -> Iterator[Chunk]:
    """A Parquet/Arrow file's rows, CHUNK_LINES a chunk; an unreadable file ends in an error chunk."""
    first = 0
    batches = record_batches(url, handle, CHUNK_LINES)
    try:
        for batch in batches:
            yield Chunk(url, "table", [(first, to_ipc(batch))])
            first += batch.num_rows
    except DataError:  # pyarrow is not installed
        raise
    except read_errors() as err:
        kind = "Parquet" if url.lower().endswith(".parquet") else "Arrow"
        yield Chunk(url, "table", [], f"{url}: not a readable {kind} file after row {first} ({err})")


def _hub_chunks(entry: str) -> Iterator[Chunk]:
    rows: list[tuple[int, dict]] = []
    for number, row in enumerate(hub_rows(entry)):
        rows.append((number, row))
        if len(rows) == CHUNK_LINES:
            yield Chunk(entry, "rows", rows)
            rows = []
    if rows:
        yield Chunk(entry, "rows", rows)


def _rows(chunk: Chunk) -> Iterator[tuple[int, Any]]:
    """(row number, row) of a "table" or "rows" chunk."""
    if chunk.kind == "rows":
        yield from chunk.records
        return
    for first, data in chunk.records:
        yield from enumerate(ipc_rows(data), start=first)


def parse_chunk(chunk: Chunk, skip_malformed: bool) -> Parsed:
    """Validated examples of a chunk; without skip_malformed, the first malformed record ends it."""
    tally = Tally()
    out: list[tuple[str, QAExample]] = []
    url = chunk.url
    try:
        if chunk.kind == "examples":
            out = [("", example) for example in chunk.records]
        elif chunk.kind == "squad":
            for a, p, text in chunk.records:
                if p is None:
                    bad_article(url, a, skip_malformed, tally)
                    continue
                paragraph = json.loads(text)  # decodes: the reader checked it
                for item in paragraph_records(
                    url, f"data[{a}].paragraphs[{p}]", paragraph, skip_malformed, tally
                ):
                    out.append(item)
        elif chunk.kind in ("table", "rows"):
            for number, row in _rows(chunk):
                try:
                    out.append((f"row {number}", row_example(row)))
                except (ValueError, RecursionError) as err:
                    if not skip_malformed:
                        raise DataError(f"{url}: {named(f'row {number}', row)}: {err}") from None
                    tally.skipped += 1
        else:
            for number, line in chunk.records:
                if not line.strip():
                    continue
                try:
                    out.append((f"line {number}", _jsonl_record(line)))
                except (ValueError, RecursionError) as err:
                    if not skip_malformed:
                        raise DataError(f"{url}: {named(f'line {number}', _loose(line))}: {err}") from None
                    tally.skipped += 1
    except DataError as err:
        return Parsed(out, tally.skipped, str(err))
    return Parsed(out, tally.skipped, chunk.error)


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


def _loose(line: bytes) -> Any:
    """The line's object if it decodes (for the id in an error message), else None."""
    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        return None


class ExampleReader:
    """One source's chunks, and its validated examples in order (one pass per IdAdmission).

    A malformed record raises DataError naming the file and the record (SQuAD: `data[a].paragraphs[p]
    .qas[q]`, JSON Lines: `line n`, tables: `row n`, counted from 0), or with skip_malformed is counted
    by the pass's IdAdmission and left out.
    """

    def __init__(self, source: str, skip_malformed: bool = False) -> None:
        self.source, self.urls = source, source_urls(source)
        self.skip_malformed = skip_malformed

    def chunks(self) -> Iterator[Chunk]:
        for url in self.urls:
            yield from chunks(url)

    def places(self) -> Iterator[tuple[str, str]]:
        """(place, question id) of every valid record, in order (reads the files again)."""
        for chunk in self.chunks():
            for record, example in parse_chunk(chunk, True).records:
                yield (record if len(self.urls) == 1 else f"{chunk.url}: {record}"), example.id

    def admission(self) -> IdAdmission:
        """A fresh pass's duplicate-id admission."""
        return IdAdmission(self.source, self.skip_malformed, self.places)

    def examples(self, admission: IdAdmission) -> Iterator[QAExample]:
        """One pass: the examples `admission` keeps; it holds the counts."""
        for chunk in self.chunks():
            parsed = parse_chunk(chunk, self.skip_malformed)
            keep = admission.admit(chunk.url, parsed.names(), parsed.skipped, parsed.error)
            yield from (example for (_, example), kept in zip(parsed.records, keep, strict=True) if kept)
        admission.finish()

    def __iter__(self) -> Iterator[QAExample]:
        return self.examples(self.admission())


def read_squad(url: str, skip_malformed: bool = False) -> tuple[list[QAExample], int]:
    """Examples of one data source (SQuAD JSON or JSON Lines; several files, a glob) and records skipped."""
    reader = ExampleReader(url, skip_malformed)
    admission = reader.admission()
    return list(reader.examples(admission)), admission.skipped


def parse_squad(doc: Any, url: str, skip_malformed: bool = False) -> tuple[list[QAExample], int]:
    """Examples of a decoded SQuAD document in file order, and the malformed records skipped."""
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
        raise DataError(f"{url}: not SQuAD JSON (expected an object with a 'data' list)")

    def places() -> Iterator[tuple[str, str]]:
        return ((record, e.id) for record, e in squad_records(url, doc["data"], True, Tally()))

    tally = Tally()
    admission = IdAdmission(url, skip_malformed, places)
    records = squad_records(url, doc["data"], skip_malformed, tally)
    examples = [e for record, e in records if admission.admit_id(url, record, e.id)]
    admission.skipped += tally.skipped  # the malformed records the walk left out
    admission.finish()
    return examples, admission.skipped
