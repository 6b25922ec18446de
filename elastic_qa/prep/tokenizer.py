"""Tokenisers that keep exact character offsets, for any language.

Sequence length is what decides CPU speed for a small QA model, so the default is word-level: words are
hashed into a fixed number of buckets (no vocabulary file to train or ship), CJK characters are single
tokens (Chinese has no spaces), and punctuation marks are tokens of their own. `byte` is the universal
fallback: UTF-8 bytes, about 5x longer sequences on English. `wordpiece` (prep.wordpiece) trains a subword
vocabulary on the training texts; prep.windows picks the tokenizer a config names.
"""

from __future__ import annotations

import re
import zlib
from typing import Protocol

PAD, CLS, SEP, UNK = 0, 1, 2, 3
NUM_SPECIAL = 4

# Han, Hiragana/Katakana, Hangul syllables and the CJK punctuation block: one character, one token.
_CJK = "\u3000-\u303f\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff\uff00-\uffef"
_WORD_PATTERN = re.compile(rf"[{_CJK}]|[^\W{_CJK}]+|[^\w\s]")
_LONE_SURROGATE = re.compile(r"[\ud800-\udfff]")
_MEMO_WORDS = 200_000  # words whose id is remembered (about 20 MB)


class Tokenizer(Protocol):
    name: str
    vocab_size: int

    def encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and, per token, the [start, end) character span it came from."""
        ...


class WordTokenizer:
    """Hashed words: stable across processes and machines (crc32, not Python's salted hash)."""

    name = "word"

    def __init__(self, vocab_size: int, lowercase: bool = True) -> None:
        self.vocab_size = vocab_size
        self.lowercase = lowercase
        self._ids: dict[str, int] = {}

    def _id(self, word: str) -> int:
        key = word.lower() if self.lowercase else word
        # surrogatepass: a lone surrogate (from a command-line argument, say) hashes instead of raising
        token_id = NUM_SPECIAL + zlib.crc32(key.encode("utf-8", "surrogatepass")) % (
            self.vocab_size - NUM_SPECIAL
        )
        if len(self._ids) >= _MEMO_WORDS:  # a memo, not a vocabulary: bounded whatever the data
            self._ids.clear()
        self._ids[word] = token_id
        return token_id

    def encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        matches = list(_WORD_PATTERN.finditer(text))
        known = self._ids.get
        ids = [known(word) or self._id(word) for word in map(re.Match.group, matches)]  # ids are >= 4
        return ids, [match.span() for match in matches]


class ByteTokenizer:
    """UTF-8 bytes; every byte of a multi-byte character maps back to that character's span."""

    name = "byte"
    vocab_size = NUM_SPECIAL + 256

    def encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        try:
            ids, spans = [], []
            for index, char in enumerate(text):
                if char.isspace():
                    continue
                for byte in char.encode("utf-8"):
                    ids.append(NUM_SPECIAL + byte)
                    spans.append((index, index + 1))
            return ids, spans
        except UnicodeEncodeError:  # a lone surrogate (from a command-line argument, say) reads as U+FFFD
            return self.encode(_LONE_SURROGATE.sub("\ufffd", text))


def build_tokenizer(kind: str, vocab_size: int, lowercase: bool) -> Tokenizer:
    if kind == "word":
        return WordTokenizer(vocab_size, lowercase)
    if kind == "byte":
        return ByteTokenizer()
    raise ValueError(f"unknown tokenizer {kind!r}")
