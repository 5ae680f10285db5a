"""A store that is a folder on this machine, reached with rsync over the instance's SSH settings."""

from __future__ import annotations

import shlex
from pathlib import Path

from ..errors import CheckpointError, EvacuationError
from ..layouts import Checkpoint
from ..steps.common import Job
from ..steps.preflight import human
from ..store import CheckpointRecord, FileRecord, LocalStore, StoreManifest
from .base import Received, Store
from .rsync import RETRYABLE, Rsync


def pull_into(job: Job, store: LocalStore, cp: Checkpoint, again: bool) -> Received:
    """rsync the checkpoint's listed files into the store's staging folder (never trusted)."""
    rsync = Rsync(job.target, job.remote.known_hosts, job.ui)
    files = [e.path for e in cp.files]
    total = sum(e.size for e in cp.files)
    extra = ["--checksum"] if again else []
    result = rsync.pull_files(job.paths.ckpt_dir, files, store.staging(cp.name), f"{cp.name} <- {job.host}",
                              total, extra)
    if result.ok:
        return Received(True)
    if result.status == 11 or "No space left on device" in result.output:
        raise EvacuationError(f"{job.host}: evacuate: no room in the store {store.root} for {cp.name} "
                              f"({human(total)}): {result.output.strip()[-200:]}",
                              "free space on this machine (nothing was deleted to make room), then rerun")
    return Received(False, vanished=result.status in (23, 24), lost=result.status in RETRYABLE,
                    message=f"rsync failed ({result.meaning}): {result.output.strip()[-300:]}")


def push_from(job: Job, source: Path, name: str, incoming: str, total: int) -> None:
    """rsync a checkpoint (file or folder) from this machine to `incoming/<name>` on the instance."""
    rsync = Rsync(job.target, job.remote.known_hosts, job.ui)
    result = rsync.push(source, f"{incoming}/{name}", f"{name} -> {job.host}", total)
    if not result.ok:
        raise CheckpointError(f"{job.host}: checkpoint: rsync failed ({result.meaning}): "
                              f"{result.output.strip()[-300:]}", "nothing is lost; rerun `relaunch up`")


class LocalPathStore(Store):
    via = "local"

    def __init__(self, root: Path) -> None:
        self.fs = LocalStore(root)
        self.label = str(root)

    @property
    def root(self) -> Path:
        return self.fs.root

    def is_empty(self) -> bool:
        return self.fs.is_empty()

    def load_manifest(self) -> StoreManifest | None:
        return self.fs.load_manifest()

    def save_manifest(self, manifest: StoreManifest) -> None:
        self.fs.save_manifest(manifest)

    def write_meta(self, filename: str, text: str) -> None:
        self.fs.write_meta(filename, text)

    def prune(self, manifest: StoreManifest, keep: int) -> list[str]:
        return self.fs.prune(manifest, keep)

    def receive(self, job: Job, cp: Checkpoint, again: bool = False) -> Received:
        return pull_into(job, self.fs, cp, again)

    def verify(self, job: Job, cp: Checkpoint, expected: dict[str, FileRecord]) -> list[str]:
        return self.fs.verify_staged(cp.name, expected)

    def commit(self, job: Job, record: CheckpointRecord) -> None:
        self.fs.commit(record)

    def send(self, job: Job, record: CheckpointRecord, incoming: str) -> None:
        push_from(job, self.root / record.name, record.name, incoming, sum(f.size for f in record.files.values()))

    def describe_send(self, job: Job, record: CheckpointRecord, incoming: str) -> str:
        rsync = Rsync(job.target, job.remote.known_hosts, job.ui)
        return shlex.join(rsync.push_argv(self.root / record.name, f"{incoming}/{record.name}"))
