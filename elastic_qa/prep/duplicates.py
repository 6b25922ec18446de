"""Question ids admitted once over one pass of a source (one split, all its files).

A question id seen before is malformed too: predictions and scores are keyed by id, so a duplicate would
silently replace the first question's prediction. Validated examples arrive chunk by chunk, in order,
possibly from worker processes; the one IdAdmission of the pass decides which to keep, raises the
duplicate-id error naming both places, counts what was skipped and reports it at the end.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable

from elastic_qa.data.examples import DataError
from elastic_qa.observe.log import get_logger
from elastic_qa.prep.squad import shown_id


class IdAdmission:
    """Which examples of a pass to keep, and the records skipped (malformed ones and duplicates).

    The ids seen are kept as 8-byte digests (a few dozen bytes a question, not the strings). When a digest
    repeats, `places()` (every valid record's place and id, in order: the source read again, an error
    path) finds the first occurrence for the message, and tells a digest collision (odds about 1e-7 at a
    million questions) from a duplicate; with skip_malformed such a collision skips the question.
    """

    def __init__(
        self, source: str, skip_malformed: bool, places: Callable[[], Iterable[tuple[str, str]]]
    ) -> None:
        self.source, self.skip_malformed, self.places = source, skip_malformed, places
        self.seen: set[int] = set()
        self.kept = 0
        self.skipped = 0  # malformed records, the duplicates among them
        self.duplicates = 0

    def admit(self, url: str, names: list[tuple[str, str]], skipped: int, error: str | None) -> list[bool]:
        """Which of a parsed chunk's examples (`names`: record, id) to keep; `skipped`: its malformed
        records left out; `error`: a DataError message to raise after its examples."""
        self.skipped += skipped
        keep = [self.admit_id(url, record, qid) for record, qid in names]
        if error:
            raise DataError(error)
        return keep

    def admit_id(self, url: str, record: str, qid: str) -> bool:
        digest = int.from_bytes(hashlib.blake2b(qid.encode(), digest_size=8).digest(), "little")
        if digest in self.seen:
            if self.skip_malformed:
                self.skipped += 1
                self.duplicates += 1
                return False
            first = next((place for place, seen in self.places() if seen == qid), None)
            if first is not None:
                raise DataError(f"{url}: {record} (id {shown_id(qid)}): duplicate id, first at {first}")
        self.seen.add(digest)
        self.kept += 1
        return True

    def finish(self) -> None:
        """The pass is over: a warning when records were skipped; DataError when none was kept."""
        if self.skipped:
            get_logger().warning(
                "malformed_records_skipped",
                source=self.source,
                skipped=self.skipped,
                duplicate_ids=self.duplicates,
                kept=self.kept,
            )
        if not self.kept:
            raise DataError(f"{self.source}: no usable questions")
