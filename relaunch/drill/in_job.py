"""`relaunch drill RECIPE --job`: the goodput of a job under a scheduler, with the same metrics as
`drill --watch` (timeline.py). The interruptions are the engine's (a requeue, a preemption, a time
limit, a node lost) and `relaunch run` recorded each in the store's history; the steps come from
the timeline node 0's relaunch run writes beside run.log (each step line with the time it was
printed, and each start). Nothing is run or interrupted here: it reads and measures.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import UsageError
from ..history import read_history
from ..manifest import utc_now
from ..recipe import Recipe, render_at, render_context
from ..transports import open_store
from .follow import Line
from .timeline import Measured, measure


def default_timeline(recipe: Recipe) -> Path:
    """run.log's timeline as node 0 writes it, the log's path rendered on this machine."""
    home = str(Path.home())
    log = render_at(recipe, "run.log", render_context(recipe, home=home))
    if log == "~" or log.startswith("~/"):
        log = home + log[1:]
    return Path(f"{log}.timeline")


def read_timeline(path: Path) -> list[Line]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise UsageError(f"{path}: cannot read the job's timeline: {exc.strerror or exc}",
                         "give the timeline node 0's `relaunch run` wrote beside run.log (--timeline PATH)") from None
    lines = []
    for raw in text.splitlines():
        try:
            doc = json.loads(raw)
            lines.append(Line(float(doc["at"]), str(doc["host"]), str(doc["text"])))
        except (ValueError, KeyError, TypeError):
            continue
    return lines


def measure_job(recipe: Recipe, timelines: list[Path], tolerance: float) -> Measured:
    lines = [line for path in timelines for line in read_timeline(path)]
    if not lines:
        raise UsageError(f"{', '.join(map(str, timelines))}: no step in the job's timeline yet",
                         "run the job with `relaunch run` first; its node 0 writes the timeline")
    since = min(line.at for line in lines)
    records = [r for r in read_history(open_store(recipe)) if r.at_epoch >= since]
    hosts = list(dict.fromkeys(line.host for line in lines))
    report = Measured(recipe.name, hosts, [r.cause for r in records if r.cause != "rebalance"], tolerance,
                      at=utc_now(), mode="--job")
    return measure(report, lines, recipe.run.metrics, records)
