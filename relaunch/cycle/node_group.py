"""`up` on a node group: one plan for every node (prepare together, the checkpoint to node 0 and
fanned out, then start together); a newer checkpoint spread over the nodes goes into the store first.
"""

from __future__ import annotations

import dataclasses
import shlex

from ..errors import EnvError
from ..executor import HashMismatch
from ..gather import gather_group
from ..host.spec import HostSpec
from ..job import Job
from ..layouts import Checkpoint
from ..plan import Action, Plan
from ..recipe import Recipe
from ..steps.checkpoint import choose, instance_checkpoints, on_every_node, plan_restore
from ..steps.env import plan_env
from ..steps.group import barrier, check_reshard, plan_fanout, shape, shaped, tag, what_changed
from ..steps.launch import plan_launch
from ..steps.lineage import plan_branch
from ..steps.preflight import plan_preflight
from ..transports import Store, open_store
from ..ui import UI
from .evacuation import evacuate_jobs
from .handlers import executor_for
from .hosts import connected, group_known_hosts, open_group, remember_host
from .starting import UpResult, not_held, say_facts, say_launched


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
    plan.extend(plan_branch(resumed, choice, exclude)[1])
    plan.extend([barrier("launch", f"starting training on {len(jobs)} nodes")])
    for again in resumed:
        launch = [dataclasses.replace(a, produces=f"{a.produces}@{again.host}" if a.produces else "")
                  for a in plan_launch(again)]
        plan.extend(tag(launch, again, lane=f"launch@{again.host}"))
    return plan, resumed


def up_group(recipe: Recipe, specs: list[HostSpec], ui: UI, dry_run: bool = False,
             accept_new_host_key: bool = False, wanted: str | None = None) -> list[UpResult]:
    """`up` on several nodes (node 0 first: torchrun's master): one plan, one executor."""
    pairs = open_group(recipe, specs, ui, accept_new_host_key, booting=not dry_run)
    with connected(pairs) as remotes:
        store = open_store(recipe)
        damaged: set[str] = set()
        tried: set[str] = set()             # group checkpoints already sent to the store once
        known = group_known_hosts([node for node, _ in pairs])
        while True:
            jobs = gather_group(pairs, recipe, store, notices=True)
            for job in jobs:
                say_facts(job, store, ui)
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
            if not_held(jobs[0], store, damaged, wanted, ui):
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
        statuses = [say_launched(job, results.get(f"launch@{job.host}") or {}, ui) for job in jobs]
        remember_host(recipe, *zip((job.target for job in jobs), specs, strict=True))
        return [UpResult(job.host, status, job.checkpoint, job.step) for job, status in zip(jobs, statuses,
                                                                                              strict=True)]


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
