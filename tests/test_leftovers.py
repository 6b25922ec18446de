"""tests.leftovers, the check `make test-loaded` runs over what the suite left: a damaged checkpoint in a run
directory fails it, one doctored on purpose (and marked so) does not, a bare store is not a run."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.leftovers import DAMAGED_ON_PURPOSE, main


def test_a_damaged_checkpoint_in_a_run_directory_fails_the_check_unless_marked(
    trained: Path, tmp_path: Path
) -> None:
    run = tmp_path / "suite" / "some_test0" / "run"
    shutil.copytree(trained, run)
    assert main([str(tmp_path / "suite")]) == 0
    victim = next((run / "checkpoints").glob("step-*/optimizer.pt"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert main([str(tmp_path / "suite")]) == 1
    (run / DAMAGED_ON_PURPOSE).touch()
    assert main([str(tmp_path / "suite")]) == 0


def test_a_bare_checkpoints_directory_is_not_a_run(trained: Path, tmp_path: Path) -> None:
    shutil.copytree(trained / "checkpoints", tmp_path / "suite" / "ckpt")
    for victim in (tmp_path / "suite" / "ckpt").glob("step-*/model.pt"):
        victim.write_bytes(b"")
    assert main([str(tmp_path / "suite")]) == 0
