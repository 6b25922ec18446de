"""One large JSON document read incrementally: SQuAD's `data` list yields one article at a time.

`json.loads` of a whole file holds the text and every object of it at once (about 29 KB per SQuAD
question, so a few million questions exceed any worker's memory). Here the top level is walked by hand
and each element of `data` is decoded on its own with the C decoder (`raw_decode` over a buffer that
holds one article and a chunk of read-ahead), so memory is bounded by the largest article.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterator
from typing import IO, Any

_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"[ \t\n\r]*")
_STRUCTURE = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')
CHUNK = 1 << 20


class JSONStreamError(ValueError):
    """Unreadable JSON at a place in the file (the message says what, without the file name)."""


class TextStream:
    """UTF-8 text of a binary handle, buffered; knows the line and column of any buffered index."""

    def __init__(self, handle: IO[bytes], chunk: int | None = None) -> None:
        self.handle, self.chunk = handle, chunk or CHUNK
        self.decoder = codecs.getincrementaldecoder("utf-8-sig")()  # editors on Windows write a BOM
        self.buf, self.pos, self.eof = "", 0, False
        self.line, self.column = 1, 1  # of buf[0]
        self.bytes_read = 0

    def _read(self, at_least: int) -> None:
        """Drop what was consumed, then append at least `at_least` more characters (or reach the end)."""
        consumed = self.buf[: self.pos]
        newlines = consumed.count("\n")
        if newlines:
            self.line += newlines
            self.column = len(consumed) - consumed.rfind("\n")
        else:
            self.column += len(consumed)
        self.buf, self.pos = self.buf[self.pos :], 0
        wanted = len(self.buf) + at_least
        while len(self.buf) < wanted and not self.eof:
            raw = self.handle.read(max(self.chunk, at_least))
            pending = len(self.decoder.getstate()[0])
            try:
                self.buf += self.decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as err:
                byte = self.bytes_read - pending + err.start
                raise JSONStreamError(f"not UTF-8 text (byte {byte})") from None
            self.bytes_read += len(raw)
            self.eof = not raw

    def where(self, index: int) -> str:
        newlines = self.buf.count("\n", 0, index)
        column = index - self.buf.rfind("\n", 0, index) if newlines else self.column + index
        return f"line {self.line + newlines}, column {column}"

    def peek(self) -> str:
        """The next character that is not whitespace ("" at the end of the text)."""
        while True:
            space = _SPACE.match(self.buf, self.pos)
            assert space is not None  # the pattern matches the empty string, so anywhere
            self.pos = space.end()
            if self.pos < len(self.buf) or self.eof:
                return self.buf[self.pos : self.pos + 1]
            self._read(self.chunk)

    def expect(self, chars: str, what: str) -> str:
        char = self.peek()
        if not char or char not in chars:
            raise JSONStreamError(f"not valid JSON ({self.where(self.pos)}: {what})")
        self.pos += 1
        return char

    def value(self, depth: int = 0) -> Any:
        """Decode the next JSON value, reading on until the buffer holds all of it."""
        return self._decode(depth)[0]

    def text(self, depth: int = 0) -> str:
        """The next JSON value's text, checked by decoding it (the caller decodes it again, elsewhere)."""
        _, start, end = self._decode(depth)
        return self.buf[start:end]

    def _decode(self, depth: int) -> tuple[Any, int, int]:
        self.peek()
        while True:
            try:
                value, end = _DECODER.raw_decode(self.buf, self.pos)
                if end < len(self.buf) or self.eof:  # a number at the buffer's end may go on
                    start, self.pos = self.pos, end
                    return value, start, end
            except json.JSONDecodeError as err:
                # Incomplete rather than wrong: the error is at the buffer's end, or a string runs off it.
                near_end = err.pos >= len(self.buf) - 16 or err.msg.startswith("Unterminated string")
                if self.eof or not near_end:
                    raise JSONStreamError(f"not valid JSON ({self.where(err.pos)}: {err.msg})") from None
            except RecursionError:  # the json module recurses once per level of nesting
                raise JSONStreamError(f"JSON nested too deeply to read ({self._deepest(depth)})") from None
            except ValueError as err:  # e.g. an integer literal longer than Python's 4300-digit limit
                raise JSONStreamError(f"unreadable JSON value ({str(err).split(':')[0]})") from None
            self._read(max(self.chunk, len(self.buf) - self.pos))  # double: re-decoding stays linear

    def _deepest(self, depth: int) -> str:
        """Depth and position of the most deeply nested value buffered (error path only)."""
        deepest, where = depth, self.pos
        for match in _STRUCTURE.finditer(self.buf, self.pos):
            char = match.group()
            if char in "[{":
                depth += 1
                if depth > deepest:
                    deepest, where = depth, match.start()
            elif char in "]}":
                depth -= 1
        return f"{deepest} levels, deepest at {self.where(where)}"


def _members(text: TextStream, depth: int) -> Iterator[str]:
    """Walk an object's members (its `{` already consumed), yielding each key once its `:` is read;
    the consumer reads the value before asking for the next key."""
    if text.peek() == "}":
        text.pos += 1
        return
    while True:
        key = text.value(depth)
        if not isinstance(key, str):
            raise JSONStreamError(f"not valid JSON ({text.where(text.pos)}: expecting a property name)")
        text.expect(":", "Expecting ':' delimiter")
        yield key
        if text.expect(",}", "Expecting ',' delimiter") == "}":
            return


def _elements(text: TextStream) -> Iterator[None]:
    """Walk a list's elements (its `[` already consumed); the consumer reads each one."""
    if text.peek() == "]":
        text.pos += 1
        return
    while True:
        yield None
        if text.expect(",]", "Expecting ',' delimiter") == "]":
            return


Paragraph = tuple[int, int, str] | tuple[int, None, None]


def squad_paragraphs(handle: IO[bytes]) -> Iterator[Paragraph]:
    """(article index, paragraph index, the paragraph's JSON text) of a SQuAD document, in order, and
    (article index, None, None) for an article without a `paragraphs` list; raises JSONStreamError.

    Memory holds one paragraph at a time (a context and its questions), whatever the size of an
    article or of the file. Other keys are decoded and dropped. A document without a `data` list raises
    JSONStreamError("not SQuAD JSON ...") once the whole object has been read.
    """
    text = TextStream(handle)
    if not text.peek():
        raise JSONStreamError("empty file, not SQuAD JSON")
    if text.peek() != "{":
        text.value()  # a bad document is "not valid JSON"; a valid one of the wrong shape is below
        raise JSONStreamError("not SQuAD JSON (expected an object with a 'data' list)")
    text.pos += 1
    found = False
    articles = 0
    for key in _members(text, 1):
        if key != "data" or text.peek() != "[":
            text.value(1)
            continue
        found = True
        text.pos += 1
        for _ in _elements(text):
            a, articles = articles, articles + 1
            if text.peek() != "{":
                text.value(2)
                yield a, None, None
                continue
            text.pos += 1
            listed = False
            for member in _members(text, 3):
                if member != "paragraphs" or text.peek() != "[":
                    text.value(3)
                    continue
                listed = True
                text.pos += 1
                for p, _ in enumerate(_elements(text)):
                    yield a, p, text.text(4)
            if not listed:
                yield a, None, None
    if text.peek():
        raise JSONStreamError(f"not valid JSON ({text.where(text.pos)}: Extra data)")
    if not found:
        raise JSONStreamError("not SQuAD JSON (expected an object with a 'data' list)")
