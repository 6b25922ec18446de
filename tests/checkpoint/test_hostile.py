"""Hostile or odd files in a checkpoint directory: each gets one clear verdict, never a hang, a traceback,
a read outside the checkpoint directory, or a change to anything that is not ours."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from collections.abc import Callable
from contextlib import redirect_stdout, suppress
from io import StringIO
from pathlib import Path
from typing import Any

import pytest

from elastic_qa import ckpt as inspect
from elastic_qa.checkpoint import locate
from elastic_qa.checkpoint.backends import open_store
from elastic_qa.checkpoint.manager import Checkpointer
from elastic_qa.checkpoint.payload import MODEL_FILE, TRAINER_FILE
from elastic_qa.checkpoint.store import MANIFEST, CheckpointError, CheckpointStore, serialize, step_dir_name
from elastic_qa.cli import main as cli_main
from elastic_qa.config import CheckpointConfig
from tests.checkpoint.helpers import crafted_tensor_file, event_names, file_path, manifest_fields, small_files
from tests.checkpoint.runs import train

# ---- helpers ------------------------------------------------------------------------------------------


def rewrite_manifest(store: CheckpointStore, step: int, change: Callable[[dict[str, Any]], None]) -> str:
    """Edit checkpoint `step`'s manifest in place (as a hostile hand would); returns the step directory."""
    path = store.path(step_dir_name(step))
    manifest = json.loads(store.fs.cat_file(f"{path}/{MANIFEST}"))
    change(manifest)
    store.fs.pipe_file(f"{path}/{MANIFEST}", json.dumps(manifest).encode())
    return path


def rename_model(name: str) -> Callable[[dict[str, Any]], None]:
    def change(manifest: dict[str, Any]) -> None:
        manifest["files"][MODEL_FILE]["name"] = name

    return change


def within(seconds: float, call: Callable[[], Any], unblock: Callable[[], None]) -> Any:
    """`call()`'s result, failing the test if it takes longer than `seconds` (then `unblock` frees it)."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = call()
        except BaseException as err:  # noqa: BLE001 - re-raised in the test's thread
            result["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        unblock()
        thread.join(5)
        pytest.fail(f"still blocked after {seconds}s")
    if "error" in result:
        raise result["error"]
    return result["value"]


def open_fifo_writer_briefly(fifo: Path) -> None:
    """A reader blocked in open() on `fifo` gets past it (and sees end of file)."""
    with suppress(OSError):
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def tree(root: Path) -> dict[str, bytes]:
    """Every file under `root` with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def local(tmp_path: Path) -> CheckpointStore:
    return open_store(str(tmp_path / "ckpt"))


# ---- 7: a checkpoint pruned while it is being verified is gone, not damaged ---------------------------


def pruned_underfoot(backend: type[CheckpointStore], target: str, when: str) -> type[CheckpointStore]:
    """A store (of concrete class `backend`) whose checkpoint `target` is deleted by a concurrent pruner
    just before (or just after) its manifest is read: the moments a real prune can hit `ckpt verify`."""
    pruned: list[str] = []

    class PrunedUnderfoot(backend):
        def read_manifest(self, path: str) -> dict[str, Any]:
            if path.endswith(target) and not pruned and when == "before-manifest":
                pruned.append(path)
                self.remove(path)
            manifest = super().read_manifest(path)
            if path.endswith(target) and not pruned and when == "after-manifest":
                pruned.append(path)
                self.remove(path)
            return manifest

    return PrunedUnderfoot


@pytest.mark.parametrize("when", ["before-manifest", "after-manifest"])
def test_ckpt_verify_reports_a_checkpoint_pruned_while_verifying_as_gone_not_bad(
    store: CheckpointStore, monkeypatch, capsys, when: str
) -> None:
    for step in (10, 20, 30):
        store.commit(step, small_files(step), manifest_fields())
    pruned = pruned_underfoot(type(store), step_dir_name(20), when)
    monkeypatch.setattr(locate, "open_store", lambda url: pruned(url))

    code = inspect.cmd_verify(store.url)

    lines = capsys.readouterr().out.splitlines()
    assert code == 0, lines
    assert lines == ["step 10: ok", "step 20: pruned while verifying", "step 30: ok"]
    assert [info.step for info in store.list_steps()] == [10, 30]


def test_ckpt_list_leaves_out_a_checkpoint_pruned_while_listing(
    store: CheckpointStore, monkeypatch, capsys
) -> None:
    for step in (10, 20):
        store.commit(step, small_files(step), manifest_fields())
    pruned = pruned_underfoot(type(store), step_dir_name(10), "after-manifest")
    monkeypatch.setattr(locate, "open_store", lambda url: pruned(url))

    assert inspect.cmd_list(store.url) == 0

    rows = capsys.readouterr().out.splitlines()[1:]
    assert [row.split()[0] for row in rows] == ["20"]
    assert rows[0].endswith("yes")


def test_ckpt_verify_racing_a_real_writer_that_prunes_never_reports_damage(local: CheckpointStore) -> None:
    """The race as it happens: a writer commits and prunes (keep_last=1) while verify runs again and again."""
    checkpointer = Checkpointer(CheckpointConfig(async_=False, keep_last=1), local)
    local.commit(1, small_files(1), manifest_fields())
    done = threading.Event()

    def writer() -> None:
        for step in range(2, 16):
            local.commit(step, small_files(step), manifest_fields())
            checkpointer.prune(keep=step)
        done.set()

    outputs, codes = [], []
    thread = threading.Thread(target=writer)
    thread.start()
    try:
        while not done.is_set():
            out = StringIO()
            with redirect_stdout(out):
                codes.append(inspect.cmd_verify(local.root))
            outputs.append(out.getvalue())
    finally:
        thread.join()
    assert set(codes) == {0}, [o for o in outputs if "BAD" in o][:3]


# ---- 8: only plain files directly inside the step directory are ever read ------------------------------


@pytest.mark.parametrize(
    "name",
    ["../step-00000001/MODEL", "sub/MODEL", "..", "", MANIFEST, "a\\b", "x\x00y", 7],
    ids=["sibling-step", "subdirectory", "dotdot", "empty", "manifest", "backslash", "nul", "not-a-string"],
)
def test_a_manifest_naming_anything_but_a_plain_file_of_its_own_directory_is_refused(
    store: CheckpointStore, name: Any
) -> None:
    """Even when the named file holds exactly the recorded bytes (it is step 1's model, same sha256)."""
    store.commit(1, small_files(1), manifest_fields())
    theirs = file_path(store, 1, MODEL_FILE)
    model = store.fs.cat_file(theirs)
    if isinstance(name, str):
        name = name.replace("MODEL", theirs.rsplit("/", 1)[-1])
    path = store.path(step_dir_name(2))
    store.commit(2, {**small_files(2), MODEL_FILE: model}, manifest_fields())
    store.fs.makedirs(f"{path}/sub", exist_ok=True)
    store.fs.pipe_file(f"{path}/sub/{theirs.rsplit('/', 1)[-1]}", model)
    rewrite_manifest(store, 2, rename_model(name))

    verdict = store.verify(path)

    assert not verdict.ok and "model.pt" in verdict.reason and "plain name" in verdict.reason
    with pytest.raises(CheckpointError, match="plain name"):
        store.load_file(path, verdict.manifest, MODEL_FILE)


def test_a_manifest_naming_one_file_many_times_is_refused(store: CheckpointStore) -> None:
    """Else one big file listed under thousands of names would be hashed thousands of times."""
    path = store.commit(1, small_files(1), manifest_fields())

    def change(manifest: dict[str, Any]) -> None:
        for copy in range(3):
            manifest["files"][f"copy-{copy}"] = manifest["files"][MODEL_FILE]

    rewrite_manifest(store, 1, change)

    verdict = store.verify(path)

    assert not verdict.ok and "more than once" in verdict.reason


def test_a_manifest_naming_a_file_outside_the_checkpoint_directory_is_never_read(
    local: CheckpointStore, tmp_path: Path
) -> None:
    path = local.commit(1, small_files(1), manifest_fields())
    outside = tmp_path / "elsewhere" / "model.pt"
    outside.parent.mkdir()
    outside.write_bytes(small_files(1)[MODEL_FILE])  # hash-matching: reading it would pass
    rewrite_manifest(local, 1, rename_model("../../elsewhere/model.pt"))
    manifest = json.loads(Path(path, MANIFEST).read_text())

    assert not local.verify(path).ok
    with pytest.raises(CheckpointError):
        local.load_file(path, manifest, MODEL_FILE)


@pytest.mark.parametrize("target", ["outside-copy", "/dev/null"])
def test_a_file_that_is_a_symlink_is_refused_even_when_its_contents_match(
    local: CheckpointStore, tmp_path: Path, target: str
) -> None:
    path = local.commit(1, small_files(1), manifest_fields())
    model = Path(path, MODEL_FILE)
    copy = tmp_path / "copy.pt"
    copy.write_bytes(model.read_bytes())
    model.unlink()
    model.symlink_to(copy if target == "outside-copy" else target)

    verdict = local.verify(path)

    assert not verdict.ok and "model.pt" in verdict.reason and "symbolic link" in verdict.reason
    with pytest.raises(CheckpointError, match="symbolic link"):
        local.load_file(path, json.loads(Path(path, MANIFEST).read_text()), MODEL_FILE)


def test_a_manifest_that_is_a_symlink_is_refused(local: CheckpointStore, tmp_path: Path) -> None:
    path = local.commit(1, small_files(1), manifest_fields())
    manifest = Path(path, MANIFEST)
    elsewhere = tmp_path / "manifest-elsewhere.json"
    elsewhere.write_bytes(manifest.read_bytes())
    manifest.unlink()
    manifest.symlink_to(elsewhere)

    verdict = local.verify(path)

    assert not verdict.ok and "manifest.json unreadable" in verdict.reason


@pytest.mark.parametrize("which", [MODEL_FILE, MANIFEST])
def test_a_fifo_in_a_checkpoint_is_refused_at_once_by_verify_and_by_resume(
    local: CheckpointStore, events, which: str
) -> None:
    local.commit(1, small_files(1), manifest_fields())
    path = local.commit(2, small_files(2), manifest_fields())
    fifo = Path(path, which)
    fifo.unlink()
    os.mkfifo(fifo)

    verdict = within(3, lambda: local.verify(path), lambda: open_fifo_writer_briefly(fifo))
    loaded = within(
        3,
        lambda: Checkpointer(CheckpointConfig(), local).load_newest(),
        lambda: open_fifo_writer_briefly(fifo),
    )

    assert not verdict.ok and "regular file" in verdict.reason
    assert loaded is not None and loaded.step == 1  # resume falls back to the older checkpoint
    assert "checkpoint_rejected" in event_names(events)


def test_a_directory_named_like_a_checkpoint_file_is_refused(local: CheckpointStore) -> None:
    path = local.commit(1, small_files(1), manifest_fields())
    Path(path, MODEL_FILE).unlink()
    Path(path, MODEL_FILE).mkdir()

    verdict = local.verify(path)

    assert not verdict.ok and "regular file" in verdict.reason


@pytest.mark.parametrize("size", ["float", "negative", "string", "bool"])
def test_a_size_that_is_not_a_byte_count_is_refused(store: CheckpointStore, size: str) -> None:
    """A float equal to the real size compared equal before: the check must be on the type."""
    files = {**small_files(1), TRAINER_FILE: serialize({"x": 1})[:1]}  # a one-byte file: size True == 1
    path = store.commit(1, files, manifest_fields())
    real = store.read_manifest(path)["files"][TRAINER_FILE]["size"]
    bad = {"float": float(real), "negative": -1, "string": str(real), "bool": True}[size]

    def change(manifest: dict[str, Any]) -> None:
        manifest["files"][TRAINER_FILE]["size"] = bad

    rewrite_manifest(store, 1, change)

    verdict = store.verify(path)

    assert not verdict.ok and "trainer.pt" in verdict.reason and "size" in verdict.reason


def test_a_manifest_over_one_mib_is_refused(store: CheckpointStore) -> None:
    path = store.commit(1, small_files(1), manifest_fields())
    rewrite_manifest(store, 1, lambda manifest: manifest.update(padding="x" * 2**20))

    verdict = store.verify(path)

    assert not verdict.ok and "manifest.json unreadable" in verdict.reason


def test_a_deeply_nested_manifest_is_refused_cleanly(store: CheckpointStore) -> None:
    path = store.commit(1, small_files(1), manifest_fields())
    store.fs.pipe_file(f"{path}/{MANIFEST}", b"[" * 100_000 + b"]" * 100_000)

    verdict = store.verify(path)

    assert not verdict.ok and "manifest.json unreadable" in verdict.reason


def test_a_file_larger_than_its_manifest_says_is_refused(local: CheckpointStore) -> None:
    path = local.commit(1, small_files(1), manifest_fields())
    with open(Path(path, MODEL_FILE), "ab") as handle:
        handle.write(bytes(2**20))

    verdict = local.verify(path)

    assert not verdict.ok and "model.pt" in verdict.reason and "size" in verdict.reason


# ---- 9: nothing outside the checkpoint directory is ever modified --------------------------------------


@pytest.fixture
def other_run(tmp_path: Path) -> Path:
    """Another run's committed checkpoint (step 5), outside our checkpoint directory."""
    other = open_store(str(tmp_path / "other-run" / "checkpoints"))
    other.commit(5, small_files(5), manifest_fields())
    return tmp_path / "other-run"


def test_pruning_never_follows_a_symlinked_step_directory_into_another_run(
    local: CheckpointStore, other_run: Path, events, capsys
) -> None:
    before = tree(other_run)
    for step in (10, 20, 30):
        local.commit(step, small_files(step), manifest_fields())
    link = Path(local.path(step_dir_name(1)))
    link.symlink_to(other_run / "checkpoints" / step_dir_name(5), target_is_directory=True)

    Checkpointer(CheckpointConfig(keep_last=1), local).prune(keep=30)

    assert tree(other_run) == before
    assert [info.step for info in local.list_steps(committed_only=False)] == [30]
    assert inspect.cmd_verify(local.root) == 0
    assert capsys.readouterr().out.splitlines() == ["step 30: ok"]
    assert inspect.cmd_list(local.root) == 0
    assert [row.split()[0] for row in capsys.readouterr().out.splitlines()[1:]] == ["30"]
    assert tree(other_run) == before
    assert "checkpoint_foreign_entry" in event_names(events)
    assert link.is_symlink()  # not ours to delete either


def test_remove_refuses_a_symlink_and_anything_outside_its_directory(
    local: CheckpointStore, other_run: Path
) -> None:
    before = tree(other_run)
    local.commit(10, small_files(10), manifest_fields())
    link = Path(local.path(step_dir_name(1)))
    theirs = other_run / "checkpoints" / step_dir_name(5)
    link.symlink_to(theirs, target_is_directory=True)

    for path in (str(link), str(theirs), local.path("sub", step_dir_name(10))):
        with pytest.raises(CheckpointError):
            local.remove(path)

    assert tree(other_run) == before
    assert link.is_symlink() and local.verify(local.path(step_dir_name(10))).ok


def test_a_file_named_like_a_step_directory_is_not_a_checkpoint(store: CheckpointStore, events) -> None:
    store.commit(10, small_files(10), manifest_fields())
    store.fs.pipe_file(store.path(step_dir_name(20)), b"not a directory")

    assert [info.step for info in store.list_steps(committed_only=False)] == [10]
    assert "checkpoint_foreign_entry" in event_names(events)
    with pytest.raises(CheckpointError):
        store.remove(store.path(step_dir_name(20)))
    assert store.fs.cat_file(store.path(step_dir_name(20))) == b"not a directory"


# ---- 11: steps of any number of digits ----------------------------------------------------------------


def test_steps_of_nine_and_more_digits_are_listed_resumed_and_pruned_in_numeric_order(
    store: CheckpointStore,
) -> None:
    steps = [5, 99_999_999, 123_456_789, 1_234_567_890]
    for step in reversed(steps):
        store.commit(step, small_files(step % 1000), manifest_fields())
    # Nine digits with a leading zero is not what step_dir_name(1) writes: not a checkpoint name.
    odd = store.path("step-000000001")
    store.fs.makedirs(odd, exist_ok=True)
    store.fs.pipe_file(f"{odd}/{MANIFEST}", store.fs.cat_file(f"{store.path(step_dir_name(5))}/{MANIFEST}"))

    assert [info.step for info in store.list_steps(committed_only=False)] == steps
    checkpointer = Checkpointer(CheckpointConfig(keep_last=2), store)
    checkpointer.prune(keep=1_234_567_890)
    assert [info.step for info in store.list_steps()] == [123_456_789, 1_234_567_890]
    assert store.exists(1_234_567_890) and not store.exists(5)
    assert store.fs.exists(f"{odd}/{MANIFEST}")  # not ours by name: never pruned


def test_a_step_name_of_thousands_of_digits_is_ignored_not_a_crash() -> None:
    store = open_store("memory://ckpt-digits")
    store.commit(1, small_files(1), manifest_fields())
    store.fs.makedirs(store.path("step-" + "9" * 5000), exist_ok=True)

    assert [info.step for info in store.list_steps(committed_only=False)] == [1]


# ---- 13b: the ckpt commands on paths that are not checkpoint directories ------------------------------


@pytest.mark.parametrize("command", ["list", "verify", "show"])
def test_ckpt_commands_on_a_path_that_does_not_exist_exit_2_naming_it(
    tmp_path: Path, capsys, command: str
) -> None:
    missing = tmp_path / "no-such-run" / "checkpoints"

    assert cli_main(["ckpt", command, str(missing)]) == 2

    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.splitlines()) == 1 and str(missing) in captured.err


def test_ckpt_list_and_verify_of_a_file_exit_2(tmp_path: Path, capsys) -> None:
    a_file = tmp_path / "notes.txt"
    a_file.write_text("hello")

    assert cli_main(["ckpt", "list", str(a_file)]) == 2
    assert cli_main(["ckpt", "verify", str(a_file)]) == 2
    assert capsys.readouterr().err.count(str(a_file)) == 2


def test_ckpt_verify_and_list_of_an_existing_empty_directory_say_so_with_exit_2(
    tmp_path: Path, capsys
) -> None:
    assert cli_main(["ckpt", "verify", str(tmp_path)]) == 2
    assert cli_main(["ckpt", "list", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 2
    assert all(str(tmp_path) in line and "no checkpoints" in line for line in captured.err.splitlines())


def break_manifest(store: CheckpointStore) -> str:
    path = store.path(step_dir_name(1))
    Path(path, MANIFEST).unlink()
    return path


def garble_manifest(store: CheckpointStore) -> str:
    path = store.path(step_dir_name(1))
    Path(path, MANIFEST).write_bytes(b"\x00{not json\xff")
    return path


def not_a_trainer_state(store: CheckpointStore) -> str:
    store.commit(2, {**small_files(2), TRAINER_FILE: serialize({"not": "a trainer"})}, manifest_fields())
    return store.path(step_dir_name(2))


@pytest.mark.parametrize(
    "make",
    [break_manifest, garble_manifest, not_a_trainer_state],
    ids=["no-manifest", "garbled-manifest", "not-a-trainer-state"],
)
def test_ckpt_show_of_anything_but_a_valid_checkpoint_exits_2_with_one_line(
    local: CheckpointStore, capsys, make: Callable[[CheckpointStore], str]
) -> None:
    local.commit(1, small_files(1), manifest_fields())
    path = make(local)

    assert cli_main(["ckpt", "show", path]) == 2

    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.splitlines()) == 1 and path in captured.err


def test_ckpt_show_of_a_valid_checkpoint_under_another_name_shows_it(tmp_path: Path, capsys) -> None:
    store = open_store(str(tmp_path / "ckpt"))
    store.commit(3, small_files(3), manifest_fields())
    renamed = tmp_path / "ckpt" / "step-abc"
    os.rename(store.path(step_dir_name(3)), renamed)

    assert cli_main(["ckpt", "show", str(renamed)]) == 0
    assert "model.pt" in capsys.readouterr().out


def test_ckpt_list_escapes_control_characters_a_manifest_holds(local: CheckpointStore, capsys) -> None:
    local.commit(1, small_files(1), manifest_fields())
    rewrite_manifest(local, 1, lambda manifest: manifest.update(epoch="\x1b[2J\x1b]0;pwned\x07"))

    assert inspect.cmd_list(local.root) == 0

    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert out.splitlines()[1].endswith("yes")


def test_a_pickled_resume_from_is_refused_in_one_line_that_never_advises_weights_only_false(
    trained: Path, tmp_path: Path, cache_dir: Path
) -> None:
    step_dir = tmp_path / "given" / step_dir_name(30)
    shutil.copytree(trained / "checkpoints" / step_dir_name(30), step_dir)
    marker = tmp_path / "code-ran"
    crafted = crafted_tensor_file(str(marker))
    (step_dir / MODEL_FILE).write_bytes(crafted)
    manifest = json.loads((step_dir / MANIFEST).read_text())
    manifest["files"][MODEL_FILE].update(size=len(crafted), sha256=hashlib.sha256(crafted).hexdigest())
    (step_dir / MANIFEST).write_text(json.dumps(manifest))
    result = train(tmp_path / "run", cache_dir, f"checkpoint.resume_from={step_dir}")
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.pt refused by weights_only loading: Unsupported global" in lines[0], (
        lines
    )
    assert "False" not in lines[0] and not marker.exists()
