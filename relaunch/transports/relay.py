"""`via: local` for rclone and hf remotes: bytes pass through this machine, and the instance never
holds the remote's credentials.

Evacuate: instance -> rsync -> a cache folder here (verified by sha256 against the instance) ->
the remote (verified by the remote's own hashes against these bytes) -> the manifest.
Restore: the remote -> the cache -> rsync -> the instance (verified there by the caller).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..job import Job, StoreState
from ..layouts import Checkpoint
from ..plan import LOCAL, Action, Ref
from ..store import CheckpointRecord, LocalStore, StoreManifest
from .base import Store
from .hf import HfStore
from .local import StagingCalls, pull_actions, push_actions
from .rclone import RcloneStore


class Relay(Store):
    instance_hashes = ("sha256",)

    def __init__(self, remote: RcloneStore | HfStore, cache_root: Path) -> None:
        self.remote = remote
        self.cache = LocalStore(cache_root)
        self.staging = StagingCalls(self.cache)
        self.label = remote.label
        self.recipe_name = remote.recipe_name
        self.hash_name = f"sha256 of the instance's bytes = sha256 of the copy here; then {remote.hash_name}"

    @property  # type: ignore[override]
    def manifest(self) -> StoreManifest | None:
        return self.remote.manifest

    @manifest.setter
    def manifest(self, value: StoreManifest | None) -> None:
        self.remote.manifest = value

    def is_credential(self, name: str) -> bool:
        return self.remote.is_credential(name)

    def handlers(self) -> dict[str, Any]:
        return {"store": self, "staging": self.staging, "remote": self.remote}

    def read(self, writing: bool = False) -> StoreState:
        return self.remote.read(writing)

    def save_manifest(self, manifest: StoreManifest) -> None:
        self.remote.save_manifest(manifest)

    def write_meta(self, filename: str, text: str) -> None:
        self.remote.write_meta(filename, text)

    def read_meta(self, filename: str) -> str | None:
        return self.remote.read_meta(filename)

    def prune(self, manifest: StoreManifest, keep: int, protect: frozenset[str] = frozenset()) -> list[str]:
        return self.remote.prune(manifest, keep, protect)

    # -- evacuation ---------------------------------------------------------------------------
    def plan_receive(self, job: Job, cp: Checkpoint, again: bool = False) -> list[Action]:
        return self.plan_receive_parts([(job, cp)], cp, again)

    def plan_receive_parts(self, parts: list[tuple[Job, Checkpoint]], cp: Checkpoint,
                           again: bool = False) -> list[Action]:
        return pull_actions(parts, self.cache, cp, again, f"the cache {self.cache.root} on this machine")

    def plan_accept(self, job: Job, cp: Checkpoint, hashes: Ref | list[Ref],
                    about: dict[str, Any] | None = None) -> list[Action]:
        staged = self.cache.staging_path(cp.name)
        record = Ref(f"record:{cp.name}")
        return [
            Action("evacuate", f"verify {cp.name} here against the instance's sha256", where=LOCAL,
                   call="staging.verify", args={"cp": cp, "hashes": hashes, "host": job.host,
                                                **({"about": about} if about else {})},
                   produces=record.name, fails_as="evacuate"),
            *self.remote.upload_actions(staged, cp, job.host),
            Action("evacuate", f"verify {cp.name} on {self.label}, record it, clear the cache", where=LOCAL,
                   call="store.finish", args={"record": record, "staged": staged}, fails_as="evacuate",
                   produces=f"verified:{cp.name}"),
        ]

    def finish(self, record: CheckpointRecord, staged: Path) -> str:
        compared = self.remote.check_uploaded(record, staged)
        self.record(record)
        self.cache.drop_staging(record.name)
        return f"sha256 of the instance's bytes = sha256 of the copy here; then {compared}"

    # -- restore ------------------------------------------------------------------------------
    def plan_send(self, job: Job, record: CheckpointRecord, incoming: str) -> list[Action]:
        name = f"restore-{record.name}"
        here = self.cache.staging_path(name)
        total = sum(f.size for f in record.files.values())
        drop = Action("checkpoint", f"clear {here}", where=LOCAL, call="staging.drop", args={"name": name},
                      fails_as="checkpoint")
        return [drop, *self.remote.download_actions(record, here),
                *push_actions(job, here / record.name, record.name, incoming, total, record.is_dir),
                Action("checkpoint", f"clear {here}", where=LOCAL, call="staging.drop", args={"name": name},
                       always=True, fails_as="checkpoint")]
