"""`up` (and `plan`, its dry run) on one host: gather, plan, execute; a checkpoint that does not
verify is copied again, then set aside as damaged. `up` on several HOSTs goes to node_group.
"""

from __future__ import annotations

import shlex

from ..executor import HashMismatch
from ..gather import gather
from ..host.spec import HostSpec
from ..job import Job
from ..plan import Action, Plan
from ..recipe import Recipe, variables
from ..steps.checkpoint import choose, plan_restore
from ..steps.env import plan_env
from ..steps.group import check_reshard, shape, shaped, what_changed
from ..steps.launch import plan_launch
from ..steps.lineage import plan_branch
from ..steps.preflight import plan_preflight
from ..transports import Store, open_store
from ..ui import UI
from .handlers import executor_for
from .hosts import make_target, open_host, remember_host
from .starting import UpResult, not_held, say_facts, say_launched


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
    _, aside = plan_branch([job], choice, exclude)
    plan = Plan(job.host, reads=list(job.facts.reads))
    if changed:
        plan.extend([Action("launch", "the group's shape", say=changed)])
    plan.extend([*preflight, *plan_env(job), *restore, *aside, *plan_launch(job)])
    return plan, job


def up_one(recipe: Recipe, spec: HostSpec, ui: UI, dry_run: bool = False, accept_new_host_key: bool = False,
           rank: int = 0, nnodes: int = 1, master_addr: str = "", wanted: str | None = None) -> UpResult:
    node, remote = open_host(recipe, spec, ui, accept_new_host_key, rank, nnodes, master_addr,
                             booting=not dry_run)         # `plan` looks at an instance that runs
    with remote:
        store = open_store(recipe)
        damaged: set[str] = set()           # store records whose bytes failed their check twice
        suspect: set[str] = set()           # ... once: copied again before they count as damaged
        while True:
            job = gather(remote, recipe, node, store, notices=True)
            say_facts(job, store, ui)
            if not_held(job, store, damaged, wanted, ui):
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
        status = say_launched(job, results.get("launch") or {}, ui)
        remember_host(recipe, (node.target, spec))
        return UpResult(job.host, status, job.checkpoint, job.step)


def prepare(recipe: Recipe, group: list[HostSpec], rank: int, ui: UI) -> None:
    """Preflight and the env (venv, lock, env.files, env.setup) on node `rank` of the group it is
    to join later (a replacement rented while the shrunk group trains), rendered as that node
    (`{{ node_rank }}`, `{{ nnodes }}`, `{{ master_addr }}`). The `up` on the whole group then
    finds them made, and the others stop only for the save, its copy and the start."""
    variables.check(recipe)
    master = make_target(recipe, group[0]).address
    node, remote = open_host(recipe, group[rank], ui, rank=rank, nnodes=len(group), master_addr=master,
                             booting=True)
    with remote:
        job = gather(remote, recipe, node, listing=False)
        executor_for(job, remote, None, ui).run([*plan_preflight(job, 0), *plan_env(job)])
