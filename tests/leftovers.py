"""`python -m tests.leftovers DIR`: run `elastic-qa ckpt verify` on every checkpoints directory under DIR
(a pytest --basetemp after a run of the suite) and fail if one holds a damaged checkpoint.

What the suite leaves behind is what its jobs left: a damaged checkpoint there is one that a job (killed,
faulted, stopped) left where the next start would look first. Tests that damage checkpoints on purpose
and never run a job over them again say so with a file named DAMAGED_ON_PURPOSE in their checkpoints
directory (or above it), and are skipped.
"""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

from elastic_qa import ckpt
from elastic_qa.checkpoint.store import CheckpointError

MARK = "DAMAGED_ON_PURPOSE"


def checkpoint_dirs(root: Path) -> list[Path]:
    """Directories holding step-N directories (a checkpoint.dir), each once."""
    found = {step.parent for step in root.rglob("step-*") if step.is_dir() and step.name[5:].isdigit()}
    return sorted(found)


def on_purpose(directory: Path, root: Path) -> bool:
    return any((p / MARK).exists() for p in [directory, *directory.parents] if p == root or root in p.parents)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not Path(args[0]).is_dir():
        print("usage: python -m tests.leftovers DIR", file=sys.stderr)
        return 2
    root = Path(args[0]).resolve()
    checked, bad, skipped = 0, [], 0
    for directory in checkpoint_dirs(root):
        if on_purpose(directory, root):
            skipped += 1
            continue
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                code = ckpt.cmd_verify(str(directory))
            except CheckpointError as err:  # e.g. every checkpoint pruned meanwhile
                code, out = 0, io.StringIO(str(err))
        checked += 1
        if code:
            bad.append((directory, out.getvalue().strip()))
    for directory, report in bad:
        print(f"{directory}:\n  " + report.replace("\n", "\n  "))
    print(f"leftovers: {checked} checkpoint directories verified, {len(bad)} damaged, {skipped} on purpose")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
