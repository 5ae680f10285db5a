"""via: instance (the default for hf remotes): the instance runs `hf upload` / `hf download` from
relaunch's tools venv. The token reaches only the stdin of the one `hf` command that copies
(`credentials_stdin`), never the instance's disk. These variables of this machine are passed to
the instance's `hf` as they are (they are not secret): see PASSED_VARS.

`hf upload` on the instance cannot be held to a parent revision, and may land long after the store
was read (a slow link): it puts the checkpoint under `.relaunch/incoming/<tag>/`, where nothing is
ever recorded; verified there, it is moved into place by one commit from this machine against the
head (LFS files copied by reference, small regular ones sent again), refused when that head
records the name with other files. So no writer's upload ever replaces the bytes of a checkpoint
another one recorded, however late it lands.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shlex
from typing import Any

from ...errors import CheckpointError, EvacuationError, RelaunchError
from ...job import Job
from ...layouts import Checkpoint
from ...manifest import CheckpointRecord
from ...plan import LOCAL, Action, Ref
from ...ui import human
from .. import rsync
from ..base import Hashes, cp_bytes, expected_record, merged, store_deadline
from ..tools import credentials_stdin, tool_action, tool_path
from .client import ANSI, Snapshot, last_line
from .commits import Commits
from .merge import conflict_error
from .repo import INCOMING
from .verifying import Verifying

# Not secret: handed to the instance's `hf` on its command line when set on this machine.
# HF_ENDPOINT points at a mirror (or the tests' fake hub); the others tune the client.
PASSED_VARS = ("HF_ENDPOINT", "HF_HUB_DISABLE_XET", "HF_HUB_ENABLE_HF_TRANSFER", "HF_HUB_DISABLE_TELEMETRY",
               "HF_HUB_DISABLE_UPDATE_CHECK", "HF_HUB_DISABLE_PROGRESS_BARS", "HF_HUB_ETAG_TIMEOUT",
               "HF_HUB_DOWNLOAD_TIMEOUT")

_COMMIT = re.compile(r"/commit/([0-9a-f]{40})")
_AUTH = re.compile(r"\b401 Unauthorized\b|\b403 Forbidden\b|Invalid credentials")
_NOT_FOUND = re.compile(r"not found|RepositoryNotFound|does not exist", re.I)


class ViaInstance(Commits, Verifying):
    """HfStore's plans for the instance's `hf`, and the moves into place here (a mixin: its
    state lives in HfRepo)."""

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
