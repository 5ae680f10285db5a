"""One watch per recipe and store, and what `relaunch status` shows of it.

Two watches of one recipe would both recover a lost instance: two replacements rented and
billing, two trainings writing one store. So a watch holds
- a lock on this machine (`STATE/watch/KEY.lock`, flock, naming who holds it), and
- a lease in the store (`.relaunch/watch.json`: machine, pid, since, renewed every LEASE_EVERY
  seconds), so that a watch on another machine sees it too. A lease not renewed for LEASE_STALE
  seconds counts as gone (a watch killed with kill -9, a machine switched off), and so does one
  from this machine whose process is gone.

The lease is only ever changed by a compare-and-set (`Store.swap_meta`) against what was read:
taking it against the lease found there, renewing it and giving it back against the one this
watch wrote last. How atomic that is depends on the store (its `swap_guarantee`): a local folder
and a Hugging Face repo compare and set for real (an fcntl lock; a commit with the head as
parent_commit); rclone has no conditional write, so there a race between two watches' read and
write is seen at the latest by the loser's next renewal or look before renting.

A thread of its own renews the lease (never held up by a copy, a recovery or a wait for a host).
A lease is this watch's by its token, never by its text: a renewal whose write landed but whose
answer was lost (a connection cut after the commit) leaves this watch's own lease there with
another time in it, and the next renewal takes that as its own. A renewal that finds another
watch's lease there writes nothing: this watch was taken over (`taken`), and the loop stops
acting. Before renting anything the watch reads the lease again (`why_not_mine`): another
holder there, or a lease this watch could not renew for so long that another watch may have taken
it, means it rents nothing.
`STATE/watch/KEY.json` is what `status` shows: pid, hosts, since, last round, last error.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from .. import processes
from ..errors import Interrupted, RelaunchError, UsageError
from ..history import iso
from ..paths import state_dir
from ..transports import Store
from ..ui import UI

LEASE = "watch.json"
LEASE_EVERY = 300.0
TAKE_TRIES = 5             # compare-and-set tries when other watches keep writing the lease meanwhile
GIVE_BACK = 30.0           # seconds the lease's give-back may take after a Ctrl-C ended every other wait
RENEW_AGAIN = 30.0         # seconds before a renewal that failed (the store did not answer) is tried again


def lease_every() -> float:
    """Seconds between renewals (RELAUNCH_LEASE_EVERY, default LEASE_EVERY: tests shorten it)."""
    return float(os.environ.get("RELAUNCH_LEASE_EVERY") or LEASE_EVERY)


def lease_stale() -> float:
    """A lease not renewed for this long counts as gone."""
    return 3 * lease_every()


def key(recipe_name: str, store_label: str) -> str:
    return hashlib.sha256(f"{recipe_name}\n{store_label}".encode()).hexdigest()[:16]


def folder() -> Path:
    path = state_dir() / "watch"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def machine() -> str:
    return socket.gethostname()


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def describe(info: dict[str, Any]) -> str:
    hosts = " ".join(info.get("hosts") or []) or "?"
    return f"pid {info.get('pid', '?')} on {info.get('machine', '?')}, since {info.get('since', '?')}, watching {hosts}"


def stale(info: dict[str, Any], now: float) -> bool:
    """Is that lease's watch gone? (not renewed for lease_stale(), or its process is gone here)"""
    if info.get("machine") == machine() and isinstance(info.get("pid"), int) and not _running(info["pid"]):
        return True
    return now - float(info.get("renewed_epoch") or 0) > lease_stale()


def parse_lease(text: str | None) -> dict[str, Any] | None:
    """A lease's content; None for none, a given-back one (`{}`) or one that does not parse."""
    try:
        data = json.loads(text or "null")
    except ValueError:
        return None
    return data if isinstance(data, dict) and data else None


class Holder:
    """What this watch holds; `take()` first, `release()` at the end."""

    def __init__(self, recipe_name: str, store: Store, hosts: list[str]) -> None:
        self.name, self.store, self.hosts = recipe_name, store, hosts
        self.key = key(recipe_name, store.label)
        self.token = f"{machine()}:{os.getpid()}:{time.time():.3f}"
        self.since = iso(time.time())
        self._lock: IO[str] | None = None
        self._state: dict[str, Any] = {}
        self._written: str | None = None      # the lease as this watch last wrote it (what a renewal compares with)
        self._writing: str | None = None      # ... and the one it is writing (a Ctrl-C may land after the write)
        # one look at the lease at a time (the renewer's, the loop's): a read compared with _written
        # is never split by a renewal that changes it
        self._store_lock = threading.RLock()
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self.renewed = 0.0                    # monotonic time of the last renewal that wrote the lease
        self.taken: dict[str, Any] | None = None   # another watch's lease, found where ours was

    # -- this machine ---------------------------------------------------------------------------
    @property
    def lock_path(self) -> Path:
        return folder() / f"{self.key}.lock"

    @property
    def state_path(self) -> Path:
        return folder() / f"{self.key}.json"

    def mine(self) -> dict[str, Any]:
        return {"token": self.token, "machine": machine(), "pid": os.getpid(), "since": self.since,
                "hosts": self.hosts, "recipe": self.name, "store": self.store.label,
                "command": " ".join(["relaunch", *sys.argv[1:3]])}

    def take(self, ui: UI, take_over: bool = False) -> None:
        handle = open(self.lock_path, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            try:
                info = json.loads(handle.read() or "{}")
            except ValueError:
                info = {}
            handle.close()
            raise UsageError(f"another `relaunch watch` of {self.name} on the store {self.store.label} is running "
                             f"here: {describe(info)}",
                             "two watches would both recover a lost instance (two replacements rented); stop that "
                             "one first (Ctrl-C in its terminal, or kill its pid)") from None
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps(self.mine()))
        handle.flush()
        self._lock = handle
        try:
            self._take_lease(ui, take_over)
        except BaseException:
            # all or nothing: a Ctrl-C that lands once the lease is written gives it back too
            self.release(ui)
            raise

    def _take_lease(self, ui: UI, take_over: bool) -> None:
        """The lease, by compare-and-set against what was read: a watch that wrote it between this
        read and this write is seen (on the stores where swap_meta is atomic) and looked at again."""
        for _ in range(TAKE_TRIES):
            text = self._read()
            other = self._other(text)
            if other is not None and not take_over:
                raise UsageError(f"another `relaunch watch` of {self.name} holds the store {self.store.label}: "
                                 f"{describe(other)} (its lease in .relaunch/{LEASE} was renewed at "
                                 f"{other.get('renewed', '?')})",
                                 "two watches would both recover a lost instance; stop that one, or, if it is gone "
                                 f"for good, `relaunch watch --take-over` (its lease counts as gone "
                                 f"{lease_stale() / 60:.0f} min after its last renewal)")
            if self._swap(text):
                return
        raise UsageError(f"the lease in {self.store.label}/.relaunch/{LEASE} kept changing while this watch took it "
                         f"({TAKE_TRIES} tries): another watch is taking it too", "stop the other watch first")

    # -- the store's lease ----------------------------------------------------------------------
    def _read(self) -> str | None:
        with self._store_lock:
            return self.store.read_meta(LEASE)

    def _other(self, text: str | None) -> dict[str, Any] | None:
        """Another live watch's lease in `text`, else None (none, ours, or a stale one)."""
        info = parse_lease(text)
        if info is None or info.get("token") == self.token or stale(info, time.time()):
            return None
        return info

    def _swap(self, expected: str | None, data: dict[str, Any] | None = None) -> bool:
        """Write our lease (or `data`) where `expected` is now; False when something else is there."""
        now = time.time()
        text = json.dumps(data if data is not None else {**self.mine(), "renewed": iso(now), "renewed_epoch": now},
                          sort_keys=True) + "\n"
        # not under Store.lock: a sync round holds that for as long as it copies, and the lease must
        # not wait on a copy; swap_meta is safe beside the round's writes (another file, or a commit
        # against the head)
        with self._store_lock:
            self._writing = text
            if not self.store.swap_meta(LEASE, expected, text):
                return False
            self._written = text
            self.renewed = time.monotonic()
        return True

    def renew(self, ui: UI) -> bool:
        """Renew the lease while it is still this watch's (its token); False, writing nothing, when
        something else is there (this watch was taken over: `taken` says by whom)."""
        if self.taken is not None:
            return False
        if self._swap(self._written):
            return True
        # not the text this watch wrote last: its own still, when a renewal's write landed and its answer
        # was lost (the text has that renewal's time); then renewed against what is there
        text = self._read()
        if self._ours(text) and self._swap(text):
            return True
        self.taken = parse_lease(self._read()) or {"machine": "?", "pid": "?", "since": "?",
                                                  "detail": "the lease was removed"}
        return False

    def _ours(self, text: str | None) -> bool:
        """Is `text` a lease this watch wrote (its token), whatever time it holds?"""
        info = parse_lease(text)
        return info is not None and info.get("token") == self.token

    def why_not_mine(self) -> str | None:
        """Before renting or starting training: None while this watch holds the store, else why not
        (taken over, or a lease it could not renew for so long that it counts as gone)."""
        if self.taken is None:
            with self._store_lock:
                try:
                    text = self._read()
                except RelaunchError as exc:
                    since = time.monotonic() - self.renewed
                    if since < lease_stale() - lease_every():
                        return None      # the store does not answer now, but the lease is fresh for a while yet
                    return (f"the store does not answer ({exc.message.splitlines()[0]}) and this watch's lease was "
                            f"last renewed {since:.0f}s ago: another watch may have taken the store")
                if self._ours(text):
                    self._written = text      # a renewal whose answer was lost wrote it
                else:
                    self.taken = parse_lease(text) or {"machine": "?", "pid": "?", "detail": "the lease was removed"}
        if self.taken is not None:
            return f"another watch holds the store now ({describe(self.taken)})"
        return None

    def start_renewing(self, ui: UI, say: Callable[[str, str], None]) -> None:
        """Renew from a thread of its own every lease_every() seconds (RENEW_AGAIN after a failure);
        say(kind, text) reports a failure (once a run), a renewal that works again, a take-over."""
        def run() -> None:
            failing = False
            wait = lease_every()
            while not self._stop.wait(wait):
                try:
                    held = self.renew(ui)
                except Interrupted:
                    return
                except RelaunchError as exc:
                    if not failing:
                        say("warn", f"could not renew this watch's lease in {self.store.label}: "
                                    f"{exc.message.splitlines()[0]}; trying again every {RENEW_AGAIN:g}s")
                    failing, wait = True, min(RENEW_AGAIN, lease_every())
                    continue
                if not held:
                    say("warn", f"another watch took the store: {describe(self.taken or {})}")
                    return
                if failing:
                    say("say", "this watch's lease is renewed again")
                failing, wait = False, lease_every()

        self._renewer = threading.Thread(target=run, name="lease", daemon=True)
        self._renewer.start()

    def release(self, ui: UI) -> None:
        """Give back the local lock and, when it is still ours, the store's lease; nothing when
        `take()` did not get the lock (the state file then belongs to the watch that has it)."""
        if self._lock is None:
            return
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(timeout=5)
        if self.taken is None:
            # only ours (as last written, or as being written when a Ctrl-C landed): a watch that
            # took over keeps its lease
            with processes.despite_cancel(GIVE_BACK):
                for ours in dict.fromkeys(t for t in (self._written, self._writing) if t is not None):
                    try:
                        if self._swap(ours, {}):
                            break
                    except RelaunchError:
                        break              # it goes stale by itself
        self.note(ended=iso(time.time()))
        self._lock.close()
        self._lock = None

    # -- what status shows ----------------------------------------------------------------------
    def note(self, **fields: Any) -> None:
        """Add to the state file `status` reads (last round, last error, hosts, ended)."""
        self._state.update({**self.mine(), **fields})
        tmp = self.state_path.with_name(f"{self.state_path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(self._state, sort_keys=True) + "\n")
        os.chmod(tmp, 0o600)
        os.replace(tmp, self.state_path)


def read_state(recipe_name: str, store_label: str) -> dict[str, Any] | None:
    """The last watch of this recipe and store on this machine: its state file, and whether it runs."""
    path = folder() / f"{key(recipe_name, store_label)}.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    data["running"] = not data.get("ended") and isinstance(data.get("pid"), int) and _running(data["pid"])
    return data
