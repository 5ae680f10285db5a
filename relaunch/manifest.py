"""The store's records: what `.relaunch/manifest.json` says of each checkpoint (its files with
size and sha256, when it was verified, from which host), and how that is read and written as
JSON. Every kind of store (`transports/`) keeps the same manifest.

Layout of a store root:

    ckpt-00000500.pt                 each checkpoint under its own name, exactly as training
    checkpoint-500/...               wrote it (paths relative to the root = relative to
                                     checkpoint.dir on the instance)
    .relaunch/manifest.json          the trusted record: every checkpoint's files, size, sha256
    .relaunch/freeze.txt, versions.json, log-tail.txt
    .relaunch/aside/<branch>/...     an abandoned branch's files, moved when a new save of the same
                                     name took their place (the manifest's branch says so)

Lineage: a training resumed from an older checkpoint starts a new branch (`Branch`). The records
of the run before it that are newer than that checkpoint stay, marked `aside` with the branch's
id: never "newest", never counted or deleted by `keep`, never overwritten.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from relaunch.errors import CheckpointError, UsageError
from relaunch.train import BRANCH_ID

META_DIR = ".relaunch"
MANIFEST = "manifest.json"
# the manifest's format version: 1 until a branch is recorded, then 2, which an older relaunch
# refuses (loudly) rather than read as if the abandoned branch's checkpoints were the newest
FORMAT = 1
FORMAT_BRANCHES = 2
ASIDE = "aside"             # .relaunch/aside/<branch id>/: bytes a new save of the same name displaced

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
    aside: str | None = None   # the id of the branch that set it aside (None: the current branch's)

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
class Branch:
    """A training resumed from a checkpoint older than the newest: the checkpoints newer than it
    belong to an abandoned branch and are set aside (on the instance: moved under
    `<checkpoint.dir>/.relaunch-aside/<id>/`; in the store: their records marked with `id`)."""

    id: str                   # "<UTC time>-from-<name>": also its folder under .relaunch-aside/
    resumed: str              # the checkpoint training resumed from
    step: int                 # its step
    at: float                 # when, in seconds since the epoch (the clock of whoever branched)
    aside: list[str] = field(default_factory=list)   # what was set aside where it branched
    by: str = ""              # who branched: `relaunch up`, relaunch.train's Checkpointer or a callback
    host: str = ""            # the instance it branched on ("" unknown)
    where: str = ""           # the folder on that instance holding what it set aside
    moved: dict[str, str] = field(default_factory=dict)  # name -> where its store bytes went, once displaced

    def as_dict(self) -> dict[str, Any]:
        said = {k: v for k, v in (("by", self.by), ("host", self.host), ("where", self.where)) if v}
        return {"id": self.id, "resumed": self.resumed, "step": self.step, "at": self.at, "aside": list(self.aside),
                **said, **({"moved": dict(self.moved)} if self.moved else {})}

    @classmethod
    def from_dict(cls, raw: Any) -> Branch:
        """ValueError (TypeError, KeyError) when it is not one."""
        if not isinstance(raw, dict):
            raise ValueError("a branch is not a JSON object")
        step, at = raw["step"], raw["at"]
        if not isinstance(step, int) or isinstance(step, bool) or not isinstance(at, (int, float)):
            raise ValueError(f"branch {raw.get('id')!r}: step or at is not a number")
        aside, moved = raw.get("aside") or [], raw.get("moved") or {}
        if not isinstance(aside, list) or not all(isinstance(n, str) for n in aside) or not isinstance(moved, dict):
            raise ValueError(f"branch {raw.get('id')!r}: aside or moved is malformed")
        ident, resumed = raw["id"], raw["resumed"]
        if not isinstance(ident, str) or not BRANCH_ID.fullmatch(ident) or not isinstance(resumed, str):
            raise ValueError(f"branch {ident!r}: its id is not a folder name relaunch makes, or resumed is not a "
                             "string")
        return cls(id=ident, resumed=resumed, step=step, at=float(at), aside=list(aside), by=str(raw.get("by", "")),
                   host=str(raw.get("host", "")), where=str(raw.get("where", "")),
                   moved={str(k): str(v) for k, v in moved.items()})


@dataclass
class StoreManifest:
    recipe: str
    checkpoints: dict[str, CheckpointRecord] = field(default_factory=dict)
    branches: list[Branch] = field(default_factory=list)   # oldest first

    def ordered(self) -> list[CheckpointRecord]:
        """The current branch's records, oldest first by step (the name breaks ties): what
        "newest" and `keep` look at. Records set aside are in `aside_records`."""
        return sorted((r for r in self.checkpoints.values() if r.aside is None), key=lambda r: (r.step, r.name))

    def newest(self) -> CheckpointRecord | None:
        records = self.ordered()
        return records[-1] if records else None

    def aside_records(self) -> list[CheckpointRecord]:
        """The records of abandoned branches, oldest first by step."""
        return sorted((r for r in self.checkpoints.values() if r.aside is not None), key=lambda r: (r.step, r.name))

    def branch(self, branch: Branch, everything: bool = False) -> list[str]:
        """Record `branch` (once: a branch already recorded changes nothing) and set aside the
        current records newer than its step that were written before it branched (`everything`:
        all of them, for `up`, which branches before training can save anything). A save of the
        new branch, written after it, stays current even when it reached the store before the
        branch did (a copy round that read the instance in between). The names set aside."""
        if any(known.id == branch.id for known in self.branches):
            return []
        self.branches.append(branch)
        marked = []
        for record in self.ordered():
            if record.step > branch.step and (everything or record.written_at is None
                                              or record.written_at < branch.at):
                # replaced, never changed in place: a store may hold the records it read (hf's base)
                self.checkpoints[record.name] = dataclasses.replace(record, aside=branch.id)
                marked.append(record.name)
        return marked

    def displace(self, name: str, where: str) -> None:
        """An aside record whose name a new save takes: its record goes, its branch says where its
        bytes went (`where`)."""
        record = self.checkpoints.pop(name)
        self.branches = [dataclasses.replace(b, moved={**b.moved, name: where}) if b.id == record.aside else b
                         for b in self.branches]

    def branch_of(self, record: CheckpointRecord) -> Branch | None:
        return next((b for b in self.branches if b.id == record.aside), None)

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
        records = self.ordered()          # the current branch's: an abandoned one's are never pruned
        drop = [r for r in (records[:-keep] if len(records) > keep else []) if r.name not in protect]
        for record in drop:
            del self.checkpoints[record.name]
        return drop

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n"

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT_BRANCHES if self.branches else FORMAT,
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
                    **({"aside": r.aside} if r.aside is not None else {}),
                    "files": {p: f.as_dict() for p, f in sorted(r.files.items())},
                }
                for r in sorted(self.checkpoints.values(), key=lambda r: (r.step, r.name))
            ],
            **({"branches": [b.as_dict() for b in self.branches]} if self.branches else {}),
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
        if doc.get("format") not in (FORMAT, FORMAT_BRANCHES):
            raise ValueError(f"unknown format {doc.get('format')!r} (this relaunch reads {FORMAT} and "
                             f"{FORMAT_BRANCHES})")
        recipe = doc["recipe"]
        if not isinstance(recipe, str):
            raise ValueError("recipe is not a string")
        manifest = cls(recipe=recipe, branches=[Branch.from_dict(b) for b in doc.get("branches") or []])
        known = {b.id for b in manifest.branches}
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
                aside=raw.get("aside"),
            )
            if record.aside is not None and (not isinstance(record.aside, str) or record.aside not in known):
                raise ValueError(f"checkpoint {record.name!r}: set aside by branch {record.aside!r}, which is "
                                 "not recorded")
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
