"""A store folder on this machine, as `StoreFolder` keeps it: the manifest and metadata files
written atomically, staging, verifying and committing a checkpoint, pruning. A path
`checkpoint.remote` is one (local.py runs the transfers), and so is the relay's cache. The
records and the layout of a store root are in relaunch/manifest.py; this module adds:

    .relaunch/partial/<name>/...     staging for transfers in flight; never trusted

Rules this module keeps: a checkpoint is in the manifest only after every file of it was
verified and moved into place; nothing is overwritten with different bytes; nothing is deleted
except by `prune`, and then only after the manifest no longer lists it. The manifest is always
replaced atomically, so a crash leaves either the old one or the new one, never a mix.

One writer at a time: the caller holds the store's lock (`Store.lock`, transports/base.py) around
a sync or an evacuation; only `swap_meta` locks on its own (one meta file, compared and replaced).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import stat
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from ..errors import CheckpointError, EvacuationError, UsageError
from ..manifest import MANIFEST, META_DIR, CheckpointRecord, FileRecord, Seen, StoreManifest, check_relpath

SWAP_WAIT = 30.0        # seconds a compare-and-set of a metadata file waits for another one (held for milliseconds)
PARTIAL = "partial"
DAMAGED = "damaged"          # store files that no longer matched their record, set aside (never deleted)

RSYNC_PARTIAL = ".rsync-partial"                     # rsync --partial-dir: kept by a stopped transfer
_RSYNC_TEMP = re.compile(r"\.(.+)\.[A-Za-z0-9]{6}")   # rsync's in-flight temp name for NAME


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, text: str) -> None:
    """Temp file in the same folder, fsync, rename over `path`, fsync the folder.

    Any failure (or Ctrl-C) before the rename leaves the old file untouched and no temp file.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


class StoreFolder:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.meta = self.root / META_DIR
        self.manifest_path = self.meta / MANIFEST

    # -- reading ---------------------------------------------------------------------------

    def is_empty(self) -> bool:
        """True for a missing folder, or one holding nothing but `.relaunch/` (metadata a copy
        round wrote before training saved anything, and staging, which is never trusted)."""
        if not self.root.exists():
            return True
        if not self.root.is_dir():
            return False
        return all(child.name == META_DIR for child in self.root.iterdir())

    def load_manifest(self) -> StoreManifest | None:
        """The manifest, or None when the store has none yet; corrupt -> CheckpointError."""
        try:
            data = self.manifest_path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CheckpointError(f"{self.manifest_path}: cannot read the store manifest: {exc}") from None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise CheckpointError(f"{self.manifest_path}: corrupt store manifest: not UTF-8 text") from None
        return StoreManifest.from_json(text, str(self.manifest_path))

    @staticmethod
    def hash_file(path: Path, algo: str = "sha256") -> str:
        """A file's hash, streamed (checkpoints are bigger than memory)."""
        with open(path, "rb") as f:
            return hashlib.file_digest(f, algo).hexdigest()

    # -- writing metadata ------------------------------------------------------------------

    def save_manifest(self, m: StoreManifest) -> None:
        """Replace the manifest atomically (temp file, fsync, rename, fsync folder)."""
        for record in m.checkpoints.values():
            try:
                record.check()
            except ValueError as exc:
                raise CheckpointError(f"refusing to save the store manifest: {exc}") from None
        self.meta.mkdir(parents=True, exist_ok=True)
        _atomic_write(self.manifest_path, m.to_json())

    def write_meta(self, filename: str, text: str) -> None:
        """Atomically write `.relaunch/<filename>` (freeze.txt, versions.json, log-tail.txt)."""
        if "/" in filename or filename in ("", ".", "..", MANIFEST, PARTIAL):
            raise UsageError(f"write_meta: {filename!r} is not a plain metadata file name")
        self.meta.mkdir(parents=True, exist_ok=True)
        _atomic_write(self.meta / filename, text)

    def swap_meta(self, filename: str, expected: str | None, text: str, wait: float = SWAP_WAIT) -> bool:
        """Compare and set `.relaunch/<filename>`: write `text` (atomically) only while it holds
        `expected` (None: absent); False, writing nothing, when it holds anything else. Every writer
        that comes this way takes an fcntl lock on `.relaunch/.<filename>.lock` first, which holds
        for every process of this machine and, through a shared mount that supports locks, of others."""
        if "/" in filename or filename in ("", ".", "..", MANIFEST, PARTIAL):
            raise UsageError(f"swap_meta: {filename!r} is not a plain metadata file name")
        self.meta.mkdir(parents=True, exist_ok=True)
        with open(self.meta / f".{filename}.lock", "a") as handle:
            end = time.monotonic() + wait
            while True:
                try:
                    fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError:
                    if time.monotonic() > end:
                        raise EvacuationError(f"{self.root}: {META_DIR}/{filename} stayed locked by another "
                                              f"writer for {wait:g}s") from None
                    time.sleep(0.05)
            try:
                if self.read_meta(filename) != expected:
                    return False
                _atomic_write(self.meta / filename, text)
                return True
            finally:
                fcntl.lockf(handle, fcntl.LOCK_UN)

    def read_meta(self, filename: str) -> str | None:
        """`.relaunch/<filename>`, None when it does not exist."""
        if "/" in filename or filename in ("", ".", "..", PARTIAL):
            raise UsageError(f"read_meta: {filename!r} is not a plain metadata file name")
        try:
            return (self.meta / filename).read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return None

    # -- staging, verifying, committing ----------------------------------------------------

    def staging_path(self, name: str) -> Path:
        try:
            check_relpath(name, "checkpoint name")
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None
        return self.meta / PARTIAL / name

    def staging(self, name: str) -> Path:
        """`.relaunch/partial/<name>/` (created): a mini store root for one checkpoint.

        Transfer the checkpoint so that its store path P lands at `staging(name) / P`, e.g.
        `.relaunch/partial/checkpoint-500/checkpoint-500/model.pt`.
        """
        path = self.staging_path(name)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def copied_marker(self, name: str) -> Path:
        """Made when a copy into staging(name) is over: hashing it as it lands stops there.

        Beside the staging folder, also for a name with folders in it (the accelerate layout's
        `checkpoints/checkpoint_3`: `partial/checkpoints/.checkpoint_3.copied`)."""
        staging = self.staging_path(name)
        return staging.with_name(f".{staging.name}.copied")

    def prepare_staging(self, name: str, files: list[str]) -> Path:
        """The staging folder of a checkpoint, ready for a transfer that continues what an earlier,
        stopped one received: rsync's temp file left by a killed run (`.NAME.XXXXXX`) becomes the
        basis rsync continues from; anything else that is not one of `files` goes (staging is
        never trusted, and the caller holds the store lock, so no one else writes here)."""
        base = self.staging(name)
        self.copied_marker(name).unlink(missing_ok=True)
        wanted = set(files)
        for dirpath, dirnames, filenames in os.walk(base, topdown=False):
            folder = Path(dirpath)
            rel = folder.relative_to(base)
            if RSYNC_PARTIAL in rel.parts:
                continue
            for fname in filenames:
                path = folder / fname
                if (rel / fname).as_posix() in wanted:
                    continue
                temp = _RSYNC_TEMP.fullmatch(fname)
                if temp and (rel / temp.group(1)).as_posix() in wanted:
                    keep = folder / RSYNC_PARTIAL / temp.group(1)
                    if not keep.exists() or keep.stat().st_size < path.stat().st_size:
                        keep.parent.mkdir(exist_ok=True)
                        os.replace(path, keep)
                        continue
                path.unlink()
            for dname in dirnames:
                sub = folder / dname
                if sub.is_symlink():
                    sub.unlink()
                elif dname != RSYNC_PARTIAL:
                    with contextlib.suppress(OSError):
                        sub.rmdir()      # only when empty
        return base

    def join_staged(self, name: str, parts: list[str], files: list[str]) -> None:
        """Move the files of the parts staged under `parts` (each node of a group received its own)
        into the staging folder of `name`, prepared for exactly `files`; the parts' folders go."""
        base = self.prepare_staging(name, files)
        wanted = set(files)
        for part in parts:
            folder = self.staging_path(part)
            for path in sorted(wanted):
                src = folder / path
                if src.is_file() and not src.is_symlink():
                    (base / path).parent.mkdir(parents=True, exist_ok=True)
                    os.replace(src, base / path)
            self.drop_staging(part)

    def drop_staging(self, name: str) -> None:
        shutil.rmtree(self.staging_path(name), ignore_errors=True)
        self.copied_marker(name).unlink(missing_ok=True)

    def verify_staged(self, name: str, expected: dict[str, FileRecord],
                      received: dict[str, tuple[int, str]] | None = None) -> list[str]:
        """Check the staged copy of a checkpoint against `expected` (paths relative to the store
        root, hashes from the instance). `received`: (size, sha256) of staged files computed as
        they landed (hashes.py --follow); a file without one is read now. Returns the problems; an
        empty list means verified."""
        received = received or {}
        base = self.staging_path(name)
        problems: list[str] = []
        for path, want in sorted(expected.items()):
            try:
                check_relpath(path, "file path")
            except ValueError as exc:
                problems.append(str(exc))
                continue
            try:
                st = os.lstat(base / path)
            except FileNotFoundError:
                problems.append(f"{path}: missing")
                continue
            if not stat.S_ISREG(st.st_mode):
                problems.append(f"{path}: not a regular file")
            elif st.st_size != want.size:
                problems.append(f"{path}: size {st.st_size}, expected {want.size}")
            else:
                landed = received.get(path)
                got = landed[1] if landed and landed[0] == st.st_size else self.hash_file(base / path)
                if got != want.sha256:
                    problems.append(f"{path}: sha256 {got}, expected {want.sha256}")
        if base.is_dir():
            for dirpath, dirnames, filenames in os.walk(base):
                dirnames[:] = [d for d in dirnames if d != RSYNC_PARTIAL or os.path.islink(os.path.join(dirpath, d))]
                rel_dir = Path(dirpath).relative_to(base)
                # symlinks to folders show up in dirnames; os.walk does not follow them
                links = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
                for fname in sorted(filenames + links):
                    rel = (rel_dir / fname).as_posix()
                    if rel not in expected:
                        problems.append(f"{rel}: unexpected (not in the instance's listing)")
        return problems

    def _check_parents(self, path: str) -> None:
        """No folder between the root and `path` may be a symlink or a file: a symlinked folder
        would let a write or delete land outside the store."""
        current = self.root
        for part in path.split("/")[:-1]:
            current = current / part
            try:
                st = os.lstat(current)
            except FileNotFoundError:
                return
            if not stat.S_ISDIR(st.st_mode):
                raise EvacuationError(
                    f"{current} is not a plain folder (symlink or file); refusing to write through it"
                )

    def commit(self, record: CheckpointRecord) -> None:
        """Move a verified staged checkpoint into the store, file by file.

        Call after `verify_staged` returned no problems. A store file that already holds the
        same bytes is kept; one with different bytes is never overwritten (EvacuationError
        naming it), and that is checked for every file before anything moves. Afterwards the
        caller adds the record to the manifest and saves it: the manifest is written last.
        """
        try:
            record.check()
        except ValueError as exc:
            raise EvacuationError(f"cannot commit checkpoint {record.name!r}: {exc}") from None
        base = self.staging_path(record.name)
        to_move: list[str] = []
        for path, want in sorted(record.files.items()):
            self._check_parents(path)
            dst = self.root / path
            try:
                st = os.lstat(dst)
            except FileNotFoundError:
                st = None
            if st is not None:
                same = (
                    stat.S_ISREG(st.st_mode)
                    and st.st_size == want.size
                    and self.hash_file(dst) == want.sha256
                )
                if not same:
                    raise EvacuationError(
                        f"{dst}: the store already holds different bytes under this name; "
                        "refusing to overwrite",
                        hint="the store never overwrites a checkpoint; if the instance rewrote it, "
                        "move the old copy aside by hand after checking which one is right",
                        refused=True,
                    )
                continue  # identical bytes already there (an earlier interrupted commit)
            src = base / path
            try:
                src_st = os.lstat(src)
            except FileNotFoundError:
                raise EvacuationError(f"{path}: not staged in {base}; nothing was committed") from None
            if not stat.S_ISREG(src_st.st_mode) or src_st.st_size != want.size:
                raise EvacuationError(f"{src}: staged file does not match the record; verify it first")
            to_move.append(path)

        touched: set[Path] = set()
        for path in to_move:
            src, dst = base / path, self.root / path
            with open(src, "rb") as f:
                os.fsync(f.fileno())  # the transfer tool may not have; the manifest will vouch for it
            self._make_dirs(dst.parent, touched)
            os.replace(src, dst)
            touched.add(dst.parent)
        for folder in sorted(touched, key=lambda p: len(p.parts), reverse=True):
            _fsync_dir(folder)
        shutil.rmtree(base, ignore_errors=True)  # only leftovers; staging is never trusted
        self.copied_marker(record.name).unlink(missing_ok=True)

    def _make_dirs(self, folder: Path, touched: set[Path]) -> None:
        """mkdir -p, remembering each new folder's parent so its entry gets fsynced too."""
        missing = []
        while not folder.exists():
            missing.append(folder)
            folder = folder.parent
        for new in reversed(missing):
            new.mkdir()
            touched.add(new.parent)

    # -- what it holds now -----------------------------------------------------------------

    def observe(self, record: CheckpointRecord, size_only: bool = False) -> dict[str, Seen]:
        """The record's regular files in the store now: size and (unless size_only) sha256 of the
        bytes, read again; a missing file, a symlink or a folder in its place is left out."""
        seen: dict[str, Seen] = {}
        for path in sorted(record.files):
            try:
                check_relpath(path, "file path")
                self._check_parents(path)
                st = os.lstat(self.root / path)
            except (OSError, ValueError, EvacuationError):
                continue
            if stat.S_ISREG(st.st_mode):
                seen[path] = Seen(st.st_size, {} if size_only else {"sha256": self.hash_file(self.root / path)})
        return seen

    def set_aside(self, name: str, paths: list[str], into: str | None = None) -> str:
        """Move the named store files (found damaged) to `.relaunch/damaged/<name>.<time>/` (with
        `into`: `.relaunch/<into>/`, an abandoned branch's), so a new copy can take their place:
        relaunch never deletes or overwrites a file it did not verify now."""
        folder = (self.meta / into if into else
                  self.meta / DAMAGED / f"{name}.{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}")
        moved = 0
        for path in paths:
            try:
                check_relpath(path, "file path")
                self._check_parents(path)
            except (ValueError, EvacuationError):
                continue
            src = self.root / path
            if not os.path.lexists(src):
                continue
            dst = folder / path
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.replace(src, dst)
            moved += 1
        return f"{moved} file(s) moved to {folder}" if moved else ""

    # -- pruning ---------------------------------------------------------------------------

    def prune(self, manifest: StoreManifest, keep: int, protect: frozenset[str] = frozenset()) -> list[str]:
        """Keep the newest `keep` checkpoints (and those in `protect`); drop older records from
        `manifest`, save it FIRST, then delete their files. Never removes the newest. Returns the
        removed names, oldest first.
        """
        drop = manifest.drop_beyond(keep, protect)
        if not drop:
            return []
        self.save_manifest(manifest)
        still_listed = {p for r in manifest.checkpoints.values() for p in r.files}
        for record in drop:
            for path in sorted(record.files):
                if path in still_listed:
                    continue
                try:
                    self._check_parents(path)
                except EvacuationError:
                    continue  # never delete through a symlinked folder
                (self.root / path).unlink(missing_ok=True)
            self._remove_empty_dirs(record)
        return [r.name for r in drop]

    def _remove_empty_dirs(self, record: CheckpointRecord) -> None:
        """Remove the folders the checkpoint's files left empty, deepest first, up to its name."""
        folders: set[Path] = set()
        name_dir = self.root / record.name
        for path in record.files:
            folder = (self.root / path).parent
            while folder != self.root and (folder == name_dir or name_dir in folder.parents):
                folders.add(folder)
                folder = folder.parent
        for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):
            try:
                folder.rmdir()
            except OSError:
                pass  # not empty (files we did not write) or already gone: leave it
