"""`relaunch sync`: the copy-off loop that runs while training runs.

Each round is an evacuation that only moves what is new (pulled from this machine: no
credentials on the instance) and reports the lag. The loop outlives the instance going away
(it says so and retries with backoff); a full disk or a store conflict ends it with exit 6.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from . import processes
from .cycle import connected, evacuate_jobs, executor_for, open_group
from .errors import ConnectError, EvacuationError, Interrupted, RelaunchError, UsageError
from .gather import gather_group
from .host.spec import HostSpec
from .recipe import Recipe
from .retry import RECONNECT_WAIT, retrying
from .steps.evacuate import Report, round_line
from .transports import open_store
from .ui import UI

MAX_BACKOFF = 300


def sync_round(recipe: Recipe, specs: HostSpec | list[HostSpec], ui: UI) -> Report:
    """One round: connect (to every node of a group), gather, copy what is new (verified), report the lag."""
    store = open_store(recipe)
    pairs = open_group(recipe, specs if isinstance(specs, list) else [specs], ui)
    with connected(pairs) as remotes:
        jobs = gather_group(pairs, recipe)
        executor = executor_for(jobs[0], remotes[jobs[0].host], store, ui, remotes)
        with store.lock(ui):
            return evacuate_jobs(jobs, remotes, store, executor, ui, rounds=1, reverify=False,
                                 require_newest=False)


def _worth_retrying(exc: BaseException) -> bool:
    """The instance away or a round failing on the way; not a bad recipe, a store problem or Ctrl-C."""
    return isinstance(exc, RelaunchError) and not isinstance(exc, (UsageError, EvacuationError, Interrupted))


def sync(recipe: Recipe, spec: HostSpec | list[HostSpec], ui: UI, every: float, once: bool,
         emit: Callable[[str], None] | None = None) -> None:
    # one line per round: the steps' own messages only with -v (they are in the debug log anyway)
    inner = UI(verbose=ui.verbose, quiet=not ui.verbose)
    if once:
        try:
            report = sync_round(recipe, spec, inner)
        except RelaunchError as exc:
            if not _worth_retrying(exc):
                raise
            raise EvacuationError(f"{exc.message}\nsync round NOT verified", exc.hint, exc.refused) from exc
        _show(ui, report, emit)
        if not report.safe:
            raise EvacuationError(f"{report.why}\nsync round NOT verified",
                                  "rerun, or `relaunch evacuate` (it insists on the newest checkpoint)")
        return
    # after the first attempt, do not sit through all of ssh.wait on every outage
    reconnecting = recipe.ssh_wait_at_most(RECONNECT_WAIT)
    current = [recipe]

    def one_round() -> Report:
        this = current[-1]
        current[:] = [reconnecting]
        return sync_round(this, spec, inner)

    def on_retry(exc: BaseException, seconds: float) -> None:
        what = "unreachable" if isinstance(exc, ConnectError) else "round failed"
        message = exc.message if isinstance(exc, RelaunchError) else str(exc)
        ui.warn(f"{spec}: {what}: {message.splitlines()[0]}; retrying in {seconds:.0f}s "
                "(Ctrl-C to stop; nothing partial is trusted)")

    while True:
        report = retrying(one_round, transient=_worth_retrying, first=5.0, most=MAX_BACKOFF, on_retry=on_retry)
        _show(ui, report, emit)
        processes.sleep(every)


def _show(ui: UI, report: Report, emit: Callable[[str], None] | None) -> None:
    ui.ok(round_line(report))
    if emit:
        emit(json.dumps(report.as_dict()))
