"""Stopping the training: asked to save and stop (`evacuate --stop`), asked to save without
waiting (a node group saves together), or ended without a save (a group that lost a node).
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import EvacuationError, shorten
from ..executor import Executor
from ..host.remote import Remote
from ..host.spec import HostSpec
from ..job import Job, Node
from ..recipe import Recipe
from ..steps.group import tag
from ..steps.stop import STILL_RUNNING, end_command, plan_stop, signal_command
from ..ui import UI
from .hosts import connected, open_group


def _on_every_node(recipe: Recipe, specs: list[HostSpec], ui: UI, command: Any, what: str) -> None:
    """command(job) on every node at the same time (a fresh connection each)."""
    from ..host.facts import HostFacts
    from ..job import Facts

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


def stop_jobs(jobs: list[Job], executor: Executor, ui: UI) -> None:
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
