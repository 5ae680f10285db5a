"""`relaunch watch`: everything `sync` does, plus a look at the guard every few seconds, and
recovery when the instance is reclaimed or lost.

The loop, on this machine:
- every `guard.every` seconds one read-only look at the instance (training's and the guard's
  tmux sessions, the guard's notice record, now and then checkpoint.dir) over one kept SSH
  connection; every `checkpoint.every` seconds a `sync` round (the same copy + verify).
- a notice from the guard: wait for the save the guard asked for (until the notice's deadline),
  then evacuate at once (the same evacuation as `relaunch evacuate`, newest checkpoint
  verified), say whether it was verified before the deadline, add the copy to the notice
  record on the instance and the interruption to the store's history; then recover.
- no answer for `recover.lost_after` seconds: the instance is lost; the interruption goes into
  the history (with the steps lost: newest checkpoint seen there minus newest verified), then
  recover.
- recover: with `recover.command`, run it here (deadline `recover.timeout`), take the HOST on
  its last line (and the host key fingerprint after it, pinned), `up` there, and go on watching
  that host; up to `recover.attempts` times, with backoff (the one retry policy). Without it,
  wait for the instance to answer again and `up` there (a paused instance that comes back).
- training ended by itself: a last round, then exit 0 (finished) or 4 (it failed: not an
  interruption of the instance).

Ctrl-C ends the watch and the command or copy it is running; it never signals the training.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import history, processes
from .cycle import evacuate_job, executor_for, make_target, open_host, up_one
from .errors import ConnectError, EnvError, EvacuationError, HostKeyError, Interrupted, RelaunchError, UsageError, \
    shorten
from .gather import gather
from .host.connection import Remote, connect
from .host.facts import HostFacts
from .host.spec import HostSpec
from .job import Facts, Job, Node
from .layouts import complete_checkpoints
from .recipe import Recipe, render_context
from .recipe.model import SSH
from .retry import retrying
from .steps.evacuate import Report, round_line
from .steps.guard import LOOK_DEADLINE, Look, look_command, newest_logged_step, parse_look, record_command
from .sync import RETRY_WAIT, sync_round
from .transports import open_store
from .ui import UI, redact

CONNECT_WAIT = 10.0        # seconds one reconnection for a look may take (the loop goes on meanwhile)
LISTING_EVERY = 10.0       # seconds between looks that also list checkpoint.dir (newest step seen)
SAVE_SLACK = 10.0          # seconds beyond run.stop.timeout to wait for the guard's save
WRITE_BACK_DEADLINE = 15.0


@dataclass
class Outcome:
    """How the watch ended (when it did not run until Ctrl-C)."""

    reason: str              # "finished" | "notice handled"
    host: str

    def as_dict(self) -> dict[str, Any]:
        return {"event": "end", "reason": self.reason, "host": self.host}


def _brief(recipe: Recipe, wait: float) -> Recipe:
    return recipe.model_copy(update={"ssh": recipe.ssh.model_copy(update={"wait": min(recipe.ssh.wait, wait)})})


def _pinned(recipe: Recipe, fingerprint: str | None) -> Recipe:
    """The recipe for a replacement: its own host key pin (or none: trust on first use)."""
    return recipe.model_copy(update={"ssh": recipe.ssh.model_copy(update={"host_key": fingerprint})})


def _clock(epoch: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(epoch))


class Watch:
    def __init__(self, recipe: Recipe, spec: HostSpec, ui: UI, emit: Callable[[str], None] | None = None) -> None:
        self.base = recipe                  # as the user gave it (a replacement gets its own pin)
        self.recipe, self.spec = recipe, spec
        self.ui = ui
        # one line per step: the building blocks' own messages only with -v
        self.inner = UI(verbose=ui.verbose, quiet=not ui.verbose)
        self._emit = emit
        self.remote: Remote | None = None
        self.job: Job | None = None
        self.reset_host()

    # -- output ------------------------------------------------------------------------------
    def emit(self, event: str, **data: Any) -> None:
        if self._emit is not None:
            self._emit(json.dumps({"event": event, "time": history.iso(time.time()), "host": str(self.spec), **data}))

    def say(self, text: str) -> None:
        self.ui.say(f"{time.strftime('%H:%M:%S')} {text}")

    def warn(self, text: str) -> None:
        self.ui.warn(f"{time.strftime('%H:%M:%S')} {text}")

    # -- the host being watched ----------------------------------------------------------------
    def reset_host(self) -> None:
        self.close()
        self.last_answer = time.monotonic()
        self.last_answer_epoch = time.time()
        self.newest_seen: int | None = None
        self.next_round = 0.0
        self.next_listing = 0.0
        self.outage_said = False
        self.waiting_for: history.Interruption | None = None   # lost, no recover.command: back?

    def close(self) -> None:
        if self.remote is not None:
            self.remote.close()
        self.remote, self.job = None, None

    @property
    def host(self) -> str:
        return str(self.spec)

    def look(self) -> Look | None:
        """One read-only look; None when the instance does not answer."""
        if self.remote is None or not self.remote.alive:
            self.close()
            target = make_target(_brief(self.recipe, CONNECT_WAIT), self.spec)
            try:
                remote = connect(target, say=self.inner.say)
            except HostKeyError:
                raise                       # another machine answers there: not an outage
            except ConnectError as exc:
                self._outage(exc.message)
                return None
            self.remote = remote
            self.job = Job(self.recipe, Node(target), Facts(host=HostFacts(home=remote.home)))
        assert self.job is not None
        listing = time.monotonic() >= self.next_listing
        result = self.remote.exec(look_command(self.job, listing), deadline=LOOK_DEADLINE)
        if result.status is None:
            self.close()
            self._outage("the look did not answer" if result.timed_out else "the SSH connection was lost")
            return None
        look = parse_look(result.stdout)
        logged = newest_logged_step(look.log_tail, self.recipe.run.metrics.step)
        if logged is not None:
            self.newest_seen = max(logged, self.newest_seen or 0)
        if look.listing is not None:
            self.next_listing = time.monotonic() + LISTING_EVERY
            c = self.recipe.checkpoint
            complete = complete_checkpoints(look.listing, c.layout, c.pattern)
            if complete:
                self.newest_seen = max(complete[-1].step, self.newest_seen or 0)
        if self.outage_said:
            self.say(f"{self.host}: answers again")
            self.outage_said = False
        self.last_answer, self.last_answer_epoch = time.monotonic(), time.time()
        return look

    def _outage(self, why: str) -> None:
        if not self.outage_said:
            lost_after = self.recipe.recover.lost_after
            self.warn(f"{self.host}: no answer ({redact(why).splitlines()[0]}); lost after {lost_after:g}s without one")
            self.emit("unreachable", why=redact(why))
            self.outage_said = True

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> Outcome:
        try:
            return self._loop()
        finally:
            self.close()

    def _loop(self) -> Outcome:
        every = self.recipe.guard.every
        self.say(f"watching {self.host}: a look every {every:g}s, a sync round every {self.recipe.checkpoint.every:g}s"
                 f", lost after {self.recipe.recover.lost_after:g}s without an answer; recover: "
                 + (f"`{self.recipe.recover.command}`" if self.recipe.recover.command else
                    "none (recover.command unset): wait for the instance to come back"))
        while True:
            look = self.look()
            if look is None:
                if time.monotonic() - self.last_answer >= self.recipe.recover.lost_after and self.waiting_for is None:
                    self.lost()
                    continue
            else:
                notice = look.notice
                if notice and notice.get("source"):
                    outcome = self.on_notice(look)
                    if outcome is not None:
                        return outcome
                    continue
                if self.waiting_for is not None:
                    self.came_back(look)
                    continue
                if not look.training:
                    outcome = self.training_ended(look)
                    if outcome is not None:
                        return outcome
                    continue
                if time.monotonic() >= self.next_round:
                    self.round()
            processes.sleep(every)

    def round(self) -> Report | None:
        try:
            report = sync_round(_brief(self.recipe, RETRY_WAIT), self.spec, self.inner)
        except (Interrupted, UsageError):
            raise
        except RelaunchError as exc:
            # an outage in the middle of a round is the looks' business; anything else (a full
            # disk here, a store conflict) ends the watch as it ends `sync`
            if isinstance(exc, EvacuationError) and self.look() is not None:
                raise
            self.warn(f"{self.host}: sync round failed: {redact(exc.message).splitlines()[0]}")
            self.next_round = time.monotonic() + self.recipe.guard.every
            return None
        self.next_round = time.monotonic() + self.recipe.checkpoint.every
        self.last_answer, self.last_answer_epoch = time.monotonic(), time.time()   # a round that worked answered
        if report.newest_step is not None:
            self.newest_seen = max(report.newest_step, self.newest_seen or 0)
        self.ui.ok(f"{round_line(report)}")
        self.emit("round", **report.as_dict())
        return report

    def evacuate(self) -> Report:
        """The same evacuation as `relaunch evacuate` (newest checkpoint verified), not stopping training."""
        recipe = _brief(self.recipe, RETRY_WAIT)
        store = open_store(recipe)
        node, remote = open_host(recipe, self.spec, self.inner)
        with remote:
            job = gather(remote, recipe, node)
            with store.lock(self.inner):
                return evacuate_job(job, remote, store, executor_for(job, remote, store, self.inner), self.inner,
                                    reverify=False)

    # -- a reclaim notice ----------------------------------------------------------------------
    def on_notice(self, look: Look) -> Outcome | None:
        notice = dict(look.notice or {})
        source, detail = notice.get("source", "?"), notice.get("detail", "")
        seen = float(notice.get("seen_at") or time.time())
        deadline = float(notice.get("deadline") or seen)
        self.warn(f"{self.host}: reclaim notice from {source}: {detail}; deadline {_clock(deadline)} "
                  f"({deadline - time.time():.0f}s left, from {notice.get('deadline_from', '?')})")
        self.emit("notice", notice=notice)
        notice = self.wait_for_save(notice, deadline)
        save = notice.get("save") or {}
        self.say(f"{self.host}: guard: training {self._save_words(save)}; evacuating now")
        started = time.time()
        report: Report | None = None
        try:
            report = self.evacuate()
        except (Interrupted, UsageError):
            raise
        except RelaunchError as exc:
            self.warn(f"{self.host}: evacuation after the notice NOT verified: {redact(exc.message).splitlines()[0]}")
        finished = time.time()
        verified = report is not None and report.safe
        made = verified and finished <= deadline
        if report is not None and verified:
            newest = f"{report.newest} (step {report.newest_step})" if report.newest else "no checkpoint"
            timing = (f"{deadline - finished:.0f}s before the deadline" if made
                      else f"NOT before the deadline ({finished - deadline:.0f}s late)")
            line = f"{self.host}: evacuated after the notice: {newest} verified in {report.store}, {timing}"
            (self.ui.ok if made else self.ui.warn)(f"{time.strftime('%H:%M:%S')} {line}")
        copy = {"by": "relaunch watch", "verified": verified, "checkpoint": report.newest if report else None,
                "step": report.newest_step if report else None, "seconds": round(finished - started, 1),
                "finished": history.iso(finished), "made_deadline": made}
        self.emit("evacuated", **copy, report=report.as_dict() if report else None)
        notice["copy"] = copy
        notice["verdict"] = (f"{notice.get('verdict') or ''}; the copy: "
                             + (f"{copy['checkpoint']} verified in the store "
                                + ("before the deadline" if made else "AFTER the deadline")
                                if verified else "NOT verified")).lstrip("; ")
        self.write_back(notice)
        seen_step = max([s for s in (self.newest_seen, report.newest_step if report else None) if s is not None],
                        default=None)
        verified_step = report.stored_step if report is not None else self.store_newest()
        entry = history.Interruption.start(self.host, "notice", f"{source}: {detail}", seen, seen_step, verified_step)
        entry.deadline, entry.made_deadline = history.iso(deadline), made
        entry.copy_seconds = round(finished - started, 1) if verified else None
        self.record(entry)
        if not self.recipe.recover.command:
            if not verified:
                raise EvacuationError(f"{self.host}: after the reclaim notice, the newest checkpoint is not "
                                      "verified in the store", "rerun `relaunch evacuate` while the instance exists")
            self.say(f"{self.host}: no recover.command: training is stopped and its newest checkpoint is in the store; "
                     "bring it up on a new instance with `relaunch up RECIPE HOST`")
            return Outcome("notice handled", self.host)
        self.recover(entry)
        return None

    def wait_for_save(self, notice: dict[str, Any], deadline: float) -> dict[str, Any]:
        """The notice record once the guard says how the save went, training is gone, or the time is up."""
        until = min(deadline, time.time() + self.recipe.run.stop.timeout + SAVE_SLACK)
        while (notice.get("save") or {}).get("state") in (None, "asking") and time.time() < until:
            processes.sleep(1.0)
            look = self.look()
            if look is None:
                break
            if look.notice and look.notice.get("seen_at") == notice.get("seen_at"):
                notice = dict(look.notice)
            if (notice.get("save") or {}).get("state") in (None, "asking") and not look.training and not look.guard:
                notice["save"] = {"state": "saved" if look.exit == "0" else "exited", "exit": look.exit}
        return notice

    @staticmethod
    def _save_words(save: dict[str, Any]) -> str:
        state = save.get("state")
        if state == "saved":
            return f"saved and exited{' after ' + str(save['seconds']) + 's' if 'seconds' in save else ''}"
        if state == "exited":
            return f"exited with status {save.get('exit') or '?'}"
        if state == "not running":
            return "was not running"
        return f"has not finished saving ({state or 'no word from the guard'})"

    def write_back(self, notice: dict[str, Any]) -> None:
        """Add the copy and the verdict to the notice record on the instance (when it still answers)."""
        if self.remote is None or self.job is None or not self.remote.alive:
            return
        result = self.remote.exec(record_command(self.job), deadline=WRITE_BACK_DEADLINE,
                                  stdin=(json.dumps(notice, sort_keys=True) + "\n").encode())
        if not result.ok:
            self.inner.warn(f"{self.host}: could not add the copy to the notice record: {shorten(result.output, 200)}")

    # -- lost, back, recovered -----------------------------------------------------------------
    def store_newest(self) -> int | None:
        try:
            store = open_store(self.recipe)
            store.read()
        except (Interrupted, UsageError):
            raise
        except RelaunchError as exc:
            self.warn(f"reading the store: {redact(exc.message).splitlines()[0]}")
            return None
        newest = store.manifest.newest() if store.manifest else None
        return newest.step if newest else None

    def record(self, entry: history.Interruption) -> None:
        try:
            history.record(open_store(self.recipe), entry, self.inner)
        except (Interrupted, UsageError):
            raise
        except RelaunchError as exc:
            self.warn(f"could not write the history of interruptions: {redact(exc.message).splitlines()[0]}")
        self.say(f"interruption recorded: {entry.line()}")
        self.emit("interruption", **entry.as_dict())

    def lost(self) -> None:
        silent = time.monotonic() - self.last_answer
        self.close()
        self.warn(f"{self.host}: no answer for {silent:.0f}s (recover.lost_after {self.recipe.recover.lost_after:g}s): "
                  "the instance is lost; if it comes back it may still be training: stop it (`relaunch evacuate "
                  "RECIPE HOST --stop`) or destroy it")
        entry = history.Interruption.start(self.host, "lost", f"no answer for {silent:.0f}s",
                                           self.last_answer_epoch, self.newest_seen, self.store_newest())
        self.record(entry)
        if self.recipe.recover.command:
            self.recover(entry)
        else:
            self.say(f"{self.host}: no recover.command: waiting for it to answer again (Ctrl-C to stop)")
            self.waiting_for = entry

    def came_back(self, look: Look) -> None:
        entry = self.waiting_for
        assert entry is not None
        self.waiting_for = None
        if look.training:
            self.say(f"{self.host}: back, and training is still running there")
            entry.resumed(self.host, time.time())
        else:
            self.say(f"{self.host}: back; training is not running: `up` there")
            self.up_here(entry)
        self.record(entry)

    def training_ended(self, look: Look) -> Outcome | None:
        if look.exit == "":
            # gone without an exit status: the instance restarted under it (a paused instance resumed)
            entry = history.Interruption.start(self.host, "restarted", "training was gone without an exit status",
                                               self.last_answer_epoch, self.newest_seen, self.store_newest())
            self.warn(f"{self.host}: training is not running and never exited (the instance restarted?): `up` there")
            self.up_here(entry)
            self.record(entry)
            return None
        self.round()
        if look.exit == "0":
            self.ui.ok(f"{time.strftime('%H:%M:%S')} {self.host}: training finished (exit 0); nothing more to watch")
            self.emit("finished")
            return Outcome("finished", self.host)
        raise EnvError(f"{self.host}: training exited with status {look.exit}: it failed by itself, the instance was "
                       "not taken away", "see `relaunch status` for its last lines; `relaunch up` starts it again")

    def up_here(self, entry: history.Interruption) -> None:
        def again(exc: BaseException, seconds: float) -> None:
            self.warn(f"{self.host}: up failed: {_first_line(exc)}; again in {seconds:.0f}s")

        result = retrying(lambda: up_one(self.recipe, self.spec, self.inner), transient=_recoverable,
                          attempts=self.recipe.recover.attempts, first=5.0, most=60.0, on_retry=again)
        entry.resumed(self.host, time.time())
        resumed = f" (resumed from {result.checkpoint}, step {result.step})" if result.checkpoint else ""
        self.ui.ok(f"{time.strftime('%H:%M:%S')} {self.host}: training {result.status} again{resumed}")
        self.emit("up", **result.as_dict())

    def recover(self, entry: history.Interruption) -> None:
        """recover.command, then `up` on the HOST it printed; the watch goes on there."""
        recover = self.recipe.recover
        kept: list[tuple[HostSpec, str | None]] = []     # a host whose `up` failed to connect: tried again
        attempt = [0]

        def once() -> tuple[Recipe, HostSpec, Any]:
            attempt[0] += 1
            if kept:
                spec, pin = kept.pop()
                self.say(f"recover attempt {attempt[0]}: `up` on {spec} again")
            else:
                spec, pin = self.run_command(entry, attempt[0])
            recipe = _pinned(self.base, pin)
            self.say(f"recover: `up` on {spec}" + (f" (host key pinned: {pin})" if pin else ""))
            try:
                return recipe, spec, up_one(recipe, spec, self.inner)
            except Interrupted:
                raise
            except ConnectError:
                kept.append((spec, pin))            # not reachable yet: the next attempt tries it again
                raise
            except RelaunchError:
                self.warn(f"recover: {spec} is not used after this failure; destroy it unless recover.command "
                          "reuses it (RELAUNCH_ATTEMPT counts the attempts)")
                raise

        recipe, spec, result = retrying(
            once, transient=_recoverable, attempts=recover.attempts, first=5.0, most=120.0,
            on_retry=lambda e, s: self.warn(f"recover attempt {attempt[0]} of {recover.attempts} failed: "
                                            f"{_first_line(e)}; next in {s:.0f}s"))
        old = self.host
        self.recipe, self.spec = recipe, spec
        self.reset_host()
        entry.resumed(self.host, time.time())
        resumed = f"resumed from {result.checkpoint} (step {result.step})" if result.checkpoint else "fresh start"
        self.ui.ok(f"{time.strftime('%H:%M:%S')} recovered: training {result.status} on {self.host} ({resumed}), "
                   f"{entry.time_to_resume:g}s after {old} stopped; watching {self.host} now")
        self.emit("up", **result.as_dict())
        self.record(entry)

    def run_command(self, entry: history.Interruption, attempt: int) -> tuple[HostSpec, str | None]:
        recover, recipe = self.recipe.recover, self.recipe
        assert recover.command is not None
        text, values = recipe.render_shell("recover.command", render_context(recipe, host=self.spec.address))
        env = {**os.environ, **values, "RELAUNCH_RECIPE": str(recipe.source), "RELAUNCH_NAME": recipe.name,
               "RELAUNCH_LOST_HOST": entry.host, "RELAUNCH_CAUSE": entry.cause, "RELAUNCH_ATTEMPT": str(attempt)}
        self.say(f"recover attempt {attempt} of {recover.attempts}: running recover.command `{recover.command}` "
                 f"(up to {recover.timeout:g}s)")
        done = processes.run(["bash", "-c", text], deadline=recover.timeout, env=env, cwd=recipe.source.parent,
                             on_stderr=lambda data: self.inner.detail(data.decode(errors="replace").rstrip()))
        if done.timed_out:
            raise ConnectError(f"recover.command did not finish within recover.timeout={recover.timeout:g}s; it was "
                               "ended", "make it wait for the instance itself, or raise recover.timeout")
        tail = [ln for ln in (done.text + "\n" + done.err).splitlines() if ln.strip()][-5:]
        if done.status != 0:
            raise ConnectError(f"recover.command failed (exit {done.status}): " + redact(" | ".join(tail)),
                               "try the command by hand; it must print the new HOST on its last line")
        lines = [ln.strip() for ln in done.text.splitlines() if ln.strip()]
        if not lines:
            raise ConnectError("recover.command printed nothing; its last line must be the new HOST",
                               "print HOST (and optionally the host key fingerprint) as the last line")
        words = lines[-1].split()
        try:
            spec = HostSpec.parse(words[0])
            pin = SSH.model_validate({"host_key": words[1]}).host_key if len(words) > 1 else None
        except (RelaunchError, ValueError) as exc:
            raise ConnectError(f"recover.command's last line {lines[-1]!r} is not HOST [SHA256:FINGERPRINT]: "
                               f"{_first_line(exc)}") from None
        self.say(f"recover.command gave {spec}" + (f" {pin}" if pin else ""))
        self.emit("recover", new_host=str(spec), host_key=pin, attempt=attempt)
        return spec, pin


def _recoverable(exc: BaseException) -> bool:
    return isinstance(exc, RelaunchError) and not isinstance(exc, (UsageError, Interrupted, HostKeyError))


def _first_line(exc: BaseException) -> str:
    message = exc.message if isinstance(exc, RelaunchError) else str(exc)
    return redact(message).splitlines()[0] if message else type(exc).__name__


def watch(recipe: Recipe, specs: list[HostSpec], ui: UI, emit: Callable[[str], None] | None = None) -> Outcome:
    if len(specs) != 1:
        raise UsageError("watch follows one instance; a node group is not watched yet",
                         "give node 0's HOST (the one that writes the checkpoints)")
    return Watch(recipe, specs[0], ui, emit).run()
