"""The store: the off-machine copy of the checkpoints, here a folder on this machine.

Layout of a store root:

    ckpt-00000500.pt                 each checkpoint under its own name, exactly as training
    checkpoint-500/...               wrote it (paths relative to the root = relative to
                                     checkpoint.dir on the instance)
    .relaunch/manifest.json          the trusted record: every checkpoint's files, size, sha256
    .relaunch/freeze.txt, versions.json, log-tail.txt
    .relaunch/partial/<name>/...     staging for transfers in flight; never trusted

Rules this module keeps: a checkpoint is in the manifest only after every file of it was
verified and moved into place; nothing is overwritten with different bytes; nothing is deleted
except by `prune`, and then only after the manifest no longer lists it. The manifest is always
replaced atomically, so a crash leaves either the old one or the new one, never a mix.

One writer at a time: nothing here locks the store against a concurrent sync/evacuate.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, UTC
from pathlib import Path
from typing import Any

from relaunch.errors import CheckpointError, EvacuationError, UsageError

META_DIR = ".relaunch"
SWAP_WAIT = 30.0        # seconds a compare-and-set of a metadata file waits for another one (held for milliseconds)
MANIFEST = "manifest.json"
PARTIAL = "partial"
DAMAGED = "damaged"          # store files that no longer matched their record, set aside (never deleted)
FORMAT = 1  # manifest format version, written into the file for later migrations

_HEX64 = re.compile(r"[0-9a-f]{64}")
RSYNC_PARTIAL = ".rsync-partial"                     # rsync --partial-dir: kept by a stopped transfer
_RSYNC_TEMP = re.compile(r"\.(.+)\.[A-Za-z0-9]{6}")   # rsync's in-flight temp name for NAME


def utc_now() -> str:
    """An ISO 8601 UTC timestamp for `verified_at`: 2025-01-31T12:00:00Z."""
    return datetime.now(UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def check_relpath(path: str, what: str = "path") -> str:
    """A path that stays inside the store and out of `.relaunch/`, or ValueError saying why.

    The manifest decides what `commit` writes and `prune` deletes, so a hand-edited or hostile
    manifest must not be able to point outside the store.
    """
    if not isinstance(path, str):
        raise ValueError(f"{what} {path!r} is not a string")
    if not path:
        raise ValueError(f"{what} is empty")
    if "\0" in path or path.startswith("/"):
        raise ValueError(f"{what} {path!r} is not a relative path")
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"{what} {path!r} has an empty, '.' or '..' component")
    if parts[0] == META_DIR:
        raise ValueError(f"{what} {path!r} is inside {META_DIR}/")
    return path


# hashes a record keeps beside sha256: the store's own, so that what it holds can be checked
# later without the instance (an rclone remote's md5, a Hub file's git blob id)
EXTRA_HASHES = ("md5", "gitblob")


@dataclass(frozen=True)
class Seen:
    """One file as the store holds it now: its size and the hashes the store itself gives."""

    size: int
    hashes: dict[str, str] = field(default_factory=dict, hash=False)   # "sha256", "md5", "gitblob", ...


@dataclass
class FileRecord:
    size: int
    sha256: str
    node: str | None = None  # in a node group: the node that held it
    extra: dict[str, str] = field(default_factory=dict)   # EXTRA_HASHES of the same bytes

    def as_dict(self) -> dict[str, Any]:
        return {"size": self.size, "sha256": self.sha256, **({"node": self.node} if self.node else {}),
                **{k: v for k, v in sorted(self.extra.items())}}


@dataclass
class CheckpointRecord:
    name: str
    step: int
    files: dict[str, FileRecord]  # path relative to the store root ("checkpoint-500/model.pt")
    verified_at: str  # ISO 8601 UTC
    host: str
    written_at: float | None = None  # newest file mtime on the instance (epoch s): what lag is measured from
    # how training ran when it saved this (run.json of the `up` that started it): world size,
    # processes per node, grad_accum, global and micro batch; None when relaunch did not start it
    saved_with: dict[str, Any] | None = None

    @property
    def is_dir(self) -> bool:
        """A folder checkpoint (checkpoint-500/...) rather than one file (ckpt-500.pt)."""
        return any(path != self.name for path in self.files)

    def check(self) -> None:
        """ValueError unless the name and every path are safe and every path is inside the
        checkpoint (a file shared by two records would be deleted by pruning either)."""
        check_relpath(self.name, "checkpoint name")
        if not self.files:
            raise ValueError(f"checkpoint {self.name!r} lists no files")
        for path, rec in self.files.items():
            check_relpath(path, "file path")
            if path != self.name and not path.startswith(self.name + "/"):
                raise ValueError(f"file {path!r} is not inside checkpoint {self.name!r}")
            if not _HEX64.fullmatch(rec.sha256):
                raise ValueError(f"{path}: sha256 {rec.sha256!r} is not 64 lowercase hex digits")
            if rec.size < 0:
                raise ValueError(f"{path}: negative size")


@dataclass
class StoreManifest:
    recipe: str
    checkpoints: dict[str, CheckpointRecord] = field(default_factory=dict)

    def ordered(self) -> list[CheckpointRecord]:
        """Oldest first by step (the name breaks ties)."""
        return sorted(self.checkpoints.values(), key=lambda r: (r.step, r.name))

    def newest(self) -> CheckpointRecord | None:
        records = self.ordered()
        return records[-1] if records else None

    def add(self, record: CheckpointRecord) -> None:
        self.checkpoints[record.name] = record

    def drop_beyond(self, keep: int, protect: frozenset[str] = frozenset()) -> list[CheckpointRecord]:
        """Remove all but the newest `keep` records (never the newest, never one named in
        `protect`: what an evacuation counts on); return them, oldest first.

        Every store prunes the same way: this first, then save the manifest, and only then
        delete the dropped files, so a crash leaves unlisted files, never a listed checkpoint
        with files missing.
        """
        if keep < 1:
            raise UsageError(f"checkpoint.keep must be at least 1, not {keep}")
        records = self.ordered()
        drop = [r for r in (records[:-keep] if len(records) > keep else []) if r.name not in protect]
        for record in drop:
            del self.checkpoints[record.name]
        return drop

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n"

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "recipe": self.recipe,
            # a list, oldest first, reads better than a dict keyed by name
            "checkpoints": [
                {
                    "name": r.name,
                    "step": r.step,
                    "verified_at": r.verified_at,
                    "host": r.host,
                    **({"written_at": r.written_at} if r.written_at is not None else {}),
                    **({"saved_with": r.saved_with} if r.saved_with else {}),
                    "files": {p: f.as_dict() for p, f in sorted(r.files.items())},
                }
                for r in self.ordered()
            ],
        }

    @classmethod
    def from_json(cls, text: str, where: str) -> StoreManifest:
        """Parse a manifest; anything wrong is a CheckpointError naming `where`."""
        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise _corrupt(where, str(exc)) from None
        return cls.from_dict(doc, where)

    @classmethod
    def from_dict(cls, doc: Any, where: str) -> StoreManifest:
        try:
            return cls._parse(doc)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise _corrupt(where, f"missing key {exc}" if isinstance(exc, KeyError) else str(exc)) from None

    @classmethod
    def _parse(cls, doc: Any) -> StoreManifest:
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        if doc.get("format") != FORMAT:
            raise ValueError(f"unknown format {doc.get('format')!r} (this relaunch reads {FORMAT})")
        recipe = doc["recipe"]
        if not isinstance(recipe, str):
            raise ValueError("recipe is not a string")
        manifest = cls(recipe=recipe)
        for raw in doc["checkpoints"]:
            step = raw["step"]
            if not isinstance(step, int) or isinstance(step, bool):
                raise ValueError(f"checkpoint {raw['name']!r}: step is not an integer")
            files = {}
            for path, f in raw["files"].items():
                size = f["size"]
                if not isinstance(size, int) or isinstance(size, bool):
                    raise ValueError(f"{path}: size is not an integer")
                node = f.get("node")
                if node is not None and not isinstance(node, str):
                    raise ValueError(f"{path}: node is not a string")
                extra = {k: f[k] for k in EXTRA_HASHES if isinstance(f.get(k), str)}
                files[path] = FileRecord(size=size, sha256=f["sha256"], node=node, extra=extra)
            record = CheckpointRecord(
                name=raw["name"],
                step=step,
                files=files,
                verified_at=str(raw["verified_at"]),
                host=str(raw["host"]),
                written_at=float(raw["written_at"]) if raw.get("written_at") is not None else None,
                saved_with=_saved_with(raw.get("saved_with")),
            )
            record.check()
            if record.name in manifest.checkpoints:
                raise ValueError(f"checkpoint {record.name!r} listed twice")
            manifest.add(record)
        return manifest


def _saved_with(raw: Any) -> dict[str, Any] | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError("saved_with is not a mapping")
    return raw


def _corrupt(where: str, detail: str) -> CheckpointError:
    return CheckpointError(
        f"{where}: corrupt store manifest: {detail}",
        hint="it is the store's trusted record and relaunch never writes it half-way; restore "
        f"it from a backup, or move {META_DIR}/ aside to start a new record (the checkpoint "
        "files stay, but are not trusted until evacuated again)",
    )


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


class LocalStore:
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

    def set_aside(self, name: str, paths: list[str]) -> str:
        """Move the named store files (found damaged) to `.relaunch/damaged/<name>.<time>/`, so a new
        copy can take their place: relaunch never deletes or overwrites a file it did not verify now."""
        folder = self.meta / DAMAGED / f"{name}.{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}"
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
