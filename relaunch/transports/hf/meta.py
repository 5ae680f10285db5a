"""The meta files beside the manifest (`.relaunch/<filename>`): held until the next manifest
commit (one commit, not four), read at the head, and compared and set against the head.
"""

from __future__ import annotations

from ...errors import UsageError
from ...manifest import MANIFEST, META_DIR
from .commits import Commits


class MetaFiles(Commits):
    """HfStore's meta files (a mixin: its state lives in HfRepo)."""

    def write_meta(self, filename: str, text: str) -> None:
        """Kept until the next save_manifest, which evacuate always calls: one commit, not four."""
        if "/" in filename or filename in ("", ".", "..", MANIFEST):
            raise UsageError(f"write_meta: {filename!r} is not a plain metadata file name")
        self._pending_meta[filename] = text

    def read_meta(self, filename: str) -> str | None:
        """The file as this process last wrote it, else as the repo's newest revision holds it."""
        if filename in self._pending_meta:
            return self._pending_meta[filename]
        sha = self._head()
        if sha is None:
            return None
        rel = f"{META_DIR}/{filename}"
        if rel not in self._snapshot(sha).files:
            return None
        return self._read_text(rel, sha)

    swap_guarantee = "a compare-and-set: a commit against the head it compared with (parent_commit)"

    def swap_meta(self, filename: str, expected: str | None, text: str) -> bool:
        """Compare and set `.relaunch/<filename>`: the file at the head compared with `expected`,
        and `text` committed with that head as parent_commit; when another commit got in between
        (412), compared again at the new head."""
        from huggingface_hub import CommitOperationAdd

        rel = f"{META_DIR}/{filename}"
        self.ensure_repo()

        def attempt() -> bool:
            snap = self._head_snapshot()
            now = self._read_text(rel, snap.sha) if rel in snap.files else None
            if now != expected:
                return False
            self._commit([CommitOperationAdd(self._rp(rel), text.encode())], f"relaunch: {filename}", snap.sha,
                         f"writing {rel}")
            return True

        return bool(self._against_head(attempt, f"writing {rel}"))
