"""What every kind of store offers the steps: read its state, plan how a checkpoint reaches it
(receive, then accept: verify, commit, record) and how one goes back (send), and the in-process
operations those plans call. One implementation per `checkpoint.remote` kind.

Trust lives in the manifest alone: bytes may sit in the store before they are verified, but a
checkpoint counts only once its record is in the manifest, which is written after the bytes.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from .. import processes
from ..errors import CheckpointError, EvacuationError
from ..host.hashing import FileHash
from ..layouts import Checkpoint
from ..manifest import EXTRA_HASHES, Branch, CheckpointRecord, FileRecord, Seen, StoreManifest, utc_now
from ..paths import state_dir
from ..plan import LOCAL, Action, Ref
from ..ui import UI

if TYPE_CHECKING:
    from ..job import Job, StoreState

# seconds a writer waits for another one before it gives up and says who (RELAUNCH_LOCK_WAIT)
LOCK_WAIT = 900.0
# seconds an in-process store call (its `call` action) may wait on the remote for metadata (the
# Hub's API, rclone listings, a manifest commit with its retries); calls that move or read a
# checkpoint's bytes get the time a copy of that size may take on top (`store_deadline`)
STORE_CALL_DEADLINE = 300.0
STORE_WAIT = 120.0     # the same outside any action: a read that gets no answer (RELAUNCH_STORE_WAIT)


class Vanished(Exception):
    """The files being copied went away meanwhile (a trainer rotated its checkpoints)."""


class Damaged(Exception):
    """A checkpoint on the instance looks complete by its layout but its bytes say otherwise."""


class Mismatch(EvacuationError):
    """What the store received differs from the instance's bytes."""

    def __init__(self, message: str, problems: list[str]) -> None:
        super().__init__(message)
        self.problems = problems


# what hash actions produce: by path; a node group's checkpoint has one per node that held a part
Hashes = dict[str, FileHash] | list[dict[str, FileHash]]


def incoming_ready(name: str) -> str:
    """The result `up` produces once the instance's incoming folder is ready for a copy of `name`."""
    return f"incoming:{name}"


def hash_ref_names(cp: Checkpoint, hosts: list[str]) -> list[str]:
    """What the instance's hash actions for cp produce: one name, or one per node of a group."""
    return [f"hashes:{cp.name}"] if len(hosts) <= 1 else [f"hashes:{cp.name}@{host}" for host in hosts]


def merged(hashes: Hashes) -> dict[str, FileHash]:
    if isinstance(hashes, dict):
        return hashes
    out: dict[str, FileHash] = {}
    for part in hashes:
        out.update(part)
    return out


def expected_record(cp: Checkpoint, hashes: Hashes, host: str, about: dict[str, Any] | None = None) -> CheckpointRecord:
    """The manifest record the instance's hashes promise for cp: Vanished when a file went away
    after the copy, Damaged when one is a save that did not finish. `about`: `saved_with` (how
    training ran) and `held` (path -> the node that held it)."""
    about = about or {}
    held: dict[str, str] = about.get("held") or {}
    found = merged(hashes)
    files: dict[str, FileRecord] = {}
    for entry in cp.files:
        got = found.get(entry.path)
        if got is None or got.missing:
            raise Vanished(cp.name)
        if got.problem:
            raise Damaged(f"{entry.path}: {got.problem}")
        files[entry.path] = FileRecord(size=got.size, sha256=got.hashes["sha256"], node=held.get(entry.path),
                                       extra={k: v for k, v in got.hashes.items() if k in EXTRA_HASHES})
    return CheckpointRecord(name=cp.name, step=cp.step, files=files, verified_at=utc_now(), host=host,
                            written_at=max((e.mtime for e in cp.files), default=None),
                            saved_with=about.get("saved_with") or None)


class Store(ABC):
    label: str                                  # what the user wrote, for messages
    recipe_name: str
    manifest: StoreManifest | None = None       # as read by read(), then as this process changed it
    instance_hashes: tuple[str, ...] = ("sha256",)   # what evacuate computes on the instance for it
    # what "verified" means for this store, in words
    hash_name = "sha256 computed on the instance = sha256 of the copy, computed here"

    # `relaunch run` on a node group (injob/group.py): each node copies its own part of a checkpoint
    # into the store itself, then node 0 verifies the whole and records it; only a store every node
    # reaches on its own, and that lets parts wait beside each other, takes them
    takes_parts = False

    def part_name(self, name: str, rank: int) -> str:
        """The name node `rank` receives its part of checkpoint `name` under (plan_receive's cp.name)."""
        return name

    def join_parts(self, name: str, parts: list[str], files: list[str]) -> None:
        """Before node 0's plan_accept: the parts received under the names `parts` become the
        checkpoint `name`, of exactly `files` (nothing else there is trusted). By default the parts
        land where they belong (an rclone remote's uploads): nothing to do."""
        return None

    def is_credential(self, name: str) -> bool:
        """Is this environment variable one of the store's credentials (never a training secret)?"""
        return False

    def handlers(self) -> dict[str, Any]:
        """The objects whose methods this store's plans call (`store.x`, `staging.x`, `remote.x`)."""
        return {"store": self}

    # -- the record ---------------------------------------------------------------------------
    @abstractmethod
    def read(self, writing: bool = False) -> StoreState:
        """Is it empty, and its manifest (kept in self.manifest). `writing`: for an evacuation,
        which may create what does not exist yet."""

    @abstractmethod
    def save_manifest(self, manifest: StoreManifest) -> None: ...

    @abstractmethod
    def write_meta(self, filename: str, text: str) -> None: ...

    def post(self, filename: str, text: str) -> None:
        """Write `.relaunch/<filename>` now, alone, never the manifest with it: a node's word to the
        others of its group (injob/group.py), which only node 0's manifest writes may not wait for."""
        self.write_meta(filename, text)

    def read_meta(self, filename: str) -> str | None:
        """`.relaunch/<filename>` as text (history.jsonl), None when the store has none."""
        raise NotImplementedError(f"{type(self).__name__} cannot read its metadata files")

    # what swap_meta guarantees on this kind of store, in words
    swap_guarantee = "read, compare, then write: a writer between the read and the write is not seen"

    def swap_meta(self, filename: str, expected: str | None, text: str) -> bool:
        """Compare and set `.relaunch/<filename>` (the watch's lease): write `text` only while it
        holds `expected` (None: absent); False, writing nothing, when it holds anything else. As
        atomic as `swap_guarantee` says; this default reads, compares and writes (with the manifest
        as it is)."""
        if self.read_meta(filename) != expected:
            return False
        self.read(writing=True)
        self.write_meta(filename, text)
        self.flush()
        return True

    @abstractmethod
    def prune(self, manifest: StoreManifest, keep: int, protect: frozenset[str] = frozenset()) -> list[str]:
        """Drop all but the newest `keep` records (never one named in protect), manifest first."""

    def flush(self) -> None:
        """Write the manifest as it is (with the metadata some stores hold back until then)."""
        self.save_manifest(self.manifest or StoreManifest(recipe=self.recipe_name))

    def record_branch(self, branch: Branch, ui: UI) -> list[str]:
        """`up` resumed an older checkpoint: set aside every current record newer than it (they are
        an abandoned branch's), and record the branch; under the store's lock, on the manifest as it
        is now. The names set aside."""
        with self.lock(ui):
            self.read(writing=True)
            manifest = self.manifest
            if manifest is None:
                return []
            marked = manifest.branch(branch, everything=True)
            try:
                self.save_manifest(manifest)
            except OSError as exc:      # a full or read-only disk under a folder store: the user's to fix
                raise CheckpointError(
                    f"setting the abandoned branch's records aside in the store {self.label} failed: "
                    f"{exc.strerror or exc}; the manifest is as it was and training did not start",
                    "free space in the store (nothing was deleted), then rerun the same `relaunch up`",
                    refused=True) from None
            self.manifest = manifest
            return marked

    def record(self, record: CheckpointRecord) -> None:
        """Name a verified, committed checkpoint in the manifest (written after the bytes)."""
        manifest = self.manifest or StoreManifest(recipe=self.recipe_name)
        manifest.add(record)
        self.save_manifest(manifest)
        self.manifest = manifest

    # -- plans --------------------------------------------------------------------------------
    @abstractmethod
    def plan_send(self, job: Job, record: CheckpointRecord, incoming: str) -> list[Action]:
        """Actions that put the record's files at `incoming/<path>` on the instance (the caller verifies)."""

    @abstractmethod
    def plan_receive(self, job: Job, cp: Checkpoint, every_byte: bool = False) -> list[Action]:
        """Actions that copy cp's files off the instance towards the store (not trusted yet);
        `every_byte`: compare every byte instead of trusting size and time."""

    def plan_receive_parts(self, parts: list[tuple[Job, Checkpoint]], cp: Checkpoint,
                           every_byte: bool = False) -> list[Action]:
        """A node group's checkpoint: each part from the node that holds it (by default each node
        sends its part on its own)."""
        return [dataclasses.replace(a, host=job.host) if a.where != LOCAL else a
                for job, part in parts for a in self.plan_receive(job, part, every_byte)]

    def plan_accept(self, job: Job, cp: Checkpoint, hashes: Ref | list[Ref],
                    about: dict[str, Any] | None = None) -> list[Action]:
        """Actions that verify what was received against the instance's hashes, commit it and
        record it in the manifest (by default: one call of `accept`)."""
        return [Action("evacuate", f"verify {cp.name} against the instance's hashes and record it in the store",
                       where=LOCAL, call="store.accept", args={"cp": cp, "hashes": hashes, "host": job.host,
                                                               **({"about": about} if about else {})},
                       deadline=store_deadline(cp_bytes(cp)), produces=f"verified:{cp.name}", fails_as="evacuate")]

    def accept(self, cp: Checkpoint, hashes: Hashes, host: str, about: dict[str, Any] | None = None) -> str:
        """Verify, commit and record cp; return what was compared with what, in words."""
        raise NotImplementedError(f"{type(self).__name__} plans its own acceptance")

    # -- what the store holds now ---------------------------------------------------------------
    @abstractmethod
    def observe(self, record: CheckpointRecord, size_only: bool = False) -> dict[str, Seen]:
        """The record's files as the store holds them now (absent ones left out), with the hashes
        the store itself gives; `size_only`: presence and size, which costs no reading of bytes."""

    def set_aside(self, record: CheckpointRecord, paths: list[str], into: str | None = None) -> str:
        """Move files of a record out of the way of a new copy (never deleted, never overwritten):
        files the store no longer holds as recorded go to `.relaunch/damaged/<name>.<time>/`; with
        `into`, to `.relaunch/<into>/` (an abandoned branch's). Where they went, in words ("": nowhere,
        a store whose history keeps them)."""
        return ""

    # -- one writer at a time -----------------------------------------------------------------
    @contextmanager
    def lock(self, ui: UI, wait: float | None = None) -> Iterator[None]:
        """One writer per store on this machine: `sync` in the background and `evacuate` take turns.

        The holder writes who it is into the lock file; a waiter shows that, and gives up after
        `wait` seconds naming the holder.
        """
        if wait is None:
            wait = float(os.environ.get("RELAUNCH_LOCK_WAIT") or LOCK_WAIT)
        folder = state_dir() / "locks"
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = folder / (hashlib.sha256(self.label.encode()).hexdigest()[:16] + ".lock")
        with open(path, "a+") as handle:
            end = time.monotonic() + wait
            said_waiting = False
            while True:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    holder = _holder(path)
                    if not said_waiting:
                        ui.say(f"waiting up to {wait:g}s for {holder} writing to {self.label}")
                        said_waiting = True
                    if time.monotonic() > end:
                        raise EvacuationError(
                            f"{self.label}: another relaunch still writes to this store after {wait:g}s: {holder}",
                            "wait for it to finish, or stop it (it is safe to stop: nothing half-written is "
                            "trusted), then rerun") from None
                    processes.sleep(0.5)
            handle.seek(0)
            handle.truncate()
            handle.write(json.dumps({"pid": os.getpid(), "command": " ".join(["relaunch", *sys.argv[1:3]]),
                                     "since": time.strftime("%Y-%m-%d %H:%M:%S")}))
            handle.flush()
            try:
                yield
            finally:
                handle.seek(0)
                handle.truncate()


def _holder(path: os.PathLike[str]) -> str:
    try:
        with open(path) as f:
            info = json.loads(f.read() or "{}")
        return f"`{info['command']}` (pid {info['pid']}, since {info['since']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another relaunch"


def store_wait() -> float:
    """Seconds a store call made outside any action (reading the manifest first thing) waits for
    the remote to answer (RELAUNCH_STORE_WAIT, default STORE_WAIT)."""
    return float(os.environ.get("RELAUNCH_STORE_WAIT") or STORE_WAIT)


def cp_bytes(cp: Checkpoint) -> int:
    return sum(e.size for e in cp.files)


def store_deadline(total: int = 0) -> float:
    """The deadline of an in-process store call that handles `total` bytes of a checkpoint
    (downloads, uploads, hashing what the store holds): metadata, plus a copy and a read of them."""
    from ..host.hashing import hash_deadline
    from .rsync import deadline_for

    return STORE_CALL_DEADLINE + (deadline_for(total) + hash_deadline(total) if total else 0.0)
