"""`via: local` for rclone and hf remotes: bytes pass through this machine, and the instance never
holds the remote's credentials.

Evacuate: instance -> rsync -> a cache folder here (each file verified by sha256 against the
instance's as it lands) -> the remote, file by file while the next ones still arrive (verified by
the remote's own hashes against these bytes) -> the manifest. A checkpoint of one file is pulled,
then uploaded: a remote's own hash of an object (the md5 of an S3 upload in parts) is only
known for a whole file, and relaunch does not give up checking it.
Restore: the remote -> the cache -> rsync -> the instance (verified there by the caller).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..host.hashing import FileHash
from ..job import Job, StoreState
from ..layouts import Checkpoint
from ..manifest import EXTRA_HASHES, CheckpointRecord, Seen, StoreManifest
from ..plan import LOCAL, Action, Ref
from ..ui import UI, human
from .base import Hashes, Mismatch, Store, cp_bytes, expected_record, hash_ref_names, store_deadline
from .folder import StoreFolder
from .hf import HfStore
from .local import StagingCalls, pull_actions, push_actions
from .rclone import RcloneStore

UPLOAD_LANE = "upload"


class Relay(Store):
    instance_hashes = ("sha256",)

    def __init__(self, remote: RcloneStore | HfStore, cache_root: Path) -> None:
        self.remote = remote
        self.cache = StoreFolder(cache_root)
        self.staging = StagingCalls(self.cache)
        self.label = remote.label
        self.recipe_name = remote.recipe_name
        self.hash_name = f"sha256 of the instance's bytes = sha256 of the copy here; then {remote.hash_name}"
        self.swap_guarantee = remote.swap_guarantee

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

    def swap_meta(self, filename: str, expected: str | None, text: str) -> bool:
        return self.remote.swap_meta(filename, expected, text)

    def prune(self, manifest: StoreManifest, keep: int, protect: frozenset[str] = frozenset()) -> list[str]:
        return self.remote.prune(manifest, keep, protect)

    def observe(self, record: CheckpointRecord, size_only: bool = False) -> dict[str, Seen]:
        return self.remote.observe(record, size_only)

    def set_aside(self, record: CheckpointRecord, paths: list[str], into: str | None = None) -> str:
        return self.remote.set_aside(record, paths, into)

    # -- evacuation ---------------------------------------------------------------------------
    def plan_receive(self, job: Job, cp: Checkpoint, every_byte: bool = False) -> list[Action]:
        return self.plan_receive_parts([(job, cp)], cp, every_byte)

    def plan_receive_parts(self, parts: list[tuple[Job, Checkpoint]], cp: Checkpoint,
                           every_byte: bool = False) -> list[Action]:
        # one stream unless the recipe asks for more: files then land one after the other and
        # each goes up while the next arrives (streams land theirs together, at the end)
        asked = "streams" in parts[0][0].recipe.checkpoint.model_fields_set
        pull = pull_actions(parts, self.cache, cp, every_byte, f"the cache {self.cache.root} on this machine",
                            follow=False, streams=None if asked else 1)
        hosts = [job.host for job, _ in parts]
        names = hash_ref_names(cp, hosts)
        hashes: Ref | list[Ref] = Ref(names[0]) if len(names) == 1 else [Ref(n) for n in names]
        total = sum(e.size for e in cp.files)
        upload = Action("evacuate", f"each file of {cp.name} from this machine to {self.label} once it verified here",
                        where=LOCAL, call="store.upload_landed", args={"cp": cp, "hashes": hashes, "host": hosts[0]},
                        lane=UPLOAD_LANE, needs=(f"staging:{cp.name}", *names), produces=f"landed:{cp.name}",
                        deadline=store_deadline(total),
                        fails_as="evacuate", say=f"uploading {cp.name} ({len(cp.files)} file(s), {human(total)}) "
                                                 f"to {self.label} as its files arrive here")
        return [*pull, upload]

    def plan_accept(self, job: Job, cp: Checkpoint, hashes: Ref | list[Ref],
                    about: dict[str, Any] | None = None) -> list[Action]:
        return [Action("evacuate", f"verify {cp.name} on {self.label}, record it, clear the cache", where=LOCAL,
                       call="store.finish", fails_as="evacuate", produces=f"verified:{cp.name}",
                       deadline=store_deadline(cp_bytes(cp)),
                       args={"cp": cp, "hashes": hashes, "landed": Ref(f"landed:{cp.name}"), "host": job.host,
                             **({"about": about} if about else {})})]

    def upload_landed(self, cp: Checkpoint, hashes: Hashes, host: str, ui: UI,
                      cancelled: Callable[[], bool]) -> dict[str, FileHash]:
        """Upload each staged file as soon as it is in place and its sha256 equals the instance's;
        what landed here, by path (with the hashes the remote's check needs)."""
        expected = expected_record(cp, hashes, host)     # Vanished / Damaged before any upload
        staged = self.cache.staging_path(cp.name)
        landed: dict[str, FileHash] = {}
        ready: list[str] = []
        upload = self.remote.begin_upload(staged, cp, host)

        def send() -> None:
            size = sum(landed[p].size for p in ready)
            upload.send(sorted(ready), size, ui, cancelled)
            ready.clear()

        # while one batch uploads, the next files arrive: they make the next batch
        for batch in self.staging.follow(cp, self.remote.landed_hashes, cancelled):
            for got in batch:
                want = expected.files.get(got.path)
                if want is None or got.missing or got.size != want.size or got.hashes.get("sha256") != want.sha256:
                    problem = (f"{got.path}: missing" if got.missing or want is None else
                               f"{got.path}: sha256 {got.hashes.get('sha256')} size {got.size}, expected "
                               f"{want.sha256} size {want.size}")
                    raise Mismatch(f"{cp.name} did not verify: {problem}", [problem])
                landed[got.path] = got
                ready.append(got.path)
            send()
        missing = sorted(set(expected.files) - set(landed))
        if missing:
            raise Mismatch(f"{cp.name} did not verify: {missing[0]}: missing here", [f"{missing[0]}: missing"])
        upload.finish(ui, cancelled)
        return landed

    def finish(self, cp: Checkpoint, hashes: Hashes, landed: dict[str, FileHash], host: str,
               about: dict[str, Any] | None = None) -> str:
        record = expected_record(cp, hashes, host, about)
        compared = self.remote.check_uploaded(record, self.cache.staging_path(cp.name), landed)
        # the remote's own hashes of these bytes (an md5, a git blob id): what it holds can be checked later
        own = self.remote.own_hashes(cp.name) if isinstance(self.remote, HfStore) else {}
        for path, want in record.files.items():
            got = landed.get(path)
            want.extra.update({k: v for k, v in (got.hashes if got else {}).items() if k in EXTRA_HASHES})
            want.extra.update(own.get(path, {}))
        self.record(record)
        self.cache.drop_staging(record.name)
        return f"sha256 of the instance's bytes = sha256 of the copy here; then {compared}"

    # -- restore ------------------------------------------------------------------------------
    def plan_send(self, job: Job, record: CheckpointRecord, incoming: str) -> list[Action]:
        name = f"restore-{record.name}"
        here = self.cache.staging_path(name)
        drop = Action("checkpoint", f"clear {here}", where=LOCAL, call="staging.drop", args={"name": name},
                      fails_as="checkpoint")
        fetched = f"fetched:{record.name}"
        download = self.remote.download_actions(record, here)
        download[-1] = dataclasses.replace(download[-1], produces=fetched)
        return [drop, *download,
                *push_actions(job, here / record.name, record.name, incoming,
                              {p: f.size for p, f in record.files.items()}, record.is_dir, after=(fetched,)),
                Action("checkpoint", f"clear {here}", where=LOCAL, call="staging.drop", args={"name": name},
                       always=True, fails_as="checkpoint")]
