"""Checkpoint: find the newest complete checkpoint and put it on the instance, verified.

The copy lands in a hidden folder beside checkpoint.dir, is verified by sha256 on the instance
against the store manifest, and only then renamed into place: a trainer never sees half a
checkpoint. A newer complete checkpoint already on the instance wins over the store's.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from ..errors import CheckpointError, ConnectError, RelaunchError, remote_failure
from ..host.connection import Remote
from ..layouts import Checkpoint, LISTING_COMMAND, complete_checkpoints, parse_hashsum, parse_listing
from ..plan import Action
from ..store import CheckpointRecord
from ..transports.base import Store
from .common import Job
from .preflight import human


def list_instance(remote: Remote, ckpt_dir: str, layout: str, pattern: str, step: str,
                  error: type[RelaunchError] = CheckpointError) -> list[Checkpoint]:
    """Complete checkpoints under ckpt_dir on the instance, oldest first ([] if the folder is missing)."""
    q = shlex.quote(ckpt_dir)
    command = f"if [ -d {q} ]; then {LISTING_COMMAND.format(dir=q)}; fi"
    result = remote.exec(command, timeout=600)
    # find exits 1 when a file vanishes while it walks (trainers rotate checkpoints); the
    # listing is still good. Anything else it says is a real problem.
    vanished = all("No such file or directory" in line for line in result.stderr.decode(errors="replace")
                   .splitlines() if line.strip())
    if result.status is None and not remote.alive:
        raise ConnectError(f"{remote.label}: {step}: the SSH connection was lost")
    if result.status is None or not (result.ok or (result.status == 1 and vanished)):
        raise remote_failure(error, remote.label, step, command, result.status, result.output)
    return complete_checkpoints(parse_listing(result.stdout), layout, pattern)


def hash_on_instance(remote: Remote, root: str, files: list[str], step: str,
                     algo: str = "sha256") -> dict[str, str] | None:
    """Hashes of files (relative to root) computed on the instance; None if any vanished."""
    listing = b"\0".join(f.encode() for f in files) + b"\0"
    result = remote.exec(f"cd {shlex.quote(root)} && xargs -0 {algo}sum -z --", stdin=listing, timeout=3600)
    if result.status is None:
        raise ConnectError(f"{remote.label}: {step}: the SSH connection was lost while hashing")
    if not result.ok:
        return None
    return parse_hashsum(result.stdout, algo)


@dataclass
class Choice:
    record: CheckpointRecord | None      # from the store; None when the instance's own wins or fresh
    on_instance: Checkpoint | None       # a complete one already on the instance
    reason: str

    @property
    def step(self) -> int:
        if self.record:
            return self.record.step
        return self.on_instance.step if self.on_instance else 0


def choose(job: Job, store: Store) -> Choice:
    recipe = job.recipe
    local = list_instance(job.remote, job.paths.ckpt_dir, recipe.checkpoint.layout, recipe.checkpoint.pattern,
                          "checkpoint (listing the instance)")
    newest_here = local[-1] if local else None
    if store.is_empty():
        record = None
        if newest_here is None:
            return Choice(None, None, f"the store {store.label} is empty: fresh start")
    else:
        manifest = store.load_manifest()
        if manifest is None or manifest.newest() is None:
            raise CheckpointError(
                f"the store {store.label} holds files but no verified checkpoint "
                f"({'no manifest' if manifest is None else 'the manifest lists none'})",
                "nothing is lost: run `relaunch evacuate` on the old instance if it still exists, "
                "or point checkpoint.remote at the right store",
            )
        record = manifest.newest()
    if newest_here is not None and (record is None or newest_here.step > record.step):
        return Choice(None, newest_here, f"the instance already has {newest_here.name} (step {newest_here.step}), "
                      "newer than the store's")
    assert record is not None
    if newest_here is not None and newest_here.name == record.name:
        return Choice(record, newest_here, f"{record.name} (step {record.step}) is already on the instance")
    return Choice(record, None, f"newest verified in the store: {record.name} (step {record.step})")


def plan_restore(job: Job, store: Store, choice: Choice) -> list[Action]:
    paths = job.paths
    if choice.record is None and choice.on_instance is None:
        return [Action("checkpoint", "restore", skip=choice.reason)]
    if choice.record is None:
        assert choice.on_instance is not None
        job.checkpoint, job.step = f"{paths.ckpt_dir}/{choice.on_instance.name}", choice.on_instance.step
        return [Action("checkpoint", "restore", skip=choice.reason)]

    record = choice.record
    dest = f"{paths.ckpt_dir}/{record.name}"
    job.checkpoint, job.step = dest, record.step
    files = sorted(record.files)
    expected = {f: r.sha256 for f, r in record.files.items()}
    total = sum(r.size for r in record.files.values())

    if choice.on_instance is not None:
        def verify_present() -> None:
            seen = hash_on_instance(job.remote, paths.ckpt_dir, files, "checkpoint (verify)")
            if seen != expected:
                raise CheckpointError(
                    f"{job.host}: {dest} is on the instance but its bytes differ from the store's verified copy",
                    "relaunch does not overwrite it; move it aside on the instance and rerun `up`",
                )
            job.say("checkpoint", f"{record.name} already on the instance, verified")

        return [Action("checkpoint", f"verify {dest} against the store manifest (sha256)", run=verify_present)]

    incoming = paths.incoming
    move = (f"cd {shlex.quote(incoming)} && mkdir -p {shlex.quote(paths.ckpt_dir)} && "
            f"mv -T -- {shlex.quote(record.name)} {shlex.quote(dest)} && cd / && rmdir {shlex.quote(incoming)}")

    def restore() -> None:
        job.say("checkpoint", f"{choice.reason}; copying {human(total)} from {store.label}")
        store.send(job, record, incoming)
        seen = hash_on_instance(job.remote, incoming, files, "checkpoint (verify)")
        bad = sorted(f for f in files if (seen or {}).get(f) != expected[f])
        if bad:
            raise CheckpointError(f"{job.host}: checkpoint: {len(bad)} file(s) differ from the store manifest "
                                  f"after the copy, e.g. {bad[0]}", "nothing was put in place; rerun `relaunch up`")
        job.remote.check(move, "checkpoint (move into place)", CheckpointError)
        job.say("checkpoint", f"restored {record.name} (step {record.step}), {len(files)} file(s) verified")

    shown = (f"{store.describe_send(job, record, incoming)}\n"
             f"cd {incoming} && xargs -0 sha256sum -z -- <files>   # compare with manifest\n{move}")
    return [Action("checkpoint", f"copy {record.name} (step {record.step}, {human(total)}) to {dest}", shown,
                   restore)]
