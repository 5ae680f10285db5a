"""What the sandbox changed on this machine, recorded where a reboot keeps it.

The sandbox's bookkeeping (claims, ranges, instance folders) lives under /run, which a reboot
empties; some of its changes outlive a reboot (an account, the sudoers file, folders made in /),
and a killed process leaves the others (a namespace, a link, a route, a cgroup). Each is recorded
here before it is made and forgotten once undone, so that `relaunch sandbox clean` can undo
whatever is left, also after a reboot:

- instances: name -> {dir, slot}: every instance claimed (its namespace rl-NAME, its link pair
  rlv<SLOT>h/i with its forwarding setting, its cgroup relaunch-sandbox-NAME, its folder DIR/NAME)
- routes: the `unreachable` routes of the address ranges
- users: name -> {created, password, home}: accounts made, or unlocked (the password to put back)
- files: files written outside the sandbox's folders (/etc/sudoers.d/relaunch-sandbox)
- folders: folders made outside them, removed only if empty (mount points: /workspace ...)
- caches: folders of copies it made for itself (the relocatable Pythons), removed whole

JOURNAL is root's only (0600 in a 0700 folder: it may hold a password hash), and goes when it
records nothing. Read and changed under network.machine_lock().
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

STATE = Path("/var/lib/relaunch-sandbox")
JOURNAL = STATE / "changes.json"
# where versions before the journal recorded users and mount points (a reboot loses them): still
# read, so that what they changed is undone too
LEGACY = Path("/run/relaunch-sandbox")
LEGACY_MOUNT_POINTS = LEGACY / ".mount-points.json"


def legacy_user_record(user: str) -> Path:
    return LEGACY / f".user-{user}.json"


def _empty() -> dict[str, Any]:
    return {"instances": {}, "routes": [], "users": {}, "files": [], "folders": [], "caches": []}


def read() -> dict[str, Any]:
    """The journal (what older versions recorded under /run merged in). Call under machine_lock()."""
    data = _empty()
    with contextlib.suppress(OSError, ValueError):
        found = json.loads(JOURNAL.read_text())
        for key, empty in data.items():
            if isinstance(found.get(key), type(empty)):
                data[key] = found[key]
    with contextlib.suppress(OSError, ValueError):
        data["folders"] += [f for f in json.loads(LEGACY_MOUNT_POINTS.read_text()) if f not in data["folders"]]
    for record in LEGACY.glob(".user-*.json"):
        with contextlib.suppress(OSError, ValueError):
            data["users"].setdefault(record.stem.removeprefix(".user-"), json.loads(record.read_text()))
    return data


@contextlib.contextmanager
def changing() -> Iterator[dict[str, Any]]:
    """The journal, to change in place: written back when the block ends (not when it raises).
    Call under machine_lock()."""
    data = read()
    yield data
    write(data)


def write(data: dict[str, Any]) -> None:
    if not any(data.values()):
        JOURNAL.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            STATE.rmdir()
        return
    STATE.mkdir(mode=0o700, parents=True, exist_ok=True)
    STATE.chmod(0o700)
    tmp = STATE / f".changes.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, JOURNAL)


def add(key: str, item: str) -> None:
    """Record `item` in the list `key` (files, folders, caches, routes). Call under machine_lock()."""
    with changing() as data:
        if item not in data[key]:
            data[key].append(item)


def forget(key: str, item: str) -> None:
    """`item` of the list or mapping `key` is undone. Call under machine_lock()."""
    with changing() as data:
        if isinstance(data[key], dict):
            data[key].pop(item, None)
        elif item in data[key]:
            data[key].remove(item)
    if key == "folders":
        with contextlib.suppress(OSError, ValueError):
            left = [f for f in json.loads(LEGACY_MOUNT_POINTS.read_text()) if f != item]
            if left:
                LEGACY_MOUNT_POINTS.write_text(json.dumps(left) + "\n")
            else:
                LEGACY_MOUNT_POINTS.unlink()
    if key == "users":
        legacy_user_record(item).unlink(missing_ok=True)
