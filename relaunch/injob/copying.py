"""Copying each checkpoint into the store as the training saves it: a look at checkpoint.dir every
LOOK_EVERY seconds (a listing on this node: cheap), and a round whenever the newest complete
checkpoint is not the one the last round verified. A round is the evacuation `sync` runs
(cycle/evacuation.py: pinned, hashed here, verified in the store, recorded, pruned), in a thread
of its own, so that the main loop answers the engine's signals at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..cycle.evacuation import evacuate_jobs
from ..errors import RelaunchError
from ..executor import Executor
from ..gather import read_listing
from ..job import Job
from ..steps.checkpoint import instance_checkpoints
from ..steps.evacuate import Report, round_line
from ..transports import Store
from ..ui import UI
from .node import NodeShell

LOOK_EVERY = 2.0

Round = Callable[[bool, float | None], Report]       # (final?, the stop's deadline) -> the round's report


# a job's training logged steps and relaunch found no checkpoint of them: evacuate's --allow-empty
# is no way out inside a job, where the training saves is what to look at
NOTHING_SAVED_HINT = ("the training logged steps but no complete checkpoint is in checkpoint.dir: check "
                      "checkpoint.dir, layout and pattern against where it saves (`relaunch check RECIPE --explain`)")


def one_node_round(job: Job, shell: NodeShell, store: Store, executor: Executor, ui: UI) -> Round:
    """A round on one node: what `relaunch sync` does (final: what `evacuate` insists on, the
    newest checkpoint verified, else EvacuationError)."""
    def run(final: bool, deadline: float | None = None) -> Report:
        with store.lock(ui):
            return evacuate_jobs([job], {job.host: shell}, store, executor, ui, rounds=3 if final else 1,
                                 reverify=False, require_newest=final, empty_hint=NOTHING_SAVED_HINT)
    return run


class Copier:
    """The rounds while training runs; `finish()` lets the round under way end and starts none after it."""

    def __init__(self, job: Job, shell: NodeShell, round_: Round, ui: UI,
                 after: Callable[[Report], None] | None = None, newest: Callable[[], str | None] | None = None,
                 halted: threading.Event | None = None) -> None:
        self.job, self.shell, self.round, self.ui = job, shell, round_, ui
        self.after = after
        self._newest = newest                 # a node group's node 0 judges by its own disk (group.Leader)
        self.halt = halted or threading.Event()
        self.busy = threading.Lock()
        self.copied: str | None = None      # the newest checkpoint a round verified
        self.seconds = 0.0                  # how long the last round that copied took
        self.thread = threading.Thread(target=self._loop, name="copier", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def finish(self) -> None:
        self.halt.set()
        self.thread.join()

    def _loop(self) -> None:
        while not self.halt.wait(LOOK_EVERY):
            try:
                self.look()
            except RelaunchError as exc:    # the next look tries again; the stop's round insists
                self.ui.warn(f"{self.job.host}: copying to the store failed: {exc.message.splitlines()[0]}; "
                             f"trying again in {LOOK_EVERY:g}s")

    def newest(self) -> str | None:
        if self._newest is not None:
            return self._newest()
        self.job.facts.listing = read_listing(self.shell, self.job.paths.ckpt_dir)
        found = [cp for cp in instance_checkpoints(self.job) if cp.name not in self.job.facts.damaged]
        return found[-1].name if found else None

    def look(self) -> None:
        newest = self.newest()
        if newest is None or newest == self.copied:
            return
        self.run_round(final=False)

    def run_round(self, final: bool, deadline: float | None = None) -> Report:
        with self.busy:
            started = time.monotonic()
            self.newest()                   # the listing as it is now (the stop's save)
            report = self.round(final, deadline)
            if report.copied:
                self.seconds = time.monotonic() - started
            if report.stored and (report.newest is None or report.newest in report.copied + report.already):
                self.copied = report.newest
            self.ui.ok(f"{self.job.host}: {round_line(report)}")
            if self.after is not None:
                self.after(report)
            return report
