"""What `up` says and decides around its plan, on one host or a group: the facts it reports, a
store checkpoint it must not use, and how the start went (verdicts.launched).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import verdicts
from ..errors import CheckpointError, EnvError
from ..job import Job
from ..plan import Plan
from ..steps.checkpoint import choose
from ..steps.launch import attach_command
from ..steps.notices import protection
from ..steps.preflight import summary
from ..transports import Store
from ..ui import UI
from .evacuation import lost_from_store


@dataclass
class UpResult:
    host: str
    status: str                       # "started" | "already running" | "finished" | "planned"
    checkpoint: str = ""
    step: int = 0
    plan: Plan | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"host": self.host, "status": self.status, "checkpoint": self.checkpoint, "step": self.step}


def not_held(job: Job, store: Store, damaged: set[str], wanted: str | None, ui: UI) -> bool:
    """Is the store's checkpoint `up` would restore listed in the manifest but not held by the store
    (deleted by hand, a lifecycle rule, a disk fault)? Then, like a damaged one, it is not used:
    True, and it joins `damaged`, so that the next verified one is chosen."""
    if job.facts.host.session_alive:
        return False
    choice = choose(job, frozenset(damaged), wanted)
    record = choice.record
    if record is None or choice.on_instance is not None:
        return False
    problems = verdicts.store_holds(record, store.observe(record, size_only=True), size_only=True)
    if not problems:
        return False
    said = lost_from_store(record.name, store, problems)
    if wanted is not None:
        raise CheckpointError(said, "choose another with --checkpoint, or none for the newest that the store holds")
    damaged.add(record.name)
    ui.warn(f"{said}; not used; falling back to the next verified checkpoint")
    return True


def say_facts(job: Job, store: Store, ui: UI) -> None:
    if job.facts.withheld:
        ui.warn(f"env.secrets lists {', '.join(job.facts.withheld)}, the credentials of the store "
                f"{store.label}: relaunch hands them to the instance only while a copy runs, not to training; "
                "remove them from env.secrets")
    for name, why in sorted(job.facts.damaged.items()):
        ui.warn(f"{job.host}: {name} on the instance is a save that did not finish ({why}); not used")
    for line in summary(job):
        ui.step(job.host, "preflight", line)
    if not job.facts.host.session_alive:
        for line in protection(job, job.facts.notices).lines():
            ui.step(job.host, "guard", line)


def say_launched(job: Job, watch: dict[str, Any], ui: UI) -> str:
    """Say how the start went, as verdicts.launched decides it: running, finished, or died
    (EnvError, exit 4, with its last lines)."""
    paths, run = job.paths, job.recipe.run
    state = watch.get("state")
    if not verdicts.launched(state):
        lines = "\n".join("  | " + ln for ln in watch.get("tail", []))
        raise EnvError(f"{job.host}: launch: the command died {watch.get('seconds', '?')}s after it started "
                       f"(exit {watch.get('status') or '?'}); last lines of {paths.log}:\n{lines}",
                       "fix run.command (try it by hand in the venv) and rerun `up`")
    if state == "finished":
        ui.ok(f"[{job.host}] the command already finished (exit 0); log: {paths.log}")
        return "finished"
    resumed = f"resumed from {job.checkpoint}" if job.checkpoint else "fresh start"
    proof = {"ready": f"its log says {watch.get('line', '')!r}",
             "progressing": f"the step in its log went up: {watch.get('line', '')!r}"}.get(
        state or "", f"alive after {watch.get('seconds', run.grace)}s")
    ui.ok(f"[{job.host}] training is running in tmux session {run.session} ({resumed}; {proof})")
    ui.say(f"  attach: {attach_command(job)}\n  log:    {paths.log}")
    return "started"
