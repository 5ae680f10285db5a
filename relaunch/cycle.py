"""The resume cycle: `up` (and `plan`, its dry run) and `evacuate`, on one or many hosts.

Each command runs the same way: connect, gather the facts once, plan (pure), then hand the plan
to the executor. `plan` stops before the executor and prints the plan it would have run.
The CLI calls these; they return results and raise relaunch errors, never print tracebacks.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import processes
from .errors import EnvError, EvacuationError, RelaunchError, UsageError, shorten
from .executor import Executor, HashMismatch
from .gather import gather, read_listing
from .host.connection import Remote, connect
from .host.spec import HostSpec, Target
from .host.sshconfig import Layer, resolve
from .job import Job, Node, drift
from .layouts import Checkpoint
from .paths import state_dir
from .plan import Action, Plan
from .recipe import Recipe
from .steps.checkpoint import choose, instance_checkpoints, plan_restore
from .steps.env import plan_env
from .steps.evacuate import Report, plan_copy, plan_meta
from .steps.launch import attach_command, plan_launch
from .steps.preflight import plan_preflight, summary
from .steps.stop import STILL_RUNNING, plan_stop
from .transports import Damaged, Mismatch, Store, Vanished, open_store
from .ui import UI, redact

log = logging.getLogger("relaunch")


def make_target(recipe: Recipe, spec: HostSpec) -> Target:
    """HOST wins over what the recipe wrote in its ssh section, which wins over ~/.ssh/config for
    that host, which wins over the provider preset and the defaults (see host/sshconfig.py)."""
    ssh = recipe.ssh
    written = Layer(user=ssh.user if recipe.wrote("ssh.user") else None,
                    port=ssh.port if recipe.wrote("ssh.port") else None,
                    key=str(ssh.key) if ssh.key else None)
    return resolve(spec, written, Layer(user=ssh.user, port=ssh.port), host_key=ssh.host_key, wait=ssh.wait)


# -- remembered hosts --------------------------------------------------------------------------
def _hosts_file(recipe: Recipe) -> Path:
    folder = state_dir() / "hosts"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    return folder / f"{recipe.name}.json"


def remember_host(recipe: Recipe, target: Target, spec: HostSpec) -> None:
    # an ssh config alias is remembered as typed, so that a later run resolves it (and its jump
    # host) again; an address as the endpoint it was resolved to
    entry = {"host": str(spec)} if target.alias else {"host": target.endpoint, "port": target.port}
    _hosts_file(recipe).write_text(json.dumps(entry) + "\n")


def last_host(recipe: Recipe, ui: UI) -> HostSpec:
    path = _hosts_file(recipe)
    if not path.exists():
        raise UsageError(f"no HOST given and no successful `relaunch up` of recipe {recipe.name} on record",
                         "give the instance as HOST")
    data = json.loads(path.read_text())
    spec = HostSpec.parse(data["host"])
    spec = HostSpec(spec.address, spec.user, spec.port or data.get("port"))
    ui.say(f"using {spec}, the host of the last `relaunch up` of {recipe.name}")
    return spec


# -- one host ------------------------------------------------------------------------------------
def open_host(recipe: Recipe, spec: HostSpec, ui: UI, accept_new_host_key: bool = False, rank: int = 0,
              nnodes: int = 1, master_addr: str = "") -> tuple[Node, Remote]:
    node = Node(make_target(recipe, spec), rank, nnodes, master_addr)
    through = f" through jump host {node.target.jump.label}" if node.target.jump else ""
    ui.say(f"connecting to {node.label}{through} (waiting up to {node.target.wait:g}s while it boots)")
    remote = connect(node.target, accept_new_host_key=accept_new_host_key, say=ui.say)
    missing = [name for name in recipe.env.secrets if name not in os.environ]
    if missing:
        ui.warn(f"env.secrets {', '.join(missing)} not set on this machine; not handed to the instance")
    return node, remote


# the lines of pip's or uv's output that name what could not be installed, best first
_INSTALL_ERRORS = (re.compile(r"Because (.+?)(?:, we can conclude.*)?$", re.M),            # uv
                   re.compile(r"^ERROR: (No matching distribution found for .+)$", re.M),   # pip
                   re.compile(r"^(?:ERROR|error): (.+)$", re.M))


class Checks:
    """In-process checks that plans call (`checks.x`): they say what they found."""

    def __init__(self, ui: UI, host: str) -> None:
        self.ui, self.host = ui, host

    def install_failure(self, status: int | None, output: str) -> RelaunchError | None:
        """The installer's own words for the package it could not install, as the error line."""
        text = redact(output)
        for pattern in _INSTALL_ERRORS:
            found = pattern.search(text)
            if found:
                return EnvError(f"{self.host}: env: installing the lock failed: {shorten(found.group(1))}",
                                "fix that pin in env.lock (or env.index_url if the package lives on another index), "
                                "then rerun `relaunch up`; the full output is in the debug log")
        return None

    def drift(self, lock: list[str], freeze: list[str]) -> None:
        differences = drift(lock, freeze)
        if differences:
            self.ui.warn(f"{self.host}: the env differs from the lock in {len(differences)} package(s):")
            for line in differences[:20]:
                self.ui.warn(f"  {line}")
        else:
            self.ui.step(self.host, "env", "pip freeze matches the lock")


def executor_for(job: Job, remote: Remote, store: Store | None, ui: UI) -> Executor:
    handlers: dict[str, Any] = {"checks": Checks(ui, job.host)}
    if store is not None:
        handlers.update(store.handlers())
    return Executor(ui, job.host, remote, handlers)


@dataclass
class UpResult:
    host: str
    status: str                       # "started" | "already running" | "finished" | "planned"
    checkpoint: str = ""
    step: int = 0
    plan: Plan | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"host": self.host, "status": self.status, "checkpoint": self.checkpoint, "step": self.step}


def plan_up(job: Job, store: Store, exclude: frozenset[str] = frozenset(),
            wanted: str | None = None) -> tuple[Plan, Job]:
    """Everything `up` does on this host, from its facts alone (no I/O)."""
    if job.facts.host.session_alive:
        return Plan(job.host, reads=list(job.facts.reads), actions=[Action(
            "launch", f"start tmux session {job.recipe.run.session}",
            skip=f"training is already running in tmux session {job.recipe.run.session}")]), job
    choice = choose(job, exclude, wanted)
    preflight = plan_preflight(job, choice.copy_bytes)
    job, restore = plan_restore(job, store, choice)
    plan = Plan(job.host, reads=list(job.facts.reads))
    plan.extend([*preflight, *plan_env(job), *restore, *plan_launch(job)])
    return plan, job


def up_one(recipe: Recipe, spec: HostSpec, ui: UI, dry_run: bool = False, accept_new_host_key: bool = False,
           rank: int = 0, nnodes: int = 1, master_addr: str = "", wanted: str | None = None) -> UpResult:
    node, remote = open_host(recipe, spec, ui, accept_new_host_key, rank, nnodes, master_addr)
    with remote:
        store = open_store(recipe)
        damaged: set[str] = set()           # store records whose bytes failed their check twice
        suspect: set[str] = set()           # ... once: copied again before they count as damaged
        while True:
            job = gather(remote, recipe, node, store)
            _say_facts(job, store, ui)
            plan, job = plan_up(job, store, frozenset(damaged), wanted)
            if dry_run:
                return UpResult(job.host, "planned", job.checkpoint, job.step, plan)
            if job.facts.host.session_alive:
                ui.ok(f"[{job.host}] training is already running in tmux session {recipe.run.session}; "
                      "nothing to do")
                remember_host(recipe, node.target, spec)
                return UpResult(job.host, "already running")
            executor = executor_for(job, remote, store, ui)
            try:
                results = executor.run(plan.actions)
                break
            except HashMismatch as exc:
                name = job.checkpoint.rsplit("/", 1)[-1]
                executor.run_one(Action("checkpoint", f"remove the copy of {name} that did not verify",
                                        command=f"rm -rf -- {shlex.quote(job.paths.incoming)}"))
                if name in suspect or wanted is not None:
                    damaged.add(name)
                    if wanted is not None:
                        raise
                    ui.warn(f"{name} in the store {store.label} does not match its manifest ({exc.message}); it "
                            "is damaged and kept as it is; falling back to the newest checkpoint that verifies")
                else:
                    suspect.add(name)
                    ui.warn(f"{exc.message}; copying {name} again before calling it damaged")
        status = _launched(job, results.get("launch") or {}, ui)
        remember_host(recipe, node.target, spec)
        return UpResult(job.host, status, job.checkpoint, job.step)


def _say_facts(job: Job, store: Store, ui: UI) -> None:
    if job.facts.withheld:
        ui.warn(f"env.secrets lists {', '.join(job.facts.withheld)}, the credentials of the store "
                f"{store.label}: relaunch hands them to the instance only while a copy runs, not to training; "
                "remove them from env.secrets")
    for name, why in sorted(job.facts.damaged.items()):
        ui.warn(f"{job.host}: {name} on the instance is a save that did not finish ({why}); not used")
    for line in summary(job):
        ui.step(job.host, "preflight", line)


def _launched(job: Job, watch: dict[str, Any], ui: UI) -> str:
    """Say how the start went: running, finished, or died (EnvError, exit 4, with its last lines)."""
    paths, run = job.paths, job.recipe.run
    state = watch.get("state")
    resumed = f"resumed from {job.checkpoint}" if job.checkpoint else "fresh start"
    if state in ("ready", "alive"):
        proof = (f"its log says {watch.get('line', '')!r}" if state == "ready"
                 else f"alive after {watch.get('seconds', run.grace)}s")
        ui.ok(f"[{job.host}] training is running in tmux session {run.session} ({resumed}; {proof})")
        ui.say(f"  attach: {attach_command(job)}\n  log:    {paths.log}")
        return "started"
    if state == "finished":
        ui.ok(f"[{job.host}] the command already finished (exit 0); log: {paths.log}")
        return "finished"
    lines = "\n".join("  | " + ln for ln in watch.get("tail", []))
    raise EnvError(f"{job.host}: launch: the command died {watch.get('seconds', '?')}s after it started "
                   f"(exit {watch.get('status') or '?'}); last lines of {paths.log}:\n{lines}",
                   "fix run.command (try it by hand in the venv) and rerun `up`")


def up(recipe: Recipe, specs: list[HostSpec], ui: UI, dry_run: bool = False,
       accept_new_host_key: bool = False, checkpoint: str | None = None) -> list[UpResult]:
    if len(specs) == 1:
        return [up_one(recipe, specs[0], ui, dry_run, accept_new_host_key, wanted=checkpoint)]
    master = make_target(recipe, specs[0]).address     # as resolved: an ssh config alias means nothing there
    with ThreadPoolExecutor(max_workers=len(specs), thread_name_prefix="host") as pool:
        futures = [pool.submit(up_one, recipe, spec, ui, dry_run, accept_new_host_key, rank, len(specs), master,
                               checkpoint)
                   for rank, spec in enumerate(specs)]
        try:
            for future in futures:
                future.exception()
        except KeyboardInterrupt:
            processes.CANCEL.set()
            raise
    results, errors = [], []
    for spec, future in zip(specs, futures, strict=True):
        exc = future.exception()
        if exc is None:
            results.append(future.result())
        else:
            errors.append((spec, exc))
    for spec, exc in errors:
        ui.warn(f"{spec}: {redact(str(exc))}")
    if errors:
        first = errors[0][1]
        if isinstance(first, RelaunchError):
            raise type(first)(f"{len(errors)} of {len(specs)} hosts failed; first: {first.message}", first.hint)
        raise first
    return results


# -- evacuate ----------------------------------------------------------------------------------
def evacuate(recipe: Recipe, spec: HostSpec, ui: UI, stop: bool = False) -> Report:
    """Any failure becomes exit 6: the instance must not be destroyed."""
    try:
        store = open_store(recipe)
        node, remote = open_host(recipe, spec, ui)
        with remote:
            job = gather(remote, recipe, node)
            executor = executor_for(job, remote, store, ui)
            if stop:
                _stop(job, executor, ui)
            with store.lock(ui):
                return evacuate_job(job, remote, store, executor, ui)
    except UsageError:
        raise
    except RelaunchError as exc:
        raise EvacuationError(f"{exc.message}\nevacuation NOT verified: DO NOT destroy the instance",
                              exc.hint) from exc


def _stop(job: Job, executor: Executor, ui: UI) -> None:
    results = executor.run(plan_stop(job))
    outcome = str(results.get("stop") or "").strip()
    if outcome.startswith(STILL_RUNNING):
        ui.warn(f"{job.host}: training still running after {job.recipe.run.stop.timeout:g}s (run.stop.timeout); "
                "evacuating what is there")
    elif outcome:
        ui.step(job.host, "stop", f"training stopped (exit {outcome.split(' ', 1)[-1].strip() or '?'})")


def evacuate_job(job: Job, remote: Remote, store: Store, executor: Executor, ui: UI, rounds: int = 3,
                 reverify: bool = True, require_newest: bool = True) -> Report:
    """Copy the newest `keep` complete checkpoints (newest first) until the newest is verified.

    Call with the store lock held. `evacuate` re-hashes what the store already holds and insists
    that the newest checkpoint on the instance ends up verified; a `sync` round (reverify=False,
    require_newest=False) only moves what is new and reports the lag instead.
    """
    started = time.monotonic()
    keep = job.recipe.checkpoint.keep
    job.facts.store = store.read(writing=True)
    report = Report(store=store.label, verified_by=store.hash_name)
    listing = instance_checkpoints(job)
    try:
        for _ in range(rounds):
            for cp in reversed(listing[-keep:]):
                if cp.name not in report.copied + report.already + report.skipped + _names(report.damaged):
                    _evacuate_one(job, store, executor, cp, report, reverify)
            job.facts.listing = read_listing(remote, job.paths.ckpt_dir, EvacuationError)
            listing = [cp for cp in instance_checkpoints(job) if cp.name not in _names(report.damaged)]
            newest = listing[-1] if listing else None
            report.newest = report.newest_step = report.newest_mtime = None
            if newest is not None:
                report.newest, report.newest_step = newest.name, newest.step
                report.newest_mtime = max((e.mtime for e in newest.files), default=None)
            if newest is None or not require_newest or newest.name in report.copied + report.already:
                break
            ui.step(job.host, "evacuate", f"training wrote {newest.name} meanwhile; another round")
        else:
            raise EvacuationError(
                f"{job.host}: training keeps writing new checkpoints faster than they can be copied; the "
                "newest is not in the store yet", "stop training first (`relaunch evacuate --stop`), then "
                "evacuate again")
        executor.run(plan_meta(job))
        manifest = store.manifest
        report.safe = report.verdict()
        if require_newest and not report.safe:
            raise EvacuationError(f"{job.host}: the newest checkpoint {report.newest} is not verified in the store")
        if report.copied and manifest is not None:
            protect = frozenset(report.copied + report.already)
            report.pruned = store.prune(manifest, keep, protect)
            for name in report.pruned:
                ui.step(job.host, "evacuate", f"pruned {name} from the store (keep={keep})")
    except OSError as exc:
        # a full or read-only disk on this machine: nothing is deleted to make room, and what
        # was being written stays in the store's staging folder, which is never trusted
        raise EvacuationError(f"writing the store {store.label} failed: {exc.strerror or exc}",
                              "free space on this machine (nothing was deleted to make room), then rerun") from exc
    stored = store.manifest.newest() if store.manifest else None
    if stored is not None:
        report.stored, report.stored_step, report.stored_written_at = stored.name, stored.step, stored.written_at
    report.seconds = time.monotonic() - started
    return report


def _names(damaged: list[str]) -> list[str]:
    return [d.split(":", 1)[0] for d in damaged]


def _evacuate_one(job: Job, store: Store, executor: Executor, cp: Checkpoint, report: Report,
                  reverify: bool) -> None:
    known = store.manifest.checkpoints.get(cp.name) if store.manifest else None
    sizes = {e.path: e.size for e in cp.files}
    if known is not None:
        if not reverify and {p: f.size for p, f in known.files.items()} == sizes:
            report.already.append(cp.name)        # a sync round: same files, same sizes, verified before
            report.unchanged.append(cp.name)
            return
        from .steps.evacuate import hash_action

        hashes = executor.run_one(hash_action(job, store, cp))
        if any(h.missing for h in hashes.values()):
            report.skipped.append(cp.name)
            return
        if set(hashes) == set(known.files) and all(known.files[p].sha256 == h.hashes.get("sha256")
                                                   for p, h in hashes.items()):
            report.already.append(cp.name)
            return
        raise EvacuationError(
            f"{job.host}: {cp.name} on the instance differs from the verified copy in the store {store.label}",
            "the store never overwrites a checkpoint; move the store's copy aside if the instance's is right")
    try:
        try:
            results = executor.run(plan_copy(job, store, cp))
        except Mismatch as exc:
            # a quick check (size + mtime) can trust a damaged partial file: compare every byte
            ui = executor.ui
            ui.warn(f"{cp.name}: {exc.problems[0]}; copying again, comparing every byte")
            results = executor.run(plan_copy(job, store, cp, again=True))
    except Vanished:
        executor.ui.step(job.host, "evacuate", f"{cp.name} was rotated away by the trainer during the copy; skipped")
        report.skipped.append(cp.name)
        return
    except Damaged as exc:
        executor.ui.warn(f"{job.host}: {cp.name} is damaged on the instance ({exc}); not copied")
        report.damaged.append(f"{cp.name}: {exc}")
        return
    report.copied.append(cp.name)
    report.bytes_copied += sum(sizes.values())
    executor.ui.step(job.host, "evacuate", f"{cp.name} verified: {len(sizes)} file(s), "
                                           f"{results.get(f'verified:{cp.name}') or store.hash_name}")

