"""What a provider does to a running instance: stop and start it, pause and resume it.

A stop is the image's (images.py): on the default image every process is killed at once; on a VM
the init gets SIGTERM, stops every process as a shutdown does and exits, and whatever is left
after `grace` is killed; on a container SIGTERM goes to PID 1 only (a start script that drops it)
and SIGKILL to everything after `grace`. The disks a stop wipes go with the namespaces; the
instance keeps its address, host key, port and the disks that survive. A start boots it again in
fresh namespaces. A pause freezes every process of the instance (freezer.py), sshd too; a resume
thaws them, each where it was.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Any

from relaunch.errors import UsageError

from . import freezer, images
from .instance import _boot_sshd, _cgroup, _kill_all, _serve_index
from .processes import netns_pids, pid1, process_state
from .records import folder_of, meta_of, require_root, save_meta


def _in_state(name: str, wanted: str, verb: str) -> dict[str, Any]:
    require_root()
    meta = meta_of(name)
    now = meta.get("state", "running")
    if now != wanted:
        hint = {"stopped": f"relaunch sandbox start {name}", "paused": f"relaunch sandbox resume {name}"}.get(now)
        raise UsageError(f"sandbox {name!r} is {now}: cannot {verb} it", hint=hint)
    return meta


def stop(name: str, grace: float | None = None) -> float:
    """Stop instance `name` as its provider does; returns the grace used (seconds between the
    SIGTERM and the SIGKILL to everything left)."""
    if grace is not None and (not isinstance(grace, (int, float)) or grace < 0):
        raise UsageError(f"bad grace {grace!r}: use a number of seconds >= 0")
    meta = meta_of(name)
    if meta.get("state") == "paused":  # stopping a paused instance: thawed first, then stopped
        resume(name)
        meta = meta_of(name)
    meta = _in_state(name, "running", "stop")
    image = images.profile(str(meta.get("image", "default")))
    grace = image.stop_grace if grace is None else float(grace)
    first = pid1(name) if image.own_pid_namespace else None
    if first is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(first, signal.SIGTERM)
        # a VM's init exits once its processes are gone; a container's PID 1 never heard it
        deadline = time.monotonic() + grace
        while process_state(first) not in (None, "Z") and time.monotonic() < deadline:
            time.sleep(0.05)
    _kill_all(name, folder_of(name))
    save_meta(folder_of(name), {**meta, "state": "stopped", "index_url": meta.get("index_url")})
    return grace


def start(name: str) -> None:
    """Boot a stopped instance again: fresh namespaces, the same address, host key, port and kept disks."""
    meta = _in_state(name, "stopped", "start")
    folder = folder_of(name)
    if netns_pids(name):
        _kill_all(name, folder)  # (a stop leaves none; a process someone started into the netns since)
    pending = folder / "authorized_keys.pending"
    if pending.exists():  # stopped before the delayed key arrived: it is there now
        os.replace(pending, folder / "authorized_keys")
    _boot_sshd(name, meta)
    save_meta(folder, {**meta, "index_url": _serve_index(name, meta), "state": "running"})


def _freezable(name: str, verb: str, wanted: str) -> tuple[dict[str, Any], freezer.Cgroup]:
    meta = meta_of(name)
    image = images.profile(str(meta.get("image", "default")))
    cgroup = _cgroup(meta)
    if not image.can_pause or cgroup is None:
        can = ", ".join(i.name for i in images.PROFILES.values() if i.can_pause)
        raise UsageError(f"sandbox {name!r} (image {image.name}) cannot {verb}: its provider does not pause "
                         "instances", hint=f"images that pause: {can}")
    meta = _in_state(name, wanted, verb)
    return meta, cgroup


def pause(name: str) -> None:
    """Freeze every process of the instance (an outbid Vast instance): no signal, sshd silent."""
    meta, cgroup = _freezable(name, "pause", "running")
    cgroup.freeze(True)
    save_meta(folder_of(name), {**meta, "state": "paused"})


def resume(name: str) -> None:
    """Thaw a paused instance: every process goes on where it was, same PIDs."""
    meta, cgroup = _freezable(name, "resume", "paused")
    cgroup.freeze(False)
    save_meta(folder_of(name), {**meta, "state": "running"})
