"""What `relaunch run` leaves in the store beside the checkpoints (node 0 only): the history of
interruptions (history.py, as `watch` writes it) and `.relaunch/job.json`, the run in progress.

job.json says which run is training now and what it last saw (the newest step, when). A run that
finds it still saying "running" for another run knows that one ended without a word (SIGKILL, an
OOM, a node that vanished): it records that as a `lost` interruption. Every interruption is
completed by the run after it once its training prints a step (`resumed`, time until training ran
again), as `watch` does.
"""

from __future__ import annotations

import json
import time
from typing import Any

from .. import history
from ..errors import RelaunchError
from ..transports import Store
from ..ui import UI
from .engine import Placement

JOB = "job.json"
OPEN_CAUSES = ("signal", "notice", "lost", "restarted")


def read_job(store: Store) -> dict[str, Any] | None:
    try:
        data = json.loads(store.read_meta(JOB) or "null")
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def write_job(store: Store, place: Placement, state: str, step: int | None, ui: UI) -> None:
    """job.json as this run sees it now (under the store lock; flushed where metadata waits for it)."""
    doc = {"run": place.run_key or place.job or place.node, "node": place.label, "job": place.job,
           "state": state, "step": step, "at": round(time.time(), 3),
           "at_iso": history.iso(time.time())}
    with store.lock(ui):
        store.read(writing=True)
        store.write_meta(JOB, json.dumps(doc, sort_keys=True) + "\n")
        store.flush()


def newest_verified_step(store: Store) -> int | None:
    newest = store.manifest.newest() if store.manifest else None
    return newest.step if newest else None


def lost_before(store: Store, place: Placement, ui: UI) -> None:
    """The run before this one ended without a stop (job.json still says running): record it."""
    found = read_job(store)
    if not found or found.get("state") != "running":
        return
    at = float(found.get("at") or time.time())
    step = found.get("step") if isinstance(found.get("step"), int) else None
    entry = history.Interruption.start(str(found.get("node") or "?"), "lost",
                                       f"{found.get('job') or 'the run before'} ended without a stop "
                                       "(SIGKILL, out of memory, a node that went away)", at, step,
                                       newest_verified_step(store))
    history.record(store, entry, ui)
    ui.warn(f"the run before ({found.get('node')}, {found.get('job') or '?'}) ended without a stop after its last "
            f"look at {found.get('at_iso')}: recorded as lost; {entry.line()}")


def open_entries(store: Store) -> list[history.Interruption]:
    """Interruptions no run has come back from yet."""
    return [e for e in history.read_history(store) if e.cause in OPEN_CAUSES and e.resumed_epoch is None]


def resumed(store: Store, place: Placement, at: float, ui: UI) -> None:
    """Training runs again (its first step line): every open interruption is completed."""
    try:
        for entry in open_entries(store):
            entry.resumed(place.label, at)
            entry.nodes_after = place.nnodes
            history.record(store, entry, ui)
            ui.say(f"history: {entry.line()}")
    except RelaunchError as exc:      # the history is a record, never a reason to stop training
        ui.warn(f"could not complete the history in {store.label}: {exc.message}")
