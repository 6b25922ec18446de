"""`python -m tests.leftovers DIR`: run `elastic-qa ckpt verify` on the checkpoints of every run
directory under DIR (a pytest --basetemp after a run of the suite) and fail if one holds a damaged one.

A run directory (a checkpoints directory beside logs/) is what a job left: a damaged checkpoint there is one
a job (killed, faulted, stopped, fenced) left where the next start would look. Unit tests of the store that
damage bare checkpoint directories on purpose are not run directories; a test that doctors a run directory
on purpose (the chaos verifier's evidence) says so with a file named DAMAGED_ON_PURPOSE in it or above it.
"""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

from elastic_qa import ckpt
from elastic_qa.checkpoint.store import CheckpointError

DAMAGED_ON_PURPOSE = "DAMAGED_ON_PURPOSE"


def checkpoint_dirs(root: Path) -> list[Path]:
    """Directories holding step-N directories beside a logs/ directory (a run's checkpoints), each once."""
    found = {step.parent for step in root.rglob("step-*") if step.is_dir() and step.name[5:].isdigit()}
    return sorted(directory for directory in found if (directory.parent / "logs").is_dir())


def on_purpose(directory: Path, root: Path) -> bool:
    inside = [p for p in [directory, *directory.parents] if p == root or root in p.parents]
    return any((p / DAMAGED_ON_PURPOSE).exists() for p in inside)


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
