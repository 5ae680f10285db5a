r"""The history of interruptions, kept in the store beside its manifest: `.relaunch/history.jsonl`.

One JSON object per line, one line per interruption: when, which host, the cause (a reclaim
notice or a lost instance), the newest checkpoint step seen on the instance and the newest
verified in the store (their difference is the steps lost), whether a notice's save and copy
made its deadline, and when and where training ran again. `relaunch watch` writes it (a line
is written when the interruption is declared and completed once training runs again), and so
does `relaunch run` inside a scheduler's job (an engine's stop signal, a notice, a run that
ended without a word; completed by the next run once it trains),
`relaunch status` shows the last ones, `relaunch interval` measures the mean time between
interruptions from it. It goes through the store's own metadata calls, so it lives wherever
the checkpoints do (a local folder, an rclone remote, a Hugging Face repo), under the store lock.

The newest step seen on the instance is the newest of the steps its log showed (read with
`run.metrics.step`, default `step (\d+)`) and of its complete checkpoints, as `watch` last saw
them (a look every `guard.every` seconds); steps lost are that minus the newest verified step.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, fields
from typing import Any

from .transports import Store
from .ui import UI

HISTORY = "history.jsonl"


def iso(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


def seconds_text(seconds: float) -> str:
    return f"{seconds:.0f}s" if seconds < 120 else f"{seconds / 60:.1f} min" if seconds < 7200 else \
        f"{seconds / 3600:.1f}h"


@dataclass
class Interruption:
    id: str                                   # host and time: a record is completed, never repeated
    at: str                                   # when training stopped (notice seen, or the last answer), UTC
    at_epoch: float
    host: str
    cause: str                                # "notice" | "lost" | "restarted" | "signal" (an engine's stop)
    detail: str                               # "aws: spot terminate at ...", "no answer for 130s"
    newest_seen_step: int | None = None       # newest step seen on the instance (its log, its checkpoints)
    newest_verified_step: int | None = None   # newest verified in the store when it was declared
    steps_lost: int | None = None
    deadline: str | None = None               # of a notice, UTC
    made_deadline: bool | None = None         # the save after the notice was verified in the store before it
    copy_seconds: float | None = None         # how long that copy and its verification took
    resumed_host: str | None = None
    resumed_at: str | None = None
    resumed_epoch: float | None = None
    time_to_resume: float | None = None       # seconds from `at` until training ran again
    nodes_before: int | None = None           # a node group's size before and after (a shrink, a grow back)
    nodes_after: int | None = None

    @classmethod
    def start(cls, host: str, cause: str, detail: str, at_epoch: float, seen: int | None,
              verified: int | None) -> Interruption:
        if verified is not None and (seen is None or seen < verified):
            seen = verified                 # a copy verified after the last look saw it there
        lost = None if seen is None else max(seen - (verified or 0), 0)
        return cls(id=f"{host}@{at_epoch:.3f}", at=iso(at_epoch), at_epoch=at_epoch, host=host, cause=cause,
                   detail=detail, newest_seen_step=seen, newest_verified_step=verified, steps_lost=lost)

    def resumed(self, host: str, epoch: float) -> None:
        self.resumed_host, self.resumed_at, self.resumed_epoch = host, iso(epoch), epoch
        self.time_to_resume = round(max(epoch - self.at_epoch, 0.0), 1)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Interruption:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def line(self) -> str:
        """One line for `status` and `watch`."""
        lost = "steps lost unknown" if self.steps_lost is None else f"{self.steps_lost} steps lost"
        seen = (f" (newest seen step {self.newest_seen_step}, verified {self.newest_verified_step})"
                if self.newest_seen_step is not None else "")
        deadline = ""
        if self.made_deadline is not None:
            deadline = "; saved and verified before the deadline" if self.made_deadline else \
                "; NOT verified before the deadline"
        again = (f"; running again on {self.resumed_host} after {seconds_text(self.time_to_resume)}"
                 if self.resumed_host and self.time_to_resume is not None else "; not running again yet")
        shape = (f"; {self.nodes_before} -> {self.nodes_after} nodes" if self.nodes_after is not None
                 and self.nodes_before is not None and self.nodes_after != self.nodes_before else "")
        if self.cause == "rebalance":
            return f"{self.at} {self.host} rebalance ({self.detail}): a copy now, training went on"
        return f"{self.at} {self.host} {self.cause} ({self.detail}): {lost}{seen}{deadline}{again}{shape}"


def read_history(store: Store) -> list[Interruption]:
    """The interruptions on record, oldest first (lines that do not parse are skipped)."""
    text = store.read_meta(HISTORY) or ""
    out = []
    for line in text.splitlines():
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if isinstance(data, dict) and "id" in data:
            try:
                out.append(Interruption.from_dict(data))
            except TypeError:
                continue
    return out


def record(store: Store, entry: Interruption, ui: UI) -> None:
    """Add the entry, or replace the line with its id, under the store lock."""
    with store.lock(ui):
        store.read(writing=True)            # the manifest as it is: written back unchanged with the file
        lines = (store.read_meta(HISTORY) or "").splitlines()
        mine = json.dumps(entry.as_dict(), sort_keys=True)
        kept, replaced = [], False
        for line in lines:
            try:
                same = json.loads(line).get("id") == entry.id
            except (ValueError, AttributeError):
                same = False
            if same:
                kept.append(mine)
                replaced = True
            elif line.strip():
                kept.append(line)
        if not replaced:
            kept.append(mine)
        store.write_meta(HISTORY, "\n".join(kept) + "\n")
        store.flush()                       # stores that write metadata with the manifest (hf) write now


# the provider's or the engine's doing; a rebalance or a grow back is not
INTERRUPTIONS = ("notice", "lost", "restarted", "signal")


def mean_time_between(entries: list[Interruption]) -> tuple[float, int] | None:
    """Mean seconds of running between one interruption and the next (from when training ran
    again, else from the interruption itself), and how many gaps that is; None below two."""
    entries = [e for e in entries if e.cause in INTERRUPTIONS]
    gaps = []
    for before, after in zip(entries, entries[1:], strict=False):
        start = before.resumed_epoch or before.at_epoch
        if after.at_epoch > start:
            gaps.append(after.at_epoch - start)
    return (statistics.mean(gaps), len(gaps)) if gaps else None


def copy_time(entries: list[Interruption]) -> float | None:
    """The median copy time after a notice, as measured (None when no notice was handled)."""
    times = [e.copy_seconds for e in entries if e.copy_seconds is not None]
    return statistics.median(times) if times else None
