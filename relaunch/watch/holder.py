"""One watch per recipe and store, and what `relaunch status` shows of it.

Two watches of one recipe would both recover a lost instance: two replacements rented and
billing, two trainings writing one store. So a watch holds
- a lock on this machine (`STATE/watch/KEY.lock`, flock, naming who holds it), and
- a lease in the store (`.relaunch/watch.json`: machine, pid, since, renewed every LEASE_EVERY
  seconds), so that a watch on another machine sees it too. A lease not renewed for LEASE_STALE
  seconds counts as gone (a watch killed with kill -9, a machine switched off), and so does one
  from this machine whose process is gone.
Before renting anything the watch reads the lease again; another holder there means it rents
nothing. `STATE/watch/KEY.json` is what `status` shows: pid, hosts, since, last round, last error.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import IO, Any

from ..errors import RelaunchError, UsageError
from ..history import iso
from ..paths import state_dir
from ..transports import Store
from ..ui import UI

LEASE = "watch.json"
LEASE_EVERY = 300.0
LEASE_STALE = 3 * LEASE_EVERY


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
    """Is that lease's watch gone? (not renewed for LEASE_STALE, or its process is gone here)"""
    if info.get("machine") == machine() and isinstance(info.get("pid"), int) and not _running(info["pid"]):
        return True
    return now - float(info.get("renewed_epoch") or 0) > LEASE_STALE


class Holder:
    """What this watch holds; `take()` first, `release()` at the end."""

    def __init__(self, recipe_name: str, store: Store, hosts: list[str]) -> None:
        self.name, self.store, self.hosts = recipe_name, store, hosts
        self.key = key(recipe_name, store.label)
        self.token = f"{machine()}:{os.getpid()}:{time.time():.3f}"
        self.since = iso(time.time())
        self._lock: IO[str] | None = None
        self._state: dict[str, Any] = {}
        self.renewed = 0.0

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
            other = self.lease_holder()
            if other is not None and not take_over:
                raise UsageError(f"another `relaunch watch` of {self.name} holds the store {self.store.label}: "
                                 f"{describe(other)} (its lease in .relaunch/{LEASE} was renewed at "
                                 f"{other.get('renewed', '?')})",
                                 "two watches would both recover a lost instance; stop that one, or, if it is gone "
                                 f"for good, `relaunch watch --take-over` (its lease counts as gone "
                                 f"{LEASE_STALE / 60:.0f} min after its last renewal)")
            self.renew(ui)
        except BaseException:
            # all or nothing: a Ctrl-C that lands once the lease is written gives it back too
            self.release(ui)
            raise

    # -- the store's lease ----------------------------------------------------------------------
    def _read_lease(self) -> dict[str, Any] | None:
        try:
            data = json.loads(self.store.read_meta(LEASE) or "null")
        except ValueError:
            return None
        return data if isinstance(data, dict) else None

    def lease_holder(self) -> dict[str, Any] | None:
        """Another live watch's lease, else None (none, ours, or a stale one)."""
        info = self._read_lease()
        if info is None or info.get("token") == self.token or stale(info, time.time()):
            return None
        return info

    def still_mine(self) -> dict[str, Any] | None:
        """Before renting: None when this watch still holds the store, else who took it."""
        try:
            return self.lease_holder()
        except RelaunchError:
            return None          # the store does not answer: the local lock still holds; rent as planned

    def _write_lease(self, ui: UI, data: dict[str, Any] | None) -> None:
        with self.store.lock(ui):
            self.store.read(writing=True)
            self.store.write_meta(LEASE, json.dumps(data, sort_keys=True) + "\n" if data else "{}\n")
            self.store.flush()

    def renew(self, ui: UI) -> None:
        now = time.time()
        self._write_lease(ui, {**self.mine(), "renewed": iso(now), "renewed_epoch": now})
        self.renewed = time.monotonic()

    def due(self) -> bool:
        return time.monotonic() - self.renewed >= LEASE_EVERY

    def release(self, ui: UI) -> None:
        """Give back the local lock and, when it is still ours, the store's lease; nothing when
        `take()` did not get the lock (the state file then belongs to the watch that has it)."""
        if self._lock is None:
            return
        try:
            info = self._read_lease()
            if info is not None and info.get("token") == self.token:
                self._write_lease(ui, None)
        except RelaunchError:
            pass                   # it goes stale by itself
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
