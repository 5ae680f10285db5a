"""The repo as this machine reads it at one commit: the Hub's calls (a failure of any of them is
one line of ours), the tree at a commit, the manifest saved at a commit. HfRepo also holds the
state every room of HfStore shares.

A repo that holds no relaunch manifest but a Trainer's `last-checkpoint/` (push_to_hub with
hub_strategy="checkpoint") is read as a store with that one checkpoint, so `up` can resume from
it; relaunch never writes that record into its manifest, and never prunes those files.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ...errors import CheckpointError, ConnectError, EvacuationError, RelaunchError, UsageError
from ...job import StoreState
from ...manifest import MANIFEST, META_DIR, CheckpointRecord, FileRecord, StoreManifest, utc_now
from ..base import Store
from .client import Bounded, RemoteFile, Snapshot, last_line, sha256_of

TRAINER_LAST = "last-checkpoint"           # the folder Trainer(push_to_hub, hub_strategy="checkpoint") keeps
# files a repo may hold without being a store (the Hub's first commit, a model card)
REPO_FILES = {".gitattributes", "README.md"}
INCOMING = f"{META_DIR}/incoming"          # where the instance's `hf upload` puts a checkpoint


class HfRepo(Store):
    """The state of HfStore's rooms, and the repo read from this machine at one commit."""

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

    def _read_text(self, rel: str, sha: str) -> str:
        """A small file's text at commit `sha` (a metadata file, the manifest)."""
        with tempfile.TemporaryDirectory(prefix="relaunch-hf-") as tmp:
            return self._download(rel, sha, Path(tmp)).read_text(encoding="utf-8", errors="replace")

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
            return StoreManifest.from_json(self._read_text(manifest_path, snap.sha),
                                           f"{self.label}/{manifest_path}@{snap.sha[:12]}")
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
            n: r for n, r in manifest.checkpoints.items() if n not in self._synthetic},
            branches=list(manifest.branches))

    def _manifest_at(self, snap: Snapshot) -> StoreManifest:
        """The manifest saved at snap.sha (empty when there is none), read again unless it is ours."""
        if snap.sha == self._revision and self._base is not None:
            return StoreManifest(recipe=self._base.recipe, checkpoints=dict(self._base.checkpoints),
                                 branches=list(self._base.branches))
        path = f"{META_DIR}/{MANIFEST}"
        if path not in snap.files:
            return StoreManifest(recipe=self.recipe_name)
        return StoreManifest.from_json(self._read_text(path, snap.sha), f"{self.label}/{path}@{snap.sha[:12]}")
