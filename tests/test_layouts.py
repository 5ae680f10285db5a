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
from relaunch.layouts import (
    LAYOUTS,
    LISTING_COMMAND,
    Entry,
    complete_checkpoints,
    detect_layout,
    layout_names,
    parse_listing,
    parse_sha256sum,
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


@pytest.mark.parametrize("flag", ["-t", "-b"])  # text mode "HEX  PATH", binary mode "HEX *PATH"
def test_parse_sha256sum_reads_real_output(tmp_path: Path, flag: str) -> None:
    names = ["plain.pt", "with space.pt", "new\nline.pt", "back\\slash.pt", "sub/x.bin"]
    (tmp_path / "sub").mkdir()
    for i, name in enumerate(names):
        (tmp_path / name).write_bytes(bytes([i]) * (1000 + i))
    out = subprocess.run(
        ["sha256sum", flag, "-z", "--", *names], cwd=tmp_path, check=True, capture_output=True
    ).stdout
    got = parse_sha256sum(out)
    assert got == {n: hashlib.sha256((tmp_path / n).read_bytes()).hexdigest() for n in names}


@pytest.mark.parametrize(
    "raw",
    [b"abc  file\0", b"z" * 64 + b"  file\0", b"a" * 64 + b"file\0", b"a" * 64 + b"  \0"],
)
def test_parse_sha256sum_rejects_malformed(raw: bytes) -> None:
    with pytest.raises(CheckpointError, match="could not read sha256sum output"):
        parse_sha256sum(raw)


def test_parse_sha256sum_conflicting_duplicates() -> None:
    raw = b"a" * 64 + b"  f\0" + b"b" * 64 + b"  f\0"
    with pytest.raises(CheckpointError, match="two different hashes"):
        parse_sha256sum(raw)
