"""Evacuate: the actions that copy one checkpoint off the instance into the store, verified, and
the report whose verdict decides `safe to destroy`.

Order of trust: the store receives the files (into staging, or an upload not yet recorded), the
instance hashes its own bytes, the store checks what it received against those hashes, commits,
and only then names the checkpoint in the manifest. Nothing on the instance is changed.
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
    damaged: list[str] = field(default_factory=list)      # "name: why" (a save that did not finish)
    pruned: list[str] = field(default_factory=list)
    set_aside: list[str] = field(default_factory=list)    # the store held them differently from their record
    verified_now: list[str] = field(default_factory=list)  # checked in the store after the copy
    bytes_copied: int = 0
    seconds: float = 0.0
    safe: bool = False                                    # the verdict (verdicts.evacuation): exit 0 vs 6
    why: str = ""                                         # what decided it, in words


def hash_action(job: Job, store: Store, cp: Checkpoint, beside: bool = False) -> Action:
    files = [e.path for e in cp.files]
    total = sum(e.size for e in cp.files)
    return Action("evacuate", f"hash {cp.name} on the instance ({', '.join(store.instance_hashes)})",
                  command=hash_command(job.paths.ckpt_dir, job.facts.host.python, store.instance_hashes, beside=beside),
                  stdin=paths_stdin(files), deadline=hash_deadline(total), produces=f"hashes:{cp.name}",
                  parse="hashes", fails_as="evacuate", progress="hashes", size=total)


def plan_copy(job: Job, store: Store, cp: Checkpoint, again: bool = False,
              parts: list[tuple[Job, Checkpoint]] | None = None, about: dict[str, Any] | None = None) -> list[Action]:
    """Receive cp and, at the same time, hash it on the instance (a complete checkpoint does not
    change; one that is rotated away or rewritten meanwhile fails the comparison or counts as
    vanished); then verify, commit, record. In a node group, `parts` says which node sends which
    files; each hashes its own."""
    if not parts or len(parts) == 1:
        receive = store.plan_receive(job, cp, again)
        hashing = [dataclasses.replace(hash_action(job, store, cp, beside=True), lane=HASH_LANE)]
        refs: Ref | list[Ref] = Ref(hash_ref_names(cp, [job.host])[0])
    else:
        receive = store.plan_receive_parts(parts, cp, again)
        refs = [Ref(name) for name in hash_ref_names(cp, [part_job.host for part_job, _ in parts])]
        hashing = [dataclasses.replace(hash_action(part_job, store, part, beside=True), host=part_job.host,
                                       produces=ref.name,
                                       lane=f"{HASH_LANE}@{part_job.host}")
                   for (part_job, part), ref in zip(parts, refs, strict=True)]
    receive = [a if a.lane else dataclasses.replace(a, lane=COPY_LANE) for a in receive]
    still = ([still_there(job, cp)] if not parts or len(parts) == 1 else
             [dataclasses.replace(still_there(part_job, part), host=part_job.host) for part_job, part in parts])
    return [*receive, *hashing, *still, *store.plan_accept(job, cp, refs, about)]


def still_there(job: Job, cp: Checkpoint) -> Action:
    """After the copy: a file deleted while it was copied still reads to its end (for the copy and
    for the hash beside it); a checkpoint that is gone by then was rotated away, not evacuated."""
    return Action("evacuate", f"{cp.name} is still on the instance",
                  command=f"cd {shlex.quote(job.paths.ckpt_dir)} && xargs -0 -r stat -c %i -- >/dev/null",
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
    return (f"{time.strftime('%H:%M:%S')} copied {copied} ({human(report.bytes_copied)}{speed}){skipped}{damaged}"
            f"{unchanged}; {newest}; {lag}")
