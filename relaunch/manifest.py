"""The store's records: what `.relaunch/manifest.json` says of each checkpoint (its files with
size and sha256, when it was verified, from which host), and how that is read and written as
JSON. Every kind of store (`transports/`) keeps the same manifest.

Layout of a store root:

    ckpt-00000500.pt                 each checkpoint under its own name, exactly as training
    checkpoint-500/...               wrote it (paths relative to the root = relative to
                                     checkpoint.dir on the instance)
    .relaunch/manifest.json          the trusted record: every checkpoint's files, size, sha256
    .relaunch/freeze.txt, versions.json, log-tail.txt
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from relaunch.errors import CheckpointError, UsageError

META_DIR = ".relaunch"
MANIFEST = "manifest.json"
FORMAT = 1  # manifest format version, written into the file for later migrations

_HEX64 = re.compile(r"[0-9a-f]{64}")


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
