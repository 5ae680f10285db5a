"""Several writers (two instances evacuating at once, `sync` here and `evacuate` elsewhere: the
local lock in Store.lock serialises only this machine): every commit that changes the manifest
is made with the head it was computed from as `parent_commit`. The Hub refuses it (412) when
another writer committed meanwhile; then the manifest is read again at the new head, this
writer's changes since its last read are applied to it (`merge_manifests`: the other writer's
records stay, ours are added, a name both recorded with different files is refused, never
overwritten) and the commit is tried again, a bounded number of times (relaunch.retry). A
record is added only while its files at that head are the very blobs verified at the commit its
upload made, so a manifest never lists files another writer pruned or replaced.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ...errors import EvacuationError, RelaunchError
from ...manifest import MANIFEST, META_DIR, StoreManifest
from ...retry import retrying
from .client import Snapshot
from .merge import HeadMoved, merge_manifests
from .repo import HfRepo

# commits tried while other writers keep moving the head (each retry re-reads and merges)
COMMIT_TRIES = 8

log = logging.getLogger("relaunch.hf")


class Commits(HfRepo):
    """HfStore's commits against the head (a mixin: its state lives in HfRepo)."""

    def _head_snapshot(self) -> Snapshot:
        sha = self._head()
        if sha is None:
            raise EvacuationError(f"{self.label}: the repo {self.repo_id} went away while writing to it")
        return self._snapshot(sha)

    def _commit(self, ops: list[Any], message: str, parent: str, what: str) -> str:
        """One commit on top of `parent`; HeadMoved when the head is no longer there."""
        from huggingface_hub.errors import HfHubHTTPError

        try:
            info = self._api().create_commit(self.repo_id, ops, commit_message=message, parent_commit=parent)
        except HfHubHTTPError as exc:
            if getattr(exc.response, "status_code", None) == 412:
                raise HeadMoved(parent) from None
            raise self._fail(exc, what, EvacuationError) from None
        except RelaunchError:
            raise
        except Exception as exc:  # httpx/OSError: one line of ours
            raise self._fail(exc, what, EvacuationError) from None
        return str(info.oid)

    def _against_head(self, attempt: Callable[[], Any], what: str) -> Any:
        """Run attempt (read the head, decide, commit against it) until no other writer got in
        between, at most COMMIT_TRIES times (the one retry policy)."""
        def told(exc: BaseException, seconds: float) -> None:
            log.info("%s: another writer committed to %s meanwhile; %s again on the new head in %.1fs",
                     self.label, self.repo_id, what, seconds)

        try:
            return retrying(attempt, transient=lambda exc: isinstance(exc, HeadMoved), attempts=COMMIT_TRIES,
                            first=0.2, most=3.0, on_retry=told)
        except HeadMoved:
            raise EvacuationError(f"{self.label}: {what} failed: other writers kept committing to {self.repo_id} "
                                  f"({COMMIT_TRIES} tries)", "rerun: nothing unverified is trusted") from None

    def _check_added(self, final: StoreManifest, theirs: StoreManifest, snap: Snapshot) -> None:
        """Each record this commit adds: its files at snap are the blobs verified at its upload's
        commit (another writer may have pruned or replaced them since)."""
        for name, record in final.checkpoints.items():
            if name in theirs.checkpoints:
                continue
            verified = self._verified.get(name)
            for path, want in sorted(record.files.items()):
                got = snap.files.get(path)
                same = (got == verified.get(path) if verified is not None else
                        got is not None and got.size == want.size and got.sha256 in (None, want.sha256))
                if not same:
                    raise EvacuationError(
                        f"{self.label}: {name} not recorded: {path} is "
                        f"{'gone from' if got is None else 'different in'} {self.repo_id}@{snap.sha[:12]} since it "
                        "was verified (another writer pruned or replaced it)", "rerun: it is copied and verified again")

    def _commit_manifest(self, ours: StoreManifest,
                         decide: Callable[[StoreManifest], None] | None = None) -> StoreManifest:
        """Commit this writer's changes to the manifest (ours, against what it read) on top of the
        head, with the pending metadata; returns the manifest now in the repo plus the synthetic
        records. decide(manifest) may change the merged manifest before it is committed (prune)."""
        from huggingface_hub import CommitOperationAdd

        self.ensure_repo()
        synthetic = {n: r for n, r in ours.checkpoints.items() if n in self._synthetic}

        def attempt() -> tuple[str, StoreManifest, StoreManifest]:
            snap = self._head_snapshot()
            theirs = self._manifest_at(snap)
            merged = merge_manifests(self._base or StoreManifest(recipe=self.recipe_name), self._saved(ours),
                                     theirs, self.label)
            full = StoreManifest(recipe=merged.recipe, checkpoints={**merged.checkpoints, **synthetic},
                                 branches=merged.branches)
            if decide is not None:
                decide(full)
            final = self._saved(full)
            for record in final.checkpoints.values():
                try:
                    record.check()
                except ValueError as exc:
                    raise EvacuationError(f"refusing to save the store manifest: {exc}") from None
            self._check_added(final, theirs, snap)
            texts = {**{f"{META_DIR}/{n}": t for n, t in self._pending_meta.items()},
                     f"{META_DIR}/{MANIFEST}": final.to_json()}
            ops = [CommitOperationAdd(self._rp(path), text.encode()) for path, text in texts.items()]
            return self._commit(ops, "relaunch: manifest", snap.sha, "writing the manifest"), final, full

        sha, final, full = self._against_head(attempt, "writing the manifest")
        self._revision, self._base = sha, final
        self._pending_meta.clear()
        return full

    def save_manifest(self, manifest: StoreManifest) -> None:
        """Commit what this process changed in `manifest` since it read the store, merged with what
        other writers committed meanwhile; `manifest` then holds the merged result."""
        try:
            full = self._commit_manifest(manifest)
        except BaseException:
            # what is in the repo, not what failed to get there
            base = self._base or StoreManifest(recipe=self.recipe_name)
            manifest.checkpoints = {**base.checkpoints, **{n: r for n, r in manifest.checkpoints.items()
                                                          if n in self._synthetic}}
            manifest.branches = list(base.branches)
            raise
        manifest.recipe, manifest.checkpoints, manifest.branches = full.recipe, full.checkpoints, full.branches
        self.manifest = manifest
