"""Throwaway local "cloud GPU instances" (without the GPU) for trying recipes and for tests.

An instance is a Linux network namespace `rl-<name>` joined to this machine by a veth pair, with a
real OpenSSH sshd listening on its own address, an empty private home and a private /tmp.

- `instance`: create, destroy, list_instances, get, run_in, set_link (and sshd, mounts, users)
- `network`: slots, addresses, namespaces, veth pairs, routes, link state, rate shaping
- `index`: build_index, a local PEP 503 package index an instance serves to itself

`instance` uses `network`; `index` stands alone.
"""

from .index import build_index
from .instance import (
    INDEX_PORT,
    RUN_DIR,
    Instance,
    create,
    default_key,
    destroy,
    get,
    list_instances,
    run_in,
    set_link,
)

__all__ = [
    "INDEX_PORT",
    "RUN_DIR",
    "Instance",
    "build_index",
    "create",
    "default_key",
    "destroy",
    "get",
    "list_instances",
    "run_in",
    "set_link",
]
