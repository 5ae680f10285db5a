"""The resume cycle: `up` (and `plan`, its dry run) and `evacuate`, on one or many hosts.

Each command runs the same way: connect, gather the facts once, plan (pure), then hand the plan
to the executor. `plan` stops before the executor and prints the plan it would have run.
The CLI calls these; they return results and raise relaunch errors, never print tracebacks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shlex
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import processes
from . import verdicts
from .errors import CheckpointError, EnvError, EvacuationError, Interrupted, RelaunchError, UsageError, shorten
from .executor import Executor, HashMismatch
from .gather import gather, gather_group, read_listing, share_listings
from .host.connection import Remote, connect
from .host.spec import HostSpec, Target
from .host.sshconfig import Layer, resolve
from .job import Job, Node, drift
from .layouts import Checkpoint, Entry
from .paths import state_dir
from .plan import LOCAL, Action, Plan
from .recipe import Recipe
from .store import CheckpointRecord
from .steps.checkpoint import choose, instance_checkpoints, on_every_node, plan_restore
from .steps.group import MARK, barrier, check_reshard, plan_fanout, shape, shaped, tag, what_changed
from .steps.env import plan_env
from .steps.evacuate import LOG_TAIL_LINES, Report, Unpinned, hash_action, plan_copy, plan_meta, plan_unpin
from .steps.guard import newest_logged_step
from .steps.launch import START_MARK, attach_command, plan_launch, tail_command
from .steps.notices import protection
from .steps.preflight import plan_preflight, summary
from .steps.stop import STILL_RUNNING, end_command, plan_stop, signal_command
from .transports import Damaged, Mismatch, Store, Vanished, open_store
from .transports.base import store_deadline
from .transports.tools import indexes_searched
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


def remember_host(recipe: Recipe, *nodes: tuple[Target, HostSpec]) -> None:
    """The host (or node group, node 0 first) of the last successful `up`, for commands without HOST.

    An ssh config alias is remembered as typed, so that a later run resolves it (and its jump
    host) again; an address as the endpoint it was resolved to."""
    hosts = [str(spec) if target.alias else target.endpoint for target, spec in nodes]
    first = nodes[0][0]
    # an alias's port comes from the ssh config again; only a plain address keeps the one it had
    port = None if first.alias else first.port
    _hosts_file(recipe).write_text(json.dumps({"host": hosts[0], "port": port, "hosts": hosts}) + "\n")


def last_hosts(recipe: Recipe, ui: UI) -> list[HostSpec]:
    path = _hosts_file(recipe)
    if not path.exists():
        raise UsageError(f"no HOST given and no successful `relaunch up` of recipe {recipe.name} on record",
                         "give the instance as HOST")
    data = json.loads(path.read_text())
    specs = [HostSpec.parse(h) for h in data.get("hosts") or [data["host"]]]
    if len(specs) == 1:
        specs = [HostSpec(specs[0].address, specs[0].user, specs[0].port or data.get("port"))]
    what = "host" if len(specs) == 1 else "node group"
    ui.say(f"using {' '.join(map(str, specs))}, the {what} of the last `relaunch up` of {recipe.name}")
    return specs


def last_host(recipe: Recipe, ui: UI) -> HostSpec:
    return last_hosts(recipe, ui)[0]


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


def open_group(recipe: Recipe, specs: list[HostSpec], ui: UI,
               accept_new_host_key: bool = False) -> list[tuple[Node, Remote]]:
    """Connect to every node at the same time (node 0 first in the result); all or nothing."""
    if len(specs) == 1:
        return [open_host(recipe, specs[0], ui, accept_new_host_key)]
    master = make_target(recipe, specs[0]).address     # as resolved: an ssh config alias means nothing there
    with ThreadPoolExecutor(max_workers=len(specs), thread_name_prefix="connect") as pool:
        futures = [pool.submit(open_host, recipe, spec, ui, accept_new_host_key, rank, len(specs), master)
                   for rank, spec in enumerate(specs)]
        try:
            outcomes = [(f.result() if f.exception() is None else f.exception()) for f in futures]
        except KeyboardInterrupt:
            processes.CANCEL.set()
            raise
    pairs = [o for o in outcomes if isinstance(o, tuple)]
    failed = [(spec, o) for spec, o in zip(specs, outcomes, strict=True) if not isinstance(o, tuple)]
    if failed:
        for _, remote in pairs:
            remote.close()
        spec, exc = failed[0]
        if isinstance(exc, RelaunchError):
            named = exc.message if exc.message.startswith(f"{make_target(recipe, spec).label}:") else \
                f"{spec}: {exc.message}"               # most messages name their host already
            raise type(exc)(f"{len(failed)} of {len(specs)} nodes could not be reached; first, {named}",
                            exc.hint, exc.refused)
        raise exc  # type: ignore[misc]
    return pairs  # type: ignore[return-value]


@contextlib.contextmanager
def connected(pairs: list[tuple[Node, Remote]]) -> Iterator[dict[str, Remote]]:
    """The group's connections by node label, closed at the end."""
    try:
        yield {node.label: remote for node, remote in pairs}
    finally:
        for _, remote in pairs:
            remote.close()


# the lines of pip's or uv's output that name what could not be installed, best first
_INSTALL_ERRORS = (re.compile(r"Because (.+?)(?:, we can conclude.*)?$", re.M),            # uv
                   re.compile(r"^ERROR: (No matching distribution found for .+)$", re.M),   # pip
                   re.compile(r"^(?:ERROR|error): (.+)$", re.M))


# templates/env.sh.j2 announces what it does next: uv providing the Python, or installing the lock
_ENV_PHASE = re.compile(r"^relaunch-env-phase (\w+)$", re.M)
# templates/setup.sh.j2 announces each env.setup line before it runs it
_SETUP_LINE = re.compile(r"^relaunch-setup-line (\d+)$", re.M)
SETUP_TAIL_LINES = 15


class Checks:
    """In-process checks that plans call (`checks.x`): they say what they found."""

    def __init__(self, ui: UI, host: str, recipe: Recipe | None = None) -> None:
        self.ui, self.host, self.recipe = ui, host, recipe

    def setup_failure(self, status: int | None, output: str) -> RelaunchError | None:
        """The env.setup line that failed, where the recipe wrote it, and the last lines it printed
        (None leaves the usual failure block: a timeout, or a team's setup.sh.j2 without the
        announcements)."""
        starts = list(_SETUP_LINE.finditer(output))
        if status is None or not starts or self.recipe is None:
            return None
        last = starts[-1]
        key = f"env.setup.{last.group(1)}"
        where = self.recipe.origin(tuple(key.split(".")))
        printed = [ln for ln in redact(output[last.end():]).splitlines() if ln.strip()][-SETUP_TAIL_LINES:]
        message = (f"{self.host}: env.setup failed (exit {status}) at {where}: {key}: "
                   f"{shorten(redact(str(self.recipe.value(key))))}")
        message += "".join(f"\n  | {ln}" for ln in printed) if printed else "\n  (it printed nothing)"
        return EnvError(message, "fix that line (or the instance), then rerun `relaunch up`: the setup runs "
                                 "again from its first line; the full output is in the debug log")

    def install_failure(self, status: int | None, output: str) -> RelaunchError | None:
        """The installer's own words for the package it could not install (or for the Python uv
        could not provide), as the error line; the hint names the indexes it searched."""
        text = redact(output)
        phases = list(_ENV_PHASE.finditer(text))
        providing = bool(phases) and phases[-1].group(1) == "python"
        if providing:
            text = text[phases[-1].end():]
        for pattern in _INSTALL_ERRORS:
            found = pattern.search(text)
            if not found:
                continue
            if providing and self.recipe is not None:
                env = self.recipe.env
                source = (f"env.python_mirror {redact(env.python_mirror)}" if env.python_mirror
                          else "uv's default download source (python-build-standalone on GitHub)")
                return EnvError(f"{self.host}: env: uv could not provide Python {env.python}: "
                                f"{shorten(found.group(1))}",
                                f"it downloads from {source}: an instance without internet access needs "
                                "env.python_mirror; or pick an image that has that Python; the full output is "
                                "in the debug log")
            searched = f"the indexes searched: {redact(indexes_searched(self.recipe))}; " if self.recipe else ""
            return EnvError(f"{self.host}: env: installing the lock failed: {shorten(found.group(1))}",
                            f"{searched}fix that pin in env.lock (or env.index_url / env.extra_index_urls if the "
                            "package lives on another index), then rerun `relaunch up`; the full output is in the "
                            "debug log")
        return None

    def pinned(self, name: str, hosts: list[str], found: list[dict[str, Any] | None]) -> None:
        """Say where each node pinned checkpoint `name` for its copy (and that it removed what an
        earlier copy left); Unpinned for the nodes where it could not, with why."""
        refused: dict[str, str] = {}
        for host, doc in zip(hosts, found, strict=True):
            doc = doc or {}
            if doc.get("stale"):
                self.ui.step(host, "evacuate", f"removed {doc['stale']} pinned file(s) an earlier copy left "
                                               "(its relaunch was stopped before it could)")
            if doc.get("pinned"):
                self.ui.step(host, "evacuate", f"{name} pinned for its copy: {doc.get('files')} hard link(s) in "
                                               f"{doc['pinned']}")
            else:
                refused[host] = str(doc.get("unpinned") or "pin.py said nothing")
        if refused:
            raise Unpinned(refused)

    def drift(self, lock: list[str], freeze: list[str]) -> None:
        differences = drift(lock, freeze)
        if differences:
            self.ui.warn(f"{self.host}: the env differs from the lock in {len(differences)} package(s):")
            for line in differences[:20]:
                self.ui.warn(f"  {line}")
        else:
            self.ui.step(self.host, "env", "pip freeze matches the lock")


class Fanout:
    """The key a node group uses to copy a checkpoint between its nodes (`fanout.keypair`): made
    here for one copy, never written to this machine's disk."""

    def keypair(self) -> dict[str, bytes]:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        key = Ed25519PrivateKey.generate()
        private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                    serialization.NoEncryption())
        public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        # `restrict`: no forwarding, no pty; the copy needs nothing else
        return {"private": private, "authorized": b"restrict " + public + f" {MARK}\n".encode()}


def executor_for(job: Job, remote: Remote, store: Store | None, ui: UI,
                 remotes: dict[str, Remote] | None = None) -> Executor:
    handlers: dict[str, Any] = {"checks": Checks(ui, job.host, job.recipe), "fanout": Fanout()}
    if store is not None:
        handlers.update(store.handlers())
    return Executor(ui, job.host, remote, handlers, remotes)


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
    form = shape([job])
    job = shaped([job], form)[0]
    choice = choose(job, exclude, wanted)
    check_reshard(choice.record, form, job)
    changed = what_changed(choice.record, form, job)
    preflight = plan_preflight(job, choice.copy_bytes)
    job, restore = plan_restore(job, store, choice)
    plan = Plan(job.host, reads=list(job.facts.reads))
    if changed:
        plan.extend([Action("launch", "the group's shape", say=changed)])
    plan.extend([*preflight, *plan_env(job), *restore, *plan_launch(job)])
    return plan, job


def plan_group_up(jobs: list[Job], store: Store, known_hosts: str, exclude: frozenset[str] = frozenset(),
                  wanted: str | None = None) -> tuple[Plan, list[Job]]:
    """`up` on a node group, from the facts of every node (no I/O): every node prepares at the
    same time, the checkpoint crosses to node 0 and fans out to the others, then all start."""
    first = jobs[0]
    plan = Plan(" ".join(job.host for job in jobs), reads=[f"{job.host}: {r}" for job in jobs
                                                            for r in job.facts.reads])
    alive = [job.host for job in jobs if job.facts.host.session_alive]
    if alive and len(alive) == len(jobs):
        plan.extend([Action("launch", f"start tmux session {first.recipe.run.session} on every node",
                            skip=f"training is already running on every node (tmux session "
                                 f"{first.recipe.run.session})")])
        return plan, jobs
    if alive:
        raise EnvError(f"training runs on {', '.join(alive)} but not on "
                       f"{', '.join(j.host for j in jobs if j.host not in alive)}",
                       "stop the group (`relaunch evacuate RECIPE HOST... --stop`), then run `up` again")
    form = shape(jobs)
    jobs = shaped(jobs, form)
    choice = choose(jobs[0], exclude, wanted)
    check_reshard(choice.record, form, jobs[0])
    changed = what_changed(choice.record, form, jobs[0])
    plan.extend([Action("launch", "the group's shape", say=changed or
                        f"{form.nnodes} node(s) x {form.nproc} process(es): world size {form.world_size}"
                        + (f", grad_accum {form.grad_accum}" if first.recipe.run.batch else ""))])
    for job in jobs:
        plan.extend(tag(plan_preflight(job, choice.copy_bytes), job, lane=f"preflight@{job.host}"))
    plan.extend([barrier("preflight", "every node is ready for the env and the checkpoint")])
    resumed, restores = [], []
    for job in jobs:
        again, restore = plan_restore(job, store, choice, follow=False)
        resumed.append(again)
        restores.append(restore)
    copying = choice.record is not None and choice.on_instance is None
    cleanup: list[Action] = []
    lanes: list[Action] = []
    if copying:
        assert choice.record is not None
        # the slow link once, to node 0; from there the nodes double it between themselves
        keypair, lanes, cleanup = plan_fanout(resumed, choice.record, known_hosts, restores[0][:-1],
                                              [restore[-1] for restore in restores])
        plan.extend([keypair])
    else:
        lanes = [a for again, restore in zip(resumed, restores, strict=True)
                 for a in tag(restore, again, lane=f"checkpoint@{again.host}")]     # nothing to copy
    plan.extend([a for again in resumed for a in tag(plan_env(again), again)])
    plan.extend(lanes)
    plan.extend(cleanup)
    plan.extend([barrier("launch", f"starting training on {len(jobs)} nodes")])
    for again in resumed:
        launch = [dataclasses.replace(a, produces=f"{a.produces}@{again.host}" if a.produces else "")
                  for a in plan_launch(again)]
        plan.extend(tag(launch, again, lane=f"launch@{again.host}"))
    return plan, resumed


def up_one(recipe: Recipe, spec: HostSpec, ui: UI, dry_run: bool = False, accept_new_host_key: bool = False,
           rank: int = 0, nnodes: int = 1, master_addr: str = "", wanted: str | None = None) -> UpResult:
    node, remote = open_host(recipe, spec, ui, accept_new_host_key, rank, nnodes, master_addr)
    with remote:
        store = open_store(recipe)
        damaged: set[str] = set()           # store records whose bytes failed their check twice
        suspect: set[str] = set()           # ... once: copied again before they count as damaged
        while True:
            job = gather(remote, recipe, node, store, notices=True)
            _say_facts(job, store, ui)
            if _not_held(job, store, damaged, wanted, ui):
                continue
            plan, job = plan_up(job, store, frozenset(damaged), wanted)
            if dry_run:
                return UpResult(job.host, "planned", job.checkpoint, job.step, plan)
            if job.facts.host.session_alive:
                ui.ok(f"[{job.host}] training is already running in tmux session {recipe.run.session}; "
                      "nothing to do")
                remember_host(recipe, (node.target, spec))
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
        remember_host(recipe, (node.target, spec))
        return UpResult(job.host, status, job.checkpoint, job.step)


def prepare(recipe: Recipe, group: list[HostSpec], rank: int, ui: UI) -> None:
    """Preflight and the env (venv, lock, env.files, env.setup) on node `rank` of the group it is
    to join later (a replacement rented while the shrunk group trains), rendered as that node
    (`{{ node_rank }}`, `{{ nnodes }}`, `{{ master_addr }}`). The `up` on the whole group then
    finds them made, and the others stop only for the save, its copy and the start."""
    master = make_target(recipe, group[0]).address
    node, remote = open_host(recipe, group[rank], ui, rank=rank, nnodes=len(group), master_addr=master)
    with remote:
        job = gather(remote, recipe, node, listing=False)
        executor_for(job, remote, None, ui).run([*plan_preflight(job, 0), *plan_env(job)])


def _not_held(job: Job, store: Store, damaged: set[str], wanted: str | None, ui: UI) -> bool:
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
    said = _lost(record.name, store, problems)
    if wanted is not None:
        raise CheckpointError(said, "choose another with --checkpoint, or none for the newest that the store holds")
    damaged.add(record.name)
    ui.warn(f"{said}; not used; falling back to the next verified checkpoint")
    return True


def _say_facts(job: Job, store: Store, ui: UI) -> None:
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
    return up_group(recipe, specs, ui, dry_run, accept_new_host_key, checkpoint)


def up_group(recipe: Recipe, specs: list[HostSpec], ui: UI, dry_run: bool = False,
             accept_new_host_key: bool = False, wanted: str | None = None) -> list[UpResult]:
    """`up` on several nodes (node 0 first: torchrun's master): one plan, one executor."""
    pairs = open_group(recipe, specs, ui, accept_new_host_key)
    with connected(pairs) as remotes:
        store = open_store(recipe)
        damaged: set[str] = set()
        tried: set[str] = set()             # group checkpoints already sent to the store once
        known = group_known_hosts([node for node, _ in pairs])
        while True:
            jobs = gather_group(pairs, recipe, store, notices=True)
            for job in jobs:
                _say_facts(job, store, ui)
            newer = unsaved_group_checkpoint(jobs[0])
            if newer is not None and newer.name in tried:
                ui.warn(f"{newer.name} could not be copied into the store; resuming from the store's newest")
            elif newer is not None and not dry_run and wanted is None:
                tried.add(newer.name)
                # the group holds a newer checkpoint than the store, spread over its nodes: into the
                # store first, so that every node can get all of it
                ui.step(jobs[0].host, "checkpoint", f"{newer.name} (step {newer.step}) is newer than the store's "
                        "and spread over the nodes; copying it into the store first")
                with store.lock(ui):
                    evacuate_jobs(jobs, remotes, store, executor_for(jobs[0], remotes[jobs[0].host], store, ui,
                                                                     remotes), ui, rounds=1, require_newest=False)
                continue
            if _not_held(jobs[0], store, damaged, wanted, ui):
                continue
            plan, jobs = plan_group_up(jobs, store, known, frozenset(damaged), wanted)
            if dry_run:
                if newer is not None and wanted is None:
                    plan.actions.insert(0, Action("checkpoint", "the group's newest checkpoint", say=(
                        f"first: {newer.name} (step {newer.step}) is newer than the store's and spread over the "
                        "nodes: `up` copies it into the store (as `evacuate` does), then plans again from there")))
                return [UpResult(plan.host, "planned", jobs[0].checkpoint, jobs[0].step, plan)]
            if all(job.facts.host.session_alive for job in jobs):
                ui.ok(f"training is already running on every node (tmux session {recipe.run.session}); nothing to do")
                remember_host(recipe, *zip((job.target for job in jobs), specs, strict=True))
                return [UpResult(job.host, "already running") for job in jobs]
            executor = executor_for(jobs[0], remotes[jobs[0].host], store, ui, remotes)
            try:
                results = executor.run(plan.actions)
                break
            except HashMismatch as exc:
                name = jobs[0].checkpoint.rsplit("/", 1)[-1]
                for job in jobs:
                    executor.run_one(Action("checkpoint", f"remove the copy of {name} that did not verify",
                                            command=f"rm -rf -- {shlex.quote(job.paths.incoming)}", host=job.host))
                if wanted is not None:
                    raise
                damaged.add(name)
                ui.warn(f"{exc.message}; {name} is not used (kept in the store as it is); falling back")
        statuses = [_launched(job, results.get(f"launch@{job.host}") or {}, ui) for job in jobs]
        remember_host(recipe, *zip((job.target for job in jobs), specs, strict=True))
        return [UpResult(job.host, status, job.checkpoint, job.step) for job, status in zip(jobs, statuses,
                                                                                              strict=True)]


def group_known_hosts(nodes: list[Node]) -> str:
    """relaunch's recorded host keys of the group's nodes, as a known_hosts file for the nodes."""
    from .host.known_hosts import KnownHosts
    from .paths import known_hosts_file

    known = KnownHosts(known_hosts_file())
    return "".join(f"{node.target.known_hosts_name} {key.get_name()} {key.get_base64()}\n"
                   for node in nodes for key in known.recorded(node.target.known_hosts_name))


def unsaved_group_checkpoint(job: Job) -> Checkpoint | None:
    """The group's newest complete checkpoint when it is newer than the store's and not on every node."""
    found = [cp for cp in instance_checkpoints(job) if cp.name not in job.facts.damaged]
    if not found or job.facts.holders is None:
        return None
    newest = found[-1]
    stored = job.facts.store.manifest.newest() if job.facts.store and job.facts.store.manifest else None
    if (stored is not None and stored.step >= newest.step) or on_every_node(job, newest):
        return None
    return newest


# -- evacuate ----------------------------------------------------------------------------------
def evacuate(recipe: Recipe, specs: HostSpec | list[HostSpec], ui: UI, stop: bool = False,
             allow_empty: bool = False, newest_only: bool = False, reverify: bool = True) -> Report:
    """Any failure becomes exit 6: the instance (or any node of the group) must not be destroyed;
    Ctrl-C stays an interruption (exit 130), which says the same. `newest_only`: after a reclaim
    notice, only the newest checkpoint is copied (the others are either in the store already or
    older than what the instance has left to give in its window)."""
    specs = specs if isinstance(specs, list) else [specs]
    try:
        store = open_store(recipe)
        pairs = open_group(recipe, specs, ui)
        with connected(pairs) as remotes:
            jobs = gather_group(pairs, recipe)
            executor = executor_for(jobs[0], remotes[jobs[0].host], store, ui, remotes)
            if stop:
                _stop(jobs, executor, ui)
                relist(jobs, remotes)            # the save the stop asked for
            with store.lock(ui):
                return evacuate_jobs(jobs, remotes, store, executor, ui, allow_empty=allow_empty,
                                     newest_only=newest_only, reverify=reverify)
    except (UsageError, Interrupted):
        raise
    except RelaunchError as exc:
        what = "the instance" if len(specs) == 1 else "any node of the group"
        refusal = EvacuationError(f"{exc.message}\nevacuation NOT verified: DO NOT destroy {what}", exc.hint,
                                  exc.refused)
        refusal.result = exc.result
        raise refusal from exc


def _on_every_node(recipe: Recipe, specs: list[HostSpec], ui: UI, command: Any, what: str) -> None:
    """command(job) on every node at the same time (a fresh connection each)."""
    from .host.facts import HostFacts
    from .job import Facts

    pairs = open_group(recipe, specs, ui)
    with connected(pairs), ThreadPoolExecutor(max_workers=len(pairs)) as pool:
        def one(pair: tuple[Node, Remote]) -> None:
            node, remote = pair
            job = Job(recipe, node, Facts(host=HostFacts(home=remote.home)))
            result = remote.exec(command(job), deadline=30)
            if not result.ok:
                raise EvacuationError(f"{node.label}: could not {what}: {shorten(result.output, 200)}")
        for future in [pool.submit(one, pair) for pair in pairs]:
            future.result()


def stop_training(recipe: Recipe, specs: list[HostSpec], ui: UI) -> None:
    """End the training (and its guard) on these nodes at once, without a save: nodes whose group
    lost a node are stuck in a collective that never completes; a replaced instance that answers
    again holds nothing the store lacks."""
    _on_every_node(recipe, specs, ui, end_command, "end the training")


def ask_to_stop(recipe: Recipe, specs: list[HostSpec], ui: UI) -> None:
    """run.stop.signal to the training on every node at once, without waiting: a node group saves
    together (every rank of every node stops at the same step), as after a notice on one node."""
    _on_every_node(recipe, specs, ui, lambda job: f"{signal_command(job)} 2>/dev/null; true", "signal the training")


def _stop(jobs: list[Job], executor: Executor, ui: UI) -> None:
    group = len(jobs) > 1
    actions = [a for job in jobs for a in (tag(plan_stop(job), job, lane=f"stop@{job.host}") if group
                                           else plan_stop(job))]
    results = executor.run([dataclasses.replace(a, produces=f"stop@{a.host}" if group and a.produces else a.produces)
                            for a in actions])
    for job in jobs:
        outcome = str(results.get(f"stop@{job.host}" if group else "stop") or "").strip()
        if outcome.startswith(STILL_RUNNING):
            ui.warn(f"{job.host}: training still running after {job.recipe.run.stop.timeout:g}s (run.stop.timeout); "
                    "evacuating what is there")
        elif outcome:
            status = outcome.removeprefix("stopped").strip()
            # no exit status: relaunch did not start that run (`relaunch adopt`), it only saw it end
            ui.step(job.host, "stop", f"training stopped (exit {status})" if status else "training stopped")


def evacuate_jobs(jobs: list[Job], remotes: dict[str, Remote], store: Store, executor: Executor, ui: UI,
                  rounds: int = 3, reverify: bool = True, require_newest: bool = True,
                  allow_empty: bool = False, newest_only: bool = False) -> Report:
    """Copy the newest `keep` complete checkpoints (newest first) until the newest is verified;
    in a node group, each file from the node that holds it. Then the verdict, from what the store
    holds at that moment (verdicts.py): `report.safe`.

    Call with the store lock held. `evacuate` re-hashes on the instance what the store already
    records and insists that the newest checkpoint on the instance ends up verified; a `sync` round
    (reverify=False, require_newest=False) only moves what is new and reports the lag instead.
    """
    started = time.monotonic()
    job = jobs[0]
    keep = job.recipe.checkpoint.keep
    state = store.read(writing=True)
    for each in jobs:
        each.facts.store = state
    report = Report(store=store.label, verified_by=store.hash_name)
    listing = instance_checkpoints(job)
    at_start = listing[-1] if listing else None     # what a sync round must have verified when it ends
    copied_any = False          # a copy ran (and pinned first)
    try:
        for _ in range(rounds):
            for cp in reversed(listing[-(1 if newest_only else keep):]):
                if cp.name not in report.copied + report.already + report.skipped + _names(report.damaged):
                    # the newest is checked in the store once, for the verdict, after everything else
                    copied_any = _evacuate_one(jobs, store, executor, cp, report, reverify,
                                               check_store=cp is not listing[-1]) or copied_any
            relist(jobs, remotes)
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
        if not copied_any:
            # no copy ran, so none removed what a killed relaunch may have left pinned: a pin
            # holds the disk space the trainer's rotation meant to free
            executor.run(plan_unpin(jobs))
        executor.run(plan_meta(job))
        if report.copied and store.manifest is not None:
            protect = frozenset(report.copied + report.already)
            report.pruned = store.prune(store.manifest, keep, protect)
            for name in report.pruned:
                ui.step(job.host, "evacuate", f"pruned {name} from the store (keep={keep})")
        newest = listing[-1] if listing else None
        # the verdict's checkpoint: evacuate's is the newest now; a sync round's the newest when it
        # began, unless the instance holds nothing that new any more (its trainer deleted it): then
        # the newest it holds now
        target = newest if require_newest else at_start
        if not require_newest and at_start is not None and (newest is None or newest.step < at_start.step):
            target = newest
        if target is not None and target.name in report.copied + report.already:
            _check_in_store(jobs, store, executor, target, report, reverify)
        empty = None
        if newest is None and require_newest:
            held = _newest_held(store, executor)
            empty = verdicts.nothing_to_copy(_progress(job, executor), held.step if held else None, allow_empty)
        verdict = (verdicts.evacuation(report.newest, report.verified_now, empty) if require_newest else
                   verdicts.sync_round(target.name if target else None, report.verified_now, report.newest,
                                       began=at_start.name if at_start else None))
        report.safe, report.why = verdict.ok, verdict.why
        if require_newest and not report.safe:
            refusal = EvacuationError(f"{job.host}: {verdict.why}")
            refusal.result = report.as_dict()
            raise refusal
    except OSError as exc:
        # a full or read-only disk on this machine: nothing is deleted to make room, and what
        # was being written stays in the store's staging folder, which is never trusted
        raise EvacuationError(f"writing the store {store.label} failed: {exc.strerror or exc}",
                              "free space on this machine (nothing was deleted to make room), then rerun",
                              refused=True) from exc
    stored = store.manifest.newest() if store.manifest else None
    if stored is not None:
        report.stored, report.stored_step, report.stored_written_at = stored.name, stored.step, stored.written_at
    report.seconds = time.monotonic() - started
    return report


def _lost(name: str, store: Store, problems: list[str]) -> str:
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return f"{name} is in the store's manifest, but the store {store.label} does not hold it: {problems[0]}{more}"


def _check_in_store(jobs: list[Job], store: Store, executor: Executor, cp: Checkpoint, report: Report,
                    reverify: bool) -> None:
    """The verdict's evidence: the store holds cp now, byte for byte as the instance's record says.
    A file missing or different is copied again (once), never taken on the manifest's word."""
    for attempt in range(2):
        record = store.manifest.checkpoints.get(cp.name) if store.manifest else None
        problems = (["not in the store's manifest"] if record is None else
                    verdicts.store_holds(record, executor.run_one(_observe_action(store, record))))
        if not problems:
            report.verified_now.append(cp.name)
            return
        said = (_lost(cp.name, store, problems) if record else
                f"{cp.name} is not in the store {store.label}'s manifest after its copy")
        executor.ui.warn(f"{jobs[0].host}: {said}" + ("; copying it again" if attempt == 0 else ""))
        if attempt:
            break
        for name in (report.copied, report.already, report.unchanged, report.pinned):
            if cp.name in name:
                name.remove(cp.name)
        _evacuate_one(jobs, store, executor, cp, report, reverify, again=True)
        if cp.name not in report.copied:
            break


def _observe_action(store: Store, record: CheckpointRecord, size_only: bool = False) -> Action:
    total = sum(f.size for f in record.files.values())
    return Action("evacuate", f"what the store {store.label} holds of {record.name} now", where=LOCAL,
                  call="store.observe", args={"record": record, "size_only": size_only},
                  deadline=store_deadline(0 if size_only else total), fails_as="evacuate")


def _newest_held(store: Store, executor: Executor) -> CheckpointRecord | None:
    """The newest checkpoint the store holds now, byte for byte as recorded: what the verdict on an
    instance with nothing to copy compares with (a record whose files are gone holds no step)."""
    records = store.manifest.ordered() if store.manifest else []
    for record in reversed(records):
        if not verdicts.store_holds(record, executor.run_one(_observe_action(store, record))):
            return record
    return None


def _progress(job: Job, executor: Executor) -> verdicts.Progress:
    """What training did on an instance with nothing to copy: checkpoint.dir there or not, the
    step its log shows, how long its session has been alive."""
    q = shlex.quote
    read = Action("evacuate", "what training has done (checkpoint.dir, the clock, the log's tail)",
                  command=f"if [ -d {q(job.paths.ckpt_dir)} ]; then echo dir=1; else echo dir=0; fi; "
                          f"echo now=$(date +%s); {tail_command(job.paths.log, LOG_TAIL_LINES)} || true",
                  produces="progress", parse="text", fails_as="evacuate")
    text = str(executor.run([read]).get("progress") or "")
    head, lines = text.splitlines()[:2], text.splitlines()[2:]
    # this run's lines: an earlier run's higher steps above its start line are not this one's progress
    starts = [n for n, line in enumerate(lines) if line.startswith(START_MARK)]
    lines = lines[starts[-1] + 1:] if starts else lines
    words = dict(line.partition("=")[::2] for line in head)
    host = job.facts.host
    since, now = host.session_since, words.get("now", "")
    age = float(now) - float(since) if since.isdigit() and now.isdigit() else None
    return verdicts.Progress(ckpt_dir=str(job.recipe.checkpoint.dir), dir_exists=words.get("dir") == "1",
                             log_step=newest_logged_step(lines, job.recipe.run.metrics.step),
                             session_alive=host.session_alive, session_age=age, grace=job.recipe.run.grace)


def relist(jobs: list[Job], remotes: dict[str, Remote]) -> None:
    """Read checkpoint.dir again on every node (training may have saved meanwhile)."""
    if len(jobs) == 1:
        jobs[0].facts.listing = read_listing(remotes[jobs[0].host], jobs[0].paths.ckpt_dir, EvacuationError)
        return
    share_listings(jobs, remotes, {job.host: read_listing(remotes[job.host], job.paths.ckpt_dir, EvacuationError)
                                   for job in jobs})


def _names(damaged: list[str]) -> list[str]:
    return [d.split(":", 1)[0] for d in damaged]


def parts_of(jobs: list[Job], cp: Checkpoint) -> list[tuple[Job, Checkpoint]]:
    """Which node sends which files of cp (the first node that holds each)."""
    if len(jobs) == 1:
        return [(jobs[0], cp)]
    holders = jobs[0].facts.holders or {}
    by_host = {job.host: job for job in jobs}
    parts: dict[str, list[Entry]] = {}
    for entry in cp.files:
        parts.setdefault(holders[entry.path][0], []).append(entry)
    return [(by_host[host], dataclasses.replace(cp, files=tuple(files))) for host, files in parts.items()]


def _evacuate_one(jobs: list[Job], store: Store, executor: Executor, cp: Checkpoint, report: Report,
                  reverify: bool, again: bool = False, check_store: bool = True) -> bool:
    """Copy cp into the store, verified, unless the store holds it already: the manifest's record
    of it matched by the instance's bytes (re-hashed there) and (`check_store`) by what the store
    holds now. `again`: the store was found not to hold it; set aside what differs and copy it.
    Whether a copy ran (it pinned first, so it removed what a killed relaunch left pinned)."""
    job = jobs[0]
    known = store.manifest.checkpoints.get(cp.name) if store.manifest else None
    sizes = {e.path: e.size for e in cp.files}
    parts = parts_of(jobs, cp)
    if known is not None and not again:
        if not reverify and {p: f.size for p, f in known.files.items()} == sizes:
            # a sync round: same files, same sizes, verified before; and the store still holds them
            # as recorded, as far as a cheap look shows (sizes; a remote's listing gives its hashes too)
            seen = executor.run_one(_observe_action(store, known, size_only=True))
            cheap = verdicts.store_holds(known, seen, size_only=not any(s.hashes for s in seen.values()))
            if not cheap:
                report.already.append(cp.name)
                report.unchanged.append(cp.name)
                return False
            executor.ui.warn(f"{job.host}: {_lost(cp.name, store, cheap)}; copying it again")
            again = True
    if known is not None and not again:
        hashes: dict[str, Any] = {}
        for part_job, part in parts:
            found = executor.run_one(tag([hash_action(part_job, store, part)], part_job)[0]
                                     if len(jobs) > 1 else hash_action(part_job, store, part))
            hashes.update(found)
        if any(h.missing for h in hashes.values()):
            report.skipped.append(cp.name)
            return False
        if set(hashes) != set(known.files) or any(known.files[p].sha256 != h.hashes.get("sha256")
                                                  for p, h in hashes.items()):
            raise EvacuationError(
                f"{job.host}: {cp.name} on the instance differs from the verified copy in the store {store.label}",
                "the store never overwrites a checkpoint; move the store's copy aside if the instance's is right",
                refused=True)
        problems = verdicts.store_holds(known, executor.run_one(_observe_action(store, known))) if check_store else []
        if not problems:
            report.already.append(cp.name)
            return False
        executor.ui.warn(f"{job.host}: {_lost(cp.name, store, problems)}; copying it again")
        again = True
    if again and known is not None:
        seen = executor.run_one(_observe_action(store, known))
        moved = store.set_aside(known, verdicts.differing(known, seen))
        if moved:
            executor.ui.step(job.host, "evacuate", f"{cp.name}: what the store held differently was set aside: {moved}")
            report.set_aside.append(cp.name)
    about: dict[str, Any] = {"saved_with": job.facts.host.run or None}
    if len(jobs) > 1:
        about["held"] = {e.path: part_job.host for part_job, part in parts for e in part.files}
    try:
        results = _copy(jobs, store, executor, cp, parts, about, report)
    except Vanished:
        executor.ui.step(job.host, "evacuate", f"{cp.name} was rotated away by the trainer during the copy; skipped")
        report.skipped.append(cp.name)
        return True
    except Damaged as exc:
        executor.ui.warn(f"{job.host}: {cp.name} is damaged on the instance ({exc}); not copied")
        report.damaged.append(f"{cp.name}: {exc}")
        return True
    report.copied.append(cp.name)
    if cp.name not in _names(report.unpinned):
        report.pinned.append(cp.name)
    report.bytes_copied += sum(sizes.values())
    where = "" if len(parts) == 1 else f" from {len(parts)} nodes"
    executor.ui.step(job.host, "evacuate", f"{cp.name} verified: {len(sizes)} file(s){where}, "
                                           f"{results.get(f'verified:{cp.name}') or store.hash_name}")
    return True


def _copy(jobs: list[Job], store: Store, executor: Executor, cp: Checkpoint, parts: list[tuple[Job, Checkpoint]],
          about: dict[str, Any], report: Report) -> dict[str, Any]:
    """Run cp's copy plan: pinned, unless a node cannot pin (then planned again, unpinned there,
    said); after a mismatch once more, comparing every byte."""
    job = jobs[0]
    unpinned: frozenset[str] = frozenset()
    again = False
    while True:
        try:
            return executor.run(plan_copy(job, store, cp, again=again, parts=parts, about=about, unpinned=unpinned))
        except Unpinned as exc:
            for host, why in exc.why.items():
                executor.ui.warn(f"{host}: {cp.name} is copied unpinned: {why}; if the trainer's rotation deletes "
                                 "it during the copy, the copy is skipped")
            report.unpinned.append(f"{cp.name}: {exc}")
            unpinned |= frozenset(exc.why)
        except Mismatch as exc:
            if again:
                raise
            # a quick check (size + mtime) can trust a damaged partial file: compare every byte
            executor.ui.warn(f"{cp.name}: {exc.problems[0]}; copying again, comparing every byte")
            again = True
