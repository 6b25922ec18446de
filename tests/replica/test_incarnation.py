"""The Lighthouse process, and quorum ids unique across its restarts: the incarnation file the launcher
writes, read by groups."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from elastic_qa.config import ReplicaConfig
from elastic_qa.replica.ft import (
    INCARNATION_SPAN,
    QUORUM_FIELDS,
    LighthouseIncarnation,
    _IncarnationClient,
    lighthouse_command,
)


def test_the_first_lighthouse_keeps_torchfts_ids_and_each_restart_moves_them_past_every_earlier_one(
    tmp_path: Path,
) -> None:
    path = tmp_path / "lighthouse.json"
    incarnation = LighthouseIncarnation(str(path))
    assert incarnation.quorum_id(2) == 2  # no file yet: the first start
    LighthouseIncarnation.write(path, 1)
    assert incarnation.quorum_id(2) == 2
    LighthouseIncarnation.write(path, 2)
    assert incarnation.quorum_id(1) == INCARNATION_SPAN + 1
    LighthouseIncarnation.write(path, 3)
    assert incarnation.quorum_id(1) == 2 * INCARNATION_SPAN + 1
    assert not any(name.startswith(".") for name in os.listdir(tmp_path))  # the temporary file renamed


def test_a_torn_or_foreign_file_keeps_the_last_incarnation_read(tmp_path: Path) -> None:
    path = tmp_path / "lighthouse.json"
    LighthouseIncarnation.write(path, 2)
    incarnation = LighthouseIncarnation(str(path))
    assert incarnation.current() == 2
    path.write_text('{"incarn')
    assert incarnation.current() == 2
    path.write_text('{"incarnation": "three"}')
    assert incarnation.current() == 2
    LighthouseIncarnation.write(path, 3)
    assert incarnation.current() == 3


def test_no_file_named_means_torchfts_own_ids() -> None:
    assert LighthouseIncarnation(None).quorum_id(7) == 7


class FakeClient:
    """torchft's ManagerClient as the wrapper sees it: `_quorum` and one other call."""

    def _quorum(self, **kwargs: object) -> SimpleNamespace:
        return SimpleNamespace(**{name: f"{name}-value" for name in QUORUM_FIELDS} | {"quorum_id": 4})

    def should_commit(self, *args: object) -> bool:
        return True


def test_the_client_rewrites_only_the_quorum_id_and_passes_every_other_call_through(tmp_path: Path) -> None:
    path = tmp_path / "lighthouse.json"
    LighthouseIncarnation.write(path, 2)
    client = _IncarnationClient(FakeClient(), LighthouseIncarnation(str(path)))
    result = client._quorum(group_rank=0, step=1)
    assert result.quorum_id == INCARNATION_SPAN + 4
    assert all(getattr(result, name) == f"{name}-value" for name in QUORUM_FIELDS if name != "quorum_id")
    assert client.should_commit(0, 1, True) is True


@pytest.mark.parametrize("standby", [False, True])
def test_a_lighthouse_serves_without_importing_torch(tmp_path: Path, standby: bool) -> None:
    """The Lighthouse is torchft's Rust extension, loaded without the torchft package (whose import pulls in
    torch: seconds of CPU on every start and restart): its process never maps libtorch, and it answers.
    Started in a directory holding a `torchft` package of someone else's, it still loads the installed
    one (the working directory is not on its path)."""
    pytest.importorskip("torchft")
    planted = tmp_path / "torchft"
    planted.mkdir()
    (planted / "__init__.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w')\n")
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    command = lighthouse_command(port, ReplicaConfig(), "127.0.0.1", standby=standby)
    process = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=tmp_path
    )
    try:
        if standby:
            assert process.stdout is not None and process.stdin is not None
            assert process.stdout.readline().strip() == "ready"
            process.stdin.write("serve\n")
            process.stdin.flush()
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, f"the Lighthouse exited {process.returncode}"
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert time.monotonic() < deadline, "the Lighthouse did not listen"
            time.sleep(0.02)
        maps = Path(f"/proc/{process.pid}/maps").read_text()
        assert "libtorch" not in maps and "_torchft" in maps and str(planted) not in maps
        assert not (tmp_path / "ran").exists()
    finally:
        process.kill()
        process.wait()
