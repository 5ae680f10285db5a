"""The watch's copy-off rounds: each one is `relaunch sync RECIPE HOST... --once --json`, run as a
child process beside the looks, so that a round that copies for minutes never delays a look, and
a round can be ended at once (a notice: the save made after it goes first) with the child's own
Ctrl-C cleanup: credentials and pins removed on the instance, the partial copy kept in the
store's staging for a later round to continue, nothing trusted.

A round that fails on the way (the instance away, a 5xx from the store, a dropped connection) is
tried again under the one retry policy, up to ROUND_TRIES times (the last round, once training has
ended: LAST_ROUND_TRIES), then gives up until the next round; a run of failures is said once, and
once more when a round works again. One the store refuses (credentials, no room,
a conflicting writer: `refused` in the child's JSON) ends the watch with the store's message, and
so does a child that exits 1 (an internal error: a bug, or a child that could not even import
relaunch), which no retry cures.

The child runs `python -P`: the folder the watch was started from is not put on its import path,
so a folder that holds a `relaunch/` source tree (a clone) cannot stand in for the installed
package.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import processes
from ..errors import EvacuationError, Interrupted, RelaunchError
from ..retry import retrying
from ..steps.evacuate import Report

ROUND_DEADLINE = 12 * 3600.0   # the child's own actions have deadlines by size; this bounds the whole
CLEANUP_GRACE = 30.0            # seconds a child ended on purpose has for its cleanup before SIGKILL
MAX_BACKOFF = 300.0
ROUND_TRIES = 6                 # tries of one round, backoff between them, before it waits for the next round
LAST_ROUND_TRIES = 3            # the round after training ended: then the watch ends, saying what failed


@dataclass
class RoundOutcome:
    """One round's end, as the watch's loop sees it."""

    report: Report | None = None      # the round's report (also one that did not verify the newest)
    error: RelaunchError | None = None   # a refusal or an internal error: the watch ends with it
    failed: RelaunchError | None = None  # gave up after its tries (not a refusal): the next round tries again
    aborted: bool = False             # ended on purpose (a notice, a lost instance, Ctrl-C)
    started: float = 0.0              # monotonic time the child that reported began (it heard from every node)


def report_from(data: dict[str, Any]) -> Report:
    known = {f.name for f in dataclasses.fields(Report)}
    return Report(**{k: v for k, v in data.items() if k in known})


class _Failed(Exception):
    def __init__(self, error: RelaunchError) -> None:
        super().__init__(error.message)
        self.error = error


class InternalError(RelaunchError):
    """The round's child exited 1: relaunch's own failure (exit 1 in the contract), never retried."""


def _documents(text: str) -> list[Any]:
    """The JSON on the child's stdout: its one document (`--json` prints one, indented), else (a
    child that printed something beside it) each line that parses."""
    try:
        return [json.loads(text)]
    except ValueError:
        pass
    found = []
    for line in text.splitlines():
        try:
            found.append(json.loads(line))
        except ValueError:
            continue
    return found


def parse(status: int | None, stdout: bytes, stderr: bytes) -> Report | RelaunchError:
    """The child's answer: its report (the document with a store; a round not verified carries its
    error beside it), or its error as ours; exit 1 (an internal error) is an InternalError whatever
    the child printed."""
    report, failure = None, None
    for data in _documents(stdout.decode(errors="replace")):
        if not isinstance(data, dict):
            continue
        if "store" in data and "copied" in data:
            report = report_from(data)
        if "error" in data:
            failure = data
    lines = [ln for ln in stderr.decode(errors="replace").splitlines() if ln.strip()][-3:]
    if status == 1:
        # the child's own error, else its last line on stderr (a traceback's exception line)
        said = str(failure["error"]).splitlines()[0] if failure is not None else (lines or ["no output"])[-1]
        return InternalError(f"a sync round failed with an internal error (exit 1): {said}",
                             "a bug, or a relaunch that does not import: run `relaunch sync RECIPE HOST --once` "
                             "by hand to see it; the watch does not retry it")
    if report is not None:
        return report
    if failure is not None:
        message = str(failure["error"]).replace("\nsync round NOT verified", "")
        return RelaunchError(message, failure.get("hint"), refused=bool(failure.get("refused")))
    what = "was ended" if status is None else f"exited {status}"
    return RelaunchError(f"the sync round {what} without a report" + (f": {' | '.join(lines)}" if lines else ""))


class Rounds:
    """At most one round at a time, in a thread of its own; the loop polls `take()`."""

    def __init__(self, argv: Callable[[], list[str]], say: Callable[[str, str], None],
                 ended: Callable[[], None] = lambda: None) -> None:
        self._argv = argv                    # the child's command line, made when a round starts
        self._say = say                      # (kind, text) to the loop's queue: "warn" | "say"
        self._ended = ended                  # called once a round's outcome is there (the loop wakes)
        self._abort = threading.Event()
        self._thread: threading.Thread | None = None
        self._outcome: RoundOutcome | None = None
        self._lock = threading.Lock()
        self.failures = 0                    # failed tries in a row, across rounds (said once)

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, tries: int = ROUND_TRIES) -> bool:
        """Begin a round of at most `tries` tries unless one runs; False when one does."""
        if self.busy:
            return False
        self._abort.clear()
        self._outcome = None
        self._thread = threading.Thread(target=self._run, args=(tries,), name="sync-round", daemon=True)
        self._thread.start()
        return True

    def take(self) -> RoundOutcome | None:
        """The last round's outcome, once (None while it runs or when none ended since)."""
        with self._lock:
            outcome, self._outcome = self._outcome, None
        return outcome

    def abort(self, wait: float = CLEANUP_GRACE + 10) -> None:
        """End the running round (its child cleans up first); returns when it is over."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            return
        self._abort.set()
        thread.join(timeout=wait)

    def _stopped(self) -> bool:
        return self._abort.is_set() or processes.CANCEL.is_set()

    def _run(self, tries: int) -> None:
        began = [0.0]

        def once() -> Report:
            began[0] = time.monotonic()
            done = processes.run(self._argv(), deadline=ROUND_DEADLINE, cancelled=self._stopped,
                                 grace=CLEANUP_GRACE)
            answer = parse(done.status, done.stdout, done.stderr)
            if isinstance(answer, Report):
                return answer
            raise _Failed(answer)

        def failed(exc: BaseException) -> None:
            self.failures += 1
            error = exc.error if isinstance(exc, _Failed) else exc
            first = str(getattr(error, "message", error)).splitlines()[0]
            if self.failures == 1:   # said once; the loop's status file keeps the latest
                self._say("warn", f"sync round failed: {first}; trying again with backoff (up to "
                                  f"{MAX_BACKOFF:g}s apart), the watch goes on")
            self._say("error", first)

        def transient(exc: BaseException) -> bool:
            return isinstance(exc, _Failed) and not exc.error.refused and not isinstance(exc.error, InternalError)

        outcome = RoundOutcome()
        try:
            outcome.report = retrying(once, transient=transient, attempts=tries, first=5.0, most=MAX_BACKOFF,
                                      on_retry=lambda exc, seconds: failed(exc), cancel=self._abort)
            outcome.started = began[0]
            if self.failures:
                self._say("say", f"sync rounds work again after {self.failures} failed tries")
            self.failures = 0
        except Interrupted:
            outcome.aborted = True
        except _Failed as exc:
            if transient(exc):       # its tries are used up: the next round tries again
                failed(exc)
                outcome.failed = exc.error
            else:
                outcome.error = exc.error if isinstance(exc.error, InternalError) else \
                    EvacuationError(exc.error.message, exc.error.hint, refused=True)
        with self._lock:
            self._outcome = outcome
        self._ended()


def child_argv(recipe_path: str, hosts: list[str], sets: list[str]) -> list[str]:
    # -P: the current folder is not searched first (a `relaunch/` clone there is not the package)
    return [sys.executable, "-P", "-m", "relaunch.cli", "sync", recipe_path, *hosts, "--once", "--json",
            *[arg for s in sets for arg in ("--set", s)]]


def clock(epoch: float | None = None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(epoch if epoch is not None else time.time()))
