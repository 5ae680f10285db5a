"""Lineage: a training resumed from a checkpoint older than the newest starts a new branch, and
the checkpoints newer than it (the run it abandoned) are set aside: never "newest" again, never
counted or deleted by `keep`, never overwritten, and said where they are.

Whoever resumes sets them aside on the instance: `up` when it resumes an older checkpoint
(`plan_branch`: before the command starts), or relaunch.train when the training itself resumed one
(the Checkpointer's restore, the Trainer and Lightning callbacks): each moves them under
`<checkpoint.dir>/.relaunch-aside/<branch>/` and appends the branch to its lineage file there,
which facts.sh reads. The store learns it from `up` at once, and from the instance's lineage file at
the next `evacuate`, `sync` round or `watch` round (`apply`), before anything is copied or ranked.
"""

from __future__ import annotations

import json
import shlex
import time
from typing import Any

from ..job import Job
from ..manifest import Branch, StoreManifest
from ..plan import LOCAL, Action
from ..train import ASIDE_DIR, LINEAGE_FILE, branch_id
from ..transports.base import LOCK_WAIT, store_deadline
from .checkpoint import Choice, instance_checkpoints

STEP = "checkpoint"


def box_branches(jobs: list[Job]) -> list[Branch]:
    """The branches the instances' lineage files name (every node's, once each), oldest first."""
    found: dict[str, Branch] = {}
    for job in jobs:
        for raw in job.facts.host.lineage:
            try:
                branch = Branch.from_dict({"host": job.host, **raw})
            except (ValueError, TypeError, KeyError):
                continue                 # a line relaunch cannot read: a newer format, or not relaunch's
            found.setdefault(branch.id, branch)
    return sorted(found.values(), key=lambda b: (b.at, b.id))


def apply(manifest: StoreManifest | None, jobs: list[Job]) -> dict[str, list[str]]:
    """Record the instances' branches in the store's manifest: branch id -> the records each set
    aside (only branches the manifest did not hold yet; none when the store holds nothing)."""
    if manifest is None:
        return {}
    marked = {}
    for branch in box_branches(jobs):
        if not any(known.id == branch.id for known in manifest.branches):
            marked[branch.id] = manifest.branch(branch)
    return marked


def said(branch: Branch, marked: list[str], store: str) -> str:
    """What is said when the store learns a branch: what is aside, and where."""
    here = f" on {branch.host}" if branch.host else ""
    where = f"; on the instance: {branch.where}{here}" if branch.where and branch.aside else ""
    stored = f"set aside in the store {store}: {', '.join(marked)}" if marked else "nothing of it in the store"
    return (f"training resumed from {branch.resumed or 'scratch'} (step {branch.step}) at "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(branch.at))} UTC, a new branch: the later checkpoints "
            f"are an abandoned run's; {stored}{where} (kept, never the newest again)")


def plan_branch(jobs: list[Job], choice: Choice, exclude: frozenset[str] = frozenset()) -> tuple[Branch | None,
                                                                                             list[Action]]:
    """`up` resuming a checkpoint older than others on the instance or in the store: the branch,
    and its actions. On every node, the later complete checkpoints go aside (one rename each, the
    branch appended to the lineage file first); then the store sets its later records aside (under
    its lock). Run before the command starts, so no save of the new branch is ever among them.
    `exclude`: store records `up` could not use (damaged, not held): a fallback past them is not
    a rollback, and they stay as they are."""
    first = jobs[0]
    store = first.facts.store
    manifest = store.manifest if store is not None else None
    resumed = choice.record.name if choice.record else (choice.on_instance.name if choice.on_instance else "")
    step = choice.step
    here = [cp.name for cp in instance_checkpoints(first) if cp.step > step and cp.name not in first.facts.damaged]
    stored = [r.name for r in manifest.ordered() if r.step > step and r.name not in exclude] if manifest else []
    if not here and not stored:
        return None, []
    at = first.facts.host.now or time.time()
    ident = branch_id(resumed, at)
    branch = Branch(id=ident, resumed=resumed, step=step, at=at, aside=here, by="relaunch up", host=first.host,
                    where=f"{first.paths.ckpt_dir}/{ASIDE_DIR}/{ident}")
    actions = []
    if here:
        for job in jobs:
            folder = f"{job.paths.ckpt_dir}/{ASIDE_DIR}/{ident}"
            actions.append(Action(STEP, f"set aside {', '.join(here)} (newer than {resumed or 'a fresh start'}: "
                                        f"an abandoned branch) in {folder}",
                                  command=aside_command(job, branch), fails_as="checkpoint",
                                  host=job.host if len(jobs) > 1 else "",
                                  done=f"training resumes from {resumed or 'scratch'} (step {step}), a new branch: "
                                       f"the later {', '.join(here)} set aside in {folder} (kept, never the newest "
                                       "again)",
                                  hint="nothing was deleted; rerun `relaunch up`"))
    if stored:
        actions.append(Action(STEP, f"set aside in the store: {', '.join(stored)} (an abandoned branch's)",
                              where=LOCAL, call="store.record_branch", args={"branch": branch}, fails_as="checkpoint",
                              deadline=LOCK_WAIT + store_deadline(),      # it waits its turn for the store
                              done=f"set aside in the store: {', '.join(stored)}"))
    return branch, actions


def aside_command(job: Job, branch: Branch) -> str:
    """On one node: the branch appended to the lineage file (a temporary file renamed over it), then
    each checkpoint there moved under the branch's folder; what a node lacks is skipped."""
    q = shlex.quote
    record: dict[str, Any] = {**branch.as_dict(), "where": f"{job.paths.ckpt_dir}/{ASIDE_DIR}/{branch.id}"}
    record.pop("host", None)
    lineage, folder = f"{ASIDE_DIR}/{LINEAGE_FILE}", f"{ASIDE_DIR}/{branch.id}"
    moves = " ".join(q(name) for name in branch.aside)
    return (f"cd -- {q(job.paths.ckpt_dir)} && mkdir -p -- {q(folder)} && "
            f"{{ cat -- {q(lineage)} 2>/dev/null; printf '%s\\n' {q(json.dumps(record, sort_keys=True))}; }} "
            f"> {q(lineage + '.tmp')} && mv -f -- {q(lineage + '.tmp')} {q(lineage)} && "
            f"for n in {moves}; do if [ -e \"$n\" ] || [ -L \"$n\" ]; then "
            f"mkdir -p -- {q(folder)}/\"$(dirname -- \"$n\")\" && mv -T -- \"$n\" {q(folder)}/\"$n\" || exit 1; "
            "fi; done")


def aside_lines(manifest: StoreManifest | None, jobs: list[Job]) -> list[str]:
    """Where every abandoned branch's checkpoints are (`status`): in the store (under their own
    names, or where a new save of the same name displaced them) and on the instance."""
    lines = []
    known = {b.id: b for b in manifest.branches} if manifest else {}
    on_box = {b.id: b for b in box_branches(jobs)}
    for ident in sorted({*known, *on_box}, key=lambda i: (known.get(i) or on_box[i]).at):
        branch = known.get(ident) or on_box[ident]
        stored = [r.name for r in manifest.aside_records() if r.aside == ident] if manifest else []
        parts = [f"in the store under their names: {', '.join(stored)}"] if stored else []
        parts += [f"{name} in the store at {where}" for name, where in sorted(branch.moved.items())]
        here = on_box.get(ident)
        if here is not None and here.aside:
            parts.append(f"on {here.host}: {', '.join(here.aside)} in {here.where}")
        elif branch.where and branch.aside:
            parts.append(f"on {branch.host or 'the instance it ran on'}: {', '.join(branch.aside)} in {branch.where}")
        if parts:
            lines.append(f"{ident} (training resumed from {branch.resumed or 'scratch'}, step {branch.step}): "
                         + "; ".join(parts))
    return lines
