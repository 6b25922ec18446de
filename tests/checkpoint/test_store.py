"""CheckpointStore: the commit protocol, the manifest, verification and removal, on local disk and memory://."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle

import pytest
import torch

from elastic_qa.checkpoint.backends import open_store
from elastic_qa.checkpoint.payload import MODEL_FILE, OPTIMIZER_FILE, TRAINER_FILE
from elastic_qa.checkpoint.store import (
    MANIFEST,
    REJECTED_DIR,
    REJECTED_NOTE,
    CheckpointError,
    CheckpointStore,
    StaleWriterError,
    staging_dir_name,
    step_dir_name,
)
from elastic_qa.checkpoint.store_manifest import ManifestLastStore
from elastic_qa.checkpoint.store_rename import RenameCommitStore
from tests.checkpoint.faulty_fs import faults
from tests.checkpoint.helpers import (
    TouchOnUnpickle,
    crafted_plain_pickle,
    crafted_tensor_file,
    entries,
    file_path,
    flip_byte,
    garble_manifest,
    manifest_fields,
    remove_file,
    remove_manifest,
    small_files,
    snapshot,
    truncate,
)

FILES = (MODEL_FILE, OPTIMIZER_FILE, TRAINER_FILE)


def test_open_store_picks_rename_for_local_paths_and_manifest_last_elsewhere(tmp_path) -> None:
    for url in (str(tmp_path / "ckpt"), f"file://{tmp_path}/ckpt"):
        assert type(open_store(url)) is RenameCommitStore
    for url in ("memory://ckpt-kind", "faulty://ckpt-kind"):
        assert type(open_store(url)) is ManifestLastStore
    local = open_store(str(tmp_path / "ckpt"))
    assert type(open_store(local.path("sub"), local.fs)) is RenameCommitStore  # an fs given is used


def test_the_abstract_base_is_no_store_of_its_own(tmp_path) -> None:
    with pytest.raises(TypeError, match="abstract"):
        CheckpointStore(str(tmp_path / "ckpt"))


def test_a_committed_checkpoint_is_listed_verified_and_loaded(store: CheckpointStore) -> None:
    files = small_files(420)
    path = store.commit(420, files, manifest_fields())

    assert path == store.path("step-00000420")
    assert [(info.step, info.path, info.committed) for info in store.list_steps()] == [(420, path, True)]
    assert store.exists(420) and not store.exists(419)
    verdict = store.verify(path)
    assert verdict.ok, verdict.reason
    model = store.load_file(path, verdict.manifest, MODEL_FILE)
    expected = torch.load(io.BytesIO(files[MODEL_FILE]), weights_only=True)
    assert torch.equal(model["w"], expected["w"])


def test_verification_keeps_the_bytes_it_checked_of_the_files_asked_for(store: CheckpointStore) -> None:
    """A restore unpickles the very bytes verification hashed: each file is read once."""
    files = small_files(7)
    path = store.commit(7, files, manifest_fields())
    verdict = store.verify(path, keep=(MODEL_FILE, TRAINER_FILE))
    assert verdict.ok, verdict.reason
    assert verdict.kept == {MODEL_FILE: files[MODEL_FILE], TRAINER_FILE: files[TRAINER_FILE]}
    assert store.verify(path).kept == {}
    flip_byte(store, file_path(store, 7, OPTIMIZER_FILE))  # a damaged file fails the whole, kept or not
    damaged = store.verify(path, keep=(MODEL_FILE,))
    assert not damaged.ok and "sha256" in damaged.reason


def test_checkpoints_are_listed_oldest_first_and_temporary_dirs_never(store: CheckpointStore) -> None:
    for step in (30, 10, 20):
        store.commit(step, small_files(step), manifest_fields())
    store.fs.makedirs(store.path(".tmp-step-00000040-deadbeef"), exist_ok=True)
    store.fs.pipe_file(store.path(".tmp-step-00000040-deadbeef", "model.pt"), b"partial")

    assert [info.step for info in store.list_steps()] == [10, 20, 30]


def test_the_manifest_records_each_files_size_and_sha256_and_the_run(store: CheckpointStore) -> None:
    files = small_files(420)
    path = store.commit(420, files, manifest_fields(epoch=3, world_size=4))
    manifest = store.read_manifest(path)

    assert manifest["step"] == 420
    assert manifest["epoch"] == 3
    assert manifest["world_size"] == 4
    assert manifest["config_hash"] == "c0ffee" * 10
    assert set(manifest["versions"]) == {"elastic_qa", "torch", "python"}
    assert manifest["created"].endswith("Z") and manifest["created_ts"] > 0
    assert set(manifest["files"]) == set(FILES)
    for logical, data in files.items():
        entry = manifest["files"][logical]
        stored = store.fs.cat_file(f"{path}/{entry['name']}")
        assert stored == data
        assert entry["size"] == len(data)
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()


def test_a_local_checkpoint_holds_exactly_the_three_tensor_files_and_the_manifest(tmp_path) -> None:
    store = open_store(str(tmp_path / "ckpt"))
    store.commit(420, small_files(420), manifest_fields())

    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step-00000420"]
    assert sorted(os.listdir(tmp_path / "ckpt" / "step-00000420")) == sorted([*FILES, MANIFEST])


def test_a_second_commit_of_a_step_by_the_same_attempt_leaves_the_first_byte_identical(
    store: CheckpointStore,
) -> None:
    """Two survivors of one attempt write the same step: the first stands, the second copy is dropped."""
    path = store.commit(7, small_files(7), manifest_fields())
    before = snapshot(store, path)
    root_before = entries(store)

    assert store.commit(7, small_files(1234), manifest_fields(epoch=9)) == path

    assert snapshot(store, path) == before
    assert entries(store) == root_before  # no leftover temporary directory either
    assert store.verify(path).ok


def test_a_newer_attempt_supersedes_an_older_attempts_checkpoint_of_the_same_step(
    store: CheckpointStore,
) -> None:
    """A replay across a step (e.g. after its newer checkpoint was rejected) must commit its own state."""
    old = store.commit(7, small_files(7), manifest_fields(attempt=1))
    old_manifest = store.read_manifest(old)

    path = store.commit(7, small_files(1234), manifest_fields(attempt=2))

    verdict = store.verify(path)
    assert verdict.ok and verdict.manifest["attempt"] == 2
    model = store.load_file(path, verdict.manifest, MODEL_FILE)
    expected = torch.load(io.BytesIO(small_files(1234)[MODEL_FILE]), weights_only=True)
    assert torch.equal(model["w"], expected["w"])
    assert [info.step for info in store.list_steps(committed_only=False)] == [7]
    kept = [name for name in entries(store) if name == REJECTED_DIR]
    assert kept, "the superseded checkpoint's manifest is kept for forensics"
    rejected = store.fs.find(store.path(REJECTED_DIR))
    manifests = [p for p in rejected if p.endswith(MANIFEST)]
    assert len(manifests) == 1
    assert json.loads(store.fs.cat_file(manifests[0]))["files"] == old_manifest["files"]


def test_an_older_attempt_may_not_commit_over_a_newer_attempts_checkpoint(store: CheckpointStore) -> None:
    path = store.commit(7, small_files(7), manifest_fields(attempt=3))
    before = snapshot(store, path)

    with pytest.raises(StaleWriterError):
        store.commit(7, small_files(1234), manifest_fields(attempt=2))

    assert snapshot(store, path) == before
    assert entries(store) == ["step-00000007"]


def test_a_commit_over_a_damaged_checkpoint_of_its_own_attempt_replaces_it(store: CheckpointStore) -> None:
    store.commit(7, small_files(7), manifest_fields())
    flip_byte(store, file_path(store, 7, MODEL_FILE))

    path = store.commit(7, small_files(1234), manifest_fields())

    verdict = store.verify(path)
    assert verdict.ok
    model = store.load_file(path, verdict.manifest, MODEL_FILE)
    expected = torch.load(io.BytesIO(small_files(1234)[MODEL_FILE]), weights_only=True)
    assert torch.equal(model["w"], expected["w"])


def test_quarantine_moves_a_checkpoint_out_of_listing_with_a_note_of_why(store: CheckpointStore) -> None:
    keep = store.commit(3, small_files(3), manifest_fields())
    bad = store.commit(5, small_files(5), manifest_fields())
    before = {name.rsplit("/", 1)[-1]: data for name, data in snapshot(store, bad).items()}

    target = store.quarantine(bad, "model.pt: sha256 mismatch")

    assert [info.step for info in store.list_steps(committed_only=False)] == [3]
    assert store.verify(keep).ok
    moved = {name.rsplit("/", 1)[-1]: data for name, data in snapshot(store, target).items()}
    note = json.loads(moved.pop(REJECTED_NOTE))
    assert moved == before
    assert note["original"] == "step-00000005" and "sha256" in note["reason"]


def test_a_writer_that_loses_the_race_discards_its_copy_and_never_touches_the_winner(
    store: CheckpointStore,
) -> None:
    """Writer A has written its files when writer B commits the same step; A must then back off."""
    winner: dict[str, bytes] = {}

    def other_writer_commits_first() -> None:
        path = store.commit(7, small_files(1), manifest_fields())
        referenced = {f"{path}/{MANIFEST}"} | {
            f"{path}/{entry['name']}" for entry in store.read_manifest(path)["files"].values()
        }
        winner.update({name: data for name, data in snapshot(store, path).items() if name in referenced})

    path = store.path(step_dir_name(7))
    assert store.commit(7, small_files(2), manifest_fields(), may_commit=other_writer_commits_first) == path

    path = store.path(step_dir_name(7))
    assert snapshot(store, path) == winner
    assert store.verify(path).ok
    assert entries(store) == ["step-00000007"]


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (lambda s: truncate(s, file_path(s, 5, MODEL_FILE)), ["model.pt", "size"]),
        (lambda s: flip_byte(s, file_path(s, 5, OPTIMIZER_FILE)), ["optimizer.pt", "sha256"]),
        (lambda s: remove_manifest(s, 5), ["manifest.json", "missing"]),
        (lambda s: garble_manifest(s, 5), ["manifest.json", "unreadable"]),
        (lambda s: remove_file(s, 5, TRAINER_FILE), ["trainer.pt", "missing"]),
    ],
    ids=["truncated-file", "flipped-byte", "missing-manifest", "garbage-manifest", "missing-file"],
)
def test_verification_names_the_damaged_file_and_what_is_wrong(
    store: CheckpointStore, damage, expected: list[str]
) -> None:
    path = store.commit(5, small_files(5), manifest_fields())
    damage(store)

    verdict = store.verify(path)

    assert not verdict.ok
    for word in expected:
        assert word in verdict.reason


def test_a_manifest_that_is_json_but_not_a_manifest_is_unreadable(store: CheckpointStore) -> None:
    path = store.commit(5, small_files(5), manifest_fields())
    store.fs.pipe_file(f"{path}/{MANIFEST}", b"[1, 2, 3]")

    verdict = store.verify(path)

    assert not verdict.ok and "manifest.json unreadable" in verdict.reason


def test_the_crafted_payload_really_runs_code_when_unpickled_unsafely(tmp_path) -> None:
    """Guards the next test: its payload must be live, or refusing it would prove nothing."""
    marker = tmp_path / "pwned"
    pickle.loads(pickle.dumps(TouchOnUnpickle(str(marker))))
    assert marker.exists()
    marker.unlink()
    torch.load(io.BytesIO(crafted_tensor_file(str(marker))), weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize("crafted", [crafted_tensor_file, crafted_plain_pickle], ids=["zip", "legacy"])
def test_a_tensor_file_that_would_run_code_is_refused_even_with_a_correct_sha256(
    store: CheckpointStore, tmp_path, crafted
) -> None:
    from elastic_qa.checkpoint.manager import Checkpointer
    from elastic_qa.config import CheckpointConfig

    marker = tmp_path / "pwned"
    files = {**small_files(3), MODEL_FILE: crafted(str(marker))}
    path = store.commit(3, files, manifest_fields())
    verdict = store.verify(path)
    assert verdict.ok  # the sha256 matches: only weights_only loading stands in the way

    with pytest.raises(CheckpointError, match=r"model\.pt"):
        store.load_file(path, verdict.manifest, MODEL_FILE)
    with pytest.raises(CheckpointError):
        Checkpointer(CheckpointConfig(), store).load_step(path, 3)

    assert not marker.exists()


def test_load_file_refuses_a_file_changed_after_verification(store: CheckpointStore) -> None:
    path = store.commit(3, small_files(3), manifest_fields())
    verdict = store.verify(path)
    flip_byte(store, file_path(store, 3, MODEL_FILE))

    with pytest.raises(CheckpointError, match="changed"):
        store.load_file(path, verdict.manifest, MODEL_FILE)


def test_remove_deletes_the_manifest_before_anything_else(faulty_store: CheckpointStore) -> None:
    path = faulty_store.commit(3, small_files(3), manifest_fields())
    faults.removes.clear()

    faulty_store.remove(path)

    assert faults.removes[0] == f"{path}/{MANIFEST}"
    assert faulty_store.list_steps(committed_only=False) == []


def test_a_half_done_remove_leaves_a_directory_that_is_no_checkpoint(faulty_store: CheckpointStore) -> None:
    keep = faulty_store.commit(2, small_files(2), manifest_fields())
    path = faulty_store.commit(3, small_files(3), manifest_fields())
    faults.fail_removes(after=1, match="step-00000003")  # the manifest goes, the directory does not

    with pytest.raises(PermissionError):
        faulty_store.remove(path)

    assert [info.step for info in faulty_store.list_steps()] == [2]
    assert not faulty_store.verify(path).ok
    assert faulty_store.verify(keep).ok


def test_clean_staging_removes_only_older_attempts_staging_and_nothing_it_did_not_name(tmp_path) -> None:
    root = tmp_path / "ckpt"
    store = open_store(str(root))
    committed = store.commit(1, small_files(1), manifest_fields())
    older = root / staging_dir_name(6, 2, "aaaaaaaa")
    current = root / staging_dir_name(7, 3, "bbbbbbbb")
    deleted = root / ".tmp-step-00000004-deleted-cccccccc"
    legacy = root / ".tmp-step-00000005-dddddddd"  # staging named by earlier versions
    strangers = [root / ".tmp-notes", root / ".tmp-a00000001-step-00000002-NOTHEX!!", root / ".tmp-mine"]
    for directory in (older, current, deleted, legacy, *strangers):
        directory.mkdir()
        (directory / "model.pt").write_bytes(b"partial")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "keep.txt").write_text("not ours")
    link = root / staging_dir_name(1, 9, "eeeeeeee")
    link.symlink_to(tmp_path / "elsewhere")

    removed = store.clean_staging(attempt=7)

    assert sorted(removed) == sorted(str(p) for p in (older, deleted, legacy))
    left = sorted(os.listdir(root))
    assert left == sorted([current.name, link.name, "step-00000001", *(p.name for p in strangers)])
    assert (tmp_path / "elsewhere" / "keep.txt").read_text() == "not ours"
    assert store.verify(committed).ok


def test_clean_staging_does_nothing_on_stores_without_rename() -> None:
    store = open_store("memory://ckpt-staging")
    store.commit(1, small_files(1), manifest_fields())

    assert store.clean_staging(attempt=9) == []
    assert [info.step for info in store.list_steps()] == [1]


def test_a_refused_commit_leaves_nothing_behind(store: CheckpointStore) -> None:
    class Refused(RuntimeError):
        pass

    def refuse() -> None:
        raise Refused("fenced")

    with pytest.raises(Refused):
        store.commit(9, small_files(9), manifest_fields(), may_commit=refuse)

    assert entries(store) == []
    assert store.list_steps(committed_only=False) == []


def test_a_refused_commit_leaves_older_checkpoints_untouched(store: CheckpointStore) -> None:
    path = store.commit(8, small_files(8), manifest_fields())
    before = snapshot(store, path)

    def refuse() -> None:
        raise RuntimeError("fenced")

    with pytest.raises(RuntimeError):
        store.commit(9, small_files(9), manifest_fields(), may_commit=refuse)

    assert entries(store) == ["step-00000008"]
    assert snapshot(store, path) == before


@pytest.mark.parametrize("failing_write", [1, 2, 4], ids=["first-file", "second-file", "manifest"])
def test_a_storage_error_mid_commit_leaves_nothing_behind(
    faulty_store: CheckpointStore, failing_write
) -> None:
    older = faulty_store.commit(1, small_files(1), manifest_fields())
    before = snapshot(faulty_store, older)
    faults.fail_writes(after=failing_write - 1, count=1, partial=True)

    with pytest.raises(OSError):
        faulty_store.commit(2, small_files(2), manifest_fields())

    assert entries(faulty_store) == ["step-00000001"]
    assert faulty_store.list_steps(committed_only=False)[-1].step == 1
    assert snapshot(faulty_store, older) == before
    faults.heal()
    retried = faulty_store.commit(2, small_files(2), manifest_fields())  # the step is not blocked
    assert retried is not None and faulty_store.verify(retried).ok


@pytest.mark.parametrize("failing_write", [1, 2, 4], ids=["first-file", "second-file", "manifest"])
def test_a_local_storage_error_mid_commit_removes_the_staging_directory(
    tmp_path, monkeypatch, failing_write
) -> None:
    store = open_store(str(tmp_path / "ckpt"))
    older = store.commit(1, small_files(1), manifest_fields())
    before = snapshot(store, older)
    real_write = store._write
    calls = []

    def write(path: str, data: bytes) -> None:
        calls.append(path)
        if len(calls) == failing_write:
            real_write(path, data[:10])  # the disk filled up mid-file
            raise OSError(28, "No space left on device", path)
        real_write(path, data)

    monkeypatch.setattr(store, "_write", write)

    with pytest.raises(OSError):
        store.commit(2, small_files(2), manifest_fields())

    assert entries(store) == ["step-00000001"]
    assert snapshot(store, older) == before


def test_only_one_of_two_writers_racing_for_the_manifest_commits(
    faulty_store: CheckpointStore,
) -> None:
    """Stores without rename: writer B commits between writer A's last check and A's manifest write."""
    results: dict[str, str | None] = {}

    def other_writer_slips_in(path: str) -> None:
        if path.endswith(MANIFEST) and "B" not in results:
            results["B"] = "running"
            results["B"] = faulty_store.commit(7, small_files(1), manifest_fields())

    faults.before_write = other_writer_slips_in
    results["A"] = faulty_store.commit(7, small_files(2), manifest_fields())
    faults.before_write = None

    path = faulty_store.path(step_dir_name(7))
    assert results["B"] == path
    assert results["A"] == path  # A lost: it must not replace B's manifest (same attempt: B's stands)
    verdict = faulty_store.verify(path)
    assert verdict.ok
    model = faulty_store.load_file(path, verdict.manifest, MODEL_FILE)
    assert torch.equal(model["w"], torch.load(io.BytesIO(small_files(1)[MODEL_FILE]), weights_only=True)["w"])
    referenced = {f"{path}/{e['name']}" for e in verdict.manifest["files"].values()} | {f"{path}/{MANIFEST}"}
    assert set(snapshot(faulty_store, path)) == referenced  # A's files are gone


def test_a_local_delete_that_fails_midway_leaves_no_step_directory_behind(tmp_path, monkeypatch) -> None:
    store = open_store(str(tmp_path / "ckpt"))
    keep = store.commit(2, small_files(2), manifest_fields())
    path = store.commit(3, small_files(3), manifest_fields())
    real_rm = store.fs.rm

    def rm(target, recursive=False, **kwargs):
        if recursive:  # the manifest went; the rest fails (or the process dies here)
            raise OSError(5, "Input/output error", target)
        return real_rm(target, recursive=recursive, **kwargs)

    monkeypatch.setattr(store.fs, "rm", rm)
    with pytest.raises(OSError):
        store.remove(path)
    monkeypatch.undo()

    assert [info.step for info in store.list_steps(committed_only=False)] == [2]
    assert not os.path.exists(path)
    assert store.verify(keep).ok
    store.clean_staging(attempt=2)  # what a restarted job does first
    assert entries(store) == ["step-00000002"]
