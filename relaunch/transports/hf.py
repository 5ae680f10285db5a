"""A store in a Hugging Face Hub repo: `checkpoint.remote: hf:OWNER/REPO[/SUBFOLDER]`.

Layout in the repo (all under SUBFOLDER when given): each checkpoint under its own name, as
the trainer wrote it, and `.relaunch/` with the manifest and the meta files, exactly like a
local store. Reading, writing the manifest and verifying run here with huggingface_hub's HfApi.

Verification: the repo's tree is listed at ONE commit (the one the upload made) and every
expected file must be there with its size and, for an LFS file, its sha256 equal to the
instance's; a regular (non-LFS) file has no sha256 on the Hub, so its git blob id
(sha1 of b"blob <size>\\0" + content) is computed where the bytes are and compared.

via instance (the default for hf remotes): the instance runs `hf upload` / `hf download` from
relaunch's tools venv (this class). via local: a Relay (relay.py) over this class's local
primitives: instance -> rsync -> a cache on this machine (verified) -> HfApi -> repo (verified),
and the reverse for a restore.

Credentials: this machine's HF_TOKEN (else the token `hf auth login` stored), as the `hf` CLI
does; it is not a training secret, so it needs no place in env.secrets. On the instance it
reaches only the stdin of the one `hf` command that copies (`credentials_stdin`), never its disk.
These variables of this machine are passed to the instance's `hf` as they are (they are not
secret): see PASSED_VARS.

A repo that holds no relaunch manifest but a Trainer's `last-checkpoint/` (push_to_hub with
hub_strategy="checkpoint") is read as a store with that one checkpoint, so `up` can resume from
it; relaunch never writes that record into its manifest, and never prunes those files.

Several writers (two instances evacuating at once, `sync` here and `evacuate` elsewhere: the
local lock in Store.lock serialises only this machine): every commit that changes the manifest
is made with the head it was computed from as `parent_commit`. The Hub refuses it (412) when
another writer committed meanwhile; then the manifest is read again at the new head, this
writer's changes since its last read are applied to it (`merge_manifests`: the other writer's
records stay, ours are added, a name both recorded with different files is refused, never
overwritten) and the commit is tried again, a bounded number of times (relaunch.retry). A
record is added only while its files at that head are the very blobs verified at the commit its
upload made, so a manifest never lists files another writer pruned or replaced. Pruning decides
from the merged manifest (records another writer made since this one last read count towards
`keep` but are not dropped), commits the manifest first, then deletes, against the head, only
files that no record at that head lists. `via: local` uploads are made against the head too,
and refused before any byte is sent when that head records the checkpoint's name with other
files. `hf upload` on the instance cannot be held to a parent revision, and may land long after
the store was read (a slow link): it puts the checkpoint under `.relaunch/incoming/<tag>/`, where
nothing is ever recorded; verified there, it is moved into place by one commit from this
machine against the head (LFS files copied by reference, small regular ones sent again), refused
when that head records the name with other files. So no writer's upload ever replaces the bytes
of a checkpoint another one recorded, however late it lands.

One job that needs its length: HfStore, the store's every operation against one revision. The Hub
client it calls (bounded calls, snapshots, ids) is hf_client.py; the writers' merge, hf_merge.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shlex
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .. import processes
from ..errors import CheckpointError, ConnectError, EvacuationError, RelaunchError, UsageError
from ..host.hashing import FileHash
from ..job import Job, StoreState
from ..layouts.base import last_int
from ..layouts import Checkpoint
from ..manifest import Seen, META_DIR, MANIFEST, CheckpointRecord, FileRecord, StoreManifest, check_relpath, \
    utc_now
from ..plan import LOCAL, Action, Ref
from ..recipe import Recipe
from ..retry import retrying
from ..ui import UI, human, redact
from . import rsync
from .base import Hashes, Store, cp_bytes, expected_record, merged, store_deadline
from .hf_client import ANSI, Bounded, RemoteFile, Snapshot, git_blob_id, hub_token, last_line, sha256_of
from .hf_merge import HeadMoved, conflict_error, merge_manifests
from .tools import credentials_stdin, tool_action, tool_path

# Not secret: handed to the instance's `hf` on its command line when set on this machine.
# HF_ENDPOINT points at a mirror (or the tests' fake hub); the others tune the client.
PASSED_VARS = ("HF_ENDPOINT", "HF_HUB_DISABLE_XET", "HF_HUB_ENABLE_HF_TRANSFER", "HF_HUB_DISABLE_TELEMETRY",
               "HF_HUB_DISABLE_UPDATE_CHECK", "HF_HUB_DISABLE_PROGRESS_BARS", "HF_HUB_ETAG_TIMEOUT",
               "HF_HUB_DOWNLOAD_TIMEOUT")
TRAINER_LAST = "last-checkpoint"           # the folder Trainer(push_to_hub, hub_strategy="checkpoint") keeps
# files a repo may hold without being a store (the Hub's first commit, a model card)
REPO_FILES = {".gitattributes", "README.md"}

_COMMIT = re.compile(r"/commit/([0-9a-f]{40})")
_AUTH = re.compile(r"\b401 Unauthorized\b|\b403 Forbidden\b|Invalid credentials")
_NOT_FOUND = re.compile(r"not found|RepositoryNotFound|does not exist", re.I)
# commits tried while other writers keep moving the head (each retry re-reads and merges)
COMMIT_TRIES = 8
INCOMING = f"{META_DIR}/incoming"          # where the instance's `hf upload` puts a checkpoint

log = logging.getLogger("relaunch.hf")


class HfStore(Store):
    instance_hashes = ("sha256", "gitblob")
    hash_name = "the Hub's LFS sha256 (git blob id for small files) = the same of the instance's bytes, at commit"

    def __init__(self, repo_id: str, subfolder: str, recipe_name: str, token: str | None,
                 endpoint: str | None) -> None:
        self.repo_id, self.subfolder, self.recipe_name = repo_id, subfolder, recipe_name
        self.label = f"hf:{repo_id}" + (f"/{subfolder}" if subfolder else "")
        self.token, self.endpoint = token, endpoint
        self._synthetic: set[str] = set()          # records read from last-checkpoint/, never saved
        self._revision: str | None = None          # the commit the manifest was read (or last written) at
        self._base: StoreManifest | None = None    # the manifest saved at _revision (no synthetic records)
        self._verified: dict[str, dict[str, RemoteFile]] = {}   # name -> its blobs at its upload's commit
        self._snap: Snapshot | None = None         # the last tree listed (a commit's tree never changes)
        self._uploaded: dict[str, str] = {}        # checkpoint name -> commit its upload made
        self._pending_meta: dict[str, str] = {}    # written with the next manifest, in one commit
        self._repo_ready = False

    @classmethod
    def from_recipe(cls, recipe: Recipe) -> HfStore:
        where = recipe.where("checkpoint.remote")
        owner, _, rest = str(recipe.checkpoint.remote)[len("hf:"):].partition("/")
        name, _, subfolder = rest.partition("/")
        subfolder = subfolder.strip("/")
        if not owner or not name:
            raise UsageError(f"{where}: checkpoint.remote: expected hf:OWNER/REPO[/SUBFOLDER]")
        if subfolder:
            try:
                check_relpath(subfolder, "subfolder")
            except ValueError as exc:
                raise UsageError(f"{where}: checkpoint.remote: {exc}") from None
        token = hub_token()
        if token:
            redact.add([token])
        return cls(f"{owner}/{name}", subfolder, recipe.name, token, os.environ.get("HF_ENDPOINT") or None)

    # -- talking to the Hub from this machine ----------------------------------------------------
    def _api(self) -> Any:
        try:
            from huggingface_hub import HfApi
        except ImportError:
            raise UsageError("a checkpoint.remote of kind hf: needs huggingface_hub on this machine",
                             "pip install 'relaunch[hf]'") from None

        # token=False when there is none: never anonymous by accident of some other default
        return Bounded(HfApi(endpoint=self.endpoint, token=self.token or False, library_name="relaunch"),
                        self.endpoint or "https://huggingface.co")

    def _rp(self, rel: str) -> str:
        """A store path as a path in the repo."""
        return f"{self.subfolder}/{rel}" if self.subfolder else rel

    def _auth_error(self) -> ConnectError:
        return ConnectError(f"hf: HF_TOKEN is missing or not allowed for {self.repo_id}",
                            "set HF_TOKEN in this shell (or `hf auth login`) to a token with write access to "
                            "the repo; relaunch hands it to the instance only for a copy", refused=True)

    def _missing_error(self) -> CheckpointError:
        # a typo must not look like a fresh start (training from scratch, then a new repo)
        hint = (f"check checkpoint.remote; for a new run create it first: `hf repos create {self.repo_id} "
                "--private`")
        if not self.token:
            hint += "; a private repo looks missing without a token: set HF_TOKEN here (or `hf auth login`)"
        return CheckpointError(f"{self.label}: the repo {self.repo_id} does not exist (or is not visible with "
                               "this token)", hint, refused=True)

    def _fail(self, exc: BaseException, what: str, error: type[RelaunchError] = CheckpointError) -> RelaunchError:
        """A huggingface_hub/network failure as one line of ours (no traceback, no token)."""
        from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

        if isinstance(exc, RepositoryNotFoundError):
            return self._missing_error()
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if isinstance(exc, HfHubHTTPError) and status in (401, 403):
            return self._auth_error()
        if isinstance(exc, HfHubHTTPError):
            # its text is several lines (url, docs link); the server's own words say it best
            detail = f"HTTP {status}: {last_line(exc.server_message or str(exc).split(chr(10))[0])}"
        else:
            detail = last_line(str(exc)) if str(exc) else type(exc).__name__
        return error(f"{self.label}: {what} failed: {detail}")

    @contextmanager
    def _hub(self, what: str, error: type[RelaunchError] = CheckpointError) -> Iterator[None]:
        try:
            yield
        except RelaunchError:
            raise
        except Exception as exc:  # httpx/OSError/HfHubHTTPError: all become one line
            raise self._fail(exc, what, error) from None

    def _head(self) -> str | None:
        """The commit the default branch points at; None if the repo does not exist."""
        from huggingface_hub.errors import RepositoryNotFoundError

        try:
            return str(self._api().repo_info(self.repo_id).sha)
        except RepositoryNotFoundError:
            return None
        except RelaunchError:       # Interrupted: the lane or the user stopped the wait
            raise
        except Exception as exc:  # httpx/OSError/HfHubHTTPError: one line of ours
            raise self._fail(exc, "reading the repo") from None

    def _snapshot(self, sha: str) -> Snapshot:
        from huggingface_hub.errors import RemoteEntryNotFoundError

        if self._snap is not None and self._snap.sha == sha:
            return self._snap
        files: dict[str, RemoteFile] = {}
        prefix = f"{self.subfolder}/" if self.subfolder else ""
        with self._hub("listing the repo"):
            try:
                for entry in self._api().list_repo_tree(self.repo_id, self.subfolder or None, recursive=True,
                                                        revision=sha):
                    if not hasattr(entry, "blob_id") or not entry.path.startswith(prefix):
                        continue        # a folder
                    lfs = entry.lfs.sha256 if entry.lfs is not None else None
                    files[entry.path[len(prefix):]] = RemoteFile(entry.size, entry.blob_id, lfs)
            except RemoteEntryNotFoundError:
                pass                    # the subfolder does not exist yet
        self._snap = Snapshot(sha, files)
        return self._snap

    def _download(self, rel: str, sha: str, folder: Path) -> Path:
        with self._hub(f"downloading {rel}"):
            return Path(self._api().hf_hub_download(self.repo_id, self._rp(rel), revision=sha, local_dir=folder))

    def ensure_repo(self) -> None:
        """Create the repo (private) if it does not exist; relaunch never changes an existing one."""
        if self._repo_ready:
            return
        with self._hub("creating the repo", EvacuationError):
            self._api().create_repo(self.repo_id, private=True, exist_ok=True)
        self._repo_ready = True

    # -- the record ------------------------------------------------------------------------------
    def read(self, writing: bool = False) -> StoreState:
        sha = self._head()
        if sha is None:
            if not writing:
                raise self._missing_error()
            self.manifest = self._base = self._revision = None
            return StoreState(self.label, True, None)
        snap = self._snapshot(sha)
        empty = not [p for p in snap.files if (self.subfolder or p not in REPO_FILES)
                     and not p.startswith(META_DIR + "/")]
        self.manifest = self._load_manifest(snap)
        self._revision = sha
        self._base = self._saved(self.manifest or StoreManifest(recipe=self.recipe_name))
        return StoreState(self.label, empty, self.manifest)

    def _load_manifest(self, snap: Snapshot) -> StoreManifest | None:
        manifest_path = f"{META_DIR}/{MANIFEST}"
        if manifest_path in snap.files:
            with tempfile.TemporaryDirectory(prefix="relaunch-hf-") as tmp:
                text = self._download(manifest_path, snap.sha, Path(tmp)).read_text(encoding="utf-8",
                                                                                    errors="replace")
            return StoreManifest.from_json(text, f"{self.label}/{manifest_path}@{snap.sha[:12]}")
        if f"{TRAINER_LAST}/trainer_state.json" in snap.files:
            return self._trainer_manifest(snap)
        return None

    def _trainer_manifest(self, snap: Snapshot) -> StoreManifest:
        """A one-record manifest for a Trainer's `last-checkpoint/`: sizes and sha256 from the tree
        (LFS files) or from the bytes (regular files are small: they are downloaded and hashed)."""
        files: dict[str, FileRecord] = {}
        with tempfile.TemporaryDirectory(prefix="relaunch-hf-") as tmp:
            state = self._download(f"{TRAINER_LAST}/trainer_state.json", snap.sha, Path(tmp))
            try:
                step = json.loads(state.read_text())["global_step"]
            except (ValueError, KeyError, TypeError):
                step = None
            if not isinstance(step, int) or isinstance(step, bool):
                raise CheckpointError(f"{self.label}: {TRAINER_LAST}/trainer_state.json has no integer global_step",
                                      "push a complete checkpoint, or evacuate one with relaunch")
            for path, remote in sorted(snap.files.items()):
                if not path.startswith(TRAINER_LAST + "/"):
                    continue
                sha256 = remote.sha256 or sha256_of(self._download(path, snap.sha, Path(tmp)))
                files[path] = FileRecord(size=remote.size, sha256=sha256)
        record = CheckpointRecord(name=TRAINER_LAST, step=step, files=files, verified_at=utc_now(),
                                  host=f"{self.label} ({TRAINER_LAST}/ at {snap.sha[:12]})")
        self._synthetic.add(TRAINER_LAST)
        manifest = StoreManifest(recipe=self.recipe_name)
        manifest.add(record)
        return manifest

    def _saved(self, manifest: StoreManifest) -> StoreManifest:
        """What of a manifest is written to the repo: all but the records read from last-checkpoint/."""
        return StoreManifest(recipe=manifest.recipe, checkpoints={
            n: r for n, r in manifest.checkpoints.items() if n not in self._synthetic})

    def _manifest_at(self, snap: Snapshot) -> StoreManifest:
        """The manifest saved at snap.sha (empty when there is none), read again unless it is ours."""
        if snap.sha == self._revision and self._base is not None:
            return StoreManifest(recipe=self._base.recipe, checkpoints=dict(self._base.checkpoints))
        path = f"{META_DIR}/{MANIFEST}"
        if path not in snap.files:
            return StoreManifest(recipe=self.recipe_name)
        with tempfile.TemporaryDirectory(prefix="relaunch-hf-") as tmp:
            text = self._download(path, snap.sha, Path(tmp)).read_text(encoding="utf-8", errors="replace")
        return StoreManifest.from_json(text, f"{self.label}/{path}@{snap.sha[:12]}")

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
            full = StoreManifest(recipe=merged.recipe, checkpoints={**merged.checkpoints, **synthetic})
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
            raise
        manifest.recipe, manifest.checkpoints = full.recipe, full.checkpoints
        self.manifest = manifest

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
        with tempfile.TemporaryDirectory(prefix="relaunch-hf-") as tmp:
            return self._download(rel, sha, Path(tmp)).read_text(encoding="utf-8", errors="replace")

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
            now: str | None = None
            if rel in snap.files:
                with tempfile.TemporaryDirectory(prefix="relaunch-hf-") as tmp:
                    now = self._download(rel, snap.sha, Path(tmp)).read_text(encoding="utf-8", errors="replace")
            if now != expected:
                return False
            self._commit([CommitOperationAdd(self._rp(rel), text.encode())], f"relaunch: {filename}", snap.sha,
                         f"writing {rel}")
            return True

        return bool(self._against_head(attempt, f"writing {rel}"))

    def prune(self, manifest: StoreManifest, keep: int, protect: frozenset[str] = frozenset()) -> list[str]:
        self._delete_orphans()
        preview = StoreManifest(recipe=manifest.recipe, checkpoints=dict(manifest.checkpoints))
        if not preview.drop_beyond(keep, protect):
            return []
        known = frozenset(manifest.checkpoints)
        dropped: list[CheckpointRecord] = []

        def decide(merged: StoreManifest) -> None:
            # what another writer recorded since this one read the store counts towards keep, but
            # is not this writer's to drop (it may be telling its user "safe to destroy" right now)
            dropped[:] = merged.drop_beyond(keep, protect | (frozenset(merged.checkpoints) - known))

        full = self._commit_manifest(manifest, decide)      # unlisted first: a crash leaves harmless extra files
        manifest.recipe, manifest.checkpoints = full.recipe, full.checkpoints
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

    # -- via instance: the instance runs `hf` ---------------------------------------------------
    def _hf_command(self, job: Job, load: str, args: list[str]) -> str:
        passed = "".join(f"export {k}={shlex.quote(os.environ[k])}; " for k in PASSED_VARS if os.environ.get(k))
        return f"{load}{passed}{shlex.quote(tool_path(job, 'hf'))} {shlex.join(args)}"

    def _credentials(self) -> tuple[str, bytes | None, tuple[str, ...]]:
        load, head, secret = credentials_stdin({"HF_TOKEN": self.token} if self.token else {})
        return load, head or None, secret

    def explain(self, status: int | None, output: str) -> RelaunchError | None:
        """The `hf` CLI's failure as one line of ours: an auth refusal is exit 3, a missing repo 5."""
        text = last_line(output)
        if _AUTH.search(ANSI.sub("", output)) and "No such file" not in text:
            return self._auth_error()
        if _NOT_FOUND.search(text) and "No such file" not in text:
            return CheckpointError(f"{self.label}: {text}", "check checkpoint.remote; nothing was put in place")
        return None

    @staticmethod
    def incoming(cp: Checkpoint) -> str:
        """The store folder the instance uploads cp into (never a recorded path): one per save,
        named by its files' names, sizes and times, the same for every part of a group's
        checkpoint. Two writers meeting there cannot mix bytes: each moves into place what its
        own upload's commit holds."""
        tag = hashlib.sha256(json.dumps([cp.name, sorted((e.path, e.size, e.mtime) for e in cp.files)]).encode())
        return f"{INCOMING}/{tag.hexdigest()[:16]}"

    def plan_receive_parts(self, parts: list[tuple[Job, Checkpoint]], cp: Checkpoint,
                           every_byte: bool = False) -> list[Action]:
        return [dataclasses.replace(a, host=job.host) if a.where != LOCAL else a
                for job, part in parts for a in self._receive(job, part, self.incoming(cp))]

    def plan_receive(self, job: Job, cp: Checkpoint, every_byte: bool = False) -> list[Action]:
        return self._receive(job, cp, self.incoming(cp))

    def _receive(self, job: Job, cp: Checkpoint, incoming: str) -> list[Action]:
        load, stdin, secret = self._credentials()
        total = sum(e.size for e in cp.files)
        args = ["upload", self.repo_id, cp.name, self._rp(f"{incoming}/{cp.name}"), "--private", "--format", "json",
                "--commit-message", f"relaunch: incoming {cp.name} (step {cp.step}) from {job.host}"]
        upload = Action("evacuate", f"the instance uploads {cp.name} (step {cp.step}, {human(total)}) to {self.label}",
                        command=f"cd {shlex.quote(job.copy_from)} && {self._hf_command(job, load, args)}",
                        stdin=stdin, secret=secret,
                        deadline=rsync.deadline_for(total), fails_as="evacuate", produces=f"upload:{cp.name}",
                        parse="text", explain="store.explain", outcomes={"re:No such file": "vanished"},
                        say=f"the instance uploads {cp.name} to {self.label}", progress="time")
        return [Action("evacuate", f"create the repo {self.repo_id} (private) unless it exists", where=LOCAL,
                       call="store.ensure_repo", deadline=store_deadline(), fails_as="evacuate"),
                tool_action(job, "hf", "evacuate", "evacuate"), upload]

    def plan_accept(self, job: Job, cp: Checkpoint, hashes: Ref | list[Ref],
                    about: dict[str, Any] | None = None) -> list[Action]:
        # a node group's parts upload one after another: the last upload's commit holds them all
        return [Action("evacuate", f"verify {cp.name} in the repo at the commit its upload made, move it into place "
                                   "(refused if another writer recorded that name), record it",
                       where=LOCAL, call="store.accept_upload", fails_as="evacuate", produces=f"verified:{cp.name}",
                       deadline=store_deadline(cp_bytes(cp)),
                       args={"cp": cp, "hashes": hashes, "upload": Ref(f"upload:{cp.name}"), "host": job.host,
                             **({"about": about} if about else {})})]

    def accept_upload(self, cp: Checkpoint, hashes: Hashes, upload: str, host: str,
                      about: dict[str, Any] | None = None) -> str:
        """Verify the instance's upload in its incoming folder at the commit it made, move it into
        place against the head, verify it there and record it."""
        record = expected_record(cp, hashes, host, about)
        hashes = merged(hashes)
        found = _COMMIT.search(upload or "")
        sha = found.group(1) if found else self._head()
        if sha is None:
            raise EvacuationError(f"{self.label}: the repo {self.repo_id} does not exist after the upload")
        blobs = {p: h.hashes.get("gitblob", "") for p, h in hashes.items()}
        incoming = self.incoming(cp)
        snap = self._snapshot(sha)
        landed = Snapshot(sha, {p[len(incoming) + 1:]: f for p, f in snap.files.items()
                                if p.startswith(incoming + "/")})
        problems = self._compare(landed, record.files, lambda paths: blobs)
        if problems:
            raise EvacuationError(f"{self.label}: {cp.name} did not verify in the repo: {problems[0]}")
        placed = self._place(cp, record, landed, incoming, host)
        snap = self._snapshot(placed)
        problems = self._compare(snap, record.files, lambda paths: blobs)
        if problems:
            raise EvacuationError(f"{self.label}: {cp.name} did not verify in the repo after it was moved into place: "
                                  f"{problems[0]}")
        self._verified[cp.name] = {p: snap.files[p] for p in record.files}
        self.record(record)
        return f"{self.hash_name} {placed[:12]}"

    def _place(self, cp: Checkpoint, record: CheckpointRecord, landed: Snapshot, incoming: str, host: str) -> str:
        """One commit on the head: the upload's files copied from `incoming` (at the commit the
        upload made) to their own paths, and removed from `incoming`. Refused, and only the
        upload removed, when the head records cp's name with other files; nothing is copied
        where the head already holds the very same blob. Returns the commit that holds them."""
        from huggingface_hub import CommitOperationCopy, CommitOperationDelete

        want = {p: (f.size, f.sha256) for p, f in record.files.items()}

        def attempt() -> tuple[str, CheckpointRecord | None]:
            snap = self._head_snapshot()
            recorded = self._manifest_at(snap).checkpoints.get(cp.name)
            theirs = recorded if recorded is not None and {
                p: (f.size, f.sha256) for p, f in recorded.files.items()} != want else None
            ops: list[Any] = [] if theirs is not None else [
                CommitOperationCopy(self._rp(f"{incoming}/{p}"), self._rp(p), src_revision=landed.sha)
                for p in sorted(record.files) if snap.files.get(p) != landed.files[p]]
            ops += [CommitOperationDelete(self._rp(f"{incoming}/{p}")) for p in sorted(record.files)
                    if f"{incoming}/{p}" in snap.files]
            if not ops:
                return snap.sha, theirs
            message = (f"relaunch: {cp.name} (step {cp.step}) from {host}" if theirs is None else
                       f"relaunch: {cp.name} from {host} not placed (the store records other files under that name)")
            return self._commit(ops, message, snap.sha, f"moving {cp.name} into place"), theirs

        sha, theirs = self._against_head(attempt, f"moving {cp.name} into place")
        if theirs is not None:
            raise conflict_error(self.label, theirs)
        return str(sha)

    def plan_send(self, job: Job, record: CheckpointRecord, incoming: str) -> list[Action]:
        sha = self._revision
        if sha is None:
            raise self._missing_error()
        files = sorted(record.files)
        total = sum(f.size for f in record.files.values())
        load, stdin, secret = self._credentials()
        q = shlex.quote
        tmp = f"{job.paths.ckpt_dir}/.relaunch-hf-download"     # same filesystem: the move is a rename
        args = ["download", self.repo_id, *[self._rp(p) for p in files], "--revision", sha, "--local-dir", tmp,
                "--format", "json"]
        download = Action("checkpoint", f"the instance downloads {record.name} ({human(total)}) from {self.label}",
                          command=f"rm -rf -- {q(tmp)} && mkdir -p -- {q(tmp)} && {self._hf_command(job, load, args)}",
                          stdin=stdin, secret=secret,
                          deadline=rsync.deadline_for(total), fails_as="checkpoint", explain="store.explain",
                          hint="nothing is lost; rerun `relaunch up`",
                          say=f"the instance downloads {record.name} ({len(files)} file(s)) from {self.label}",
                          progress="time")
        # the files only: hf leaves its bookkeeping in <tmp>/.cache/huggingface/
        move = Action("checkpoint", f"move the download to {incoming}/{record.name}",
                      command=f"mkdir -p -- {q(incoming)} && mv -T -- {q(tmp + '/' + self._rp(record.name))} "
                              f"{q(incoming + '/' + record.name)}", fails_as="checkpoint")
        clean = Action("checkpoint", f"remove {tmp}", command=f"rm -rf -- {q(tmp)}", always=True, fails_as="checkpoint")
        return [tool_action(job, "hf", "checkpoint", "checkpoint"), download, move, clean]

    # -- via local: primitives for the relay -------------------------------------------------------
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

    def __init__(self, store: HfStore, staged: Path, cp: Checkpoint, host: str) -> None:
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
