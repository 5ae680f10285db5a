"""Pruning decides from the merged manifest (records another writer made since this one last
read count towards `keep` but are not dropped), commits the manifest first, then deletes, against
the head, only files that no record at that head lists. Before it, the instance uploads left in
`.relaunch/incoming/` that nothing will move into place are removed.
"""

from __future__ import annotations

from ...layouts.base import last_int
from ...manifest import CheckpointRecord, StoreManifest
from .commits import Commits
from .repo import INCOMING


class Pruning(Commits):
    """HfStore's pruning (a mixin: its state lives in HfRepo)."""

    def prune(self, manifest: StoreManifest, keep: int, protect: frozenset[str] = frozenset()) -> list[str]:
        self._delete_orphans()
        preview = StoreManifest(recipe=manifest.recipe, checkpoints=dict(manifest.checkpoints),
                                branches=list(manifest.branches))
        if not preview.drop_beyond(keep, protect):
            return []
        known = frozenset(manifest.checkpoints)
        dropped: list[CheckpointRecord] = []

        def decide(merged: StoreManifest) -> None:
            # what another writer recorded since this one read the store counts towards keep, but
            # is not this writer's to drop (it may be telling its user "safe to destroy" right now)
            dropped[:] = merged.drop_beyond(keep, protect | (frozenset(merged.checkpoints) - known))

        full = self._commit_manifest(manifest, decide)      # unlisted first: a crash leaves harmless extra files
        manifest.recipe, manifest.checkpoints, manifest.branches = full.recipe, full.checkpoints, full.branches
        self.manifest = manifest
        self._delete_unlisted(dropped)
        return [r.name for r in dropped]

    def _delete_orphans(self) -> None:
        """Remove the instance uploads left in `.relaunch/incoming/` that nothing will move into place
        (their relaunch was killed between the upload and the move, or their check failed): those of
        a checkpoint the head records (it is in place, from this upload or another writer's) and those
        older than the oldest checkpoint the head keeps (keep would prune them). An upload of a newer
        checkpoint stays: another writer may be about to move it."""
        from huggingface_hub import CommitOperationDelete

        def attempt() -> tuple[str, str] | None:
            snap = self._head_snapshot()
            records = self._manifest_at(snap).checkpoints
            oldest = min((r.step for r in records.values()), default=None)

            def orphan(path: str) -> bool:
                parts = path[len(INCOMING) + 1:].split("/")
                name = parts[1] if len(parts) >= 2 else ""        # <tag>/<checkpoint>[/file...]
                step = last_int(name)
                return bool(name) and (name in records or (oldest is not None and step is not None and step < oldest))

            gone = sorted(p for p in snap.files if p.startswith(INCOMING + "/") and orphan(p))
            if not gone:
                return None
            ops = [CommitOperationDelete(self._rp(p)) for p in gone]
            return self._commit(ops, f"relaunch: remove {len(gone)} leftover upload file(s)", snap.sha,
                                "removing leftover uploads"), snap.sha

        done = self._against_head(attempt, "removing leftover uploads")
        if done is not None and done[1] == self._revision:
            self._revision = done[0]

    def _delete_unlisted(self, dropped: list[CheckpointRecord]) -> None:
        """Delete the files of dropped records that no record lists at the head the deletion is
        committed on top of."""
        from huggingface_hub import CommitOperationDelete

        paths = sorted({p for r in dropped if r.name not in self._synthetic for p in r.files})
        if not paths:
            return
        message = "relaunch: prune " + ", ".join(r.name for r in dropped)

        def attempt() -> tuple[str, str] | None:
            snap = self._head_snapshot()
            listed = {p for r in self._manifest_at(snap).checkpoints.values() for p in r.files}
            gone = [p for p in paths if p in snap.files and p not in listed]
            if not gone:
                return None
            ops = [CommitOperationDelete(self._rp(p)) for p in gone]
            return self._commit(ops, message, snap.sha, "deleting pruned checkpoints"), snap.sha

        done = self._against_head(attempt, "deleting pruned checkpoints")
        if done is not None and done[1] == self._revision:
            self._revision = done[0]            # the same manifest as the commit before it
