"""train.compile: its config, the compile cache's privacy (every level of its path; a run directory swapped
or copied with planted code), and (long) a restarted compiled run that loads its graphs from the cache and
resumes to the uninterrupted compiled run's parameters."""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

import elastic_qa.compile as compile_module  # names new since 7b5c8fd are read in the tests that use them
from elastic_qa.bench.cli import main as bench_main
from elastic_qa.chaos.evidence import final_parameters, parameter_difference
from elastic_qa.compile import compile_cache_dir, private_directory
from elastic_qa.config import ConfigError, load_config, packaged_config
from elastic_qa.exits import EXIT_BAD_INPUT
from elastic_qa.observe.follow import read_events
from elastic_qa.step_holds import arm, release
from tests.conftest import tiny_overrides

STEPS = 40
# A compile takes ~25 s of CPU for the tiny model; a loaded 2-core machine stretches that several times.
COMPILED_RUN_TIMEOUT_S = 900


# Where a run directory used to keep its compile cache: what a hostile user or a copied run directory plants.
RUN_DIR_CACHE = "compile-cache"
OTHER_UID = 65534  # nobody


def compiled_command(run_dir: Path, cache: Path, *extra: str) -> list[str]:
    overrides = tiny_overrides(
        run_dir, cache, f"train.max_steps={STEPS}", "train.threads=1", "train.compile=true", *extra
    )
    return [sys.executable, "-m", "elastic_qa.train", "--config", "tiny", *overrides]


def home_env(run_dir: Path) -> dict[str, str]:
    """The environment of a compiled run whose home (and so its default compile cache) is its own."""
    home = run_dir.parent / f"{run_dir.name}-home"
    home.mkdir(exist_ok=True)
    return {**os.environ, "HOME": str(home)}


def compiled_run(
    run_dir: Path, cache: Path, *extra: str, expect: int = 0, home: str | None = None
) -> subprocess.CompletedProcess:
    env = home_env(run_dir) if home is None else {**os.environ, "HOME": home}
    result = subprocess.run(
        compiled_command(run_dir, cache, *extra),
        capture_output=True,
        text=True,
        timeout=COMPILED_RUN_TIMEOUT_S,
        env=env,
    )
    assert result.returncode == expect, result.stderr[-3000:]
    return result


def test_compile_is_off_by_default_and_its_keys_are_checked(tiny_config) -> None:
    assert tiny_config().train.compile is False
    with pytest.raises(ConfigError, match=r"train\.compile_mode='fast': must be one of"):
        tiny_config("train.compile_mode=fast")
    with pytest.raises(ConfigError, match=r"train\.compile=2: expected true or false"):
        tiny_config("train.compile=2")


def test_the_compile_cache_is_created_readable_by_its_owner_only_at_every_level_it_creates(
    tmp_path: Path,
) -> None:
    cache = private_directory(tmp_path / "home" / ".cache" / "compile")
    for level in (cache, cache.parent, cache.parent.parent):
        assert stat.S_IMODE(level.stat().st_mode) == 0o700


def test_a_compile_cache_that_others_can_write_is_refused(tmp_path: Path) -> None:
    cache = tmp_path / "compile"
    cache.mkdir()
    cache.chmod(0o777)
    with pytest.raises(ConfigError, match=r"writable by others \(mode 777\)"):
        private_directory(cache)


def test_a_level_above_the_compile_cache_that_others_can_write_is_refused_unless_sticky(
    tmp_path: Path,
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # anyone could rename what is below it and put her own directory there
    with pytest.raises(ConfigError, match=rf"train\.compile_cache_dir: {shared} is writable by others"):
        private_directory(shared / "mine" / "compile")
    shared.chmod(0o1777)  # like /tmp: only the owner of an entry can rename it
    assert private_directory(shared / "mine" / "compile") == shared / "mine" / "compile"


def test_a_level_that_another_user_owns_is_refused_even_through_a_symlink(tmp_path: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("giving a directory to another user takes root")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, OTHER_UID, OTHER_UID)
    (tmp_path / "link").symlink_to(theirs)
    for path in (theirs / "compile", tmp_path / "link" / "compile"):
        with pytest.raises(ConfigError, match=rf"{theirs} belongs to uid {OTHER_UID}, not this user or root"):
            private_directory(path)


def test_the_compile_cache_is_one_per_run_directory_and_never_inside_it(tiny_config, tmp_path: Path) -> None:
    caches = {
        compile_cache_dir(tiny_config(f"run.dir={run_dir}", f"train.compile_cache_dir={tmp_path / 'c'}"))
        for run_dir in (tmp_path / "a", tmp_path / "a" / ".." / "a", tmp_path / "b")
    }
    assert len(caches) == 2 and all(cache.parent == tmp_path / "c" for cache in caches)


def test_a_worker_refuses_to_load_code_from_a_cache_that_others_can_write(
    tmp_path: Path, cache_dir: Path
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    run_dir = tmp_path / "run"
    result = compiled_run(run_dir, cache_dir, f"train.compile_cache_dir={shared}", expect=EXIT_BAD_INPUT)
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith(f"elastic-qa: train.compile_cache_dir: {shared} is writable by others")
    assert not any(e["event"] == "train_start" for e in read_events(run_dir))


@pytest.mark.parametrize("case", ["empty home", "unwritable"])
def test_a_worker_that_cannot_place_its_compile_cache_says_so_in_one_line(
    tmp_path: Path, cache_dir: Path, case: str
) -> None:
    if case == "empty home":  # `~/.cache` would be `/.cache`
        extra, home = [], ""
        said = "train.compile_cache_dir=~/.cache/elastic_qa/compile: HOME='' is not an absolute path"
    else:  # /sys takes no new directory, not even from root
        extra, home = ["train.compile_cache_dir=/sys/elastic-qa-compile"], None
        said = "train.compile_cache_dir: cannot create /sys/elastic-qa-compile ("
    # One step: on a version that placed the cache elsewhere, the run ends after one compile.
    result = compiled_run(tmp_path, cache_dir, "train.max_steps=1", *extra, home=home, expect=EXIT_BAD_INPUT)
    assert result.stderr.strip().splitlines()[-1].startswith(f"elastic-qa: {said}"), result.stderr[-3000:]
    assert not any(e["event"] == "train_start" for e in read_events(tmp_path))


def test_the_compile_cache_dir_is_absolute_or_in_the_home_directory(tiny_config) -> None:
    with pytest.raises(
        ConfigError, match=r"train\.compile_cache_dir='cache': must be an absolute path or start"
    ):
        tiny_config("train.compile_cache_dir=cache")


@pytest.mark.parametrize("home", ["", "relative/home"])
def test_a_home_that_is_not_an_absolute_path_is_refused(
    tiny_config, monkeypatch: pytest.MonkeyPatch, home: str
) -> None:
    monkeypatch.setenv("HOME", home)
    said = f"train.compile_cache_dir=~/.cache/elastic_qa/compile: HOME={home!r} is not an absolute path"
    with pytest.raises(ConfigError, match=f"^{re.escape(said)}"):
        compile_module.cache_root(tiny_config())


def test_with_home_unset_the_password_database_says_where_home_is_or_the_start_is_refused(
    tiny_config, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pwd

    monkeypatch.delenv("HOME", raising=False)
    cfg = tiny_config()
    home = Path(pwd.getpwuid(os.getuid()).pw_dir)
    assert compile_module.cache_root(cfg) == Path(os.path.realpath(home / ".cache/elastic_qa/compile"))

    def no_entry(uid: int) -> pwd.struct_passwd:
        raise KeyError(uid)

    # A uid with no entry (a container's): running the interpreter as one here is not possible.
    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    with pytest.raises(
        ConfigError, match=r"^train\.compile_cache_dir=~/\.cache/elastic_qa/compile: HOME is unset"
    ):
        compile_module.cache_root(cfg)


def test_a_compile_cache_dir_inside_the_run_directory_is_refused(tiny_config, tmp_path: Path) -> None:
    for inside in (tmp_path / "run", tmp_path / "run" / "compile-cache"):
        cfg = tiny_config(f"train.compile_cache_dir={inside}")
        said = f"train.compile_cache_dir={inside}: inside run.dir="
        with pytest.raises(ConfigError, match=f"^{re.escape(said)}"):
            compile_cache_dir(cfg)


def test_inductor_and_triton_read_their_caches_only_from_the_checked_directory(
    tiny_config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch._dynamo.config as dynamo_config
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    import torch.compiler.config
    from torch._functorch._aot_autograd.autograd_cache import should_use_remote_autograd_cache
    from torch._inductor.runtime.cache_dir_utils import cache_dir, triton_cache_dir
    from torch._inductor.utils import should_use_remote_fx_graph_cache

    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    # What the environment may say (and monkeypatch restores once the test is done).
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "elsewhere-triton"))
    remote = [
        (inductor_config, "fx_graph_remote_cache"),
        (inductor_config, "autotune_remote_cache"),
        (inductor_config, "bundled_autotune_remote_cache"),
        (functorch_config, "enable_remote_autograd_cache"),
        (dynamo_config, "automatic_dynamic_remote_pgo"),
    ]
    for module, name in remote:  # as TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE=1 and its kin would set them
        monkeypatch.setattr(module, name, True)
    monkeypatch.setattr(inductor_config, "cpp_cache_precompile_headers", True)
    monkeypatch.setattr(torch.compiler.config, "force_disable_caches", False)

    directory = compile_module.use_compile_cache(tiny_config())
    assert directory.parent == home / ".cache" / "elastic_qa" / "compile"
    assert cache_dir() == str(directory)
    assert triton_cache_dir(0).startswith(f"{directory}{os.sep}")
    assert not should_use_remote_fx_graph_cache() and not should_use_remote_autograd_cache()
    assert all(getattr(module, name) is False for module, name in remote)
    assert inductor_config.cpp_cache_precompile_headers is False


def test_no_other_user_can_replace_a_level_of_the_compile_cache_once_it_is_checked() -> None:
    if os.getuid() != 0:
        pytest.skip("acting as another user takes root")
    # Outside tmp_path, whose parents other users cannot enter: here they can reach the shared level.
    top = Path(tempfile.mkdtemp(prefix="eqa-compile-levels-", dir="/tmp"))
    try:
        top.chmod(0o755)
        shared = top / "shared"
        shared.mkdir()
        shared.chmod(0o1777)  # like /tmp
        cache = private_directory(shared / "mine" / "compile")

        def as_other_user(*command: str) -> int:
            return subprocess.run(command, user=OTHER_UID, capture_output=True, timeout=60).returncode

        assert as_other_user("mkdir", str(shared / "hers")) == 0  # she can write into the shared level
        assert as_other_user("mv", str(shared / "mine"), str(shared / "mine.aside")) != 0
        assert as_other_user("mv", str(cache), str(cache.parent / "compile.aside")) != 0
        assert as_other_user("mkdir", str(cache / "fxgraph")) != 0
        assert not (shared / "mine.aside").exists() and not (cache / "fxgraph").exists()
    finally:
        shutil.rmtree(top)


def test_the_recovery_benchmark_turns_the_compile_cache_off_only_for_a_compiled_product(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench_main(["recovery", "--no-compile-cache", "--work-dir", str(tmp_path)]) == EXIT_BAD_INPUT
    assert capsys.readouterr().err.strip() == (
        "elastic-qa bench recovery: --no-compile-cache: only with --compile"
    )


def compile_events(run_dir: Path, attempt: int) -> list[dict]:
    return [e for e in read_events(run_dir) if e["event"] == "compile" and e.get("attempt") == attempt]


def final_params(run_dir: Path, cache: Path) -> dict[str, torch.Tensor]:
    found = final_parameters(load_config(packaged_config("tiny"), tiny_overrides(run_dir, cache)))
    assert found is not None and found[0] == STEPS
    return found[1]


@pytest.mark.long
def test_a_restarted_compiled_run_loads_its_graphs_from_the_cache_and_resumes_bitwise(
    tmp_path: Path, cache_dir: Path
) -> None:
    uninterrupted, killed = tmp_path / "uninterrupted", tmp_path / "killed"
    compiled_run(uninterrupted, cache_dir)
    # SIGKILL after step 25; the newest checkpoint is step 20 (written synchronously: see test_trainer).
    compiled_run(
        killed,
        cache_dir,
        "checkpoint.every_steps=10",
        "checkpoint.async=false",
        "debug.kill_at_step=25",
        expect=-signal.SIGKILL,
    )
    [first] = compile_events(killed, attempt=1)
    assert first["step"] == 1 and first["graph_cache_misses"] > 0 and first["graph_cache_hits"] == 0
    cache = Path(first["cache_dir"])
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700 and any((cache / "fxgraph").iterdir())

    compiled_run(killed, cache_dir, "checkpoint.every_steps=10")
    [restarted] = compile_events(killed, attempt=2)
    assert restarted["step"] == 21
    assert restarted["graph_cache_hits"] > 0 and restarted["graph_cache_misses"] == 0
    diff = parameter_difference(final_params(killed, cache_dir), final_params(uninterrupted, cache_dir))
    assert diff["bitwise_equal"], diff


# The planted line: what another user adds to a generated wrapper, which inductor imports on a cache hit.
PLANT = "\nopen({marker!r}, 'w').close()\n"


def plant(directory: Path, marker: Path) -> int:
    """Add a line that creates `marker` to every generated Python file under `directory`; how many."""
    planted = 0
    for wrapper in directory.rglob("*.py"):
        with wrapper.open("a") as out:
            out.write(PLANT.format(marker=str(marker)))
        planted += 1
    return planted


def compiled_cache(run_dir: Path) -> Path:
    """Where a compiled run's cache is: its `compile` events say."""
    return Path(compile_events(run_dir, attempt=1)[0]["cache_dir"])


def trained_to(run_dir: Path, step: int) -> bool:
    return any(e["event"] == "step" and e["step"] == step for e in read_events(run_dir))


def held_at(run_dir: Path, step: int) -> bool:
    return any(e["event"] == "hold" and e["step"] == step for e in read_events(run_dir))


@pytest.fixture(scope="module")
def producer(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Path:
    """A finished 2-step compiled run: its cache holds the training graphs and evaluation's."""
    run_dir = tmp_path_factory.mktemp("producer") / "run"
    compiled_run(run_dir, cache_dir, "train.max_steps=2", "checkpoint.every_steps=2")
    return run_dir


@pytest.mark.long
def test_a_copied_run_directory_with_a_planted_line_in_a_generated_wrapper_resumes_without_running_it(
    tmp_path: Path, cache_dir: Path, producer: Path
) -> None:
    copied, marker = tmp_path / "copied", tmp_path / "planted-code-ran"
    shutil.copytree(producer, copied, symlinks=True)
    plant(copied, marker)
    compiled_run(copied, cache_dir, "train.max_steps=4")
    assert not marker.exists()
    [resumed] = compile_events(copied, attempt=2)  # its copied cache unread: it compiled (7b5c8fd: 2 hits)
    assert resumed["graph_cache_hits"] == 0 and resumed["graph_cache_misses"] > 0
    assert trained_to(copied, 4) and any(e["event"] == "resume" for e in read_events(copied))


@pytest.mark.long
def test_a_compile_cache_dir_that_leads_to_another_users_planted_cache_is_refused(
    tmp_path: Path, cache_dir: Path, producer: Path
) -> None:
    if os.getuid() != 0:
        pytest.skip("giving a directory to another user takes root")
    run_dir, theirs, marker = tmp_path / "run", tmp_path / "theirs", tmp_path / "planted-code-ran"
    link = tmp_path / "link"
    link.symlink_to(theirs, target_is_directory=True)
    setting = f"train.compile_cache_dir={link}"
    cfg = load_config(packaged_config("tiny"), tiny_overrides(run_dir, cache_dir, setting))
    # Her cache sits exactly where this run would look, holding the graphs it compiles (hits, if read).
    shutil.copytree(compiled_cache(producer), theirs / compile_cache_dir(cfg).name)
    assert plant(theirs, marker) > 0
    for path in (theirs, *theirs.rglob("*")):
        os.chown(path, OTHER_UID, OTHER_UID, follow_symlinks=False)
    result = compiled_run(run_dir, cache_dir, setting, "train.max_steps=2", expect=EXIT_BAD_INPUT)
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith(f"elastic-qa: {setting.split('=')[0]}: {theirs} belongs to uid {OTHER_UID}")
    assert not marker.exists()


@pytest.mark.long
def test_a_run_directory_cache_swapped_for_another_users_after_the_check_is_never_loaded(
    tmp_path: Path, cache_dir: Path, producer: Path
) -> None:
    theirs, marker = tmp_path / "theirs", tmp_path / "planted-code-ran"
    shutil.copytree(compiled_cache(producer), theirs)
    assert plant(theirs, marker) > 0
    if os.getuid() == 0:
        for path in (theirs, *theirs.rglob("*")):
            os.chown(path, OTHER_UID, OTHER_UID, follow_symlinks=False)
    run_dir = tmp_path / "run"
    hold_dir = tmp_path / "holds"
    arm(hold_dir, [1])
    job = subprocess.Popen(
        compiled_command(run_dir, cache_dir, "train.max_steps=2", f"debug.hold_dir={hold_dir}"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=home_env(run_dir),
    )
    try:
        # Held after step 1: every check has run and the training graphs are loaded; evaluation's are not.
        deadline = time.monotonic() + COMPILED_RUN_TIMEOUT_S
        while not held_at(run_dir, 1):  # its `hold` event: a step line comes every log.every_steps
            assert job.poll() is None and time.monotonic() < deadline, "the job never held at step 1"
            time.sleep(0.1)
        # She can write into the run directory: where its cache used to be, her cache now is.
        swapped = run_dir / RUN_DIR_CACHE
        if swapped.exists():
            swapped.rename(run_dir / f"{RUN_DIR_CACHE}.aside")
        swapped.symlink_to(theirs, target_is_directory=True)
        release(hold_dir, 1)
        _, stderr = job.communicate(timeout=COMPILED_RUN_TIMEOUT_S)
    finally:
        job.kill()
    assert job.returncode == 0, stderr[-3000:]
    assert not marker.exists()
    assert trained_to(run_dir, 2) and any(e["event"] == "eval" for e in read_events(run_dir))
