"""The built wheel works on its own: installed in a fresh venv, its launcher and chaos tool run a job.

What this proves: `pip wheel .` holds the package with its configs and none of the checkout's top-level
trees (`chaos/`, `launch/`, `tests/`: a wheel must not claim generic names in site-packages); installed,
its `python -m elastic_qa.launcher.local` trains a 2-agent job to its final checkpoint and its
`elastic-qa chaos` console script runs and passes a one-fault scenario, from a directory outside the
checkout with nothing of the checkout on the path, so no module, config or launcher is found by file path.

What it does not prove: that pip can resolve and install the wheel's dependencies. Installing them from
PyPI would pull a multi-GB CUDA torch, so the fresh venv gets the wheel alone (`--no-deps`) and then this
environment's installed dependencies through a .pth file (a plain path: the .pth files in there, such as
an editable install's, are not run). The wheel is built without build isolation when this environment
has the build backend pyproject asks for; otherwise pip fetches it.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.wheel

SETUPTOOLS_MIN = 77  # pyproject's [build-system] requires
# What a fresh clone holds, and no more: the copy the wheel is built from (pip builds in the source tree).
NOT_SOURCE = (".git", ".venv", "runs", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".cache")
MAX_STEPS = 30


def build_isolation_flags() -> list[str]:
    try:
        major = int(importlib.metadata.version("setuptools").split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return []
    return ["--no-build-isolation"] if major >= SETUPTOOLS_MIN else []


def run(command: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    output = result.stdout[-3000:] + result.stderr[-3000:]
    assert result.returncode == 0, f"{command}: exit {result.returncode}\n{output}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(*NOT_SOURCE))
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", *build_isolation_flags()]
    run([*command, "-w", str(work / "dist"), str(source)], work, dict(os.environ), timeout=300)
    (built,) = (work / "dist").glob("elastic_qa-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A fresh venv holding the wheel (and, by a .pth file, this environment's dependencies); the
    environment to run it in: nothing of the checkout on PYTHONPATH."""
    home = tmp_path_factory.mktemp("venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(home)], check=True, timeout=120)
    python = home / "bin" / "python"
    # Installed before the .pth exists: pip must not see (and replace) this environment's own install.
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps"]
    run([*install, "--no-index", str(wheel)], home, dict(os.environ), timeout=120)
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    ours = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    (site / "project-dependencies.pth").write_text("".join(f"{path}\n" for path in ours))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    return home, env


def test_the_wheel_holds_the_package_and_its_configs_and_no_checkout_tree(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {name.split("/")[0] for name in names if ".dist-info/" not in name} == {"elastic_qa"}
    package = REPO / "elastic_qa"
    shipped = [*package.rglob("*.py"), *package.glob("configs/*.yaml")]
    missing = {path.relative_to(REPO).as_posix() for path in shipped} - names
    assert not missing  # e.g. a subpackage without __init__.py, or package data not declared


def test_the_wheel_carries_the_license_text_it_declares(wheel: Path) -> None:
    archive = zipfile.ZipFile(wheel)
    (metadata,) = [name for name in archive.namelist() if name.endswith(".dist-info/METADATA")]
    headers = archive.read(metadata).decode()
    assert "License-Expression: Apache-2.0" in headers and "License-File: LICENSE" in headers
    shipped = archive.read(metadata.replace("METADATA", "licenses/LICENSE"))
    assert shipped == (REPO / "LICENSE").read_bytes() and b"END OF TERMS AND CONDITIONS" in shipped


def test_the_installed_package_is_the_wheel_and_claims_no_generic_name(
    venv: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    home, env = venv
    (site,) = home.glob("lib/python*/site-packages")
    installed = {path.name for path in site.iterdir() if path.suffix != ".pth"}
    assert {name for name in installed if not name.endswith(".dist-info")} == {"elastic_qa"}
    probe = "import elastic_qa; print(elastic_qa.__file__)"
    where = run([str(home / "bin" / "python"), "-c", probe], tmp_path, env, 60).stdout.strip()
    assert Path(where).is_relative_to(site), where


def final_checkpoint(run_dir: Path, step: int) -> dict:
    manifest = json.loads((run_dir / "checkpoints" / f"step-{step:08d}" / "manifest.json").read_text())
    assert manifest["step"] == step
    return manifest


# Long: the chaos tool's test below starts the same installed launcher (`python -m elastic_qa.launcher.local
# start --agents 2`, the venv's python) and checks the same result line and final checkpoint, one kill on top.
@pytest.mark.long
def test_the_installed_launcher_trains_a_two_agent_job_to_its_final_checkpoint(
    venv: tuple[Path, dict[str, str]], tmp_path: Path, cache_dir: Path
) -> None:
    home, env = venv
    command = [str(home / "bin" / "python"), "-m", "elastic_qa.launcher.local", "start", "--agents", "2"]
    overrides = [f"run.dir={tmp_path / 'run'}", f"data.cache_dir={cache_dir}", f"train.max_steps={MAX_STEPS}"]
    result = run([*command, "--config", "tiny", *overrides, "log.console=none"], tmp_path, env, 180)
    assert f"result: step {MAX_STEPS}" in result.stdout
    assert final_checkpoint(tmp_path / "run", MAX_STEPS)["world_size"] == 2


def test_the_installed_chaos_tool_passes_a_one_fault_scenario(
    venv: tuple[Path, dict[str, str]], tmp_path: Path, cache_dir: Path
) -> None:
    home, env = venv
    command = [str(home / "bin" / "elastic-qa"), "chaos", "run", "--run-dir", str(tmp_path / "run")]
    command += ["--agents", "2", "--no-reference", "--timeout", "150", "--fault", "kill-worker@step=5"]
    overrides = [f"data.cache_dir={cache_dir}", f"train.max_steps={MAX_STEPS}", "debug.step_delay=100ms"]
    run([*command, *overrides], tmp_path, env, 240)
    report = json.loads((tmp_path / "run" / "chaos" / "report.json").read_text())
    assert report["ok"] and [row["verdict"] for row in report["faults"]] == ["ok"]
    # The job it ran is the installed launcher's: its result line, and a final checkpoint of two agents.
    assert f"result: step {MAX_STEPS}" in (tmp_path / "run" / "chaos" / "launcher.log").read_text()
    assert final_checkpoint(tmp_path / "run", MAX_STEPS)["world_size"] == 2
