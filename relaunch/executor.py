"""The one place that runs actions: the exact command, argv or call an action holds, with its
deadline, the one retry policy for what may be retried, and cancellation that reaches the remote
process group and every local subprocess within seconds. Progress and the debug log are here too.

Actions in different lanes that stand next to each other run at the same time (up's env install
and checkpoint restore); when one lane fails, the others are stopped and the first failure is
raised. Ctrl-C stops every lane the same way and raises Interrupted.
"""

from __future__ import annotations

import inspect
import json
import logging
import re
import threading
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from . import processes
from .errors import (
    CheckpointError,
    ConnectError,
    EnvError,
    EvacuationError,
    Interrupted,
    RelaunchError,
    remote_failure,
    shorten,
)
from .host.hashing import parse_hashes
from .host.remote import Remote
from .plan import LOCAL, Action, Ref
from .retry import retrying
from .transports import rsync
from .transports.base import Vanished
from .ui import UI, redact

log = logging.getLogger("relaunch.executor")

ERRORS: dict[str, type[RelaunchError]] = {
    "connect": ConnectError, "env": EnvError, "checkpoint": CheckpointError, "evacuate": EvacuationError,
}
MEANINGS = {"rsync": rsync.MEANING}
NO_SPACE = "No space left on device"
CLEANUP_DEADLINE = 15.0


class HashMismatch(CheckpointError):
    """Bytes on the instance differ from the hashes they had to have (a copy that went wrong,
    or a damaged copy in the store)."""


class _Transient(Exception):
    def __init__(self, error: RelaunchError) -> None:
        super().__init__(error.message)
        self.error = error


class Executor:
    """Runs actions on one instance (`remote`), or on several: an action's `host` picks it from
    `remotes` (a node group)."""

    def __init__(self, ui: UI, host: str, remote: Remote | None = None,
                 handlers: dict[str, Any] | None = None, remotes: dict[str, Remote] | None = None) -> None:
        self.ui, self.host, self.remote = ui, host, remote
        self.remotes = remotes or {}
        self.handlers = handlers or {}
        self.results: dict[str, Any] = {}
        self._stop = threading.Event()           # a sibling lane failed
        self._produced = threading.Condition()   # a result arrived (for actions that need one)
        self._running = 0                        # lanes running now
        self._waits: dict[int, tuple[str, ...]] = {}   # what each waiting lane (thread) waits for

    # -- plans ------------------------------------------------------------------------------
    def run(self, actions: Sequence[Action]) -> dict[str, Any]:
        """Run actions in order; neighbours in different lanes at the same time. Returns the results.

        After a failure, the `always` actions still ahead (cleanups) run before it is raised.
        The results these actions produce start unknown: a plan run again (a re-copy after a
        mismatch) names its results as the first run did, and what that run left must not stand in
        for them (a lane would start on the first attempt's staging, or verify its hashes)."""
        with self._produced:
            for action in actions:
                self.results.pop(action.produces, None)
        groups = _groups(actions)
        for n, group in enumerate(groups):
            try:
                if len(group) == 1:
                    self._run_lane(next(iter(group.values())))
                else:
                    self._run_parallel(list(group.values()))
            except BaseException:
                for later in groups[n + 1:]:
                    for lane in later.values():
                        for action in lane:
                            if action.always:
                                self._cleanup(action)
                raise
        return self.results

    def _wait_for(self, names: tuple[str, ...]) -> None:
        """Until earlier actions in other lanes produced these results (the lane's deadline is
        theirs); a failed sibling or Ctrl-C ends the wait, and so does a wait no lane still
        running can end (a plan that names a result nothing produces)."""
        me = threading.get_ident()
        with self._produced:
            self._waits[me] = names
            try:
                while not all(name in self.results for name in names):
                    if self._cancelled():
                        raise Interrupted("interrupted")
                    # stuck: every running lane waits for what is not there; a lane whose wait was
                    # met a moment ago (not woken yet) is about to go on, not stuck
                    stuck = [w for w in self._waits.values() if not all(n in self.results for n in w)]
                    if len(stuck) >= self._running:
                        missing = [n for n in names if n not in self.results]
                        raise RelaunchError(f"internal: waiting for {', '.join(missing)}, which no step produces")
                    self._produced.wait(0.2)
            finally:
                del self._waits[me]

    def _label(self, action: Action) -> str:
        return action.host or self.host

    def _remote_for(self, action: Action) -> Remote | None:
        return self.remotes.get(action.host, self.remote) if action.host else self.remote

    def _run_parallel(self, lanes: list[list[Action]]) -> None:
        self._stop.clear()
        with self._produced:
            self._running += len(lanes)
        with ThreadPoolExecutor(max_workers=len(lanes), thread_name_prefix="lane") as pool:
            futures = [pool.submit(self._run_lane, lane, True) for lane in lanes]
            try:
                done, _ = wait(futures, return_when=FIRST_EXCEPTION)
                if any(f.exception() for f in done):
                    self._stop.set()
                wait(futures)
            except KeyboardInterrupt:
                processes.CANCEL.set()
                wait(futures)
                raise
        self._stop.clear()          # the lanes are over: later actions of this executor run as usual
        errors = [e for e in (f.exception() for f in futures) if e is not None]
        real = [e for e in errors if not isinstance(e, Interrupted)]
        if real:
            for extra in real[1:]:
                self.ui.warn(redact(str(extra)))
            raise real[0]
        if errors:
            raise errors[0]

    def _cancelled(self) -> bool:
        return processes.CANCEL.is_set() or self._stop.is_set()

    def _run_lane(self, actions: list[Action], parallel: bool = False) -> None:
        """One lane's actions in order; counted among the running lanes until it ends (a parallel
        group counts all its lanes from before the first starts)."""
        if not parallel:
            with self._produced:
                self._running += 1
        try:
            self._run_actions(actions)
        except BaseException:
            if parallel:
                self._stop.set()     # before this lane counts as gone: a lane waiting on it stops, not errs
            raise
        finally:
            with self._produced:
                self._running -= 1
                self._produced.notify_all()

    def _run_actions(self, actions: list[Action]) -> None:
        failure: BaseException | None = None
        for action in actions:
            if failure is None:
                try:
                    self.run_one(action)
                except BaseException as exc:  # noqa: B036 - cleanup actions still run, then it is re-raised
                    failure = exc
            elif action.always:
                self._cleanup(action)
        if failure is not None:
            raise failure

    def _cleanup(self, action: Action) -> None:
        """A cleanup after a failure or Ctrl-C (remove credentials, a temp folder): run it even
        when cancelled, briefly, and never let it hide the failure."""
        try:
            if action.call:
                self._call(action, check=False)
            elif (remote := self._remote_for(action)) is not None and action.command:
                remote.exec(action.command, deadline=min(action.deadline, CLEANUP_DEADLINE),
                            stdin=self._stdin(action), cancelled=lambda: False)
        except Exception:  # the failure that got us here is what the user needs to see
            log.debug("cleanup %s failed after an earlier failure", action.title, exc_info=True)

    # -- one action ---------------------------------------------------------------------------
    def run_one(self, action: Action) -> Any:
        label = self._label(action)
        if action.needs:
            self._wait_for(action.needs)
        if action.skip:
            self.ui.step(label, action.step, action.skip)
            return None
        if action.say:
            self.ui.step(label, action.step, action.say)
        if not action.runs:
            return None
        log.debug("action %s: %s", action.step, action.title)
        if action.call:
            result = self._call(action)
        elif action.retry:
            try:
                result = retrying(lambda: self._attempt(action), transient=lambda e: isinstance(e, _Transient),
                                  attempts=3, first=2.0, on_retry=lambda e, s: self.ui.warn(
                                      f"{label}: {action.step}: {str(e).splitlines()[0]}; retrying in {s:.0f}s"))
            except _Transient as exc:       # the last attempt failed too: its own error, not the wrapper
                raise exc.error from None
        else:
            result = self._attempt(action)
        if action.produces:
            with self._produced:
                self.results[action.produces] = result
                self._produced.notify_all()
        if action.done:
            self.ui.step(label, action.step, action.done)
        return result

    def _attempt(self, action: Action) -> Any:
        try:
            return self._run_program(action)
        except _Transient as exc:
            if action.retry:
                raise
            raise exc.error from None

    def _call(self, action: Action, check: bool = True) -> Any:
        owner, _, method = action.call.partition(".")
        handler = self.handlers.get(owner)
        if handler is None or not hasattr(handler, method):
            raise RelaunchError(f"internal: no handler for {action.call}")
        args = {k: self._resolve(v) for k, v in action.args.items()}
        if check:
            processes.check_cancel()
        func = getattr(handler, method)
        # a call that runs programs itself (an upload as files arrive) shows progress and stops
        # with its lane: it asks for the UI and the cancel check by naming them
        wanted = inspect.signature(func).parameters
        args.update({k: v for k, v in (("ui", self.ui), ("cancelled", self._cancelled)) if k in wanted})
        # what it waits on (the Hub's API, rclone) ends at the action's deadline and with its lane
        deadline, cancelled = ((action.deadline, self._cancelled) if check
                               else (min(action.deadline, CLEANUP_DEADLINE), lambda: False))
        with processes.budget(deadline, cancelled):
            return func(**args)

    def _run_program(self, action: Action) -> Any:
        status: int | None
        if action.where == LOCAL:
            with self.ui.transfer(action.title, action.size, action.progress) as bar:
                done = processes.run(action.argv, deadline=action.deadline, stdin=self._stdin(action),
                                     on_stdout=bar.feed if bar else None, on_stderr=bar.feed_err if bar else None,
                                     cancelled=self._cancelled)
            status, stdout, stderr, timed_out = done.status, done.stdout, done.stderr, done.timed_out
            program = action.argv[0].rsplit("/", 1)[-1]
        else:
            remote = self._remote_for(action)
            if remote is None:
                raise RelaunchError(f"internal: {action.title} needs an instance")
            with self.ui.transfer(action.title, action.size, action.progress) as bar:
                result = remote.exec(action.command, deadline=action.deadline, stdin=self._stdin(action),
                                     on_output=lambda data: self._detail(data, bar), cancelled=self._cancelled)
            status, stdout, stderr, timed_out = result.status, result.stdout, _quiet(result.stderr), result.timed_out
            program = ""
            if status is None and not timed_out and not remote.alive:
                why = (_last_line(stderr.decode(errors="replace")).removeprefix("the SSH connection was lost").strip()
                       if stderr.strip() else "")
                raise _Transient(ConnectError(
                    f"{self._label(action)}: {action.step}: the SSH connection was lost during: {action.title}"
                    + (f": {why}" if why else ""),
                    "the instance went away or its network dropped; nothing half-done is trusted: rerun"))
        output = (stdout + b"\n" + stderr).decode(errors="replace")
        if status != 0:
            self._fail(action, status, output, timed_out, program)
        return self._result(action, stdout)

    def _fail(self, action: Action, status: int | None, output: str, timed_out: bool, program: str) -> None:
        error, label = ERRORS[action.fails_as], self._label(action)
        outcome = action.outcomes.get(status) if status is not None else None
        for key, value in action.outcomes.items():
            if isinstance(key, str) and key.startswith("re:") and re.search(key[3:], output):
                outcome = value
        if NO_SPACE in output:
            outcome = "full"
        if outcome == "partial":   # rsync's 23: only files that were gone are the trainer's rotation
            if rsync.only_vanished(output):
                outcome = "vanished"
            else:
                output = "\n".join(rsync.error_lines(output)) or output   # its reasons, not its progress
                outcome = None
        if outcome == "vanished":
            raise Vanished(action.title)
        if outcome == "full":
            raise error(f"{label}: {action.step}: no room {action.room or 'on the disk'} for {action.title}: "
                        f"{_last_line(output)}",
                        "free space (nothing was deleted to make room), then rerun", refused=True)
        if action.explain and outcome is None:
            owner, _, method = action.explain.partition(".")
            explained = getattr(self.handlers[owner], method)(status, output)
            if explained is not None:
                raise explained
        if timed_out:
            raise error(f"{label}: {action.step}: {action.title} did not finish within its deadline of "
                        f"{action.deadline:g}s; it was ended", "the instance may be overloaded or hung; rerun")
        meaning = MEANINGS.get(program, {}).get(status or -1)
        described = f"{action.title}" + (f" ({program}: {meaning})" if meaning else "")
        failure = remote_failure(error, label, action.step, described, status, redact(output), action.hint)
        if outcome == "transient":
            raise _Transient(failure)
        raise failure

    def _result(self, action: Action, stdout: bytes) -> Any:
        if not action.parse:
            return None
        kind, _, algo = action.parse.partition(":")
        if kind == "text":
            return stdout.decode(errors="replace")
        if kind == "lines":
            return stdout.decode(errors="replace").splitlines()
        if kind == "json":
            return json.loads(stdout or b"null")
        if kind == "hashes":
            hashes = parse_hashes(stdout)
            if action.expect is not None:
                self._check_hashes(action, hashes, algo or "sha256")
            return hashes
        raise RelaunchError(f"internal: unknown parse {action.parse}")

    def _check_hashes(self, action: Action, hashes: dict[str, Any], algo: str) -> None:
        assert action.expect is not None
        bad = []
        for path, want in sorted(action.expect.items()):
            got = hashes.get(path)
            if got is None or got.missing:
                bad.append(f"{path}: missing")
            elif got.hashes.get(algo) != want:
                bad.append(f"{path}: {algo} {got.hashes.get(algo)}, expected {want}")
        if bad:
            raise HashMismatch(
                f"{self._label(action)}: {action.step}: {len(bad)} file(s) differ from the store's verified copy: "
                f"{action.title}: e.g. {bad[0]}", action.hint or "nothing was put in place")

    def _resolve(self, value: Any) -> Any:
        """A Ref (or a list of them) as the results earlier actions produced."""
        if isinstance(value, Ref):
            found = self.results.get(value.name)
            return found[value.part] if value.part and found is not None else found
        if isinstance(value, list) and any(isinstance(v, Ref) for v in value):
            return [self._resolve(v) for v in value]
        return value

    def _stdin(self, action: Action) -> bytes | Path | None:
        value = self._resolve(action.stdin)
        return value.encode() if isinstance(value, str) else value

    def _detail(self, data: bytes, bar: Any = None) -> None:
        if bar is not None:
            bar.feed(data)
        text = _quiet(data).decode(errors="replace").rstrip()
        if text:
            self.ui.detail(text)


def _groups(actions: Sequence[Action]) -> list[dict[str, list[Action]]]:
    """Consecutive actions by lane: a run of actions in lanes forms one group run at the same time."""
    groups: list[dict[str, list[Action]]] = []
    for action in actions:
        if action.lane and groups and "" not in groups[-1]:
            groups[-1].setdefault(action.lane, []).append(action)
        else:
            groups.append({action.lane: [action]})
    return groups


_PROGRESS_LINE = re.compile(rb"^relaunch-(?:read|setup-line) \d+\n?", re.M)


def _quiet(data: bytes) -> bytes:
    """Output without the hasher's progress lines (they feed a bar, not a message) and env.setup's
    line announcements (they name a failing line, see cycle.handlers.StepOutputs.setup_failure)."""
    return _PROGRESS_LINE.sub(b"", data)


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in redact(text).splitlines() if ln.strip()]
    return shorten(lines[-1]) if lines else "no output"

