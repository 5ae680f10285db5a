"""The watch's loop: it reads the latest look at every node (looks.py), starts and collects the
copy-off rounds (rounds.py), and decides, from what the nodes show now:

- a reclaim notice on any node: the round copying meanwhile is ended (the save after the notice
  goes first), the guard's save is waited for (in a node group every node is asked to save), the
  newest checkpoint is evacuated and verified (its bytes hashed on the instance again, whatever
  the store records), and whether the save after the notice made the deadline (verdicts.
  notice_saved: that save, not an older checkpoint, verified by its bytes in time) is said and
  recorded; then recover;
- a rebalance recommendation (aws-rebalance): a round at once; training goes on;
- no answer for recover.lost_after (and recover.alive, when set, does not say the provider still
  runs it): lost; the interruption goes into the history; then recover;
- recover: recover.command rents a replacement (recover.py says what its answer allows), `up`
  there, and the watch goes on with it; in a node group with recover.shrink the nodes left
  resume at once and the group grows back when the replacements are there. Without
  recover.command the watch waits for the instance to answer again. A replaced instance that
  answers again is looked at: its training is ended when it holds nothing newer than the store,
  and the user is told it still bills;
- training ended by itself: a last round, then exit 0 (finished) or 4 (it failed).

All output comes from this thread; the lookers, the rounds and the background tasks (renting, renewing the
lease, ending a replaced instance's training) only post what they found. Ctrl-C ends the watch
and what it runs; it never signals the training.
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

from .. import cycle, history, processes, verdicts
from ..errors import ConnectError, EnvError, EvacuationError, HostKeyError, Interrupted, RelaunchError, UsageError
from ..host.connection import connect
from ..host.spec import HostSpec
from ..recipe import Recipe
from ..retry import RECONNECT_WAIT, retrying
from ..steps.evacuate import Report, round_line
from ..steps.guard import record_command
from ..transports import open_store
from ..ui import UI, redact
from . import recover as rent
from .holder import Holder
from .looks import Looker, View
from .rounds import LAST_ROUND_TRIES, Rounds, child_argv, clock

SAVE_SLACK = 10.0          # seconds beyond run.stop.timeout to wait for the guard's save
WRITE_BACK_DEADLINE = 15.0
REPLACED_LOOKS = 5            # a replaced instance is looked at every REPLACED_LOOKS x guard.every seconds
ALIVE_AGAIN = 30.0         # seconds before recover.alive is asked again about the same host


@dataclass
class WatchEnd:
    """How the watch ended (when it did not run until Ctrl-C)."""

    reason: str              # "finished" | "notice handled"
    host: str

    def as_dict(self) -> dict[str, Any]:
        return {"event": "end", "reason": self.reason, "host": self.host}


def _first_line(exc: BaseException) -> str:
    message = exc.message if isinstance(exc, RelaunchError) else str(exc)
    return redact(message).splitlines()[0] if message else type(exc).__name__


def _recoverable(exc: BaseException) -> bool:
    return isinstance(exc, RelaunchError) and not isinstance(exc, (UsageError, Interrupted, HostKeyError)) \
        and not exc.refused


class Watch:
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
        self.rounds = Rounds(self._round_argv, lambda kind, text: self._post(kind, text))
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
        self.asking: dict[str, Future[rent.Alive]] = {}         # recover.alive in flight, by host
        self.alive_after: dict[str, float] = {}                 # ... and when to ask it again
        self.alive_said: dict[str, bool | None] = {}            # its last answer, said once
        self.handled: set[Any] = set()                          # notices (seen_at) acted on
        self.rebalanced: set[Any] = set()
        self.ending_seen: dict[str, int] | None = None          # training gone: the looks when first seen
        self.waiting: history.Interruption | None = None       # lost, no recover.command: back?
        self.waiting_looks: dict[str, int] = {}
        self.next_round = 0.0
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
        # only node 0 lists checkpoint.dir (the newest step seen); the others' logs and guards suffice
        self.lookers = {str(s): Looker(self.current(), s, self.every, self.wake,
                                       **({} if n == 0 else {"listing_every": 1e9})).start()
                        for n, s in enumerate(self.specs)}
        self.ending_seen = None
        self.said_silent.clear()
        self.holder.hosts = [str(s) for s in self.specs]
        self.holder.note(hosts=self.holder.hosts)

    def views(self) -> list[View]:
        return [self.lookers[str(s)].view() for s in self.specs]

    def newest_seen(self) -> int | None:
        seen = [v.newest_seen for v in self.views() if v.newest_seen is not None]
        return max(seen) if seen else None

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> WatchEnd:
        self.holder.take(self.inner, self.take_over)
        try:
            self.holder.start_renewing(self.inner, self._post)
            self.look_at(self.specs)
            return self._loop()
        finally:
            self.rounds.abort()
            self.say_unused()
            for looker in [*self.lookers.values(), *self.replaced.values()]:
                looker.stop()
            self.background.shutdown(wait=False, cancel_futures=True)
            self.holder.release(self.inner)

    def _loop(self) -> WatchEnd:
        recover = self.recipe.recover
        self.say(f"watching {self.host}: a look every {self.every:g}s, a sync round every "
                 f"{self.recipe.checkpoint.every:g}s, lost after {recover.lost_after:g}s without an answer"
                 + (f" (and recover.alive `{recover.alive}` saying it is gone)" if recover.alive else "")
                 + "; recover: " + (f"`{recover.command}`" + (", shrinking the group meanwhile" if recover.shrink
                                                             and self.group else "")
                                    if recover.command else
                                    "none (recover.command unset): wait for the instance to come back"))
        while True:
            self.wake.wait(self.every)
            self.wake.clear()
            processes.check_cancel()
            self.drain()
            outcome = self.tick()
            if outcome is not None:
                return outcome

    def drain(self) -> None:
        """What the threads posted: messages, a finished round, finished background tasks."""
        self.drain_messages()
        outcome = self.rounds.take()
        if outcome is not None:
            if outcome.error is not None:
                self.holder.note(last_error={"at": history.iso(time.time()), "message": redact(outcome.error.message)})
                raise outcome.error         # the store refuses: the watch cannot do its work
            if outcome.report is not None:
                self.after_round(outcome.report, outcome.started)
            elif outcome.failed is not None:
                self.next_round = time.monotonic() + self.recipe.checkpoint.every   # its tries are used up
        if self.ending is not None and self.ending.done():
            exc = self.ending.exception()
            if isinstance(exc, RelaunchError):
                self.warn(_first_line(exc))
            self.ending = None

    def after_round(self, report: Report, started: float) -> None:
        self.next_round = time.monotonic() + self.recipe.checkpoint.every
        self.last_stored = report.stored_step
        for looker in self.lookers.values():
            looker.answered(started)        # a round that worked heard from every node, when it began
        self.ui.ok(round_line(report))
        self.emit("round", **report.as_dict())
        self.holder.note(last_round={"at": history.iso(time.time()), "line": round_line(report)})

    def tick(self) -> WatchEnd | None:
        if self.holder.taken is not None:            # seen by the lease's renewal: stop acting at once
            self.still_holding()
        now = time.monotonic()
        views = self.views()
        for view in views:
            if view.fatal is not None:
                raise view.fatal             # another machine answers there: not an outage
        noticed = next((v for v in views if v.look and (v.look.notice or {}).get("source")
                        and (v.look.notice or {}).get("seen_at") not in self.handled), None)
        if noticed is not None:
            return self.on_notice(noticed)
        for view in views:
            self.on_rebalance(view)
        self.say_silences(views, now)
        if self.waiting is not None:
            if all(v.silent_since is None and v.looks > self.waiting_looks.get(v.host, 0) for v in views):
                self.came_back(views)
            return None
        silent = [v for v in views if v.silent_for(now, self.hang_after) >= self.recipe.recover.lost_after]
        if silent:
            lost = self.confirm_lost(silent)
            if lost:
                self.lost(lost)
            return None
        outcome = self.maybe_ended(views)
        if outcome is not None or self.ending_seen is not None:     # ended, or a last look pending
            return outcome
        self.look_at_replaced()
        self.grow_back()
        if now >= self.next_round and not self.rounds.busy:
            self.rounds.start()
        return None

    def say_silences(self, views: list[View], now: float) -> None:
        for view in views:
            quiet = view.silent_for(now, self.hang_after)
            if quiet and view.host not in self.said_silent:
                self.said_silent.add(view.host)
                why = view.why or f"the look under way has had no answer for {quiet:.0f}s"
                self.warn(f"{view.host}: no answer ({why}); lost after {self.recipe.recover.lost_after:g}s "
                          "without one")
                self.emit("unreachable", node=view.host, why=why)
            elif not quiet and view.host in self.said_silent:
                self.said_silent.discard(view.host)
                self.say(f"{view.host}: answers again")

    # -- a reclaim notice ----------------------------------------------------------------------
    def on_notice(self, view: View) -> WatchEnd | None:
        assert view.look is not None and view.look.notice is not None
        notice = dict(view.look.notice)
        self.handled.add(notice.get("seen_at"))
        source, detail = notice.get("source", "?"), notice.get("detail", "")
        seen = float(notice.get("seen_at") or time.time())
        deadline = float(notice.get("deadline") or seen)
        where = f"{view.host}: " if not self.group else f"{view.host} (node {self.specs.index(view.spec)}): "
        self.warn(f"{where}reclaim notice from {source}: {detail}; deadline {clock(deadline)} "
                  f"({deadline - time.time():.0f}s left, from {notice.get('deadline_from', '?')})")
        self.emit("notice", node=view.host, notice=notice)
        if self.group:
            # every node at once: the ranks of every node stop at the same step and save together
            try:
                cycle.ask_to_stop(self.current(5), self.specs, self.inner)
                self.say(f"asked the training on every node to save and stop (SIG{self.recipe.run.stop.signal})")
            except (Interrupted, UsageError):
                raise
            except RelaunchError as exc:
                self.warn(f"could not ask every node to save: {_first_line(exc)}")
        if self.rounds.busy:
            self.rounds.abort()
            self.say("the sync round copying meanwhile was ended: the save after the notice goes first (its partial "
                     "copy stays in the store's staging for a later round; nothing of it is trusted)")
        notice = self.wait_for_save(view, notice, deadline)
        save = notice.get("save") or {}
        self.say(f"{where}guard: training {_save_words(save)}; evacuating " +
                 ("every node now" if self.group else "now"))
        started = time.time()
        report: Report | None = None
        try:
            # reverify: a checkpoint the store records may have been saved again in place since (same
            # name, same size, other bytes): the instance's bytes are hashed again, never taken on the record
            report = cycle.evacuate(self.current(), self.specs, self.inner, newest_only=True)
        except (Interrupted, UsageError):
            raise
        except RelaunchError as exc:
            self.warn(f"{where}evacuation after the notice NOT verified: {_first_line(exc)}")
        finished = time.time()
        if self.group:
            # a rank that did not stop (a launcher waiting on the node that is going) holds nothing more
            try:
                cycle.stop_training(self.current(5), self.specs, self.inner)
            except (Interrupted, UsageError):
                raise
            except RelaunchError as exc:
                self.warn(f"could not end what is left of the training: {_first_line(exc)}")
        verified = report is not None and report.safe
        shown = self.newest_seen()
        # made the deadline: the save the notice asked for, verified by its bytes in time; not merely
        # a verified checkpoint (an older one is verified in no time when the save was cut short)
        verdict = verdicts.notice_saved(verdicts.NoticeCopy(
            save_state=save.get("state"), noticed_at=seen, deadline=deadline, finished=finished,
            newest=report.newest if report else None, newest_step=report.newest_step if report else None,
            newest_mtime=report.newest_mtime if report else None,
            verified_now=tuple(report.verified_now) if report else (), seen_step=shown))
        made = verified and verdict.ok
        after_deadline = finished > deadline
        if report is not None and verified:
            newest = f"{report.newest} (step {report.newest_step})" if report.newest else "no checkpoint"
            timing = (f"{deadline - finished:.0f}s before the deadline" if made
                      else f"NOT before the deadline ({finished - deadline:.0f}s late)" if after_deadline
                      else f"but NOT the save after the notice before the deadline: {verdict.why}")
            (self.ok if made else self.warn)(f"{where}evacuated after the notice: {newest} verified in "
                                             f"{report.store}, {timing}")
        copy = {"by": "relaunch watch", "verified": verified, "checkpoint": report.newest if report else None,
                "step": report.newest_step if report else None, "seconds": round(finished - started, 1),
                "finished": history.iso(finished), "made_deadline": made, "why": verdict.why}
        self.emit("evacuated", **copy, report=report.as_dict() if report else None)
        notice["copy"] = copy
        notice["verdict"] = (f"{notice.get('verdict') or ''}; the copy: "
                             + (f"{copy['checkpoint']} verified in the store "
                                + ("before the deadline" if made else "AFTER the deadline" if after_deadline
                                   else f"before the deadline, but it is not the save after the notice: {verdict.why}")
                                if verified else "NOT verified")).lstrip("; ")
        self.write_back(view, notice)
        seen_step = max([s for s in (shown, report.newest_step if report else None) if s is not None],
                        default=None)
        verified_step = report.stored_step if report is not None else self.store_newest()
        entry = history.Interruption.start(view.host, "notice", f"{source}: {detail}", seen, seen_step,
                                           verified_step)
        entry.deadline, entry.made_deadline = history.iso(deadline), made
        entry.copy_seconds = round(finished - started, 1) if verified else None
        entry.nodes_before = len(self.specs)
        self.record(entry)
        if not self.recipe.recover.command and not (self.group and self.recipe.recover.shrink):
            if not verified:
                raise EvacuationError(f"{view.host}: after the reclaim notice, the newest checkpoint is not "
                                      "verified in the store", "rerun `relaunch evacuate` while the instance exists")
            self.say(f"{view.host}: no recover.command: training is stopped and its newest checkpoint is in the store; "
                     "bring it up on a new instance with `relaunch up RECIPE HOST`")
            return WatchEnd("notice handled", self.host)
        self.recover(entry, [view.spec])
        return None

    def wait_for_save(self, view: View, notice: dict[str, Any], deadline: float) -> dict[str, Any]:
        """The notice record once the guard says how the save went, training is gone, or the time is
        up; in a node group, also until the training is gone on every node (they save together)."""
        until = min(deadline, time.time() + self.recipe.run.stop.timeout + SAVE_SLACK)
        looker = self.lookers[view.host]

        def others_running() -> bool:
            return any(v.look is not None and v.look.training and v.silent_since is None
                       for v in self.views() if v.host != view.host)

        while ((notice.get("save") or {}).get("state") in (None, "asking") or others_running()) \
                and time.time() < until:
            processes.sleep(0.5)
            now = looker.view()
            if now.look is None or now.silent_since is not None:
                if now.silent_for(time.monotonic(), self.hang_after) > 2 * self.every + 5:
                    break
                continue
            look = now.look
            if look.notice and look.notice.get("seen_at") == notice.get("seen_at"):
                notice = dict(look.notice)
            if (notice.get("save") or {}).get("state") in (None, "asking") and not look.training and not look.guard:
                notice["save"] = {"state": "saved" if look.exit == "0" else "exited", "exit": look.exit}
        return notice

    def write_back(self, view: View, notice: dict[str, Any]) -> None:
        """Add the copy and the verdict to the notice record on the instance (when it still answers)."""
        try:
            node, remote = cycle.open_host(self.current(5), view.spec, self.inner)
        except RelaunchError:
            return
        with remote:
            from ..host.facts import HostFacts
            from ..job import Facts, Job

            job = Job(self.current(), node, Facts(host=HostFacts(home=remote.home)))
            result = remote.exec(record_command(job), deadline=WRITE_BACK_DEADLINE,
                                 stdin=(json.dumps(notice, sort_keys=True) + "\n").encode())
        if not result.ok:
            self.inner.warn(f"{view.host}: could not add the copy to the notice record: {result.output[:200]}")

    # -- a rebalance recommendation ------------------------------------------------------------
    def on_rebalance(self, view: View) -> None:
        advice = view.look.rebalance if view.look else None
        if not advice or advice.get("seen_at") in self.rebalanced:
            return
        self.rebalanced.add(advice.get("seen_at"))
        self.warn(f"{view.host}: {advice.get('detail', 'rebalance recommendation')} from {advice.get('source')}: an "
                  "elevated risk of a reclaim, not a notice: copying off now; training goes on")
        self.emit("rebalance", node=view.host, advice=advice)
        entry = history.Interruption.start(view.host, "rebalance", str(advice.get("detail", "")),
                                           float(advice.get("seen_at") or time.time()), self.newest_seen(),
                                           self.store_newest())
        entry.resumed(view.host, time.time())       # it never stopped
        entry.time_to_resume = 0.0
        self.record(entry)
        self.next_round = 0.0                       # the next (or this) tick starts one

    # -- lost, back, recovered -----------------------------------------------------------------
    def store_newest(self) -> int | None:
        try:
            store = open_store(self.recipe)
            store.read()
        except (Interrupted, UsageError):
            raise
        except RelaunchError as exc:
            self.warn(f"reading the store: {_first_line(exc)}")
            return None
        newest = store.manifest.newest() if store.manifest else None
        return newest.step if newest else None

    def record(self, entry: history.Interruption) -> None:
        try:
            history.record(open_store(self.recipe), entry, self.inner)
        except (Interrupted, UsageError):
            raise
        except RelaunchError as exc:
            self.warn(f"could not write the history of interruptions: {_first_line(exc)}")
        self.say(f"{'recorded' if entry.cause == 'rebalance' else 'interruption recorded'}: {entry.line()}")
        self.emit("interruption", **entry.as_dict())

    def confirm_lost(self, silent: list[View]) -> list[View]:
        """The silent nodes that count as lost now: all of them, or with recover.alive those the
        provider says it no longer runs (asked in a thread of its own; nothing is rented while
        it cannot tell)."""
        if self.recipe.recover.alive is None:
            return silent
        lost = []
        for view in silent:
            asking = self.asking.get(view.host)
            if asking is None:
                if time.monotonic() >= self.alive_after.get(view.host, 0.0):
                    self.asking[view.host] = self.background.submit(rent.ask_alive, self.recipe, view.host)
                continue
            if not asking.done():
                continue
            del self.asking[view.host]
            answer = asking.result()
            if answer.running is False:
                self.say(answer.said)
                lost.append(view)
                continue
            if self.alive_said.get(view.host) != answer.running:
                self.alive_said[view.host] = answer.running
                (self.say if answer.running else self.warn)(
                    f"{view.host}: no answer for {time.monotonic() - view.answered_at:.0f}s, but {answer.said}: "
                    + ("not lost; nothing is rented (this machine's network, or a passing outage)"
                       if answer.running else "nothing is rented until it can tell"))
                self.emit("alive", node=view.host, running=answer.running, said=answer.said)
            self.alive_after[view.host] = time.monotonic() + ALIVE_AGAIN
        return lost

    def lost(self, lost: list[View]) -> None:
        self.rounds.abort()
        now = time.monotonic()
        first = min(lost, key=lambda v: v.answered_at)
        silent = now - first.answered_at
        names = ", ".join(v.host for v in lost)
        self.warn(f"{names}: no answer for {silent:.0f}s (recover.lost_after {self.recipe.recover.lost_after:g}s): "
                  + ("the instance is lost" if not self.group else f"{len(lost)} of {len(self.specs)} nodes lost")
                  + "; if it comes back it may still be training: the watch looks at it now and then and ends its "
                    "training when it holds nothing newer than the store")
        entry = history.Interruption.start(names, "lost", f"no answer for {silent:.0f}s", first.answered_epoch,
                                           self.newest_seen(), self.store_newest())
        entry.nodes_before = len(self.specs)
        self.record(entry)
        gone = [v.spec for v in lost]
        if self.recipe.recover.command or (self.group and self.recipe.recover.shrink and len(gone) < len(self.specs)):
            self.recover(entry, gone)
        else:
            self.say(f"{names}: no recover.command: waiting for {'it' if len(gone) == 1 else 'them'} to answer again "
                     "(Ctrl-C to stop)")
            self.waiting = entry
            self.waiting_looks = {v.host: v.looks for v in self.views()}

    def came_back(self, views: list[View]) -> None:
        entry = self.waiting
        assert entry is not None
        self.waiting = None
        if all(v.look is not None and v.look.training for v in views):
            self.say(f"{self.host}: back, and training is still running there")
            entry.resumed(self.host, time.time())
        else:
            self.say(f"{self.host}: back; training is not running: `up` there")
            if self.group:
                cycle.stop_training(self.current(), self.specs, self.inner)
            self.up_here(entry)
        self.record(entry)

    def maybe_ended(self, views: list[View]) -> WatchEnd | None:
        """Training gone on node 0: decided once every node was looked at again after it was first
        seen gone (in a group, a notice on another node may be why: that look shows it);
        meanwhile `ending_seen` holds the looks of that first sight."""
        first = views[0]
        if first.look is None or first.look.training:
            self.ending_seen = None
            return None
        if self.ending_seen is None:
            self.ending_seen = {v.host: v.looks for v in views}
            return None
        if not all(v.looks > self.ending_seen.get(v.host, 0) for v in views):
            return None
        self.ending_seen = None
        look = first.look
        if look.exit == "":
            # gone without an exit status: the instance restarted under it (a paused instance resumed)
            entry = history.Interruption.start(self.host, "restarted", "training was gone without an exit status",
                                               first.answered_epoch, self.newest_seen(), self.store_newest())
            self.warn(f"{first.host}: training is not running and never exited (the instance restarted?): `up` there")
            if self.group:
                cycle.stop_training(self.current(), self.specs, self.inner)
            self.up_here(entry)
            self.record(entry)
            return None
        self.rounds.abort()
        problem = self.last_round()
        if look.exit == "0":
            if problem is not None:
                raise EvacuationError(f"{first.host}: training finished (exit 0), but {problem}",
                                      "the instance still holds its checkpoints: `relaunch evacuate RECIPE HOST` once "
                                      "it and the store answer; do not destroy it before")
            self.ok(f"{first.host}: training finished (exit 0); nothing more to watch")
            self.emit("finished")
            return WatchEnd("finished", self.host)
        raise EnvError(f"{first.host}: training exited with status {look.exit}: it failed by itself, the instance was "
                       "not taken away" + (f"; and {problem}" if problem else ""),
                       "see `relaunch status` for its last lines; `relaunch up` starts it again")

    def last_round(self) -> str | None:
        """Training ended: one more round, of LAST_ROUND_TRIES tries at most (each child has its
        actions' deadlines), so that an instance or a store that stopped answering cannot hold the
        watch forever. None when it verified the instance's newest checkpoint, else what went wrong."""
        while not self.rounds.start(tries=LAST_ROUND_TRIES):
            processes.sleep(0.5)          # the round ended just before is still cleaning up (bounded)
        while self.rounds.busy:
            processes.sleep(0.5)
            self.drain_messages()
        outcome = self.rounds.take()
        if outcome is None or outcome.aborted:
            return "the last sync round was ended"
        if outcome.error is not None:
            self.holder.note(last_error={"at": history.iso(time.time()), "message": redact(outcome.error.message)})
            raise outcome.error
        if outcome.report is None:
            why = _first_line(outcome.failed) if outcome.failed is not None else "no report"
            return f"the last sync round failed {LAST_ROUND_TRIES} times: {why}"
        self.after_round(outcome.report, outcome.started)
        return None if outcome.report.safe else outcome.report.why

    def up_here(self, entry: history.Interruption) -> None:
        def again(exc: BaseException, seconds: float) -> None:
            self.warn(f"{self.host}: up failed: {_first_line(exc)}; again in {seconds:.0f}s")

        def up() -> list[cycle.UpResult]:
            self.still_holding()
            return cycle.up(self.current(self.recipe.ssh.wait), self.specs, self.inner)

        results = retrying(up, transient=_recoverable, attempts=self.recipe.recover.attempts, first=5.0, most=60.0,
                           on_retry=again)
        entry.resumed(self.host, time.time())
        result = results[0]
        resumed = f" (resumed from {result.checkpoint}, step {result.step})" if result.checkpoint else ""
        self.ok(f"{self.host}: training {result.status} again{resumed}")
        self.emit("up", **result.as_dict())
        self.look_at(self.specs)
        self.next_round = time.monotonic() + self.recipe.checkpoint.every

    # -- recovery ------------------------------------------------------------------------------
    def recover(self, entry: history.Interruption, gone: list[HostSpec]) -> None:
        """Replace what is gone, or (a group with recover.shrink) go on with the nodes left."""
        self.rounds.abort()
        self.still_holding()
        left = [s for s in self.specs if s not in gone]
        old = self.host if not self.group else f"the group ({len(self.specs)} nodes)"
        if self.group and self.recipe.recover.shrink and left:
            self.say(f"recover.shrink: training goes on on the {len(left)} node(s) left now"
                     + (f"; replacements for {len(gone)} are rented meanwhile" if self.recipe.recover.command else ""))
            cycle.stop_training(self.current(), left, self.inner)
            results = self.bring_up(left)
            self.grow_after = results[0].step
            if self.recipe.recover.command:
                # another loss while earlier replacements are still being rented adds to them: every
                # one rented is used when the group grows back (or named when the watch ends)
                with self.spare_lock:
                    group = [*self.specs, *(r.spec for r in self.spares)]
                self.renting.append(self.background.submit(self.rent_and_prepare, entry, len(gone), group))
        else:
            # what earlier shrinks rented counts towards the replacements (the last nodes of a shrunk
            # group lost too): rented once, never forgotten
            spares = self.take_spares()
            need = max(self.size - len(left) - len(spares), 0) if self.group else len(gone)
            rented = [*spares, *self.rent_many(entry, need, already=spares)]
            if left:
                cycle.stop_training(self.current(), left, self.inner)
            results = self.bring_up(left + [r.spec for r in rented], new=rented)
        self.retire([s for s in gone])
        entry.resumed(self.host, time.time())
        entry.nodes_after = len(self.specs)
        first = results[0]
        resumed = f"resumed from {first.checkpoint} (step {first.step})" if first.checkpoint else "fresh start"
        self.ok(f"recovered: training {first.status} on {self.host} ({resumed}), "
                f"{entry.time_to_resume:g}s after {old} stopped; watching {self.host} now")
        self.emit("up", **first.as_dict(), nodes=[str(s) for s in self.specs])
        self.record(entry)

    def rent_many(self, entry: history.Interruption, count: int,
                  already: list[rent.Rented] | None = None) -> list[rent.Rented]:
        """`count` replacements; a failure names every one rented before it (they bill)."""
        rented: list[rent.Rented] = []
        for n in range(count):
            try:
                rented.append(self.rent_one(entry, n))
            except RelaunchError as exc:
                billing = [*(already or []), *rented]
                if billing:
                    hosts = " ".join(str(r.spec) for r in billing)
                    exc.message += (f"\nrented for this recovery and billing: {hosts}: run `relaunch up RECIPE "
                                    "HOST...` there, or destroy them")
                raise
        return rented

    def rent_and_prepare(self, entry: history.Interruption, count: int, group: list[HostSpec]) -> None:
        """recover.shrink, in a background thread: the replacements are rented while the shrunk group
        trains, each added to `spares` as soon as recover.command gave it, and their env is made then
        too, so that growing back installs nothing while training is stopped. `group`: the nodes as
        they were when this renting began (the loop's specs may change meanwhile); the env is made
        as the node it will likely be, and `up` makes it again where that rendered differently."""
        spares: list[rent.Rented] = []
        for n in range(count):
            found = self.rent_one(entry, n)
            with self.spare_lock:
                self.spares.append(found)
            spares.append(found)
        group = [*group, *(r.spec for r in spares)]           # as growing back will make it
        for rank, found in enumerate(spares, start=len(group) - len(spares)):
            self._post("say", f"recover: making the env on {found.spec} while the group trains (preflight, venv, "
                              "lock, env.files, env.setup)")
            try:
                cycle.prepare(self.current(self.recipe.ssh.wait), group, rank, self.inner)
            except (Interrupted, UsageError):
                raise
            except RelaunchError as exc:
                self._post("warn", f"recover: the env on {found.spec} could not be made ahead "
                                   f"({_first_line(exc)}); the `up` that grows the group back makes it")

    def take_spares(self) -> list[rent.Rented]:
        """Every replacement rented by earlier shrinks, once their renting is over (each bounded by
        recover.attempts and recover.timeout); they leave `spares`."""
        for renting in self.renting:
            try:
                renting.result()
            except (Interrupted, UsageError):
                raise
            except RelaunchError as exc:
                self.warn(f"recover: renting a replacement failed: {_first_line(exc)}")
        self.renting = []
        with self.spare_lock:
            spares, self.spares = self.spares, []
        return spares

    def say_unused(self) -> None:
        """The watch ends: replacements rented and not (yet) in the group bill; they are named."""
        with self.spare_lock:
            unused = list(self.spares)
        if unused:
            hosts = " ".join(str(r.spec) for r in unused)
            self.warn(f"the replacement{'s' if len(unused) > 1 else ''} {hosts} rented by recover.command "
                      f"{'are' if len(unused) > 1 else 'is'} not in the group and billing: `relaunch up RECIPE "
                      "HOST...` with them, or destroy them")
            self.emit("unused", nodes=[str(r.spec) for r in unused])
        if any(not f.done() for f in self.renting):
            self.warn("a replacement was being rented when the watch stopped: recover.command may have rented an "
                      "instance; look at your provider's console")

    def rent_one(self, entry: history.Interruption, n: int) -> rent.Rented:
        """recover.command until it names a HOST that answers with an accepted key. Once it has
        named one, a later attempt connects to that one again: nothing more is rented for it (only
        a command that failed, exit non-zero before its timeout, rented nothing and may be run again)."""
        recover = self.recipe.recover
        attempt = [0]
        rented: list[rent.Rented] = []
        for_whom = f" ({n + 1} of the lost nodes)" if self.group else ""

        def once() -> rent.Rented:
            attempt[0] += 1
            if rented:
                found = rented[0]
                self._post("say", f"recover attempt {attempt[0]} of {recover.attempts}{for_whom}: connecting to "
                                  f"{found.spec} again (rented already: nothing more is rented)")
            else:
                why = self.holder.why_not_mine()
                if why is not None:
                    raise rent.RecoverStopped(f"{why}: renting nothing", refused=True)
                self._post("say", f"recover attempt {attempt[0]} of {recover.attempts}{for_whom}: running "
                                  f"recover.command `{recover.command}` (up to {recover.timeout:g}s)")
                found = rent.rent(self.recipe, self.inner, attempt[0], entry.host, entry.cause)
                rented.append(found)
                if found.note:
                    self._post("warn", f"recover: {found.note}")
                self._post("say", f"recover.command gave {found.spec}" + (f" {found.pin}" if found.pin else ""))
                self.emit("recover", new_host=str(found.spec), host_key=found.pin, attempt=attempt[0])
            self.admit(found)
            return found

        def again(exc: BaseException, seconds: float) -> None:
            self._post("warn", f"recover attempt {attempt[0]} of {recover.attempts} failed: {_first_line(exc)}; "
                               f"next in {seconds:.0f}s")

        try:
            return retrying(once, transient=_recoverable, attempts=recover.attempts, first=5.0, most=120.0,
                            on_retry=again)
        except RelaunchError as exc:
            if rented:
                exc.message += (f"\n{rented[0].spec} was rented by recover.command and is billing: reach it (its key, "
                                "its user) and run `relaunch up RECIPE HOST` there, or destroy it")
            raise

    def drain_messages(self) -> None:
        while True:
            try:
                kind, text = self.messages.get_nowait()
            except queue.Empty:
                return
            self._show(kind, text)

    def admit(self, found: rent.Rented) -> None:
        """A new instance from recover.command: wait for it to boot, and accept its key for that
        address (or check the pin): what an earlier instance left there in known_hosts is gone."""
        recipe = self.recipe.model_copy(update={"ssh": self.recipe.ssh.model_copy(update={"host_key": found.pin})})
        target = cycle.make_target(recipe, found.spec)
        remote = connect(target, accept_new_host_key=found.pin is None, say=self.inner.say)
        remote.close()
        self.unpinned = True
        self._post("say", f"recover: {found.spec} answers" + (f" with the pinned host key {found.pin}" if found.pin
                                                              else "; its host key is accepted for that address "
                                                                   "(a new instance from recover.command)"))

    def bring_up(self, specs: list[HostSpec], new: list[rent.Rented] | None = None) -> list[cycle.UpResult]:
        self.say(f"recover: `up` on {' '.join(map(str, specs))}")

        def again(exc: BaseException, seconds: float) -> None:
            self.warn(f"recover: up failed: {_first_line(exc)}; again in {seconds:.0f}s")

        def up() -> list[cycle.UpResult]:
            self.still_holding()
            return cycle.up(self.current(self.recipe.ssh.wait), specs, self.inner)

        try:
            results = retrying(up,
                               transient=lambda e: _recoverable(e) and isinstance(e, ConnectError),
                               attempts=self.recipe.recover.attempts, first=5.0, most=60.0, on_retry=again)
        except RelaunchError as exc:
            if new:
                exc.message += (f"\nthe replacement{'s' if len(new) > 1 else ''} "
                                f"{' '.join(str(r.spec) for r in new)} {'are' if len(new) > 1 else 'is'} rented and "
                                "billing: fix the cause and run `relaunch up RECIPE HOST...` there, or destroy it")
            raise
        self.look_at(specs)
        self.next_round = time.monotonic() + self.recipe.checkpoint.every
        return results

    def grow_back(self) -> None:
        """recover.shrink: once every replacement being rented is there and the shrunk group's next
        checkpoint is verified in the store, the group saves (run.stop), is evacuated and comes back
        at full size, with every replacement rented (also those of a second loss meanwhile)."""
        if not self.renting and not self.spares:
            return
        for renting in [f for f in self.renting if f.done()]:
            self.renting.remove(renting)
            exc = renting.exception()
            if isinstance(exc, RelaunchError):
                self.warn(f"recover: renting a replacement failed: {_first_line(exc)}")
        if self.renting:
            return                       # one grow back, with every replacement
        with self.spare_lock:
            spares = list(self.spares)
        if not spares:
            self.warn(f"recover: no replacement to grow back with; training goes on on {len(self.specs)} node(s)")
            return
        if not self.said_ready:
            self.said_ready = True
            self.say(f"replacement{'s' if len(spares) > 1 else ''} ready: {' '.join(str(r.spec) for r in spares)}; "
                     f"growing back at the next checkpoint verified in the store (after step {self.grow_after})")
        if (self.last_stored or 0) <= self.grow_after:
            return
        self.still_holding()
        self.said_ready = False
        before, old = len(self.specs), self.host
        entry = history.Interruption.start(old, "grow", f"{before} -> {before + len(spares)} nodes: replacements "
                                           f"{' '.join(str(r.spec) for r in spares)} are there", time.time(),
                                           self.newest_seen(), None)
        self.say(f"growing back to {before + len(spares)} nodes: asking training to save (run.stop), evacuating, "
                 "then `up` on the whole group")
        self.rounds.abort()
        try:
            # reverify: as after a notice, the newest is hashed on the instance again, never taken on its record
            report = cycle.evacuate(self.current(), self.specs, self.inner, stop=True, newest_only=True)
            entry.newest_verified_step = report.stored_step
            seen = max([s for s in (entry.newest_seen_step, report.newest_step) if s is not None], default=None)
        except (Interrupted, UsageError):
            raise
        except RelaunchError as exc:
            # stopped, but its save not verified: the grown group resumes from the store's newest
            self.warn(f"growing back: the save was NOT verified ({_first_line(exc)}); the group comes back from the "
                      "newest checkpoint the store holds")
            entry.newest_verified_step = self.store_newest()
            seen = entry.newest_seen_step
        entry.newest_seen_step = seen
        entry.steps_lost = None if seen is None else max(seen - (entry.newest_verified_step or 0), 0)
        entry.nodes_before = before
        with self.spare_lock:            # from here on the group's (or named by bring_up's error)
            self.spares = [r for r in self.spares if r not in spares]
        results = self.bring_up(self.specs + [r.spec for r in spares], new=spares)
        entry.resumed(self.host, time.time())
        entry.nodes_after = len(self.specs)
        first = results[0]
        self.ok(f"grown back: training {first.status} on {self.host} ({len(self.specs)} nodes, resumed from "
                f"{first.checkpoint or 'nothing'}), {entry.time_to_resume:g}s without training")
        self.emit("up", **first.as_dict(), nodes=[str(s) for s in self.specs])
        self.record(entry)

    # -- replaced instances --------------------------------------------------------------------
    def retire(self, specs: list[HostSpec]) -> None:
        """A replaced instance may come back (a network outage, a paused instance): look at it now and
        then. Not one whose address a current node has now: the provider gave it away, and what
        answers there is the new instance."""
        self.alive_said.clear()
        for spec in specs:
            if self._taken(spec):
                continue
            looker = Looker(self.current(5), spec, max(REPLACED_LOOKS * self.every, 10.0), self.wake,
                            listing_every=0).start()
            self.replaced[str(spec)] = looker

    def _taken(self, spec: HostSpec) -> bool:
        mine = cycle.make_target(self.recipe, spec)
        return any((t.address, t.port) == (mine.address, mine.port)
                   for t in (cycle.make_target(self.recipe, s) for s in self.specs))

    def look_at_replaced(self) -> None:
        for name, looker in list(self.replaced.items()):
            view = looker.view()
            if view.fatal is not None or self._taken(view.spec):   # another machine there now: it is gone
                looker.stop()
                del self.replaced[name]
                continue
            if view.look is None or view.silent_since is not None or self.ending is not None:
                continue
            looker.stop()
            del self.replaced[name]
            stored = self.store_newest()
            if not view.look.training:
                self.warn(f"{name} (replaced) answers again; its training is not running. It is still billing "
                          "until you destroy it")
                continue
            if view.newest_complete is not None and view.newest_complete > (stored or 0):
                self.warn(f"{name} (replaced) answers again and is still training; it holds a checkpoint at step "
                          f"{view.newest_complete}, newer than the store's newest verified ({stored}): left running. "
                          f"The replacement resumed from the store; keep one of them (`relaunch evacuate RECIPE "
                          f"{name} --stop` stops it) and destroy the other: both are billing")
                continue
            self.warn(f"{name} (replaced) answers again and was still training; it holds nothing newer than the "
                      "store: ending its training now. It is still billing until you destroy it")
            self.emit("replaced-back", node=name)
            self.ending = self.background.submit(cycle.stop_training, self.current(10), [view.spec], self.inner)


def _save_words(save: dict[str, Any]) -> str:
    state = save.get("state")
    if state == "saved":
        return f"saved and exited{' after ' + str(save['seconds']) + 's' if 'seconds' in save else ''}"
    if state == "exited":
        return f"exited with status {save.get('exit') or '?'}"
    if state == "not running":
        return "was not running"
    return f"has not finished saving ({state or 'no word from the guard'})"


def watch(recipe: Recipe, specs: list[HostSpec], ui: UI, emit: Callable[[str], None] | None = None,
          overrides: list[str] | None = None, take_over: bool = False) -> WatchEnd:
    return Watch(recipe, specs, ui, emit, overrides, take_over).run()
