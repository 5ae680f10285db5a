"""Hashing files while rsync writes them (templates/hashes.py --follow), against the real rsync.

The receiver's sha256 is what `up` and `evacuate` compare with the other end's; computing it as
the bytes land saves a full read after the copy, and must never vouch for bytes that are not
what ended up in place: a copy started again, a file replaced, a temp left by a killed copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e import wait_for
from relaunch.host.hashing import local_hash_argv, parse_hashes, paths_stdin


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(autouse=True)
def no_follower_left() -> Iterator[None]:
    """A test that fails before its marker exists leaves its follower waiting for it: end it."""
    yield
    while Follower.running:
        proc = Follower.running.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class Follower:
    """hashes.py --follow on `dest`, its output lines with the time each arrived."""

    running: list[subprocess.Popen[bytes]] = []

    def __init__(self, dest: Path, marker: Path, files: list[str]) -> None:
        self.proc = subprocess.Popen(local_hash_argv(dest, ("sha256",), follow=marker), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        Follower.running.append(self.proc)
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(paths_stdin(files))
        self.proc.stdin.close()
        self.lines: list[tuple[float, dict]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def holds(self, temp_prefix: str, folder: Path) -> bool:
        """The follower has a temp file named `temp_prefix*` in `folder` open (it is following it)."""
        for fd in Path(f"/proc/{self.proc.pid}/fd").iterdir():
            try:
                target = Path(os.readlink(fd))
            except OSError:
                continue
            if target.parent == folder and target.name.startswith(temp_prefix):
                return True
        return False

    def wait_holding(self, temp_prefix: str, folder: Path) -> None:
        """Until the follower has the temp open. The temp is kept fresh meanwhile, as a copy writing
        it keeps it: the follower leaves alone a temp older than itself (one a killed copy left)."""
        def held() -> bool:
            for temp in folder.glob(f"{temp_prefix}*"):
                os.utime(temp)
            assert self.proc.poll() is None, f"the follower ended: {self.proc.stderr and self.proc.stderr.read()!r}"
            return self.holds(temp_prefix, folder)

        wait_for(f"the follower to open {folder / temp_prefix}*", held, timeout=60, every=0.02)

    def _read(self) -> None:
        assert self.proc.stdout
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), json.loads(line)))

    def result(self) -> dict[str, dict]:
        assert self.proc.wait(timeout=60) == 0, self.proc.stderr.read() if self.proc.stderr else ""
        self.reader.join(timeout=10)
        return {doc["path"]: doc for _, doc in self.lines}


def rsync(src: Path, dest: Path, *extra: str) -> None:
    subprocess.run(["rsync", "-a", "--partial-dir=.rsync-partial", *extra, f"{src}/", f"{dest}/"], check=True)


def hold_until_followed(copy: subprocess.Popen[bytes], follower: Follower, dest: Path, name: str) -> None:
    """Once rsync's temp of `name` appears, rsync (its process group) is stopped until the follower
    has that temp open: a follower slow to start on a loaded machine still follows it."""
    folder, base = (dest / name).parent, (dest / name).name
    def temp_written() -> bool:
        assert copy.poll() is None, f"rsync ended before the test saw its temp of {name}"
        return folder.exists() and bool(list(folder.glob(f".{base}.*")))

    wait_for(f"rsync's temp of {name}", temp_written, timeout=120, every=0.01)
    os.killpg(copy.pid, signal.SIGSTOP)
    try:
        assert not (dest / name).exists(), f"{name} landed before rsync could be held"
        follower.wait_holding(f".{base}.", folder)
    finally:
        os.killpg(copy.pid, signal.SIGCONT)


def test_each_file_is_hashed_as_it_lands_and_reported_before_the_copy_ends(tmp_path):
    src, dest = tmp_path / "src", tmp_path / "dest"
    (src / "sub").mkdir(parents=True)
    dest.mkdir()
    names = ["a.bin", "sub/b.bin", "sub/c.bin"]
    for name in names:
        (src / name).write_bytes(os.urandom(3_000_000))
    marker = tmp_path / "copied"
    follower = Follower(dest, marker, names)
    # Each file is held back until the follower follows it: rsync (its whole process group) is
    # stopped as soon as a file's temp appears and continued once the follower has that temp open.
    # A follower that starts late on a loaded machine would otherwise find a file already in place
    # and read it again, which is right but not what this test is about.
    copy = subprocess.Popen(["rsync", "-a", "--partial-dir=.rsync-partial", "--bwlimit=1000", f"{src}/", f"{dest}/"],
                            start_new_session=True)
    try:
        for name in names:              # rsync sends them in this order
            hold_until_followed(copy, follower, dest, name)
        assert copy.wait(timeout=120) == 0
    finally:
        if copy.poll() is None:
            os.killpg(copy.pid, signal.SIGKILL)
            copy.wait()
    copy_ended = time.monotonic()
    marker.touch()
    got = follower.result()
    assert {p: d["sha256"] for p, d in got.items()} == {n: sha(src / n) for n in names}
    assert all(d.get("followed") for d in got.values())          # read as they landed, not again
    first = min(t for t, _ in follower.lines)
    assert first < copy_ended                                    # a file's line came while the copy went on


def test_what_is_in_place_at_the_end_is_what_counts(tmp_path):
    src, dest = tmp_path / "src", tmp_path / "dest"
    src.mkdir()
    dest.mkdir()
    (src / "a.bin").write_bytes(os.urandom(2_000_000))
    (src / "small.txt").write_text("tiny")
    # a different file already there (rsync replaces it) and a temp a killed copy left, older
    (dest / "a.bin").write_bytes(os.urandom(1_000_000))
    stale = dest / ".a.bin.Ab12Cd"
    stale.write_bytes(b"junk" * 1000)
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    marker = tmp_path / "copied"
    follower = Follower(dest, marker, ["a.bin", "small.txt", "gone.bin"])
    rsync(src, dest, "--bwlimit=4000")
    marker.touch()
    got = follower.result()
    assert got["a.bin"]["sha256"] == sha(src / "a.bin") and got["a.bin"]["size"] == 2_000_000
    assert got["small.txt"]["sha256"] == sha(src / "small.txt")
    assert got["gone.bin"] == {"path": "gone.bin", "missing": True}


def test_a_copy_started_again_or_a_file_replaced_is_read_again(tmp_path):
    """A temp that is followed but never becomes the file (rsync's second try after a failed
    check writes a new temp): the file in place is hashed from its own bytes."""
    dest = tmp_path / "dest"
    dest.mkdir()
    marker = tmp_path / "copied"
    follower = Follower(dest, marker, ["w.pt"])
    first = dest / ".w.pt.Zz9Yy8"
    first.write_bytes(b"A" * 500_000)             # followed: it looks like rsync's temp
    follower.wait_holding(first.name, dest)
    final = os.urandom(700_000)
    second = dest / ".w.pt.Qq1Ww2"
    second.write_bytes(final)
    os.replace(second, dest / "w.pt")             # the second try is what lands
    first.unlink()
    marker.touch()
    got = follower.result()["w.pt"]
    assert got["sha256"] == hashlib.sha256(final).hexdigest() and got["size"] == len(final)


def test_a_save_that_did_not_finish_is_reported_as_it_lands(tmp_path):
    src, dest = tmp_path / "src", tmp_path / "dest"
    src.mkdir()
    dest.mkdir()
    # a torch.save zip cut before its central directory
    (src / "ckpt.pt").write_bytes(b"PK\x03\x04" + os.urandom(400_000))
    marker = tmp_path / "copied"
    follower = Follower(dest, marker, ["ckpt.pt"])
    rsync(src, dest, "--bwlimit=2000")
    marker.touch()
    got = parse_hashes(b"".join(json.dumps(d).encode() + b"\n" for d in follower.result().values()))
    assert got["ckpt.pt"].problem.startswith("truncated zip")


def test_a_checkpoint_re_saved_at_the_same_size_during_the_copy_is_read_again(tmp_path):
    """Real rsync lands the followed temp under its final name; before the follower looks, the
    checkpoint is saved again there at the same size with other bytes (another inode, the same
    length). Size alone cannot tell the two apart, the inode does: the hash is of the bytes in place."""
    import signal

    src, dest = tmp_path / "src", tmp_path / "dest"
    src.mkdir()
    dest.mkdir()
    size = 3_000_000
    (src / "w.pt").write_bytes(os.urandom(size))
    marker = tmp_path / "copied"
    follower = Follower(dest, marker, ["w.pt"])
    copy = subprocess.Popen(["rsync", "-a", "--partial-dir=.rsync-partial", "--bwlimit=1000", f"{src}/", f"{dest}/"],
                            start_new_session=True)
    held = False
    try:
        hold_until_followed(copy, follower, dest, "w.pt")
        # held while rsync ends (its temp renamed to w.pt) and the checkpoint is saved again: the
        # follower's next look finds the size it read under the final name, and another inode
        follower.proc.send_signal(signal.SIGSTOP)
        held = True
        assert copy.poll() is None, "rsync ended before the follower was held"
        assert copy.wait(timeout=60) == 0
        landed = (dest / "w.pt").stat().st_ino
        resaved = os.urandom(size)
        (dest / "w.pt.saving").write_bytes(resaved)
        os.replace(dest / "w.pt.saving", dest / "w.pt")
        assert (dest / "w.pt").stat().st_ino != landed and (dest / "w.pt").stat().st_size == size
        marker.touch()
    finally:
        if copy.poll() is None:
            copy.kill()
            copy.wait()
        if held:
            follower.proc.send_signal(signal.SIGCONT)
        if not marker.exists():
            follower.proc.kill()
    got = follower.result()["w.pt"]
    assert got["size"] == size
    assert got["sha256"] == hashlib.sha256(resaved).hexdigest() != sha(src / "w.pt")
    assert not got.get("followed")                     # read again in full, not vouched for from the temp
