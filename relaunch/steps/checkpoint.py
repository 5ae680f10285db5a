"""Checkpoint: choose the newest complete checkpoint and put it on the instance, verified.

The copy lands in a hidden folder beside checkpoint.dir, is verified by sha256 on the instance
against the store manifest, and only then renamed into place: a trainer never sees half a
checkpoint. A newer complete checkpoint already on the instance wins over the store's.
"""

from __future__ import annotations

import dataclasses
import posixpath
import shlex
from dataclasses import dataclass

from ..errors import CheckpointError
from ..host.hashing import hash_command, hash_deadline, paths_stdin
from ..job import Job
from ..layouts import Checkpoint, complete_checkpoints
from ..manifest import CheckpointRecord
from ..plan import Action
from ..transports import Store
from ..transports.base import incoming_ready
from ..ui import human

LANE, VERIFY_LANE = "checkpoint", "checkpoint-verify"
COPIED = ".relaunch-copied"      # in the incoming folder: the copy is over (hashes.py --follow stops)


@dataclass(frozen=True)
class Choice:
    record: CheckpointRecord | None      # from the store; None when the instance's own wins or fresh
    on_instance: Checkpoint | None       # a complete one already on the instance
    reason: str

    @property
    def step(self) -> int:
        if self.record:
            return self.record.step
        return self.on_instance.step if self.on_instance else 0

    @property
    def copy_bytes(self) -> int:
        """What the restore copies onto the instance (for the disk check)."""
        if self.record is None or self.on_instance is not None:
            return 0
        return sum(f.size for f in self.record.files.values())


def instance_checkpoints(job: Job) -> list[Checkpoint]:
    """Complete checkpoints in checkpoint.dir on the instance (across the node group: every file
    on some node), oldest first. A DCP checkpoint whose metadata names a file no node holds is
    not complete (a shard lost with a node)."""
    c = job.recipe.checkpoint
    found = complete_checkpoints(job.facts.listing or [], c.layout, c.pattern)
    required = job.facts.required
    if not required:
        return found
    present = {e.path for e in job.facts.listing or []}
    return [cp for cp in found if all(f"{cp.name}/{p}" in present for p in required.get(cp.name, ()))]


def on_every_node(job: Job, cp: Checkpoint) -> bool:
    """Does every node of the group hold all of cp's files (so each can resume from it as it is)?"""
    holders = job.facts.holders
    if holders is None:
        return True
    return all(len(holders.get(e.path, ())) == job.node.nnodes for e in cp.files)


def choose(job: Job, exclude: frozenset[str] = frozenset(), wanted: str | None = None) -> Choice:
    """The checkpoint `up` resumes from: the newest complete one, the instance's own when it is
    newer (never one whose save did not finish), or `wanted` by name; `exclude`: store records
    found damaged."""
    store = job.facts.store
    assert store is not None
    local = [cp for cp in instance_checkpoints(job) if cp.name not in job.facts.damaged and on_every_node(job, cp)]
    newest_here = local[-1] if local else None
    records = [r for r in store.manifest.ordered() if r.name not in exclude] if store.manifest else []
    if wanted is not None:
        return _wanted(job, wanted, records, local)
    record = records[-1] if records else None
    if record is None:
        if exclude:
            raise CheckpointError(
                f"every verified checkpoint in the store {store.label} failed its check on the instance "
                f"({', '.join(sorted(exclude))}): their bytes no longer match the manifest",
                "nothing was deleted; check the store's disk, or resume from a copy elsewhere with "
                "`relaunch up --checkpoint NAME`")
        if not store.empty:
            raise CheckpointError(
                f"the store {store.label} holds checkpoint files but no verified checkpoint "
                f"({'no manifest' if store.manifest is None else 'the manifest lists none'})",
                "nothing is lost: run `relaunch evacuate` on the old instance if it still exists, "
                "or point checkpoint.remote at the right store",
            )
        if newest_here is None:
            what = "is empty" if store.manifest is None else "holds no verified checkpoint yet"
            return Choice(None, None, f"the store {store.label} {what}: fresh start")
    if newest_here is not None and (record is None or newest_here.step > record.step):
        return Choice(None, newest_here, f"the instance already has {newest_here.name} (step {newest_here.step}), "
                      "newer than the store's")
    assert record is not None
    if newest_here is not None and newest_here.name == record.name:
        return Choice(record, newest_here, f"{record.name} (step {record.step}) is already on the instance")
    return Choice(record, None, f"newest verified in the store: {record.name} (step {record.step})")


def _wanted(job: Job, name: str, records: list[CheckpointRecord], local: list[Checkpoint]) -> Choice:
    record = next((r for r in records if r.name == name), None)
    here = next((cp for cp in local if cp.name == name), None)
    if record is not None:
        return Choice(record, here, f"{name} (step {record.step}) from the store, as asked (--checkpoint)")
    if here is not None:
        return Choice(None, here, f"{name} (step {here.step}) on the instance, as asked (--checkpoint)")
    store = job.facts.store
    assert store is not None
    names = ", ".join(r.name for r in records) or "none"
    aside = store.manifest.checkpoints.get(name) if store.manifest else None
    branch = store.manifest.branch_of(aside) if store.manifest and aside else None
    if aside is not None:
        resumed = f" when training resumed from {branch.resumed or 'scratch'}" if branch else ""
        raise CheckpointError(f"--checkpoint {name}: it belongs to an abandoned branch, set aside{resumed} "
                              f"(branch {aside.aside}); relaunch resumes only the current branch",
                              f"its files stay in the store {store.label} under {name}; the current branch holds: "
                              f"{names}")
    raise CheckpointError(f"--checkpoint {name}: no such verified checkpoint in the store {store.label} and no "
                          "complete one of that name on the instance", f"the store holds: {names}")


def plan_restore(job: Job, store: Store, choice: Choice, follow: bool = True) -> tuple[Job, list[Action]]:
    """The job as it will run (resumed or not) and the actions that put its checkpoint in place.

    `follow`: the instance hashes the files as they land (a lane beside the copy) instead of
    reading them again after it; the last two actions are always the verification and the move."""
    paths = job.paths
    if choice.record is None:
        if choice.on_instance is not None:
            job = job.resumed(f"{paths.ckpt_dir}/{choice.on_instance.name}", choice.on_instance.step)
        return job, [Action("checkpoint", "restore", lane=LANE, skip=choice.reason)]

    record = choice.record
    dest = f"{paths.ckpt_dir}/{record.name}"
    job = job.resumed(dest, record.step)
    files = sorted(record.files)
    expected = {f: r.sha256 for f, r in record.files.items()}
    total = sum(r.size for r in record.files.values())
    python = job.facts.host.python

    if choice.on_instance is not None:
        return job, [Action("checkpoint", f"verify {dest} against the store manifest (sha256)", lane=LANE,
                            command=hash_command(paths.ckpt_dir, python), stdin=paths_stdin(files),
                            deadline=hash_deadline(total), parse="hashes:sha256", expect=expected,
                            fails_as="checkpoint", done=f"{record.name} already on the instance, verified",
                            hint="relaunch does not overwrite it; move it aside on the instance and rerun `up`")]

    q = shlex.quote
    incoming = paths.incoming
    copied = f"{incoming}/{COPIED}"
    ready = incoming_ready(record.name)
    prepare = Action("checkpoint", f"{incoming} ready for the copy", lane=LANE, produces=ready,
                     command=f"mkdir -p -- {q(incoming)} && rm -f -- {q(copied)}", fails_as="checkpoint")
    # the copy's first stream in this lane; more streams (a folder of large files) in lanes of their own
    copy = [a if a.lane else dataclasses.replace(a, lane=LANE) for a in store.plan_send(job, record, incoming)]
    copy[0] = dataclasses.replace(copy[0], say=f"{choice.reason}; copying {human(total)} from {store.label}")
    over = Action("checkpoint", f"the copy of {record.name} is over", lane=LANE, command=f"touch -- {q(copied)}",
                  fails_as="checkpoint", needs=tuple(a.produces for a in copy if a.lane != LANE and a.produces))
    verify = Action("checkpoint", f"verify {record.name} on the instance against the store manifest (sha256)"
                    + (", hashing each file as it lands" if follow else ""), lane=LANE,
                    command=hash_command(incoming, python, follow=copied if follow else ""),
                    stdin=paths_stdin(files), parse="hashes:sha256", expect=expected, fails_as="checkpoint",
                    progress="hashes", size=total,
                    deadline=hash_deadline(total) + (sum(a.deadline for a in copy) * 3 if follow else 0),
                    hint="nothing was put in place; rerun `relaunch up`")
    # a name with folders in it (accelerate's `checkpoints/checkpoint_3`): its parent made at the
    # destination, and left empty in the incoming folder, which goes
    parent = posixpath.dirname(record.name)
    emptied = f"rmdir -p -- {q(parent)} && " if parent else ""
    # what stands at dest was not trusted (a save that did not finish, a node's part of a group
    # checkpoint): set aside in relaunch's folder, never overwritten nor deleted
    aside = f"{paths.state}/set-aside/{record.name.replace('/', '--')}"
    move = Action("checkpoint", f"move {record.name} into place at {dest}", lane=LANE, fails_as="checkpoint",
                  command=f"cd {q(incoming)} && rm -f -- {COPIED} && mkdir -p -- {q(posixpath.dirname(dest))} && "
                          f"{{ ! [ -e {q(dest)} ] || {{ mkdir -p -- {q(posixpath.dirname(aside))} && "
                          f"mv -T -- {q(dest)} {q(aside)}.$(date +%s); }}; }} && "
                          f"mv -T -- {q(record.name)} {q(dest)} && {emptied}cd / && rmdir -- {q(incoming)}",
                  done=f"restored {record.name} (step {record.step}), {len(files)} file(s) verified")
    if not follow:
        return job, [prepare, *copy, over, verify, move]
    verified = f"verified:{record.name}"
    return job, [prepare, *copy, over,
                 dataclasses.replace(verify, lane=VERIFY_LANE, needs=(ready,), produces=verified),
                 dataclasses.replace(move, needs=(verified,))]

