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

    def __init__(self, handle: IO[bytes], chunk: int = CHUNK) -> None:
        self.handle, self.chunk = handle, chunk
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
            self.pos = _SPACE.match(self.buf, self.pos).end()
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
        self.peek()
        while True:
            try:
                value, end = _DECODER.raw_decode(self.buf, self.pos)
                if end < len(self.buf) or self.eof:  # a number at the buffer's end may go on
                    self.pos = end
                    return value
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


def squad_articles(handle: IO[bytes]) -> Iterator[Any]:
    """The elements of the top-level object's `data` list, in order; raises JSONStreamError.

    Other top-level keys are decoded and dropped. A document without a `data` list raises
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
    if text.peek() == "}":
        text.pos += 1
    else:
        while True:
            key = text.value(1)
            if not isinstance(key, str):
                raise JSONStreamError(f"not valid JSON ({text.where(text.pos)}: expecting a property name)")
            text.expect(":", "Expecting ':' delimiter")
            if key == "data" and text.peek() == "[":
                found = True
                text.pos += 1
                if text.peek() == "]":
                    text.pos += 1
                else:
                    while True:
                        yield text.value(2)
                        if text.expect(",]", "Expecting ',' delimiter") == "]":
                            break
            else:
                text.value(1)
            if text.expect(",}", "Expecting ',' delimiter") == "}":
                break
    if text.peek():
        raise JSONStreamError(f"not valid JSON ({text.where(text.pos)}: Extra data)")
    if not found:
        raise JSONStreamError("not SQuAD JSON (expected an object with a 'data' list)")
