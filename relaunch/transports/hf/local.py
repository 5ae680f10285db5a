"""via: local: a Relay (relay.py) over these primitives: instance -> rsync -> a cache on this
machine (verified) -> HfApi -> repo (verified), and the reverse for a restore. The uploads are
made against the head too, and refused before any byte is sent when that head records the
checkpoint's name with other files.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ... import processes
from ...errors import EvacuationError
from ...host.hashing import FileHash
from ...layouts import Checkpoint
from ...manifest import CheckpointRecord
from ...plan import LOCAL, Action
from ...ui import UI, human
from ..base import store_deadline
from .client import git_blob_id, sha256_of
from .commits import Commits
from .merge import conflict_error
from .verifying import Verifying


class ViaLocal(Commits, Verifying):
    """HfStore's primitives for the relay (a mixin: its state lives in HfRepo)."""

    landed_hashes = ("sha256",)

    def begin_upload(self, staged: Path, cp: Checkpoint, host: str) -> _Upload:
        return _Upload(self, staged, cp, host)

    def commit_from(self, staged: Path, cp: Checkpoint, host: str) -> str:
        """Upload and commit all of cp's staged files at once."""
        from huggingface_hub import CommitOperationAdd

        return self.commit_ops(staged, cp, host, [CommitOperationAdd(self._rp(e.path), str(staged / e.path))
                                                  for e in cp.files])

    def commit_ops(self, staged: Path, cp: Checkpoint, host: str, ops: list[Any]) -> str:
        """One commit of cp's files (uploaded already, or small ones inline) on the head."""
        self.ensure_repo()

        def attempt() -> str:
            # against the head, so that no record another writer made there is overwritten
            snap = self._head_snapshot()
            recorded = self._manifest_at(snap).checkpoints.get(cp.name)
            if recorded is not None and not self._same_bytes(recorded, cp, staged):
                raise conflict_error(self.label, recorded)
            return self._commit(ops, f"relaunch: {cp.name} (step {cp.step}) from {host}", snap.sha,
                                f"uploading {cp.name}")

        sha: str = self._against_head(attempt, f"uploading {cp.name}")
        self._uploaded[cp.name] = sha
        return sha

    @staticmethod
    def _same_bytes(record: CheckpointRecord, cp: Checkpoint, staged: Path) -> bool:
        """Is the staged copy of cp exactly the record's files?"""
        if {e.path for e in cp.files} != set(record.files):
            return False
        for path, want in record.files.items():
            try:
                if (staged / path).stat().st_size != want.size:
                    return False
            except FileNotFoundError:
                return False
        return all(sha256_of(staged / path) == want.sha256 for path, want in record.files.items())

    def check_uploaded(self, record: CheckpointRecord, staged: Path,
                       landed: dict[str, FileHash] | None = None) -> str:
        """The commit made from `staged` against the bytes here; what was compared, in words."""
        sha = self._uploaded.get(record.name) or self._head()
        if sha is None:
            raise EvacuationError(f"{self.label}: the repo {self.repo_id} does not exist after the upload")
        snap = self._snapshot(sha)
        problems = self._compare(snap, record.files, lambda paths: {p: git_blob_id(staged / p) for p in paths})
        if problems:
            raise EvacuationError(f"{self.label}: {record.name} did not verify in the repo: {problems[0]}")
        self._verified[record.name] = {p: snap.files[p] for p in record.files}
        return f"{self.hash_name} {sha[:12]}"

    def download_actions(self, record: CheckpointRecord, dest: Path) -> list[Action]:
        total = sum(f.size for f in record.files.values())
        return [Action("checkpoint", f"{record.name} ({human(total)}) from {self.label} to this machine",
                       where=LOCAL, call="remote.download_to", args={"record": record, "dest": dest},
                       deadline=store_deadline(total), fails_as="checkpoint")]

    def download_to(self, record: CheckpointRecord, dest: Path) -> None:
        sha = self._revision or self._head()
        if sha is None:
            raise self._missing_error()
        with tempfile.TemporaryDirectory(prefix="relaunch-hf-", dir=dest.parent) as tmp:
            for path in sorted(record.files):
                self._download(path, sha, Path(tmp))
            dest.mkdir(parents=True, exist_ok=True)
            source = Path(tmp) / self._rp(record.name)
            os.replace(source, dest / record.name)


class _Upload:
    """A checkpoint going up from the relay's cache: each batch's large files to the Hub's LFS
    storage as they arrive, then one commit of them all (a checkpoint appears whole or not)."""

    def __init__(self, store: ViaLocal, staged: Path, cp: Checkpoint, host: str) -> None:
        self.store, self.staged, self.cp, self.host = store, staged, cp, host
        self.ops: dict[str, Any] = {}

    def send(self, paths: list[str], size: int, ui: UI, cancelled: Callable[[], bool]) -> None:
        from huggingface_hub import CommitOperationAdd

        store = self.store
        store.ensure_repo()
        new = [CommitOperationAdd(store._rp(p), str(self.staged / p)) for p in paths]
        with ui.transfer(f"{len(paths)} file(s) of {self.cp.name} ({human(size)}) to {store.label}", size, ""), \
                store._hub(f"uploading {self.cp.name}", EvacuationError):
            store._api().preupload_lfs_files(store.repo_id, additions=new)
        self.ops.update(zip(paths, new, strict=True))

    def finish(self, ui: UI, cancelled: Callable[[], bool]) -> None:
        processes.check_cancel()
        self.store.commit_ops(self.staged, self.cp, self.host, [self.ops[e.path] for e in self.cp.files])
