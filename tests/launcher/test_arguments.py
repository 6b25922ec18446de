"""The launcher's command line: one run directory flag for every command (run.dir=DIR accepted too), its
name as the user typed it, and its exit codes in its help."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_qa.launcher.local import main


@pytest.mark.parametrize("command", ["join", "leave", "stop", "status"])
@pytest.mark.parametrize("form", ["--run-dir", "run.dir="])
def test_every_job_command_takes_the_run_directory_both_ways(
    tmp_path: Path, command: str, form: str, capsys
) -> None:
    run_dir = tmp_path / "nothing-started-here"
    args = ["--run-dir", str(run_dir)] if form == "--run-dir" else [f"run.dir={run_dir}"]
    with pytest.raises(SystemExit) as done:
        main([command, *args])
    assert done.value.code == 2  # read the run directory it was given: no job was started there
    assert f"{run_dir}/launch.json not found" in capsys.readouterr().err


def test_two_different_run_directories_or_other_overrides_are_refused(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as done:
        main(["stop", "--run-dir", str(tmp_path / "a"), f"run.dir={tmp_path / 'b'}"])
    assert done.value.code == 2 and "name different directories" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        main(["status", "--run-dir", str(tmp_path), "train.max_steps=3"])
    assert done.value.code == 2 and "takes only --run-dir" in capsys.readouterr().err


def test_help_names_the_launcher_as_typed_and_documents_the_exit_codes(monkeypatch, capsys) -> None:
    monkeypatch.setenv("ELASTIC_QA_PROG", "launch/local.sh")
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: launch/local.sh") and "launch/local.sh stop   --run-dir DIR" in out
    assert "130 stopped by Ctrl-C" in out and "143 by SIGTERM" in out
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("elastic-qa ")


def test_join_leave_stop_and_status_do_not_wait_for_torch_to_import() -> None:
    """`join` imported torch (6-8 s on a loaded 2-core host) before it started the new agent; only
    `start` checks inputs, which needs it (and imports it then)."""
    import subprocess
    import sys

    from elastic_qa.launcher.processes import python_env

    probe = "import sys, elastic_qa.launcher.local; print(sorted({'torch', 'numpy'} & set(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=python_env(), timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
