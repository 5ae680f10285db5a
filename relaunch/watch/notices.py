"""The watch's answer to a reclaim notice (on_notice): the round under way ended, the guard's save
waited for (every node of a group asked to save), the newest checkpoint evacuated and verified by
its bytes, whether the save after the notice made the deadline said and recorded, then recover;
and to a rebalance recommendation (a round at once).
"""

from __future__ import annotations

import json
import time
from typing import Any

from .. import cycle, history, processes, verdicts
from ..errors import EvacuationError, Interrupted, RelaunchError, UsageError
from ..steps.evacuate import Report
from ..steps.guard import record_command
from .failures import first_line
from .looks import View
from .rounds import clock
from .state import WatchBase, WatchEnd

SAVE_SLACK = 10.0          # seconds beyond run.stop.timeout to wait for the guard's save
WRITE_BACK_DEADLINE = 15.0


class NoticeHandling(WatchBase):
    """Watch's methods for notices (a mixin: its state lives in Watch)."""

    # -- a reclaim notice ----------------------------------------------------------------------
    def on_notice(self, view: View) -> WatchEnd | None:
        assert view.look is not None and view.look.notice is not None
        notice = dict(view.look.notice)
        self.handled.add(notice.get("seen_at"))
        source, detail = notice.get("source", "?"), notice.get("detail", "")
        # the notice's times are on the instance's clock: every comparison with this machine's goes through
        # the offset its looks measured
        offset = view.clock_offset or 0.0
        skew = verdicts.offset_words(view.clock_offset)
        seen = float(notice.get("seen_at") or time.time() + offset)
        deadline = float(notice.get("deadline") or seen)
        here = deadline - offset                     # the deadline on this machine's clock
        where = f"{view.host}: " if not self.group else f"{view.host} (node {self.specs.index(view.spec)}): "
        self.warn(f"{where}reclaim notice from {source}: {detail}; deadline {clock(here)} "
                  f"({here - time.time():.0f}s left, from {notice.get('deadline_from', '?')})"
                  + (f"; {skew}" if skew else ""))
        self.emit("notice", node=view.host, notice=notice)
        if self.group:
            # every node at once: the ranks of every node stop at the same step and save together
            try:
                cycle.ask_to_stop(self.current(5), self.specs, self.inner)
                self.say(f"asked the training on every node to save and stop (SIG{self.recipe.run.stop.signal})")
            except (Interrupted, UsageError):
                raise
            except RelaunchError as exc:
                self.warn(f"could not ask every node to save: {first_line(exc)}")
        if self.rounds.busy:
            self.rounds.abort()
            self.say("the sync round copying meanwhile was ended: the save after the notice goes first (its partial "
                     "copy stays in the store's staging for a later round; nothing of it is trusted)")
        notice = self.wait_for_save(view, notice, here)
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
            self.warn(f"{where}evacuation after the notice NOT verified: {first_line(exc)}")
        finished = time.time()
        if self.group:
            # a rank that did not stop (a launcher waiting on the node that is going) holds nothing more
            try:
                cycle.stop_training(self.current(5), self.specs, self.inner)
            except (Interrupted, UsageError):
                raise
            except RelaunchError as exc:
                self.warn(f"could not end what is left of the training: {first_line(exc)}")
        verified = report is not None and report.safe
        shown = self.newest_seen()
        # made the deadline: the save the notice asked for, verified by its bytes in time; not merely
        # a verified checkpoint (an older one is verified in no time when the save was cut short)
        verdict = verdicts.notice_saved(verdicts.NoticeCopy(
            save_state=save.get("state"), noticed_at=seen, deadline=deadline, finished=finished, clock_offset=offset,
            newest=report.newest if report else None, newest_step=report.newest_step if report else None,
            newest_mtime=report.newest_mtime if report else None,
            verified_now=tuple(report.verified_now) if report else (), seen_step=shown))
        made = verified and verdict.ok
        after_deadline = finished > here
        if report is not None and verified:
            newest = f"{report.newest} (step {report.newest_step})" if report.newest else "no checkpoint"
            timing = (f"{here - finished:.0f}s before the deadline" if made
                      else f"NOT before the deadline ({finished - here:.0f}s late)" if after_deadline
                      else f"but NOT the save after the notice before the deadline: {verdict.why}")
            if skew and (made or after_deadline):
                timing += f" ({skew})"
            (self.ok if made else self.warn)(f"{where}evacuated after the notice: {newest} verified in "
                                             f"{report.store}, {timing}")
        copy = {"by": "relaunch watch", "verified": verified, "checkpoint": report.newest if report else None,
                "step": report.newest_step if report else None, "seconds": round(finished - started, 1),
                "finished": history.iso(finished + offset), "clock_offset": round(offset, 1), "made_deadline": made,
                "why": verdict.why}
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
        # the history is on this machine's clock (a resumption's time is)
        entry = history.Interruption.start(view.host, "notice", f"{source}: {detail}", seen - offset, seen_step,
                                           verified_step)
        entry.deadline, entry.made_deadline = history.iso(here), made
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
        up (`deadline`, on this machine's clock); in a node group, also until the training is gone on
        every node (they save together)."""
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
        self.round_asked = time.monotonic()          # a round in flight began before it: one more after it
        self.next_round = 0.0                       # the next (or this) tick starts one


def _save_words(save: dict[str, Any]) -> str:
    state = save.get("state")
    if state == "saved":
        return f"saved and exited{' after ' + str(save['seconds']) + 's' if 'seconds' in save else ''}"
    if state == "exited":
        return f"exited with status {save.get('exit') or '?'}"
    if state == "not running":
        return "was not running"
    if state == "no save":
        return "exited 0 without saving (nothing in checkpoint.dir written after the notice)"
    return f"has not finished saving ({state or 'no word from the guard'})"
