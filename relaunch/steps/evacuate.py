"""Evacuate: the actions that copy one checkpoint off the instance into the store, verified, and
the report whose verdict decides `safe to destroy`.

Order of trust: the store receives the files (into staging, or an upload not yet recorded), the
instance hashes its own bytes, the store checks what it received against those hashes, commits,
and only then names the checkpoint in the manifest.

The one change on the instance is a pin, for the length of a copy: hard links of the
checkpoint's files (templates/pin.py), which the copy and the hash beside it read, so that a
trainer's rotation deleting the checkpoint meanwhile does not waste the copy. The pins go after
verification, and on every failure (an `always` action); what a killed relaunch left is removed
by the next copy of the recipe on that instance (and by a round that copies nothing).
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import time
from dataclasses import dataclass, field
from typing import Any

from ..host.hashing import hash_command, hash_deadline, paths_stdin
from ..job import Job, Lag
from ..layouts import Checkpoint
from ..plan import LOCAL, Action, Ref
from ..scripts import plain
from ..transports import Store
from ..transports.base import hash_ref_names, store_deadline
from ..ui import human
from .launch import tail_command

LOG_TAIL_LINES = 200
COPY_LANE, HASH_LANE = "copy", "hash"


@dataclass(kw_only=True)
class Report(Lag):
    store: str
    verified_by: str = ""                                 # what "verified" means for this store
    copied: list[str] = field(default_factory=list)
    already: list[str] = field(default_factory=list)      # verified before (re-hashed on the instance)
    unchanged: list[str] = field(default_factory=list)    # in `sync`: same sizes as their verified copies
    skipped: list[str] = field(default_factory=list)      # rotated away mid-copy
    pinned: list[str] = field(default_factory=list)       # copied from pins: rotation could not waste the copy
    unpinned: list[str] = field(default_factory=list)     # "name: why" its files could not be pinned
    damaged: list[str] = field(default_factory=list)      # "name: why" (a save that did not finish)
    pruned: list[str] = field(default_factory=list)
    set_aside: list[str] = field(default_factory=list)    # the store held them differently from their record
    # the instance's rollbacks the store learned now: branch id -> the records set aside (steps/lineage.py)
    branches: dict[str, list[str]] = field(default_factory=dict)
    displaced: list[str] = field(default_factory=list)    # "name: where": an abandoned branch's, a new save's name
    verified_now: list[str] = field(default_factory=list)  # checked in the store after the copy
    bytes_copied: int = 0
    seconds: float = 0.0
    safe: bool = False                                    # the verdict (verdicts.evacuation): exit 0 vs 6
    why: str = ""                                         # what decided it, in words


class Unpinned(Exception):
    """The files of a checkpoint could not be pinned on these nodes: {host: why}. The copy is
    planned again, reading checkpoint.dir there, as it did before pins."""

    def __init__(self, why: dict[str, str]) -> None:
        super().__init__("; ".join(f"{host}: {text}" for host, text in why.items()))
        self.why = why


def hash_action(job: Job, store: Store, cp: Checkpoint, beside: bool = False) -> Action:
    files = [e.path for e in cp.files]
    total = sum(e.size for e in cp.files)
    return Action("evacuate", f"hash {cp.name} on the instance ({', '.join(store.instance_hashes)})",
                  command=hash_command(job.copy_from, job.facts.host.python, store.instance_hashes, beside=beside),
                  stdin=paths_stdin(files), deadline=hash_deadline(total), produces=f"hashes:{cp.name}",
                  parse="hashes", fails_as="evacuate", progress="hashes", size=total)


def pin_action(job: Job, cp: Checkpoint) -> Action:
    """One command: hard links of cp's files where its copy reads them (job.paths.pins), made
    after removing what an earlier copy left; its JSON line says where, or why not (pin.py)."""
    paths = job.paths
    command = (f"{shlex.quote(job.facts.host.python or 'python3')} -c {shlex.quote(plain('pin.py'))} "
               f"{shlex.join([paths.pins, paths.ckpt_dir, paths.pins_beside])}")
    return Action("evacuate", f"pin {cp.name} for the length of its copy (hard links in {paths.pins})",
                  command=command, stdin=paths_stdin([e.path for e in cp.files]), produces=f"pin:{cp.name}",
                  parse="json", outcomes={3: "vanished"}, fails_as="evacuate")


def unpin_action(job: Job, title: str = "") -> Action:
    """Remove every pin of this recipe on the instance (the beside folder only while it is a real
    folder of this user's: never through a link someone planted)."""
    q, paths = shlex.quote, job.paths
    beside = q(paths.pins_beside)
    return Action("evacuate", title or f"unpin: remove the hard links in {paths.pins}",
                  command=f"rm -rf -- {q(paths.pins)} && if [ ! -L {beside} ] && [ -O {beside} ]; then "
                          f"rm -rf -- {beside}; fi", always=True, fails_as="evacuate")


def plan_copy(job: Job, store: Store, cp: Checkpoint, every_byte: bool = False,
              parts: list[tuple[Job, Checkpoint]] | None = None, about: dict[str, Any] | None = None,
              unpinned: frozenset[str] = frozenset()) -> list[Action]:
    """Pin cp on the instance (each node its own part), then receive it and, at the same time,
    hash it on the instance, both from the pins (a complete checkpoint does not change; one that
    is rewritten meanwhile fails the comparison, one gone before it was pinned counts as
    vanished); then verify, commit, record; then unpin (also after any failure). In a node group,
    `parts` says which node sends which files; each hashes its own. `unpinned`: the nodes whose
    files cannot be pinned (Unpinned): they copy from checkpoint.dir, as before pins."""
    group = bool(parts) and len(parts or []) > 1
    job = dataclasses.replace(job, pinned=job.host not in unpinned)
    parts = [(dataclasses.replace(j, pinned=j.host not in unpinned), part) for j, part in (parts or [(job, cp)])]
    if not group:
        receive = store.plan_receive(job, cp, every_byte)
        hashing = [dataclasses.replace(hash_action(job, store, cp, beside=True), lane=HASH_LANE)]
        refs: Ref | list[Ref] = Ref(hash_ref_names(cp, [job.host])[0])
        pins = [pin_action(job, cp)] if job.pinned else []
        unpins = [unpin_action(job)] if job.pinned else []
    else:
        receive = store.plan_receive_parts(parts, cp, every_byte)
        refs = [Ref(name) for name in hash_ref_names(cp, [part_job.host for part_job, _ in parts])]
        hashing = [dataclasses.replace(hash_action(part_job, store, part, beside=True), host=part_job.host,
                                       produces=ref.name,
                                       lane=f"{HASH_LANE}@{part_job.host}")
                   for (part_job, part), ref in zip(parts, refs, strict=True)]
        pins = [dataclasses.replace(pin_action(part_job, part), host=part_job.host, lane=f"pin@{part_job.host}",
                                    produces=f"pin:{cp.name}@{part_job.host}")
                for part_job, part in parts if part_job.pinned]
        unpins = [dataclasses.replace(unpin_action(part_job), host=part_job.host, lane=f"unpin@{part_job.host}")
                  for part_job, _ in parts if part_job.pinned]
    receive = [a if a.lane else dataclasses.replace(a, lane=COPY_LANE) for a in receive]
    # a pinned checkpoint is still there (the pins hold it): only an unpinned copy asks
    still = ([still_there(j, part) for j, part in parts if not j.pinned] if not group else
             [dataclasses.replace(still_there(j, part), host=j.host) for j, part in parts if not j.pinned])
    told = []
    if pins:
        told = [Action("evacuate", f"where {cp.name} is pinned, or why it cannot be", where=LOCAL,
                       call="checks.pinned", args={"name": cp.name, "hosts": [a.host or job.host for a in pins],
                                                   "found": [Ref(a.produces) for a in pins]}, fails_as="evacuate")]
    return [*pins, *told, *receive, *hashing, *still, *store.plan_accept(job, cp, refs, about), *unpins]


def plan_unpin(jobs: list[Job]) -> list[Action]:
    """Remove the pins a killed relaunch left (a round that copies nothing pins nothing)."""
    title = "remove the pins an earlier copy may have left"
    if len(jobs) == 1:
        return [dataclasses.replace(unpin_action(jobs[0], title), always=False)]
    return [dataclasses.replace(unpin_action(job, title), always=False, host=job.host) for job in jobs]


def still_there(job: Job, cp: Checkpoint) -> Action:
    """After the copy: a file deleted while it was copied still reads to its end (for the copy and
    for the hash beside it); a checkpoint that is gone by then was rotated away, not evacuated.
    Only for a copy that is not pinned."""
    return Action("evacuate", f"{cp.name} is still on the instance",
                  command=f"cd {shlex.quote(job.copy_from)} && xargs -0 -r stat -c %i -- >/dev/null",
                  stdin=paths_stdin([e.path for e in cp.files]), outcomes={123: "vanished"}, fails_as="evacuate")


def plan_meta(job: Job) -> list[Action]:
    """The env's freeze, Python and driver versions, and the log's tail, beside the manifest."""
    facts = job.facts.host
    versions = {"python": facts.python3_version, "driver": facts.driver, "gpus": facts.gpus, "host": job.host}
    actions = [Action("evacuate", f"the last {LOG_TAIL_LINES} lines of {job.paths.log}",
                      command=f"{tail_command(job.paths.log, LOG_TAIL_LINES)} || true", produces="log-tail",
                      parse="text", fails_as="evacuate"),
               Action("evacuate", "write .relaunch/versions.json", where=LOCAL, call="store.write_meta",
                      args={"filename": "versions.json", "text": json.dumps(versions, indent=2) + "\n"},
                      deadline=store_deadline(), fails_as="evacuate"),
               Action("evacuate", "write .relaunch/log-tail.txt", where=LOCAL, call="store.write_meta",
                      args={"filename": "log-tail.txt", "text": Ref("log-tail")}, deadline=store_deadline(),
                      fails_as="evacuate")]
    actions.append(Action("evacuate", "write .relaunch/manifest.json (with the metadata)", where=LOCAL,
                          call="store.flush", deadline=store_deadline(), fails_as="evacuate"))
    if facts.venv_freeze is not None:
        actions.insert(1, Action("evacuate", "write .relaunch/freeze.txt", where=LOCAL, call="store.write_meta",
                                 args={"filename": "freeze.txt", "text": "\n".join(facts.venv_freeze) + "\n"},
                                 deadline=store_deadline(), fails_as="evacuate"))
    return actions


def round_line(report: Report) -> str:
    """One line per `sync` round."""
    copied = ", ".join(report.copied) if report.copied else "nothing new"
    speed = f", {human(int(report.bytes_copied / report.seconds))}/s" if report.bytes_copied and report.seconds else ""
    lag = "no checkpoint on the instance yet"
    if report.lag_steps is not None:
        lag = f"lag {report.lag_steps} steps"
        if report.lag_seconds is not None:
            lag += f", {report.lag_seconds / 60:.1f} min"
    newest = f"newest verified: {report.stored} (step {report.stored_step})" if report.stored else "store empty"
    skipped = f"; skipped {', '.join(report.skipped)} (rotated away mid-copy)" if report.skipped else ""
    damaged = f"; NOT copied, damaged on the instance: {'; '.join(report.damaged)}" if report.damaged else ""
    unchanged = (f"; unchanged: {', '.join(report.unchanged)} (same sizes as their verified copies)"
                 if report.unchanged else "")
    aside = [name for names in report.branches.values() for name in names]
    branched = (f"; set aside (training resumed an older checkpoint: an abandoned branch): {', '.join(aside)}"
                if aside else "")
    return (f"{time.strftime('%H:%M:%S')} copied {copied} ({human(report.bytes_copied)}{speed}){skipped}{damaged}"
            f"{unchanged}{branched}; {newest}; {lag}")
