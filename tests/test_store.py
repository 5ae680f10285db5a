"""The local store: atomic manifest, verify, commit without overwriting, prune manifest-first."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from relaunch.errors import CheckpointError, EvacuationError, UsageError
from relaunch.manifest import (
    CheckpointRecord,
    FileRecord,
    StoreManifest,
    utc_now,
)
from relaunch.transports.folder import StoreFolder


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def record_for(name: str, step: int, files: dict[str, bytes]) -> CheckpointRecord:
    return CheckpointRecord(
        name=name,
        step=step,
        files={p: FileRecord(size=len(b), sha256=sha(b)) for p, b in files.items()},
        verified_at=utc_now(),
        host="root@10.0.0.2:22",
    )


def stage(store: StoreFolder, name: str, files: dict[str, bytes]) -> CheckpointRecord:
    """Put files where a transfer would: staging(name) / <store path>."""
    base = store.staging(name)
    for path, data in files.items():
        (base / path).parent.mkdir(parents=True, exist_ok=True)
        (base / path).write_bytes(data)
    return record_for(name, int(name.rsplit("-", 1)[1].split(".")[0]), files)


def evacuate(store: StoreFolder, manifest: StoreManifest, name: str, files: dict[str, bytes]) -> None:
    record = stage(store, name, files)
    assert store.verify_staged(name, record.files) == []
    store.commit(record)
    manifest.add(record)
    store.save_manifest(manifest)


HF_500 = {"checkpoint-500/model.pt": b"weights" * 1000, "checkpoint-500/trainer_state.json": b"{}"}


# -- manifest ----------------------------------------------------------------------------------


def test_manifest_round_trip_and_numeric_order(tmp_path: Path) -> None:
    store = StoreFolder(tmp_path / "store")
    assert store.load_manifest() is None
    m = StoreManifest(recipe="llama-ft")
    for step in (1000, 999, 20):
        m.add(record_for(f"ckpt-{step}.pt", step, {f"ckpt-{step}.pt": b"x" * step}))
    store.save_manifest(m)
    loaded = store.load_manifest()
    assert loaded == m
    assert [r.step for r in loaded.ordered()] == [20, 999, 1000]
    assert loaded.newest() is not None and loaded.newest().name == "ckpt-1000.pt"
    assert StoreManifest(recipe="x").newest() is None
    doc = json.loads(store.manifest_path.read_text())
    assert [c["name"] for c in doc["checkpoints"]] == ["ckpt-20.pt", "ckpt-999.pt", "ckpt-1000.pt"]


def test_manifest_write_is_atomic_when_the_write_fails_midway(tmp_path: Path, monkeypatch) -> None:
    store = StoreFolder(tmp_path)
    old = StoreManifest(recipe="r")
    old.add(record_for("ckpt-1.pt", 1, {"ckpt-1.pt": b"a"}))
    store.save_manifest(old)

    new = StoreManifest(recipe="r", checkpoints=dict(old.checkpoints))
    new.add(record_for("ckpt-2.pt", 2, {"ckpt-2.pt": b"b"}))
    real_fdopen = os.fdopen

    class HalfWritten:
        """The file object of the temp manifest: writes half the text, then the process 'dies'."""

        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()
            return False

        def write(self, text: str) -> int:
            self.f.write(text[: len(text) // 2])
            self.f.flush()
            raise KeyboardInterrupt

    monkeypatch.setattr(os, "fdopen", lambda fd, *a, **k: HalfWritten(real_fdopen(fd, *a, **k)))
    with pytest.raises(KeyboardInterrupt):
        store.save_manifest(new)
    monkeypatch.undo()

    assert store.load_manifest() == old
    assert sorted(p.name for p in store.meta.iterdir()) == ["manifest.json"]  # no temp left behind


def test_manifest_write_is_atomic_when_fsync_fails(tmp_path: Path, monkeypatch) -> None:
    store = StoreFolder(tmp_path)
    old = StoreManifest(recipe="r")
    store.save_manifest(old)

    def broken_fsync(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError):
        store.save_manifest(StoreManifest(recipe="other"))
    monkeypatch.undo()
    assert store.load_manifest() == old
    assert sorted(p.name for p in store.meta.iterdir()) == ["manifest.json"]


GOOD = {
    "name": "ckpt-1.pt",
    "step": 1,
    "verified_at": "2025-01-01T00:00:00Z",
    "host": "h",
    "files": {"ckpt-1.pt": {"size": 1, "sha256": "a" * 64}},
}


@pytest.mark.parametrize(
    "text",
    [
        "",
        "{not json",
        '{"format": 1, "recipe": "r", "checkpoints": [',  # truncated
        "[]",
        json.dumps({"format": 99, "recipe": "r", "checkpoints": []}),
        json.dumps({"format": 1, "checkpoints": []}),
        json.dumps({"format": 1, "recipe": "r", "checkpoints": [{**GOOD, "step": "1"}]}),
        json.dumps(
            {"format": 1, "recipe": "r", "checkpoints": [{**GOOD, "files": {"ckpt-1.pt": {"size": 1}}}]}
        ),
        json.dumps(
            {
                "format": 1,
                "recipe": "r",
                "checkpoints": [{**GOOD, "files": {"ckpt-1.pt": {"size": 1, "sha256": "nothex"}}}],
            }
        ),
        json.dumps(
            {
                "format": 1,
                "recipe": "r",
                "checkpoints": [
                    {**GOOD, "name": "../etc", "files": {"../etc/passwd": {"size": 1, "sha256": "a" * 64}}}
                ],
            }
        ),
        json.dumps(
            {
                "format": 1,
                "recipe": "r",
                "checkpoints": [{**GOOD, "files": {"other.pt": {"size": 1, "sha256": "a" * 64}}}],
            }
        ),  # outside its checkpoint
        json.dumps({"format": 1, "recipe": "r", "checkpoints": [GOOD, GOOD]}),
        json.dumps({"format": 1, "recipe": "r", "checkpoints": [{**GOOD, "files": []}]}),
    ],
)
def test_corrupt_manifest_is_a_checkpoint_error(tmp_path: Path, text: str) -> None:
    store = StoreFolder(tmp_path)
    store.meta.mkdir()
    store.manifest_path.write_text(text)
    with pytest.raises(CheckpointError, match="corrupt store manifest") as info:
        store.load_manifest()
    assert str(store.manifest_path) in str(info.value)


def test_manifest_that_is_not_utf8(tmp_path: Path) -> None:
    store = StoreFolder(tmp_path)
    store.meta.mkdir()
    store.manifest_path.write_bytes(b"\xff\xfe{")
    with pytest.raises(CheckpointError, match="corrupt store manifest"):
        store.load_manifest()


# -- is_empty / write_meta / hash_file ------------------------------------------------------------


def test_is_empty(tmp_path: Path) -> None:
    store = StoreFolder(tmp_path / "store")
    assert store.is_empty()  # missing
    store.root.mkdir()
    assert store.is_empty()
    store.staging("ckpt-1.pt")
    (store.staging("ckpt-1.pt") / "ckpt-1.pt").write_bytes(b"half")
    assert store.is_empty()  # staging leftovers are never trusted
    store.write_meta("freeze.txt", "torch==2.13\n")
    store.save_manifest(StoreManifest(recipe="r"))
    assert store.is_empty()  # a copy round before the first save wrote metadata only: still no checkpoint
    other = StoreFolder(tmp_path / "other")
    other.root.mkdir()
    (other.root / "ckpt-1.pt").write_bytes(b"x")
    assert not other.is_empty()


def test_write_meta(tmp_path: Path) -> None:
    store = StoreFolder(tmp_path)
    store.write_meta("log-tail.txt", "step 500 loss 1.2\n")
    store.write_meta("log-tail.txt", "step 600 loss 1.1\n")
    assert (store.meta / "log-tail.txt").read_text() == "step 600 loss 1.1\n"
    for bad in ("manifest.json", "../x", "a/b", ""):
        with pytest.raises(UsageError):
            store.write_meta(bad, "x")


def test_hash_file_streams_large_files(tmp_path: Path) -> None:
    data = os.urandom(3 * (1 << 20) + 17)  # spans several read chunks
    (tmp_path / "big").write_bytes(data)
    assert StoreFolder.hash_file(tmp_path / "big") == sha(data)


# -- verify_staged -------------------------------------------------------------------------------


def test_verify_staged_accepts_a_good_copy(tmp_path: Path) -> None:
    store = StoreFolder(tmp_path)
    record = stage(store, "checkpoint-500", HF_500)
    assert store.staging("checkpoint-500") == tmp_path / ".relaunch" / "partial" / "checkpoint-500"
    assert store.verify_staged("checkpoint-500", record.files) == []


def test_verify_staged_catches_a_flipped_byte(tmp_path: Path) -> None:
    store = StoreFolder(tmp_path)
    record = stage(store, "checkpoint-500", HF_500)
    staged = store.staging("checkpoint-500") / "checkpoint-500/model.pt"
    data = bytearray(staged.read_bytes())
    data[4321] ^= 0x01
    staged.write_bytes(bytes(data))  # same size: only the hash can tell
    [problem] = store.verify_staged("checkpoint-500", record.files)
    assert problem.startswith("checkpoint-500/model.pt: sha256")


def test_verify_staged_catches_truncated_missing_and_unexpected(tmp_path: Path) -> None:
    store = StoreFolder(tmp_path)
    record = stage(store, "checkpoint-500", HF_500)
    base = store.staging("checkpoint-500")
    with open(base / "checkpoint-500/model.pt", "r+b") as f:
        f.truncate(100)
    (base / "checkpoint-500/trainer_state.json").unlink()
    (base / "checkpoint-500/extra.bin").write_bytes(b"?")
    (base / "checkpoint-500/linkdir").symlink_to("/etc")
    problems = store.verify_staged("checkpoint-500", record.files)
    assert problems == [
        f"checkpoint-500/model.pt: size 100, expected {len(HF_500['checkpoint-500/model.pt'])}",
        "checkpoint-500/trainer_state.json: missing",
        "checkpoint-500/extra.bin: unexpected (not in the instance's listing)",
        "checkpoint-500/linkdir: unexpected (not in the instance's listing)",
    ]


def test_verify_staged_refuses_a_symlink_in_place_of_a_file(tmp_path: Path) -> None:
    store = StoreFolder(tmp_path)
    outside = tmp_path / "outside.pt"
    outside.write_bytes(b"a")
    base = store.staging("ckpt-1.pt")
    (base / "ckpt-1.pt").symlink_to(outside)
    problems = store.verify_staged("ckpt-1.pt", {"ckpt-1.pt": FileRecord(size=1, sha256=sha(b"a"))})
    assert problems == ["ckpt-1.pt: not a regular file"]


# -- commit -------------------------------------------------------------------------------------


def test_commit_moves_files_into_place_then_manifest_last(tmp_path: Path) -> None:
    store = StoreFolder(tmp_path)
    record = stage(store, "checkpoint-500", HF_500)
    store.commit(record)
    for path, data in HF_500.items():
        assert (tmp_path / path).read_bytes() == data
    assert not (store.meta / "partial" / "checkpoint-500").exists()
    assert store.load_manifest() is None  # commit does not write the manifest: the caller does, last


def test_commit_accepts_identical_bytes_already_in_the_store(tmp_path: Path) -> None:
    store = StoreFolder(tmp_path)
    store.commit(stage(store, "checkpoint-500", HF_500))
    record = stage(store, "checkpoint-500", HF_500)  # an interrupted run transferred it again
    store.commit(record)
    for path, data in HF_500.items():
        assert (tmp_path / path).read_bytes() == data


def test_commit_refuses_to_overwrite_different_bytes(tmp_path: Path) -> None:
    store = StoreFolder(tmp_path)
    store.commit(stage(store, "checkpoint-500", HF_500))
    changed = dict(HF_500)
    changed["checkpoint-500/trainer_state.json"] = b"{}\n"  # rewritten by the instance
    changed["checkpoint-500/new.bin"] = b"n"
    record = stage(store, "checkpoint-500", changed)
    with pytest.raises(EvacuationError, match="trainer_state.json.*different bytes"):
        store.commit(record)
    assert (tmp_path / "checkpoint-500/trainer_state.json").read_bytes() == b"{}"
    assert not (tmp_path / "checkpoint-500/new.bin").exists()  # checked before anything moved


def test_commit_same_size_different_bytes_is_refused(tmp_path: Path) -> None:
    store = StoreFolder(tmp_path)
    store.commit(stage(store, "ckpt-1.pt", {"ckpt-1.pt": b"aaaa"}))
    with pytest.raises(EvacuationError, match="different bytes"):
        store.commit(stage(store, "ckpt-1.pt", {"ckpt-1.pt": b"aaab"}))
    assert (tmp_path / "ckpt-1.pt").read_bytes() == b"aaaa"


def test_commit_refuses_unstaged_and_escaping_records(tmp_path: Path) -> None:
    store = StoreFolder(tmp_path)
    with pytest.raises(EvacuationError, match="not staged"):
        store.commit(record_for("ckpt-1.pt", 1, {"ckpt-1.pt": b"a"}))
    with pytest.raises(EvacuationError, match="not inside checkpoint"):
        store.commit(record_for("ckpt-1.pt", 1, {"ckpt-2.pt": b"a"}))
    with pytest.raises(EvacuationError):
        store.commit(record_for("../x", 1, {"../x/a": b"a"}))


def test_commit_will_not_write_through_a_symlinked_folder(tmp_path: Path) -> None:
    store = StoreFolder(tmp_path / "store")
    store.root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (store.root / "checkpoint-500").symlink_to(outside)
    with pytest.raises(EvacuationError, match="not a plain folder"):
        store.commit(stage(store, "checkpoint-500", HF_500))
    assert list(outside.iterdir()) == []


# -- prune --------------------------------------------------------------------------------------


def three_checkpoints(tmp_path: Path) -> tuple[StoreFolder, StoreManifest]:
    store = StoreFolder(tmp_path)
    m = StoreManifest(recipe="r")
    for step in (1000, 999, 10):
        n = f"checkpoint-{step}"
        evacuate(store, m, n, {f"{n}/model.pt": b"w%d" % step, f"{n}/sub/trainer_state.json": b"{}"})
    return store, m


def test_prune_keeps_the_newest_and_deletes_only_after_the_manifest_dropped_them(
    tmp_path: Path, monkeypatch
) -> None:
    store, m = three_checkpoints(tmp_path)
    real_unlink = Path.unlink
    deleted: list[str] = []

    def checked_unlink(self: Path, missing_ok: bool = False) -> None:
        # at the moment a file goes, the manifest ON DISK must no longer list it
        on_disk = StoreFolder(tmp_path).load_manifest()
        listed = {p for r in on_disk.checkpoints.values() for p in r.files}
        rel = self.relative_to(tmp_path).as_posix()
        assert rel not in listed
        deleted.append(rel)
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", checked_unlink)
    assert store.prune(m, keep=2) == ["checkpoint-10"]
    monkeypatch.undo()

    assert sorted(deleted) == ["checkpoint-10/model.pt", "checkpoint-10/sub/trainer_state.json"]
    assert not (tmp_path / "checkpoint-10").exists()  # empty folders go too
    assert (tmp_path / "checkpoint-999/model.pt").exists()
    assert (tmp_path / "checkpoint-1000/model.pt").exists()
    assert sorted(store.load_manifest().checkpoints) == ["checkpoint-1000", "checkpoint-999"]


def test_prune_keep_one_never_removes_the_newest(tmp_path: Path) -> None:
    store, m = three_checkpoints(tmp_path)
    assert store.prune(m, keep=1) == ["checkpoint-10", "checkpoint-999"]
    assert [r.name for r in store.load_manifest().ordered()] == ["checkpoint-1000"]
    assert (tmp_path / "checkpoint-1000/model.pt").read_bytes() == b"w1000"
    assert store.prune(m, keep=1) == []
    with pytest.raises(UsageError):
        store.prune(m, keep=0)


def test_prune_leaves_files_it_did_not_record(tmp_path: Path) -> None:
    store, m = three_checkpoints(tmp_path)
    (tmp_path / "checkpoint-10/notes.txt").write_text("mine")
    store.prune(m, keep=2)
    assert (tmp_path / "checkpoint-10/notes.txt").read_text() == "mine"
    assert not (tmp_path / "checkpoint-10/model.pt").exists()


def test_a_checkpoint_name_with_a_folder_stages_and_commits(tmp_path: Path) -> None:
    """The accelerate layout names checkpoints by their path (`checkpoints/checkpoint_3`): staging,
    the copy-over marker beside it, and the commit work with such a name too."""
    store = StoreFolder(tmp_path)
    name = "checkpoints/checkpoint_3"
    files = {f"{name}/model.safetensors": b"weights", f"{name}/relaunch-complete.json": b'{"step": 13}\n'}
    for path, data in files.items():
        (store.staging(name) / path).parent.mkdir(parents=True, exist_ok=True)
        (store.staging(name) / path).write_bytes(data)
    record = record_for(name, 3, files)
    marker = store.copied_marker(name)
    assert marker == tmp_path / ".relaunch" / "partial" / "checkpoints" / ".checkpoint_3.copied"
    marker.touch()
    assert store.verify_staged(name, record.files) == []
    store.commit(record)
    assert (tmp_path / name / "model.safetensors").read_bytes() == b"weights"
    assert not marker.exists() and not store.staging_path(name).exists()
