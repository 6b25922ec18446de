"""Which checkpoints a lineage's save sets aside: only an older lineage's past its own start."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from elastic_qa.replica.durable import ReplicaCheckpoints


class Store:
    """The checkpoint store as `_drop_other_lineages` reads it: steps and the lineage each manifest names."""

    def __init__(self, writers: dict[int, Any]) -> None:
        self.writers = writers

    def list_steps(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(step=step, path=Path(f"step-{step}")) for step in sorted(self.writers)]

    def read_manifest(self, path: Path) -> dict[str, Any]:
        writer = self.writers[int(path.name.split("-")[1])]
        if writer is None:
            raise ValueError("torn manifest")
        return {"attempt": writer}


def dropped_by(lineage: int, began_at: int, writers: dict[int, Any]) -> list[int]:
    quarantined: list[int] = []
    context = SimpleNamespace(
        store=Store(writers), quarantine=lambda rejection: quarantined.append(rejection.step)
    )
    durable = SimpleNamespace(
        ctx=SimpleNamespace(is_main=True), lineage=lineage, began_at=began_at, context=context,
        log=SimpleNamespace(warning=lambda *args, **kwargs: None),
    )  # fmt: skip
    ReplicaCheckpoints._drop_other_lineages(durable)  # type: ignore[arg-type]
    return quarantined


def test_an_older_lineages_checkpoints_past_this_ones_start_are_set_aside() -> None:
    """Lineage 5 continues lineage 3 from step 10; lineage 4 (the losing side of a split) saved steps 15 and
    20 meanwhile: those go, lineage 3's steps up to 10 stay, and so do lineage 5's own."""
    writers = {5: 3, 10: 3, 15: 4, 20: 4, 25: 5}
    assert dropped_by(5, 10, writers) == [15, 20]


def test_a_newer_lineages_checkpoints_are_never_set_aside_by_an_older_one() -> None:
    """Lineage 3 lost to lineage 4 without knowing it yet (a no-quorum emergency save): lineage 4's step 15
    is the newest valid state and must stay; lineage 3's own save is then refused by the fence."""
    assert dropped_by(3, 10, {10: 3, 15: 4}) == []


def test_an_unreadable_or_unnumbered_manifest_is_left_to_the_restore_checks() -> None:
    assert dropped_by(5, 10, {15: None, 20: "4"}) == []
