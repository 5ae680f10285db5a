"""Local subprocesses that can be ended: each in its own process group, with a deadline, and
stopped within a second when relaunch is interrupted.

A Ctrl-C in a terminal reaches every process of the foreground group, but a `kill -INT` or a
SIGTERM from a supervisor reaches relaunch alone; so children run in groups of their own and
relaunch ends them itself. `CANCEL` is set once on SIGINT or SIGTERM (by the CLI's signal
handler, else by the relay thread of `relay_signals`); every wait in relaunch (here, remote
commands, retry sleeps) looks at it.
"""

from __future__ import annotations

import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from .errors import Interrupted

log = logging.getLogger("relaunch.processes")

CANCEL = threading.Event()
GRACE = 3.0            # seconds between SIGTERM and SIGKILL when ending a process group
# A child in a group of its own outlives a `kill -9` of relaunch; on Linux it is told to go
# too (the kernel's parent-death signal), so no copy keeps writing into a store nobody holds.
_DIE_WITH_US = (["setpriv", "--pdeathsig", "TERM", "--"]
                if sys.platform.startswith("linux") and shutil.which("setpriv") else [])
# Signals the children start with ignored (GNU env --ignore-signal): `relaunch run` sets them while
# training runs, where an engine may signal every process of the job (Slurm's scancel, requeue and
# --signal do) and the copy of the stop's save must not die of the signal that asked for it. They
# still end at their deadline or on cancel: the SIGKILL after the SIGTERM (end_group).
SHIELDED: list[str] = []


def _prefix() -> list[str]:
    if not SHIELDED or not shutil.which("env"):
        return _DIE_WITH_US
    death = ["setpriv", "--pdeathsig", "KILL", "--"] if _DIE_WITH_US else []
    return [*death, "env", *(f"--ignore-signal={name}" for name in SHIELDED), "--"]


_relaying = False
# the signals whose arrival sets CANCEL; `relaunch run` empties it while training runs, where a
# SIGTERM is the engine's stop (a save, its copy), not an interruption of what relaunch is doing
RELAYED = {int(signal.SIGINT), int(signal.SIGTERM)}


def relay_signals() -> None:
    """Set CANCEL from a thread of its own on SIGINT and SIGTERM: the C-level handler writes the
    signal's number to a pipe (`signal.set_wakeup_fd`) that this thread reads. The Python handler
    runs in the main thread wherever that thread is, maybe inside `CANCEL.wait()` with CANCEL's lock
    held, where its own `CANCEL.set()` would wait for itself forever (the CLI's handler leaves it to
    this thread there). Main thread only; once per process."""
    global _relaying
    if _relaying:
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    _relaying = True

    def relay() -> None:
        while True:
            got = os.read(read, 64)
            if not got:
                return
            if RELAYED.intersection(got):
                CANCEL.set()

    threading.Thread(target=relay, name="signals", daemon=True).start()


def wait(event: threading.Event, seconds: float) -> bool:
    """`event.wait(seconds)` that a Ctrl-C ends within 0.2 s (Interrupted). A Ctrl-C that lands while
    the main thread waits on an event sets only CANCEL (see the CLI's handler), which a plain
    `event.wait` does not see."""
    end = time.monotonic() + max(seconds, 0)
    while True:
        check_cancel()
        left = end - time.monotonic()
        if event.wait(min(max(left, 0), 0.2)):
            return True
        if left <= 0:
            return False


def interrupted() -> bool:
    """Ctrl-C (or SIGTERM) was pressed, and this is not the last act it asks for (despite_cancel)."""
    return CANCEL.is_set() and not _AFTER_CANCEL.get()


def check_cancel() -> None:
    if interrupted():
        raise Interrupted("interrupted")


T = TypeVar("T")


@dataclass(frozen=True)
class Budget:
    """What an in-process call (a `call` action) may take: until `end` (monotonic), and it stops
    when `cancelled()` turns true (its lane's sibling failed, Ctrl-C)."""

    end: float
    cancelled: Callable[[], bool]
    seconds: float = 0.0          # the whole budget, for messages (what is left shrinks as it is used)


_BUDGET: ContextVar[Budget | None] = ContextVar("relaunch_budget", default=None)
_AFTER_CANCEL: ContextVar[bool] = ContextVar("relaunch_after_cancel", default=False)


@contextmanager
def budget(deadline: float, cancelled: Callable[[], bool]) -> Iterator[None]:
    """Within this block (this thread), waits on the store take this deadline and cancellation."""
    token = _BUDGET.set(Budget(time.monotonic() + deadline, cancelled, deadline))
    try:
        yield
    finally:
        _BUDGET.reset(token)


@contextmanager
def despite_cancel(deadline: float) -> Iterator[None]:
    """The last act a Ctrl-C itself asks for (giving back the watch's lease in the store): its waits
    in this thread are not ended by the interruption that ended every other, only by `deadline`."""
    token = _AFTER_CANCEL.set(True)
    try:
        with budget(deadline, lambda: False):
            yield
    finally:
        _AFTER_CANCEL.reset(token)


def deadline_here(default: float) -> float:
    """Seconds a wait may take now: what is left of the running action's deadline, else `default`."""
    b = _BUDGET.get()
    return max(b.end - time.monotonic(), 0.0) if b is not None else default


def cancelled_here() -> bool:
    b = _BUDGET.get()
    return (CANCEL.is_set() and not _AFTER_CANCEL.get()) or (b is not None and b.cancelled())


def bounded(func: Callable[[], T], deadline: float, what: str) -> T:
    """func() (a blocking network call that has no deadline of its own) within `deadline_here
    (deadline)`, ended early by cancellation: TimeoutError / Interrupted then. The call itself
    goes on in a daemon thread until its socket gives up; nothing waits for it."""
    seconds = deadline_here(deadline)
    b = _BUDGET.get()
    said = b.seconds if b is not None else seconds      # the deadline the user knows, not what is left of it
    cancelled = cancelled_here
    done = threading.Event()
    results: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(func())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, which raises it
            errors.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, name=f"bounded {what}", daemon=True).start()
    end = time.monotonic() + seconds
    while not done.wait(min(0.2, max(end - time.monotonic(), 0))):
        if cancelled():
            raise Interrupted("interrupted")
        if time.monotonic() >= end:
            raise TimeoutError(f"{what}: no answer within {said:.0f}s")
    if errors:
        raise errors[0]
    return results[0]


def sleep(seconds: float, also: threading.Event | None = None) -> None:
    """time.sleep that ends at once when relaunch is interrupted (or `also` is set)."""
    if _AFTER_CANCEL.get():
        (also or threading.Event()).wait(max(seconds, 0))
        return
    if also is None:
        if CANCEL.wait(max(seconds, 0)):
            raise Interrupted("interrupted")
        return
    if wait(also, seconds):
        raise Interrupted("interrupted")


class Finished:
    """What a finished command left, here (`Completed`) or on the instance (`remote.ExecResult`)."""

    status: int | None
    stdout: bytes
    stderr: bytes

    @property
    def ok(self) -> bool:
        return self.status == 0

    @property
    def text(self) -> str:
        return self.stdout.decode(errors="replace")

    @property
    def err(self) -> str:
        return self.stderr.decode(errors="replace")

    @property
    def output(self) -> str:
        return (self.stdout + b"\n" + self.stderr).decode(errors="replace")


@dataclass
class Completed(Finished):
    argv: Sequence[str]
    status: int | None          # None: killed at its deadline or on cancel
    stdout: bytes
    stderr: bytes
    timed_out: bool = False


def end_group(proc: subprocess.Popen[bytes], grace: float = GRACE) -> None:
    """SIGTERM to the child's process group, SIGKILL after `grace` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run(argv: Sequence[str], *, deadline: float, stdin: bytes | Path | None = None,
        on_stdout: Callable[[bytes], None] | None = None, on_stderr: Callable[[bytes], None] | None = None,
        env: dict[str, str] | None = None, cwd: str | Path | None = None,
        cancelled: Callable[[], bool] = cancelled_here, grace: float = GRACE) -> Completed:
    """Run argv in its own process group; end it at `deadline` seconds or on cancel.

    Output is collected (and passed to the callbacks as it arrives). Cancellation raises
    Interrupted after the group is gone; a deadline returns with `timed_out` set. `grace`: the
    seconds between SIGTERM and SIGKILL (a relaunch child cleans up on SIGTERM: give it time).
    """
    check_cancel()
    log.debug("run: %s", list(argv))
    stdin_file = open(stdin, "rb") if isinstance(stdin, Path) else None
    try:
        proc = subprocess.Popen(
            [*_prefix(), *argv], stdin=stdin_file or (subprocess.PIPE if stdin is not None else subprocess.DEVNULL),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, env=env, cwd=cwd)
    except OSError as exc:
        if stdin_file:
            stdin_file.close()
        return Completed(argv, 127, b"", f"{argv[0]}: {exc.strerror or exc}".encode())
    writer = None
    if isinstance(stdin, bytes):
        writer = threading.Thread(target=_feed, args=(proc, stdin), daemon=True)
        writer.start()
    out, err = bytearray(), bytearray()
    end = time.monotonic() + deadline
    timed_out = False
    try:
        with selectors.DefaultSelector() as sel:
            assert proc.stdout is not None and proc.stderr is not None
            sel.register(proc.stdout, selectors.EVENT_READ, (out, on_stdout))
            sel.register(proc.stderr, selectors.EVENT_READ, (err, on_stderr))
            while sel.get_map():
                if cancelled():
                    end_group(proc, grace)
                    raise Interrupted("interrupted")
                if time.monotonic() > end:
                    timed_out = True
                    end_group(proc, grace)
                    break
                for key, _ in sel.select(timeout=0.2):
                    chunk = os.read(key.fd, 65536)
                    buffer, callback = key.data
                    if not chunk:
                        sel.unregister(key.fileobj)
                        continue
                    buffer += chunk
                    if callback:
                        callback(chunk)
        while proc.poll() is None:
            if cancelled():
                end_group(proc, grace)
                raise Interrupted("interrupted")
            if time.monotonic() > end:
                timed_out = True
                end_group(proc, grace)
                break
            time.sleep(0.05)
        status = proc.wait()
    except BaseException:
        end_group(proc, grace)
        raise
    finally:
        if stdin_file:
            stdin_file.close()
        for stream in (proc.stdout, proc.stderr):
            if stream:
                stream.close()
    check_cancel()
    return Completed(argv, None if timed_out else status, bytes(out), bytes(err), timed_out)


def _feed(proc: subprocess.Popen[bytes], data: bytes) -> None:
    assert proc.stdin is not None
    try:
        proc.stdin.write(data)
        proc.stdin.close()
    except (BrokenPipeError, OSError):
        pass
