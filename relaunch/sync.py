"""`relaunch sync`: the copy-off loop that runs while training runs.

Each round is an evacuation that only moves what is new (pulled from this machine: no
credentials on the instance) and reports the lag. The loop outlives the instance going away
(it says so and retries with backoff); a full disk or a store conflict ends it with exit 6.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from .cycle import open_job
from .transports import open_store
from .errors import ConnectError, EvacuationError, RelaunchError, UsageError
from .host.spec import HostSpec
from .recipe import Recipe
from .steps.evacuate import Report, evacuate as evacuate_job
from .steps.preflight import human
from .ui import UI

RETRY_WAIT = 20          # seconds each reconnect may take inside a round
MAX_BACKOFF = 300


def round_line(report: Report) -> str:
    copied = ", ".join(report.copied) if report.copied else "nothing new"
    speed = f", {human(int(report.bytes_copied / report.seconds))}/s" if report.bytes_copied and report.seconds else ""
    lag = "no checkpoint on the instance yet"
    if report.lag_steps is not None:
        lag = f"lag {report.lag_steps} steps"
        if report.lag_seconds is not None:
            lag += f", {report.lag_seconds / 60:.1f} min"
    newest = f"newest verified: {report.stored} (step {report.stored_step})" if report.stored else "store empty"
    skipped = f"; skipped {', '.join(report.skipped)} (rotated away mid-copy)" if report.skipped else ""
    return (f"{time.strftime('%H:%M:%S')} copied {copied} ({human(report.bytes_copied)}{speed}){skipped}; "
            f"{newest}; {lag}")


def sync(recipe: Recipe, spec: HostSpec, ui: UI, every: float, once: bool,
         emit: Callable[[str], None] | None = None, sleep: Callable[[float], None] = time.sleep) -> None:
    store = open_store(recipe)
    backoff = 5.0
    first = True
    # one line per round: the steps' own messages only with -v (they are in the debug log anyway)
    inner = UI(verbose=ui.verbose, quiet=not ui.verbose)
    while True:
        try:
            job = open_job(recipe, spec, inner)
            with job.remote:
                report = evacuate_job(job, store, rounds=1, reverify=False, require_newest=False)
            backoff = 5.0
            ui.ok(round_line(report))
            if emit:
                emit(json.dumps(report.as_dict()))
            if once:
                return
            sleep(every)
        except (UsageError, EvacuationError):
            raise
        except RelaunchError as exc:
            if once:
                raise EvacuationError(f"{exc.message}\nsync round NOT verified", exc.hint) from exc
            what = "unreachable" if isinstance(exc, ConnectError) else "round failed"
            ui.warn(f"{spec}: {what}: {exc.message.splitlines()[0]}; retrying in {backoff:.0f}s "
                    "(Ctrl-C to stop; nothing partial is trusted)")
            sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF)
        if first:
            # after the first round, do not sit through all of ssh.wait on every outage
            ssh = recipe.ssh.model_copy(update={"wait": min(recipe.ssh.wait, RETRY_WAIT)})
            recipe = recipe.model_copy(update={"ssh": ssh})
            first = False
