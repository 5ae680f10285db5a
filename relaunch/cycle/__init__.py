"""The resume cycle: `up` (and `plan`, its dry run) and `evacuate`, on one or many hosts.

Each command runs the same way: connect, gather the facts once, plan (pure), then hand the plan
to the executor. `plan` stops before the executor and prints the plan it would have run.
The CLI calls these; they return results and raise relaunch errors, never print tracebacks.

    hosts        HOST resolved, the last `up`'s hosts remembered, connections to one node or a group
    handlers     the in-process calls a plan makes (`checks.x`, `fanout.x`) and the executor for a job
    starting     what `up` says and decides around its plan: facts, unusable checkpoints, the start
    one_host     `up` on one host; `prepare` (a replacement's env before it joins its group)
    node_group   `up` on a node group
    evacuation   `evacuate` and a `sync` round: copy, verify every byte, the verdict
    stopping     stopping the training: with a save, asked without waiting, or ended without one
"""

from __future__ import annotations

from ..host.spec import HostSpec
from ..recipe import Recipe, variables
from ..ui import UI
from .evacuation import evacuate, evacuate_jobs, parts_of, relist
from .handlers import GroupCopyKey, StepOutputs, executor_for
from .hosts import (
    connected,
    group_known_hosts,
    last_host,
    last_hosts,
    make_target,
    open_group,
    open_host,
    remember_host,
)
from .node_group import plan_group_up, unsaved_group_checkpoint, up_group
from .one_host import plan_up, prepare, up_one
from .starting import UpResult
from .stopping import ask_to_stop, stop_training

__all__ = [
    "GroupCopyKey", "StepOutputs", "UpResult", "ask_to_stop", "connected", "evacuate", "evacuate_jobs", "executor_for",
    "group_known_hosts", "last_host", "last_hosts", "make_target", "open_group", "open_host", "parts_of",
    "plan_group_up", "plan_up", "prepare", "relist", "remember_host", "stop_training", "unsaved_group_checkpoint",
    "up", "up_group", "up_one",
]


def up(recipe: Recipe, specs: list[HostSpec], ui: UI, dry_run: bool = False,
       accept_new_host_key: bool = False, checkpoint: str | None = None) -> list[UpResult]:
    """`up` on one host, or on a node group when there are several (node 0 first)."""
    variables.check(recipe)         # a ${NAME} the install needs and this machine lacks: before any host
    if len(specs) == 1:
        return [up_one(recipe, specs[0], ui, dry_run, accept_new_host_key, wanted=checkpoint)]
    return up_group(recipe, specs, ui, dry_run, accept_new_host_key, checkpoint)
