"""`relaunch drill RECIPE HOST... --watch`: the unattended path rehearsed for real. The drill
starts training, runs the real `relaunch watch RECIPE HOST... --json` beside it (a child process,
exactly as a user runs it), and makes two things happen to the instances, one after the other:

1. a reclaim notice, through the guard's `file:` source: for the length of the drill the recipe
   gets the guard source `file:~/.relaunch/NAME/drill-notice` (with `guard.enabled=true`), for
   `up` and for the watch (which passes it on to every `up` it runs); the drill writes that file,
   `{"seconds": N}`, on the group's last node: a notice N seconds ahead;
2. a silent loss, on sandbox instances only: every packet of the last node's link is dropped
   (`sandbox.set_silent`: no refusal, no error, nothing answers, as a machine that lost power),
   its training running on in the dark.

The watch does the rest on its own (the save, the evacuation, recover.command, `up` on the
replacement), and the drill waits for what it records. Then it stops the watch (Ctrl-C, as a user
does) and measures from the world (timeline.py): the steps in the training logs, followed as they
were written (follow.py), and the interruptions the watch wrote into the store's history. What it
does itself (when it wrote the notice, when it silenced a link) is never part of a measurement.

At the end the drill removes its notice file where it wrote it. The instances recover.command
rented are named; those that are sandbox instances (the drill had them rented) are destroyed
unless --keep, after the training on them is saved and evacuated (`evacuate --stop`), so the
store holds the newest step. Any other instance is left as it is, said, with how to end it.

One job (the unattended rehearsal), a little over 500 lines: the two faults share the watch's
child process, its output and the timeline, and would only pass them around if split.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .. import processes
from ..cycle import evacuate, make_target, open_host, up
from ..errors import (
    CheckpointError,
    ConnectError,
    EnvError,
    EvacuationError,
    Interrupted,
    RelaunchError,
    UsageError,
)
from ..history import read_history
from ..host.spec import HostSpec
from ..manifest import utc_now
from ..recipe import Recipe, check_recipe, load_recipe
from ..transports import open_store
from ..ui import UI
from .follow import Followers
from .timeline import Measured, Run, measure, runs_of

log = logging.getLogger("relaunch.drill")

INTERRUPTIONS = ("notice", "lost", "restarted", "grow")     # what ends a run (a rebalance does not)
LOOK_EVERY = 0.5
STOP_WAIT = 90.0             # seconds the watch has to end after its Ctrl-C
ERRORS: dict[int, type[RelaunchError]] = {2: UsageError, 3: ConnectError, 4: EnvError, 5: CheckpointError,
                                          6: EvacuationError, 130: Interrupted}


def notice_path(recipe: Recipe) -> str:
    return f"~/.relaunch/{recipe.name}/drill-notice"


def drill_sets(recipe: Recipe) -> list[str]:
    """What the drill adds to the recipe for its length (as `--set` options, also for the watch)."""
    source = f"file:{notice_path(recipe)}"
    sources = [s for s in recipe.guard.sources if s != source] + [source]
    return ["guard.enabled=true", f"guard.sources={json.dumps(sources)}"]


def sandbox_of(recipe: Recipe, spec: HostSpec) -> Any | None:
    """The sandbox instance at HOST's address, else None."""
    from .. import sandbox as sb

    target = make_target(recipe, spec)
    return next((i for i in sb.list_instances() if i.address == target.address and i.port == target.port), None)


class WatchChild:
    """`relaunch watch ... --json` in a process group of its own: its events as they come, its
    progress on our stderr; ended as a user ends it (SIGINT), and with us if we are killed."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.events: list[dict[str, Any]] = []
        self.document: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.proc = subprocess.Popen([*processes._DIE_WITH_US, *argv], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                     env={**os.environ, "COLUMNS": os.environ.get("COLUMNS", "200")})
        self._readers = [threading.Thread(target=self._read_events, name="watch events", daemon=True),
                         threading.Thread(target=self._read_document, name="watch document", daemon=True)]
        for reader in self._readers:
            reader.start()

    def _read_events(self) -> None:
        """`watch --json` says each event as a JSON line on stderr among its progress lines: the
        events are kept, every other line passes on to our stderr."""
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            line = raw.decode(errors="replace")
            if line.startswith('{"event"'):
                try:
                    data = json.loads(line)
                except ValueError:
                    data = None
                if isinstance(data, dict):
                    with self._lock:
                        self.events.append(data)
                    continue
            sys.stderr.write(line)
            sys.stderr.flush()

    def _read_document(self) -> None:
        """Its stdout: one document when it ends (how it ended, or its error)."""
        assert self.proc.stdout is not None
        text = self.proc.stdout.read().decode(errors="replace")
        try:
            data = json.loads(text) if text.strip() else {}
        except ValueError:
            data = {}
        with self._lock:
            self.document = data if isinstance(data, dict) else {}

    def _join(self) -> None:
        for reader in self._readers:
            reader.join(timeout=5)

    def since(self, n: int) -> list[dict[str, Any]]:
        with self._lock:
            return self.events[n:]

    @property
    def status(self) -> int | None:
        return self.proc.poll()

    def failure(self) -> RelaunchError:
        """The watch ended by itself: its own error, with its exit code."""
        status = self.proc.wait()
        self._join()
        with self._lock:
            doc = dict(self.document)
        error = doc if "error" in doc else None
        end = doc if doc.get("event") == "end" else None
        if error is not None:
            kind = ERRORS.get(int(error.get("exit") or status), RelaunchError)
            return kind(f"the watch ended (exit {status}): {error['error']}", error.get("hint"))
        why = f": {end.get('reason')}" if end else ""
        return CheckpointError(f"the watch ended by itself (exit {status}){why} before the drill was over",
                               "a training that finishes during the drill ends the watch: give it more steps")

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGINT)
                self.proc.wait(timeout=STOP_WAIT)
            except subprocess.TimeoutExpired:
                processes.end_group(self.proc)
            except ProcessLookupError:
                pass
        self._join()
        return self.proc.poll()


@dataclass(frozen=True)
class Rented:
    """An instance recover.command rented during the drill, as its `recover` event named it."""

    host: str
    pin: str | None                  # the host key fingerprint it printed
    sandbox: str | None = None       # the sandbox instance at that address then (the drill had it rented)
    fingerprint: str | None = None   # ... and its host key: the same instance at the end, or not ours


@dataclass
class State:
    """What the watch's events said so far, as the drill acts on it."""

    current: list[HostSpec]
    resumed_step: int = 0                            # the step the current run resumed from
    stored: list[int] = field(default_factory=list)  # stored steps the rounds since the last `up` verified
    rented: dict[str, Rented] = field(default_factory=dict)       # by HOST
    recovered: list[dict[str, Any]] = field(default_factory=list)  # interruption events with training again
    seen: int = 0                                    # events read


class WatchedDrill:
    def __init__(self, recipe: Recipe, specs: list[HostSpec], ui: UI, overrides: list[str], kinds: list[str],
                 past: int, after: int, tolerance: float, deadline: float, notice_seconds: float,
                 keep: bool) -> None:
        self.base, self.specs, self.ui = recipe, specs, ui
        self.overrides, self.kinds = overrides, kinds
        self.past, self.after, self.tolerance, self.deadline = past, after, tolerance, deadline
        self.notice_seconds, self.keep = notice_seconds, keep
        self.sets = drill_sets(recipe)
        self.recipe = load_recipe(recipe.source, [*overrides, *self.sets])
        check_recipe(self.recipe)
        self.store = open_store(self.recipe)
        self.followers = Followers(self.recipe)
        self.state = State(list(specs))
        self.watch: WatchChild | None = None
        self.silenced: list[str] = []                # sandbox names the drill silenced
        self.noticed: list[HostSpec] = []            # where it wrote its notice file
        self.step_no, self.steps = 0, 4 + len(kinds)
        self.started = time.time()

    # -- before anything is contacted ------------------------------------------------------------
    def check(self) -> None:
        recipe = self.base
        if not recipe.recover.command:
            raise UsageError("drill --watch needs recover.command: after each interruption the watch rents a "
                             "replacement with it and brings training up there",
                             "e.g. --set recover.command=./rent-sandbox.sh (examples/pytorch/rent-sandbox.sh rents "
                             "a local sandbox instance); see docs/spot.md")
        if "lost" in self.kinds:
            strangers = [str(s) for s in self.specs if sandbox_of(recipe, s) is None]
            if strangers:
                raise UsageError(f"the silent loss drops every packet of a sandbox instance's link; "
                                 f"{', '.join(strangers)} {'is' if len(strangers) == 1 else 'are'} not a sandbox "
                                 "instance here",
                                 "rehearse the reclaim notice alone with --watch=notice, or drill on sandbox "
                                 "instances (`relaunch sandbox create`)")
        from ..watch.holder import read_state

        other = read_state(recipe.name, self.store.label)
        if other and other.get("running"):
            raise UsageError(f"a `relaunch watch` of {recipe.name} runs here already (pid {other.get('pid')}): the "
                             "drill runs its own", "stop that watch first (Ctrl-C in its terminal)")

    def say(self, text: str) -> None:
        self.step_no += 1
        self.ui.say(f"# drill {self.step_no}/{self.steps}: {text}")

    # -- the run -----------------------------------------------------------------------------------
    def run(self) -> Measured:
        self.check()
        report = Measured(self.base.name, [str(s) for s in self.specs], list(self.kinds), self.tolerance,
                          at=utc_now())
        report.added = [f"guard source file:{notice_path(self.base)} (--set {self.sets[1]}), guard.enabled=true: "
                        "for `up` and the watch, for the length of the drill"]
        self.say(f"training on {' '.join(map(str, self.specs))}, with the drill's guard source "
                 f"file:{notice_path(self.base)} added for its length")
        finished = False
        try:
            self.remove_notice(self.specs, stale=True)
            for spec in self.specs:
                self.followers.follow(spec, self.recipe.ssh.host_key)
            results = up(self.recipe, self.specs, self.ui)
            running = [r.host for r in results if r.status != "started"]
            if running:
                raise UsageError(f"training was {results[0].status} on {', '.join(running)} before the drill: its "
                                 "guard does not know the drill's notice source",
                                 "stop it first (`relaunch evacuate RECIPE HOST... --stop`: it resumes from the "
                                 "store), then run the drill again")
            self.state.resumed_step = results[0].step
            self.start_watch()
            if "notice" in self.kinds:
                self.notice()
            if "lost" in self.kinds:
                self.lose()
            self.wait_after()
            self.say("stopping the watch (Ctrl-C, as a user stops it), then measuring from the logs and the "
                     "store's history")
            assert self.watch is not None
            self.watch.stop()
            self.followers.stop()
            records = [r for r in read_history(self.store) if r.at_epoch >= self.started]
            measure(report, self.followers.lines(), self.recipe.run.metrics, records)
            finished = True
        finally:
            if self.watch is not None:
                self.watch.stop()
            self.followers.stop()
            report.rented = list(self.state.rented)
            self.step_no = self.steps - 1                # the last step, also after a failure
            self.say("cleaning up what the drill added")
            report.left = self.clean_up(finished)
            for line in report.left:
                self.ui.say(f"  {line}")
        self.write(report)
        return report

    def start_watch(self) -> None:
        argv = [sys.executable, "-m", "relaunch.cli", "watch", str(self.base.source), *map(str, self.specs), "--json",
                *(["-v"] if self.ui.verbose else []), *[a for s in [*self.overrides, *self.sets] for a in ("--set", s)]]
        self.say(f"watching: `relaunch watch {self.base.source} {' '.join(map(str, self.specs))} --json` "
                 f"(+ the drill's --set) runs beside training; its lines follow")
        self.watch = WatchChild(argv)

    # -- the watch's events ------------------------------------------------------------------------
    def pump(self) -> None:
        assert self.watch is not None
        state = self.state
        for event in self.watch.since(state.seen):
            state.seen += 1
            kind = event.get("event")
            if kind == "recover" and event.get("new_host"):
                spec = HostSpec.parse(str(event["new_host"]))
                pin = event.get("host_key")
                inst = sandbox_of(self.recipe, spec)         # made by recover.command a moment ago
                if inst is not None and pin and inst.host_key_fingerprint != pin:
                    inst = None
                state.rented[str(spec)] = Rented(str(spec), pin, inst.name if inst else None,
                                                 inst.host_key_fingerprint if inst else None)
                self.followers.follow(spec, event.get("host_key"), from_start=True)   # before the watch's `up`
            elif kind == "up":
                names = event.get("nodes") or [event.get("host")]
                state.current = [HostSpec.parse(str(n)) for n in names]
                state.resumed_step = int(event.get("step") or 0)
                state.stored = []
                for spec in state.current:
                    self.followers.follow(spec, self.host_key(spec), from_start=str(spec) in state.rented)
            elif kind == "round" and event.get("stored_step") is not None:
                state.stored.append(int(event["stored_step"]))
            elif kind == "interruption" and event.get("resumed_epoch") is not None:
                state.recovered.append(event)
        if self.watch.status is not None:
            raise self.watch.failure()

    def host_key(self, spec: HostSpec) -> str | None:
        rented = self.state.rented.get(str(spec))
        return rented.pin if rented is not None else self.recipe.ssh.host_key

    def recipe_for(self, spec: HostSpec) -> Recipe:
        return self.recipe.model_copy(update={"ssh": self.recipe.ssh.model_copy(update={"host_key": self.host_key(
            spec)})})

    def wait(self, what: str, done: Any) -> Any:
        end = time.monotonic() + self.deadline
        while True:
            self.pump()
            value = done()
            if value:
                return value
            if time.monotonic() > end:
                raise CheckpointError(f"drill: {what} did not happen within {self.deadline:g}s",
                                      "the watch's lines above say where it stands; --deadline waits longer")
            processes.sleep(LOOK_EVERY)

    def runs(self) -> list[Run] | None:
        """The runs the logs show so far, once the one after the last recovery has trained a step
        (`up` may return before: a run.ready line that is not a step), else None."""
        runs = runs_of(self.followers.lines(), self.recipe.run.metrics)
        back = sum(e.get("cause") in INTERRUPTIONS for e in self.state.recovered)
        return runs if len(runs) > back else None

    def newest_run(self) -> Run | None:
        runs = self.runs()
        return runs[-1] if runs else None

    def recovered(self, cause: str, since: int) -> bool:
        return any(e.get("cause") == cause for e in self.state.recovered[since:])

    # -- the two interruptions -------------------------------------------------------------------
    def notice(self) -> None:
        state = self.state

        def ready() -> bool:
            run = self.newest_run()
            return bool(state.stored) and run is not None and run.last > max(state.stored)

        self.wait("a checkpoint verified in the store and a step after it", ready)
        victim = state.current[-1]
        path = self.write_notice(victim)
        self.say(f"a reclaim notice on {victim}: {path} written, {{\"seconds\": {self.notice_seconds:g}}} (the "
                 "guard's file: source); the watch is on its own now")
        mark = len(state.recovered)
        self.wait("training again after the notice", lambda: self.recovered("notice", mark))

    def lose(self) -> None:
        state, resumed = self.state, self.state.resumed_step

        def ready() -> bool:
            run = self.newest_run()
            newer = [s for s in state.stored if s > resumed] if "notice" in self.kinds else state.stored
            return bool(newer) and run is not None and run.last >= max(newer) + self.past

        self.wait(f"a checkpoint of this run verified in the store and {self.past} steps past it", ready)
        victim = state.current[-1]
        inst = sandbox_of(self.recipe, victim)
        if inst is None:
            raise UsageError(f"the silent loss drops every packet of a sandbox instance's link; {victim} (rented by "
                             "recover.command) is not a sandbox instance",
                             "rehearse the notice alone with --watch=notice, or rent sandbox instances "
                             "(examples/pytorch/rent-sandbox.sh)")
        from .. import sandbox as sb

        sb.set_silent(inst.name, True)
        self.silenced.append(inst.name)
        self.say(f"a silent loss of {victim} (sandbox {inst.name}): every packet of its link dropped, its training "
                 f"runs on in the dark; the watch calls it lost after recover.lost_after="
                 f"{self.recipe.recover.lost_after:g}s")
        mark = len(state.recovered)
        self.wait("training again after the silent loss", lambda: self.recovered("lost", mark))
        if len(self.specs) > 1 and self.recipe.recover.shrink:
            self.wait("the group grown back to its size", lambda: self.recovered("grow", mark))

    def wait_after(self) -> None:
        def enough() -> bool:
            runs = self.runs()
            if not runs:
                return False
            return runs[-1].last >= max([r.last for r in runs[:-1]] or [runs[0].first]) + self.after

        self.wait(f"{self.after} steps past every step trained before", enough)

    # -- the notice file ---------------------------------------------------------------------------
    def write_notice(self, spec: HostSpec) -> str:
        node, remote = open_host(self.recipe_for(spec), spec, UI(quiet=True))
        with remote:
            path = remote.expand(notice_path(self.base))
            body = json.dumps({"seconds": self.notice_seconds})
            q = shlex.quote
            result = remote.exec(f"mkdir -p -- {q(path.rsplit('/', 1)[0])} && printf %s {q(body)} > {q(path + '.tmp')}"
                                 f" && mv -f -- {q(path + '.tmp')} {q(path)}", deadline=30)
        if not result.ok:
            raise ConnectError(f"{spec}: could not write the drill's notice file {path}: {result.output.strip()}")
        self.noticed.append(spec)
        return path

    def remove_notice(self, specs: list[HostSpec], stale: bool = False) -> list[str]:
        """Remove the notice file (before `up`: one an earlier drill left would be a notice at once)."""
        problems = []
        for spec in specs:
            try:
                # stale: before the drill's `up`, on instances that may still be booting
                node, remote = open_host(self.recipe_for(spec), spec, UI(quiet=True), booting=stale)
                with remote:
                    remote.exec(f"rm -f -- {shlex.quote(remote.expand(notice_path(self.base)))}", deadline=30)
            except RelaunchError as exc:
                if stale:
                    raise
                problems.append(f"{spec}: {exc.message.splitlines()[0]}")
        return problems

    # -- the end -----------------------------------------------------------------------------------
    def clean_up(self, finished: bool) -> list[str]:
        """What the drill added goes; what recover.command rented is destroyed (sandbox instances the
        drill had rented, after their training is saved and evacuated) or named. Returns what is left."""
        from .. import sandbox as sb
        from ..cycle import stop_training

        left: list[str] = []
        reach = not processes.CANCEL.is_set()        # after a Ctrl-C: nothing more over SSH, only said
        if self.noticed and reach:
            left += [f"the drill's notice file is still there: {p}" for p in self.remove_notice(self.noticed)]
        elif self.noticed:
            left.append(f"the drill's notice file {notice_path(self.base)} is still on "
                        f"{' '.join(map(str, self.noticed))}: remove it")
        here = {i.name: i for i in sb.list_instances()}
        # the sandbox instances rented during the drill, still the same ones (name and host key): never
        # another instance that took an address since
        ours = {host: here[r.sandbox] for host, r in self.state.rented.items()
                if r.sandbox in here and here[r.sandbox].host_key_fingerprint == r.fingerprint}
        current = self.state.current
        destroy = finished and not self.keep
        if destroy and any(str(s) in ours for s in current):
            # training runs on instances about to be destroyed: saved and in the store first
            try:
                report = evacuate(self.recipe_of(current), current, UI(quiet=not self.ui.verbose), stop=True)
                left.append(f"training on {' '.join(map(str, current))} stopped and evacuated: {report.newest} (step "
                            f"{report.newest_step}) is the store's newest; `relaunch up RECIPE HOST...` resumes it")
            except RelaunchError as exc:
                left.append(f"training on {' '.join(map(str, current))} could NOT be evacuated "
                            f"({exc.message.splitlines()[0]}); the store holds what the watch verified")
        for host, r in self.state.rented.items():
            inst = ours.get(host)
            if inst is not None and destroy:
                sb.destroy(inst.name)
                left.append(f"{host}: sandbox {inst.name}, rented by recover.command during the drill: destroyed")
            elif inst is not None:
                dark = " (silenced by the drill; its training runs on in there)" if inst.name in self.silenced else ""
                left.append(f"{host}: sandbox {inst.name}, rented by recover.command during the drill, left{dark}: "
                            f"`relaunch sandbox destroy {inst.name}`")
            elif r.sandbox:
                left.append(f"{host}: sandbox {r.sandbox}, rented by recover.command during the drill, is gone already")
            else:
                left.append(f"{host}: rented by recover.command during the drill and billing: `relaunch evacuate "
                            f"RECIPE {host} --stop` if it trains, then destroy it with your provider")
        mine = {inst.name for inst in ours.values()}
        for spec in self.specs:
            inst = sandbox_of(self.recipe, spec)
            if inst is None or inst.name not in self.silenced or inst.name in mine:
                continue
            # yours, silenced by the drill: it speaks again, and what trained there in the dark ends
            sb.set_silent(inst.name, False)
            said = f"{spec}: its link passes packets again"
            if reach:
                try:
                    stop_training(self.recipe_for(spec), [spec], UI(quiet=True))
                    said += "; the training that ran on there in the dark was ended (the replacement took over)"
                except RelaunchError as exc:
                    said += f"; its training could not be ended ({exc.message.splitlines()[0]})"
            left.append(said)
        if finished:
            now = {str(c) for c in current}
            gone = [str(s) for s in self.specs if str(s) not in now
                    and getattr(sandbox_of(self.recipe, s), "name", None) not in self.silenced]
            if gone:
                left.append(f"{' '.join(gone)}: the drill's notice stopped the training there (its save is in the "
                            "store); destroy it, or `relaunch up RECIPE HOST` there")
        return left

    def recipe_of(self, specs: list[HostSpec]) -> Recipe:
        """The recipe for these nodes: one's own pin, else known_hosts (the watch's way after a replacement)."""
        if len(specs) == 1:
            return self.recipe_for(specs[0])
        return self.recipe.model_copy(update={"ssh": self.recipe.ssh.model_copy(update={"host_key": None})})

    def write(self, report: Measured) -> None:
        with self.store.lock(UI(quiet=True)):
            self.store.read(writing=True)
            self.store.write_meta(f"drill-{report.at.replace(':', '')}.json",
                                  json.dumps(report.as_dict(), indent=2) + "\n")
            self.store.flush()


def run_watched_drill(recipe: Recipe, specs: list[HostSpec], ui: UI, overrides: list[str], kinds: list[str],
                      past: int = 3, after: int = 5, tolerance: float = 1e-4, deadline: float = 900,
                      notice_seconds: float = 120, keep: bool = False) -> Measured:
    return WatchedDrill(recipe, specs, ui, overrides, kinds, past, after, tolerance, deadline, notice_seconds,
                        keep).run()
