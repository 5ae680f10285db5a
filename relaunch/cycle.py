"""The resume cycle: `up` (and `plan`, its dry run) and `evacuate`, on one or many hosts.

The CLI calls these; they return results and raise relaunch errors, never print tracebacks.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import EvacuationError, RelaunchError, UsageError
from .host.connection import connect, environ_secrets
from .host.facts import HostFacts
from .host.spec import HostSpec, Target
from .paths import state_dir
from .plan import Action, run_actions
from .recipe import Recipe
from .steps.checkpoint import choose, plan_restore
from .steps.common import Job
from .steps.env import plan_env
from .steps.evacuate import Report, evacuate as evacuate_job
from .steps.launch import plan_launch
from .steps.stop import stop_training
from .steps.preflight import gather_facts, plan_preflight
from .transports import open_store
from .ui import UI, redact

log = logging.getLogger("relaunch")


def make_target(recipe: Recipe, spec: HostSpec) -> Target:
    """HOST wins over the recipe's ssh section, which wins over the provider preset."""
    ssh = recipe.ssh
    return Target(address=spec.address, user=spec.user or ssh.user, port=spec.port or ssh.port,
                  key=str(ssh.key) if ssh.key else None, host_key=ssh.host_key, wait=ssh.wait)


# -- remembered hosts --------------------------------------------------------------------------
def _hosts_file(recipe: Recipe) -> Path:
    folder = state_dir() / "hosts"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    return folder / f"{recipe.name}.json"


def remember_host(recipe: Recipe, target: Target) -> None:
    _hosts_file(recipe).write_text(json.dumps({"host": target.label, "port": target.port}) + "\n")


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
def open_job(recipe: Recipe, spec: HostSpec, ui: UI, accept_new_host_key: bool = False,
             node_rank: int = 0, nnodes: int = 1, master_addr: str = "") -> Job:
    target = make_target(recipe, spec)
    ui.say(f"connecting to {target.label} (waiting up to {target.wait:g}s while it boots)")
    remote = connect(target, accept_new_host_key=accept_new_host_key, say=ui.say)
    job = Job(recipe=recipe, target=target, remote=remote, facts=HostFacts(home=remote.home), ui=ui,
              secrets=environ_secrets(list(recipe.env.secrets)), node_rank=node_rank, nnodes=nnodes,
              master_addr=master_addr or target.address)
    missing = [name for name in recipe.env.secrets if name not in job.secrets]
    if missing:
        ui.warn(f"env.secrets {', '.join(missing)} not set on this machine; not handed to the instance")
    job.facts = gather_facts(remote, recipe, job.paths)
    return job


@dataclass
class UpResult:
    host: str
    status: str                       # "started" | "already running" | "finished" | "planned"
    checkpoint: str = ""
    step: int = 0
    actions: list[Action] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"host": self.host, "status": self.status, "checkpoint": self.checkpoint, "step": self.step}


def up_one(recipe: Recipe, spec: HostSpec, ui: UI, dry_run: bool = False, accept_new_host_key: bool = False,
           node_rank: int = 0, nnodes: int = 1, master_addr: str = "") -> UpResult:
    job = open_job(recipe, spec, ui, accept_new_host_key, node_rank, nnodes, master_addr)
    with job.remote:
        if job.facts.session_alive:
            ui.ok(f"[{job.host}] training is already running in tmux session {recipe.run.session}; "
                  "nothing to do")
            if not dry_run:
                remember_host(recipe, job.target)
            return UpResult(job.host, "already running")
        store = open_store(recipe)
        choice = choose(job, store)
        need = sum(f.size for f in choice.record.files.values()) if choice.record and not choice.on_instance else 0
        preflight = plan_preflight(job, need)
        env = plan_env(job)
        restore = plan_restore(job, store, choice)
        launch = plan_launch(job)
        actions = preflight + env + restore + launch
        if dry_run:
            return UpResult(job.host, "planned", job.checkpoint, job.step, actions)
        run_actions(preflight, job.say)
        # env and checkpoint do not depend on each other: up takes as long as the slower one
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="step") as pool:
            futures = [pool.submit(run_actions, env, job.say), pool.submit(run_actions, restore, job.say)]
            errors = [f.exception() for f in futures]
        failed = [e for e in errors if e is not None]
        if failed:
            for extra in failed[1:]:
                ui.warn(str(extra))
            raise failed[0]
        run_actions(launch, job.say)
        remember_host(recipe, job.target)
        return UpResult(job.host, "started", job.checkpoint, job.step)


def up(recipe: Recipe, specs: list[HostSpec], ui: UI, dry_run: bool = False,
       accept_new_host_key: bool = False) -> list[UpResult]:
    if len(specs) == 1:
        return [up_one(recipe, specs[0], ui, dry_run, accept_new_host_key)]
    master = specs[0].address
    with ThreadPoolExecutor(max_workers=len(specs), thread_name_prefix="host") as pool:
        futures = [pool.submit(up_one, recipe, spec, ui, dry_run, accept_new_host_key, rank, len(specs), master)
                   for rank, spec in enumerate(specs)]
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


def evacuate(recipe: Recipe, spec: HostSpec, ui: UI, stop: bool = False) -> Report:
    """Any failure becomes exit 6: the instance must not be destroyed."""
    try:
        store = open_store(recipe)
        job = open_job(recipe, spec, ui)
        with job.remote:
            if stop:
                stop_training(job)
            return evacuate_job(job, store)
    except UsageError:
        raise
    except RelaunchError as exc:
        raise EvacuationError(f"{exc.message}\nevacuation NOT verified: DO NOT destroy the instance",
                              exc.hint) from exc

