"""Looks at the nodes, each in a thread of its own: a slow or silent node, a copy or a recovery
never delays the look at another. Every `guard.every` seconds one read-only look over a kept SSH
connection (the training's and the guard's tmux sessions, training's exit status, the guard's
notice and rebalance records, the log's tail, and on node 0 checkpoint.dir: which checkpoints are
complete, by the recipe's layout, is what starts a round as each one is saved); the loop reads the
latest `View` of each node whenever it likes.

Why the look lists checkpoint.dir rather than the guard reporting new checkpoints: which
checkpoint is complete is decided per layout by relaunch/layouts/ on this machine (the guard runs
alone on the instance and imports nothing of relaunch), and the same listing is what a round reads.
A `find` of checkpoint.dir every few seconds costs the instance little beside a training, and the
link a line per file.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace

from .. import processes
from ..cycle import make_target
from ..errors import ConnectError, HostKeyError, RelaunchError
from ..host.connection import connect
from ..host.facts import HostFacts
from ..host.remote import Remote
from ..host.spec import HostSpec
from ..job import Facts, Job, Node
from ..layouts import Checkpoint, complete_checkpoints
from ..recipe import Recipe
from ..scripts import this_run
from ..steps.guard import LOOK_DEADLINE, Look, look_command, newest_logged_step, parse_look
from ..ui import redact

CONNECT_WAIT = 10.0        # seconds one reconnection for a look may take


@dataclass(frozen=True)
class View:
    """What the latest look at one node saw."""

    spec: HostSpec
    look: Look | None = None          # the last look that answered (None: none yet)
    looked_at: float = 0.0            # monotonic time of the last attempt, answered or not
    answered_at: float = 0.0          # monotonic time of the last answer
    sent_at: float = 0.0              # monotonic time that answer's look was sent: it saw the node after then
    answered_epoch: float = 0.0
    silent_since: float | None = None  # monotonic time the node stopped answering; None: it answers
    why: str = ""                     # why the last attempt had no answer
    newest_seen: int | None = None    # the newest step its log or its checkpoints showed
    complete: tuple[Checkpoint, ...] = ()   # complete checkpoints in checkpoint.dir, oldest first (if it lists)
    fatal: RelaunchError | None = None   # another machine answers there (a host key refused)
    looks: int = 0                    # answered looks so far (a fresh one is looks > n)
    clock_offset: float | None = None  # its clock minus this machine's, measured at the last look that could

    @property
    def host(self) -> str:
        return str(self.spec)

    @property
    def newest_complete(self) -> int | None:
        """The newest complete checkpoint's step in checkpoint.dir (None: none, or not listed)."""
        return self.complete[-1].step if self.complete else None

    def silent_for(self, now: float, hang_after: float) -> float:
        """Seconds since its last answer, once it is silent: a look failed, or the one under way is
        more than `hang_after` seconds past the last answer (a connection that hangs)."""
        quiet = now - self.answered_at
        return quiet if self.silent_since is not None or quiet > hang_after else 0.0


class Looker:
    """Looks at one node every `every` seconds in a daemon thread; `view()` is the latest. `lists`:
    each look also lists checkpoint.dir (node 0, and a replaced instance that answers again)."""

    def __init__(self, recipe: Recipe, spec: HostSpec, every: float, wake: threading.Event,
                 lists: bool = True) -> None:
        self.recipe, self.spec, self.every, self.wake = recipe, spec, every, wake
        self.lists = lists
        now = time.monotonic()
        self._view = View(spec, answered_at=now, answered_epoch=time.time())
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._remote: Remote | None = None
        self._job: Job | None = None
        self._thread = threading.Thread(target=self._run, name=f"look {spec}", daemon=True)

    def start(self) -> Looker:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def view(self) -> View:
        with self._lock:
            return self._view

    def answered(self, at: float) -> None:
        """Something else heard from the node at `at` (monotonic; a round that worked, when it began):
        its silence counts from then at the latest. A look that failed after `at` still stands: a
        long round must not hide a node that went silent while it copied."""
        with self._lock:
            v = self._view
            if at <= v.answered_at:
                return
            # a look that failed after `at` (looked_at is the failed attempt) keeps the node silent,
            # since `at`: the last time anything heard from it
            still_silent = v.silent_since is not None and v.looked_at > at
            self._view = replace(v, answered_at=at, answered_epoch=time.time() - (time.monotonic() - at),
                                 silent_since=at if still_silent else None)

    def _run(self) -> None:
        while not self._stop.is_set() and not processes.CANCEL.is_set():
            started = time.monotonic()
            try:
                self._once()
            except Exception as exc:  # noqa: BLE001 - a look that broke is a look without an answer
                self._silent(f"the look failed: {type(exc).__name__}: {exc}")
            self.wake.set()
            self._stop.wait(max(self.every - (time.monotonic() - started), 0.05))
        self._close()

    def _close(self) -> None:
        if self._remote is not None:
            self._remote.close()
        self._remote = self._job = None

    def _silent(self, why: str) -> None:
        now = time.monotonic()
        with self._lock:
            v = self._view
            self._view = replace(v, looked_at=now, why=redact(why).splitlines()[0] if why else "no answer",
                                 silent_since=v.silent_since if v.silent_since is not None else v.answered_at)

    def _once(self) -> None:
        if self._remote is None or not self._remote.alive:
            self._close()
            target = make_target(self.recipe.ssh_wait_at_most(CONNECT_WAIT), self.spec)
            try:
                remote = connect(target)
            except HostKeyError as exc:
                with self._lock:
                    self._view = replace(self._view, fatal=exc, looked_at=time.monotonic())
                self._stop.set()
                return
            except ConnectError as exc:
                self._silent(exc.message)
                return
            self._remote = remote
            self._job = Job(self.recipe, Node(target), Facts(host=HostFacts(home=remote.home)))
        assert self._remote is not None and self._job is not None
        sent = time.monotonic()
        before = time.time()
        result = self._remote.exec(look_command(self._job, self.lists), deadline=LOOK_DEADLINE,
                                   cancelled=lambda: self._stop.is_set() or processes.CANCEL.is_set())
        after = time.time()
        if result.status is None:
            self._close()
            self._silent("the look did not answer" if result.timed_out else "the SSH connection was lost")
            return
        look = parse_look(result.stdout)
        with self._lock:
            v = self._view
            seen, complete = v.newest_seen, v.complete
            logged = newest_logged_step(this_run(look.log_tail), self.recipe.run.metrics.step)
            if logged is not None:
                seen = max(logged, seen or 0)
            if look.listing is not None:
                c = self.recipe.checkpoint
                complete = tuple(complete_checkpoints(look.listing, c.layout, c.pattern))
                if complete:
                    seen = max(complete[-1].step, seen or 0)
            # the instance's clock read during the look, against the middle of this machine's clock around
            # it: off by at most half the look's time
            offset = look.clock - (before + after) / 2 if look.clock is not None else v.clock_offset
            now = time.monotonic()
            self._view = replace(v, look=look, looked_at=now, answered_at=now, answered_epoch=time.time(),
                                 sent_at=sent, silent_since=None, why="", newest_seen=seen, complete=complete,
                                 looks=v.looks + 1, clock_offset=offset)
