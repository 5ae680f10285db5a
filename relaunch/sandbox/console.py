"""Reaching into a running instance from this machine, as a provider's console or network does:
run a command inside it, read the commands it was sent over ssh, take its link down, make it silent,
install the key held back by `key_delay` now (cloud-init reaching that step)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from ipaddress import IPv4Network

from relaunch.errors import RelaunchError, UsageError

from . import network, sshd
from .boot import DEFAULT_PATH
from .processes import pid1, sshd_pid
from .records import folder_of, get, meta_of


def anchor_pid(name: str) -> int:
    """A process in every namespace of the instance, to enter them by: its PID 1, else sshd."""
    folder = folder_of(name)
    if get(name).image != "default":
        pid = pid1(name)
        if pid is not None:
            return pid
    else:
        pid = sshd_pid(folder)
        if pid is not None:
            return pid
    raise UsageError(f"sandbox {name!r} is not running (sshd not started yet, stopped, or gone)")


def run_in(name: str, argv: list[str], **kw: object) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
    """Run argv inside the instance (its network, mount and PID namespaces) as root, like a console.

    Keyword arguments go to subprocess.run (capture_output, text, check, input, timeout ...).
    The environment is a clean one like an ssh session's unless `env` is given.
    """
    inst = get(name)
    pid = anchor_pid(name)
    kw.setdefault("env", {"PATH": DEFAULT_PATH, "HOME": "/root", "USER": "root", "LANG": "C.UTF-8"})
    kw.setdefault("cwd", "/")
    spaces = ["-n", "-m"] + (["-p"] if inst.image != "default" else [])
    return subprocess.run(["nsenter", "-t", str(pid), *spaces, "--", *argv], **kw)  # type: ignore[call-overload]


def commands(name: str) -> list[str]:
    """The commands instance `name` was asked to run over ssh, in the order they arrived, byte for
    byte (bytes that are not UTF-8 come back as surrogate escapes). Needs create(command_log=True)."""
    get(name)
    try:
        data = (folder_of(name) / sshd.COMMAND_LOG).read_bytes()
    except FileNotFoundError:
        raise UsageError(
            f"sandbox {name!r} does not log commands", hint="create it with command_log=True"
        ) from None
    # every command ends with a NUL byte; a command being appended right now has none yet
    return [c.decode("utf-8", "surrogateescape") for c in data.split(b"\0")[:-1]]


def set_link(name: str, up: bool) -> None:
    """Take the instance's link down (an outage: packets vanish, connections time out) or up again."""
    inst = get(name)
    meta = meta_of(name)
    network.set_link_state(name, int(meta["slot"]), up, IPv4Network(meta["range"]) if meta.get("range") else None)
    if up and meta.get("state", "running") == "running":
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                socket.create_connection((inst.address, inst.port), timeout=0.5).close()
                return
            time.sleep(0.1)
        raise RelaunchError(f"sandbox {name}: sshd not reachable 20s after the link came back up")


def set_silent(name: str, silent: bool) -> None:
    """Drop every packet to and from the instance without a word (a machine that lost power:
    nothing answers, nothing is refused), or let them pass again. Its processes go on."""
    meta = meta_of(name)
    network.set_silent(name, int(meta["slot"]), silent, meta.get("rate"))


def release_key(name: str) -> None:
    """Authorize the key that create(key_delay=...) holds back, now: a test waits for what it means
    (auth refused once) and then lets the key in, instead of racing the delay's timer."""
    folder = folder_of(name)
    with contextlib.suppress(FileNotFoundError):
        (folder / "authorized_keys.pending").replace(folder / "authorized_keys")
