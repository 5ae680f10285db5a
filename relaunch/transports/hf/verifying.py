"""Verification: the repo's tree is listed at ONE commit (the one the upload made) and every
expected file must be there with its size and, for an LFS file, its sha256 equal to the
instance's; a regular (non-LFS) file has no sha256 on the Hub, so its git blob id
(sha1 of b"blob <size>\\0" + content) is computed where the bytes are and compared.
"""

from __future__ import annotations

from collections.abc import Callable

from ...manifest import CheckpointRecord, FileRecord, Seen
from .client import Snapshot
from .repo import HfRepo


class Verifying(HfRepo):
    """HfStore's verification (a mixin: its state lives in HfRepo)."""

    instance_hashes = ("sha256", "gitblob")
    hash_name = "the Hub's LFS sha256 (git blob id for small files) = the same of the instance's bytes, at commit"

    # -- what it holds now ---------------------------------------------------------------------------
    def observe(self, record: CheckpointRecord, size_only: bool = False) -> dict[str, Seen]:
        """The record's files at the head now: an LFS file's sha256, a regular file's git blob id."""
        sha = self._head()
        if sha is None:
            return {}
        snap = self._snapshot(sha)
        return {path: Seen(got.size, {"sha256": got.sha256} if got.sha256 else {"gitblob": got.blob_id})
                for path in record.files if (got := snap.files.get(path)) is not None}

    def own_hashes(self, name: str) -> dict[str, dict[str, str]]:
        """The git blob ids of a checkpoint's regular (non-LFS) files as verified at its upload's
        commit: the Hub's own hash of them, for the record."""
        return {p: {"gitblob": f.blob_id} for p, f in self._verified.get(name, {}).items() if f.sha256 is None}

    # -- verifying ---------------------------------------------------------------------------------
    def _compare(self, snap: Snapshot, expected: dict[str, FileRecord],
                 blob_ids: Callable[[list[str]], dict[str, str]]) -> list[str]:
        """Problems with the repo's files at snap.sha against the expected sizes and sha256."""
        at = f"in {self.repo_id}@{snap.sha[:12]}"
        problems: list[str] = []
        regular: list[str] = []
        for path, want in sorted(expected.items()):
            got = snap.files.get(path)
            if got is None:
                problems.append(f"{path}: missing {at}")
            elif got.size != want.size:
                problems.append(f"{path}: size {got.size} {at}, expected {want.size}")
            elif got.sha256 is None:
                regular.append(path)
            elif got.sha256 != want.sha256:
                problems.append(f"{path}: sha256 {got.sha256} {at}, expected {want.sha256}")
        if regular:
            ours = blob_ids(regular)
            problems += [f"{p}: git blob id {snap.files[p].blob_id} {at}, expected {ours.get(p)}"
                         for p in regular if ours.get(p) != snap.files[p].blob_id]
        return problems
