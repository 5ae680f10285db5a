"""What the watch knows and how it speaks: its state (the nodes, their lookers, the rounds, the
lease, what is being rented), its output (every line from the loop's thread), and the store's
newest verified step and the interruption history, which the loop, the notice handling and the
recovery all read and write.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .. import history
from ..errors import Interrupted, RelaunchError, UsageError
from ..host.spec import HostSpec
from ..job import Lag
from ..recipe import Recipe
from ..retry import RECONNECT_WAIT
from ..transports import open_store
from ..ui import UI, redact
from . import recover as rent
from .exposure import Meter
from .failures import first_line
from .holder import Holder
from .looks import Looker, View
from .rounds import Rounds, child_argv, clock


@dataclass
class WatchEnd:
    """How the watch ended (when it did not run until Ctrl-C)."""

    reason: str              # "finished" | "notice handled"
    host: str

    def as_dict(self) -> dict[str, Any]:
        return {"event": "end", "reason": self.reason, "host": self.host}


class WatchBase:
    def __init__(self, recipe: Recipe, specs: list[HostSpec], ui: UI, emit: Callable[[str], None] | None = None,
                 overrides: list[str] | None = None, take_over: bool = False) -> None:
        self.recipe, self.specs = recipe, list(specs)
        self.overrides = list(overrides or [])
        self.unpinned = False            # after a replacement: host keys from known_hosts, not ssh.host_key
        self.ui, self._emit, self.take_over = ui, emit, take_over
        # one line per step: the building blocks' own messages only with -v
        self.inner = UI(verbose=ui.verbose, quiet=not ui.verbose)
        self.every = recipe.guard.every
        self.hang_after = max(3 * self.every, 5.0)     # a look this much past the last answer: silent
        self.wake = threading.Event()
        self.messages: queue.Queue[tuple[str, str]] = queue.Queue()
        self.rounds = Rounds(self._round_argv, lambda kind, text: self._post(kind, text), ended=self.wake.set)
        self.background = ThreadPoolExecutor(max_workers=3, thread_name_prefix="background")
        self.store = open_store(recipe)
        self.holder = Holder(recipe.name, self.store, [str(s) for s in self.specs])
        self.lookers: dict[str, Looker] = {}
        self.replaced: dict[str, Looker] = {}        # replaced instances, looked at now and then
        self.ending: Future[Any] | None = None     # a replaced instance's training being ended
        self.size = len(self.specs)                              # the group's size, to grow back to
        self.renting: list[Future[None]] = []                    # shrink: replacements being rented (and made)
        self.spares: list[rent.Rented] = []                      # ... every one rented so far, not in the group yet
        self.spare_lock = threading.Lock()                       # the renting threads add to spares
        self.said_ready = False
        self.grow_after = 0                                      # the step the shrunk group resumed from
        self.last_stored: int | None = None                      # the newest verified, as the last round saw
        self.stored: Lag | None = None                           # ... its name, step and time, for the exposure
        self.meter = Meter()                                     # the exposure, look by look
        self.asking: dict[str, Future[rent.Alive]] = {}         # recover.alive in flight, by host
        self.alive_after: dict[str, float] = {}                 # ... and when to ask it again
        self.alive_said: dict[str, bool | None] = {}            # its last answer, said once
        self.handled: set[Any] = set()                          # notices (seen_at) acted on
        self.rebalanced: set[Any] = set()
        self.ending_seen: dict[str, int] | None = None          # training gone: the looks when first seen
        self.waiting: history.Interruption | None = None       # lost, no recover.command: back?
        self.waiting_since = 0.0                                # ... since when (monotonic)
        self.next_round = 0.0                   # the latest a round starts: checkpoint.every after the last
        self.round_newest: int | None = None    # node 0's newest complete step when the last round began
        self.given_up = False                   # the last round used up its tries: no round before next_round
        self.round_asked: float | None = None   # a round wanted at once (monotonic): owed until one begins after it
        self.said_silent: set[str] = set()

    # -- output ------------------------------------------------------------------------------
    def emit(self, event: str, **data: Any) -> None:
        """One JSON line per event (--json: to stderr, collected in stdout's document), redacted as
        every other line is: a notice's source may be a URL with a token in it, a command's output a
        secret."""
        if self._emit is not None:
            self._emit(redact(json.dumps({"event": event, "time": history.iso(time.time()), "host": self.host,
                                          **data})))

    def say(self, text: str) -> None:
        self.ui.say(f"{clock()} {text}")

    def warn(self, text: str) -> None:
        self.ui.warn(f"{clock()} {text}")

    def ok(self, text: str) -> None:
        self.ui.ok(f"{clock()} {text}")

    def _post(self, kind: str, text: str) -> None:
        """Output from any thread: said at once from this one, else by the loop when it drains."""
        if threading.current_thread() is threading.main_thread():
            self._show(kind, text)
            return
        self.messages.put((kind, text))
        self.wake.set()

    def _show(self, kind: str, text: str) -> None:
        if kind == "warn":
            self.warn(text)
        elif kind == "error":
            self.holder.note(last_error={"at": history.iso(time.time()), "message": redact(text)})
        else:
            self.say(text)

    @property
    def host(self) -> str:
        return " ".join(map(str, self.specs))

    @property
    def group(self) -> bool:
        return len(self.specs) > 1

    # -- the recipe as the watch uses it -----------------------------------------------------
    def current(self, wait: float = RECONNECT_WAIT) -> Recipe:
        recipe = self.recipe.ssh_wait_at_most(wait)
        if self.unpinned:
            recipe = recipe.model_copy(update={"ssh": recipe.ssh.model_copy(update={"host_key": None})})
        return recipe

    def still_holding(self) -> None:
        """Before renting, starting or stopping training: this watch still holds the store (its
        lease), else it stops acting (exit 2): another watch carries on."""
        why = self.holder.why_not_mine()
        if why is not None:
            self.rounds.abort()
            raise UsageError(f"this watch stops: {why}; it rents nothing and starts nothing more",
                             "the watch that holds the store carries on (`relaunch status` on its machine shows it)")

    def _round_argv(self) -> list[str]:
        sets = [*self.overrides, f"ssh.wait={min(self.recipe.ssh.wait, RECONNECT_WAIT):g}"]
        if self.unpinned:
            sets.append("ssh.host_key=null")
        return child_argv(str(self.recipe.source), [str(s) for s in self.specs], sets)

    # -- nodes and their looks ---------------------------------------------------------------
    def look_at(self, specs: list[HostSpec]) -> None:
        for looker in self.lookers.values():
            looker.stop()
        self.specs = list(specs)
        # only node 0 lists checkpoint.dir (what starts a round, the exposure); the others' logs and
        # guards suffice
        self.lookers = {str(s): Looker(self.current(), s, self.every, self.wake, lists=n == 0).start()
                        for n, s in enumerate(self.specs)}
        self.ending_seen = None
        self.round_newest = None                # other instances: their steps go on from what they restored,
        self.stored = None                      # and their exposure is measured from their first round
        self.meter.reset()
        self.said_silent.clear()
        self.holder.hosts = [str(s) for s in self.specs]
        self.holder.note(hosts=self.holder.hosts)

    def views(self) -> list[View]:
        return [self.lookers[str(s)].view() for s in self.specs]

    def newest_seen(self) -> int | None:
        seen = [v.newest_seen for v in self.views() if v.newest_seen is not None]
        return max(seen) if seen else None

    # -- the store and the history ---------------------------------------------------------
    def store_newest(self) -> int | None:
        try:
            store = open_store(self.recipe)
            store.read()
        except (Interrupted, UsageError):
            raise
        except RelaunchError as exc:
            self.warn(f"reading the store: {first_line(exc)}")
            return None
        newest = store.manifest.newest() if store.manifest else None
        return newest.step if newest else None

    def record(self, entry: history.Interruption) -> None:
        self.write_down(entry)
        self.tell(entry)

    def write_down(self, entry: history.Interruption) -> None:
        """Into the store's history. Before "training running again" is said: whoever acts on that
        line (a Ctrl-C, a script reading `--json`) finds the resumption on record already."""
        try:
            history.record(open_store(self.recipe), entry, self.inner)
        except (Interrupted, UsageError):
            raise
        except RelaunchError as exc:
            self.warn(f"could not write the history of interruptions: {first_line(exc)}")

    def tell(self, entry: history.Interruption) -> None:
        self.say(f"{'recorded' if entry.cause == 'rebalance' else 'interruption recorded'}: {entry.line()}")
        self.emit("interruption", **entry.as_dict())

    # -- what the recovery does (replacing.py), called from the notice handling --------------
    def recover(self, entry: history.Interruption, gone: list[HostSpec]) -> None:
        raise NotImplementedError
