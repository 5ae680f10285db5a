"""Layouts: fixtures "this listing in, these checkpoints out", plus the parsers against real
`find -printf` and `sha256sum -z` output."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from relaunch.errors import CheckpointError, UsageError
from relaunch.host.hashing import hash_command, parse_hashes, paths_stdin
from relaunch.layouts import (
    LAYOUTS,
    LISTING_COMMAND,
    Entry,
    complete_checkpoints,
    detect_layout,
    layout_names,
    parse_listing,
)

FIXTURES = Path(__file__).parent / "fixtures" / "listings"
FIXTURE_FILES = sorted(FIXTURES.glob("*.json"))


def as_find_output(lines: list[str]) -> bytes:
    """Fixture lines are `KIND SIZE MTIME PATH`, exactly find's -printf records without the NUL."""
    return b"".join(line.encode() + b"\0" for line in lines)


@pytest.mark.parametrize("fixture", FIXTURE_FILES, ids=[p.stem for p in FIXTURE_FILES])
def test_listing_fixture(fixture: Path) -> None:
    spec = json.loads(fixture.read_text())
    entries = parse_listing(as_find_output(spec["listing"]))
    assert len(entries) == len(spec["listing"])
    if "detect" in spec:
        assert detect_layout(entries) == spec["detect"]
    found = complete_checkpoints(entries, spec["layout"], spec.get("pattern", "ckpt-*.pt"))
    got = [{"name": c.name, "step": c.step, "files": [e.path for e in c.files]} for c in found]
    assert got == spec["expect"], spec["description"]
    for c in found:
        assert all(e.kind == "f" for e in c.files)


def test_every_layout_has_a_fixture() -> None:
    covered = set()
    for fixture in FIXTURE_FILES:
        spec = json.loads(fixture.read_text())
        covered.add(spec.get("detect") if spec["layout"] == "auto" else spec["layout"])
    assert set(LAYOUTS) <= covered
    assert layout_names()[0] == "auto"


def test_unknown_layout_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="unknown checkpoint layout 'megatron'") as info:
        complete_checkpoints([], "megatron")
    assert "hf-trainer" in (info.value.hint or "")


@pytest.mark.parametrize("pattern", ["", "ckpts/ckpt-*.pt"])
def test_bad_pattern_is_a_usage_error(pattern: str) -> None:
    with pytest.raises(UsageError):
        complete_checkpoints([], "files", pattern)


@pytest.mark.parametrize(
    ("pattern", "name", "step"),
    [
        ("ckpt-???.pt", "ckpt-500.pt", 500),  # the digit run is taken whole across '?' groups
        ("ckpt-1*.pt", "ckpt-1500.pt", 1500),
        ("ckpt_[0-9]*.pth.tar", "ckpt_42.pth.tar", 42),
        ("ckpt-[!x]*.pt", "ckpt-7.pt", 7),
        ("*", "run3-step-800.bin", 800),
    ],
)
def test_files_step_comes_from_the_wildcards(pattern: str, name: str, step: int) -> None:
    entry = Entry(path=name, kind="f", size=10, mtime=0.0)
    [c] = complete_checkpoints([entry], "files", pattern)
    assert (c.name, c.step) == (name, step)


def test_files_pattern_is_case_sensitive_and_anchored() -> None:
    entries = [Entry(p, "f", 10, 0.0) for p in ("CKPT-1.pt", "ckpt-2.pt.bak", "old-ckpt-3.pt")]
    assert complete_checkpoints(entries, "files", "ckpt-*.pt") == []


# -- the parsers against the real tools ------------------------------------------------------


def make_tree(root: Path) -> None:
    (root / "checkpoint-500").mkdir()
    (root / "checkpoint-500" / "model.pt").write_bytes(b"m" * 1234)
    (root / "checkpoint-500" / "trainer_state.json").write_text("{}")
    (root / "ckpt-9 with space.pt").write_bytes(b"x" * 10)
    (root / "ckpt-10\nnewline.pt").write_bytes(b"y" * 20)
    (root / "empty.pt").write_bytes(b"")
    (root / "last.pt").symlink_to("ckpt-9 with space.pt")
    os.utime(root / "ckpt-9 with space.pt", (1700000000.5, 1700000000.5))


def run_listing(root: Path) -> bytes:
    cmd = LISTING_COMMAND.format(dir=shlex.quote(str(root)))
    return subprocess.run(cmd, shell=True, check=True, capture_output=True).stdout


def test_parse_listing_reads_real_find_output(tmp_path: Path) -> None:
    root = tmp_path / "ckpt dir"  # the folder's own name has a space too
    root.mkdir()
    make_tree(root)
    entries = {e.path: e for e in parse_listing(run_listing(root))}
    assert set(entries) == {
        "checkpoint-500",
        "checkpoint-500/model.pt",
        "checkpoint-500/trainer_state.json",
        "ckpt-9 with space.pt",
        "ckpt-10\nnewline.pt",
        "empty.pt",
        "last.pt",
    }
    assert entries["checkpoint-500"].kind == "d"
    assert entries["last.pt"].kind == "l"
    assert (entries["checkpoint-500/model.pt"].kind, entries["checkpoint-500/model.pt"].size) == ("f", 1234)
    assert entries["ckpt-10\nnewline.pt"].size == 20
    assert entries["empty.pt"].size == 0
    assert entries["ckpt-9 with space.pt"].mtime == pytest.approx(1700000000.5)

    listing = list(entries.values())
    assert detect_layout(listing) == "hf-trainer"
    [hf] = complete_checkpoints(listing, "auto")
    assert (hf.name, hf.step) == ("checkpoint-500", 500)
    files = complete_checkpoints(listing, "files", "ckpt-*.pt")
    assert [(c.name, c.step) for c in files] == [("ckpt-9 with space.pt", 9), ("ckpt-10\nnewline.pt", 10)]


def test_parse_listing_keeps_non_utf8_names_exact(tmp_path: Path) -> None:
    raw_name = b"ckpt-7-\xff.pt"
    (tmp_path / os.fsdecode(raw_name)).write_bytes(b"z")
    [entry] = parse_listing(run_listing(tmp_path))
    assert os.fsencode(entry.path) == raw_name


@pytest.mark.parametrize(
    "raw",
    [b"f 10 1.0\0", b"f ten 1.0 a.pt\0", b"f 10 x a.pt\0", b"ff 10 1.0 a.pt\0", b"f -1 1.0 a\0", b"garbage"],
)
def test_parse_listing_rejects_malformed_records(raw: bytes) -> None:
    with pytest.raises(CheckpointError, match="could not read the checkpoint listing"):
        parse_listing(raw)


def test_parse_listing_empty() -> None:
    assert parse_listing(b"") == []


def run_hasher(folder: Path, names: list[str], *algos: str) -> bytes:
    """The instance-side hasher, run here by this machine's python3 exactly as on an instance."""
    command = hash_command(str(folder), "python3", algos or ("sha256",))
    return subprocess.run(["bash", "-c", command], input=paths_stdin(names), check=True, capture_output=True).stdout


def test_hasher_reads_real_files_with_any_name(tmp_path: Path) -> None:
    names = ["plain.pt", "with space.pt", "new\nline.pt", "back\\slash.pt", "sub/x.bin", "$(touch pwned).pt"]
    (tmp_path / "sub").mkdir()
    for i, name in enumerate(names):
        (tmp_path / name).write_bytes(bytes([i]) * (1000 + i))
    got = parse_hashes(run_hasher(tmp_path, names, "sha256", "md5", "gitblob"))
    for n in names:
        data = (tmp_path / n).read_bytes()
        assert got[n].size == len(data) and not got[n].problem and not got[n].missing
        assert got[n].hashes == {"sha256": hashlib.sha256(data).hexdigest(), "md5": hashlib.md5(data).hexdigest(),
                                 "gitblob": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()}
    assert not (tmp_path / "pwned").exists()


def test_hasher_names_a_file_that_went_away(tmp_path: Path) -> None:
    (tmp_path / "here.pt").write_bytes(b"x" * 10)
    got = parse_hashes(run_hasher(tmp_path, ["here.pt", "gone.pt"]))
    assert got["gone.pt"].missing and not got["here.pt"].missing


def test_hasher_flags_a_torch_save_that_did_not_finish(tmp_path: Path) -> None:
    import zipfile

    with zipfile.ZipFile(tmp_path / "whole.pt", "w") as z:       # torch.save writes a zip like this
        z.writestr("archive/data.pkl", b"\x80" * 5000)
    data = (tmp_path / "whole.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])      # a crash half-way through the save
    got = parse_hashes(run_hasher(tmp_path, ["whole.pt", "cut.pt"]))
    assert got["whole.pt"].problem == ""
    assert "truncated zip" in got["cut.pt"].problem


def test_hasher_flags_a_safetensors_file_shorter_than_its_header_says(tmp_path: Path) -> None:
    import json
    import struct

    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    whole = struct.pack("<Q", len(header)) + header + b"\0" * 16
    (tmp_path / "ok.safetensors").write_bytes(whole)
    (tmp_path / "cut.safetensors").write_bytes(whole[:-5])
    got = parse_hashes(run_hasher(tmp_path, ["ok.safetensors", "cut.safetensors"]))
    assert got["ok.safetensors"].problem == ""
    assert "header says" in got["cut.safetensors"].problem


@pytest.mark.parametrize("raw", [b"not json\n", b'{"size": 3}\n', b'{"path": "a", "size": "x"}\n'])
def test_parse_hashes_rejects_malformed(raw: bytes) -> None:
    with pytest.raises(CheckpointError, match="could not read the instance's hashes"):
        parse_hashes(raw)
