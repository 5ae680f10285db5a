"""Throwaway local "cloud GPU instances" (without the GPU) for trying recipes and for tests.

An instance is a Linux network namespace `rl-<name>` joined to this machine by a veth pair, with a
real OpenSSH sshd listening on its own address, an empty private home and a private /tmp.

- `instance`: create (and boot), destroy
- `records`: what is recorded of an instance (list_instances, get, state, the default key)
- `keys`: the public keys an instance accepts (users_keys: the user's own, as a provider has them)
- `processes`: the processes started for it, recorded with their start time; its PID 1
- `console`: run_in, commands, set_link, set_silent, release_key (reaching into a running instance)
- `images`: the image profiles (`create(image=...)`): the facts of a provider's stock image, as data
- `boot`: what an instance is made of on this machine (disks, mount points, PATH layers, its PID 1)
  and the script that boots it
- `power`: stop, start, pause, resume (what a provider does to a running instance)
- `freezer`: the cgroup (v2 or the v1 freezer) a pausable instance runs in
- `users`, `sshd`: the login users (`ubuntu` and its sudoers file); sshd's configuration
- `journal`: every change to this machine, recorded where a reboot keeps it
- `network`: slots, addresses, namespaces, veth pairs, routes, link state, silence, rate shaping
- `index`: build_index, a local PEP 503 package index an instance serves to itself
- `pythons`: relocatable copies of this machine's CPython builds (an image's Python, uv's mirror)

`power` uses `instance`, which uses the others; `index` and `pythons` stand alone.

What the sandbox changes on this machine, and for how long (it runs as root):
- Each instance: its namespace, veth pair, processes and folder, all gone when it is destroyed.
- Each sandbox dir (`RUN_DIR`) with instances: an address range, the first of
  `network.CANDIDATES` (10.213.0.0/16 first) that overlaps no address or route already here, so
  it never shadows a real network, and an `unreachable` route for it. Both go with the dir's last
  instance.
- From the first `ubuntu` instance on: a user `ubuntu` (made unless one exists; a locked one is
  unlocked) and /etc/sudoers.d/relaunch-sandbox. When the last instance on this machine, of any
  sandbox dir, is destroyed, the sudoers file goes and the user is deleted if the sandbox made it
  (one that existed before is locked again as it was); nothing else on the machine is touched.
- An instance of an image profile: tmpfs disks mounted under its folder, mount points this machine
  lacks (/workspace, /lambda/nfs/NAME, /opt/dlami/nvme: made, recorded, and removed if empty when
  no instance needs them any more), a cgroup `relaunch-sandbox-<name>` for one that pauses. All go
  with it.
- A Python of an image profile: relocatable copies of this machine's CPython builds in a cache
  (pythons.CACHE, /var/cache/relaunch/pythons), kept across instances.
- What stays: bookkeeping files under /run/relaunch-sandbox (locks, claims), which a reboot
  clears, and /run/sshd, the directory sshd itself needs.
Every decision on names, slots, ranges and "the last one" is taken under one machine-wide lock,
so several processes may create and destroy instances at once.

Each of these changes is recorded before it is made in a journal a reboot keeps
(/var/lib/relaunch-sandbox/changes.json: `journal`), and forgotten once undone; `clean` (`relaunch
sandbox clean`) undoes whatever the journal still holds that nothing needs: after a reboot (which
empties /run and so every record there), or a destroy that was killed, too.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .console import commands, release_key, run_in, set_link, set_silent
    from .images import PROFILES
    from .index import build_index
    from .instance import INDEX_PORT, INDEX_URL, clean, create, destroy
    from .keys import PublicKey, users_keys
    from .power import pause, resume, start, stop
    from .processes import pid1
    from .records import RUN_DIR, Instance, default_key, get, list_instances, state

# Loaded on first use: every `relaunch` command builds its `sandbox --image` choices from
# images.py, and importing the whole sandbox (namespaces, locks, boot scripts) for that made
# `import relaunch.cli` take 137 ms instead of 93 (measured here, quiet).
_FROM = {
    "commands": "console", "release_key": "console", "run_in": "console", "set_link": "console",
    "set_silent": "console", "PROFILES": "images", "build_index": "index", "INDEX_PORT": "instance",
    "INDEX_URL": "instance", "PublicKey": "keys", "users_keys": "keys",
    "clean": "instance", "create": "instance", "destroy": "instance", "pause": "power", "resume": "power",
    "start": "power", "stop": "power", "pid1": "processes", "RUN_DIR": "records", "Instance": "records",
    "default_key": "records", "get": "records", "list_instances": "records", "state": "records",
}


def __getattr__(name: str) -> Any:
    module = _FROM.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "INDEX_PORT",
    "INDEX_URL",
    "PROFILES",
    "PublicKey",
    "RUN_DIR",
    "Instance",
    "build_index",
    "clean",
    "commands",
    "create",
    "default_key",
    "destroy",
    "get",
    "list_instances",
    "pause",
    "pid1",
    "release_key",
    "resume",
    "run_in",
    "set_link",
    "set_silent",
    "start",
    "state",
    "stop",
    "users_keys",
]
