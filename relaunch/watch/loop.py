"""The watch's loop (its state and output in state.py, the notice handling in notices.py, the
recovery in replacing.py): it reads the latest look at every node (looks.py), starts and collects the
copy-off rounds (rounds.py), and decides, from what the nodes show now:

- a new complete checkpoint on node 0 (its look lists checkpoint.dir): a round at once, unless one
  runs (the next one then starts when it ends and copies whatever is newest then); without a new
  one, a round after checkpoint.every; the exposure (exposure.py) measured at every look, said
  when the copies fall behind the saves;
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

import time
from collections.abc import Callable

from .. import cycle, history, processes
from ..errors import EnvError, EvacuationError, RelaunchError
from ..host.spec import HostSpec
from ..recipe import Recipe
from ..retry import retrying
from ..steps.evacuate import Report, round_line
from ..ui import UI, redact
from . import recover as rent
from .failures import first_line, recoverable
from .looks import View
from .notices import NoticeHandling
from .replacing import Replacing
from .rounds import LAST_ROUND_TRIES
from .state import WatchEnd

ALIVE_AGAIN = 30.0         # seconds before recover.alive is asked again about the same host


class Watch(NoticeHandling, Replacing):
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
        self.say(f"watching {self.host}: a look every {self.every:g}s, a sync round as each checkpoint is saved "
                 f"(at least every {self.recipe.checkpoint.every:g}s), lost after {recover.lost_after:g}s without an "
                 "answer"
                 + (f" (and recover.alive `{recover.alive}` saying it is gone)" if recover.alive else "")
                 + "; recover: " + (f"`{recover.command}`" + (", shrinking the group meanwhile" if recover.shrink
                                                             and self.group else "")
                                    if recover.command else
                                    "none (recover.command unset): wait for the instance to come back"))
        while True:
            processes.wait(self.wake, self.every)
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
                # its tries are used up: the next round at checkpoint.every, a new checkpoint or not
                self.next_round = time.monotonic() + self.recipe.checkpoint.every
                self.given_up = True
        if self.ending is not None and self.ending.done():
            exc = self.ending.exception()
            if isinstance(exc, RelaunchError):
                self.warn(first_line(exc))
            self.ending = None

    def plan_next_round(self, started: float) -> None:
        """After checkpoint.every, or at once when a round was asked for (a rebalance) after the one
        that just ended had begun: that one may not hold what was there when it was asked."""
        if self.round_asked is not None and started < self.round_asked:
            self.next_round = 0.0
            return
        self.round_asked = None
        self.next_round = time.monotonic() + self.recipe.checkpoint.every

    def after_round(self, report: Report, started: float) -> None:
        self.plan_next_round(started)
        self.last_stored = report.stored_step
        self.stored = report
        self.given_up = False
        for looker in self.lookers.values():
            looker.answered(started)        # a round that worked heard from every node, when it began
        self.ui.ok(round_line(report))
        began = time.time() - (time.monotonic() - started)
        self.emit("round", started=history.iso(began), **report.as_dict())
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
            # only a look sent after the wait began: one sent before the silence can answer once the
            # link is back with what it saw then (its answer waited in the dead link), training included
            if all(v.silent_since is None and v.sent_at > self.waiting_since for v in views):
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
        newest = views[0].newest_complete
        if (now >= self.next_round or self.saved_since_round(views[0])) and self.rounds.start():
            self.round_newest = newest          # a round already running is not doubled: start() says so
        self.follow_exposure(views[0])
        return None

    def saved_since_round(self, view: View) -> bool:
        """Node 0 holds a complete checkpoint newer than both the store's newest verified and its
        newest when the last round began: a round now (not after a round that used up its tries:
        that waits for checkpoint.every). What the look saw only says when to copy; what the round
        copies is what it finds newest then, verified by the store's bytes."""
        newest = view.newest_complete
        if newest is None or self.given_up:
            return False
        return all(newest > known for known in (self.last_stored, self.round_newest) if known is not None)

    def follow_exposure(self, view: View) -> None:
        """The exposure at this look, once a round said what the store holds; a line (and an
        `exposure` event) when the copies fall behind the saves or catch up again; status's copy in
        the watch's state file when it changed."""
        if self.stored is None:
            return
        before = self.meter.now
        now = self.meter.measure(view.complete, self.stored)
        if now is None:
            return
        news = self.meter.news()
        if news == "behind":
            self.warn(f"exposure {now.words()}: {now.behind} checkpoints not verified in the store yet; the copies "
                      "fall behind the saves")
        elif news == "caught up":
            self.say(f"exposure back to {now.words()}: the copies keep up with the saves again")
        if news is not None:
            self.emit("exposure", **now.as_dict())
        if before is None or (before.newest_step, before.stored_step) != (now.newest_step, now.stored_step):
            worst = self.meter.worst
            self.holder.note(exposure=now.as_dict(), exposure_most=worst.as_dict() if worst else None)

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

    # -- lost, back -----------------------------------------------------------------------
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
            self.waiting_since = time.monotonic()

    def came_back(self, views: list[View]) -> None:
        entry = self.waiting
        assert entry is not None
        self.waiting = None
        if all(v.look is not None and v.look.training for v in views):
            self.say(f"{self.host}: back, and training is still running there")
            entry.resumed(self.host, time.time())
            self.record(entry)
        else:
            self.say(f"{self.host}: back; training is not running: `up` there")
            if self.group:
                cycle.stop_training(self.current(), self.specs, self.inner)
            self.up_here(entry)
            self.tell(entry)

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
            self.tell(entry)
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
            why = first_line(outcome.failed) if outcome.failed is not None else "no report"
            return f"the last sync round failed {LAST_ROUND_TRIES} times: {why}"
        self.after_round(outcome.report, outcome.started)
        return None if outcome.report.safe else outcome.report.why

    def up_here(self, entry: history.Interruption) -> None:
        def again(exc: BaseException, seconds: float) -> None:
            self.warn(f"{self.host}: up failed: {first_line(exc)}; again in {seconds:.0f}s")

        def up() -> list[cycle.UpResult]:
            self.still_holding()
            return cycle.up(self.current(self.recipe.ssh.wait), self.specs, self.inner)

        results = retrying(up, transient=recoverable, attempts=self.recipe.recover.attempts, first=5.0, most=60.0,
                           on_retry=again)
        entry.resumed(self.host, time.time())
        self.write_down(entry)
        result = results[0]
        resumed = f" (resumed from {result.checkpoint}, step {result.step})" if result.checkpoint else ""
        self.ok(f"{self.host}: training {result.status} again{resumed}")
        self.emit("up", **result.as_dict())
        self.look_at(self.specs)
        self.next_round = time.monotonic() + self.recipe.checkpoint.every


def watch(recipe: Recipe, specs: list[HostSpec], ui: UI, emit: Callable[[str], None] | None = None,
          overrides: list[str] | None = None, take_over: bool = False) -> WatchEnd:
    return Watch(recipe, specs, ui, emit, overrides, take_over).run()
