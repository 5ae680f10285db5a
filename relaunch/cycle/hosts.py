"""Which instance a command talks to: HOST resolved over the recipe and ~/.ssh/config, the
hosts of the last `up` remembered, and the connections to one node or a node group.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .. import processes
from ..errors import RelaunchError, UsageError
from ..host.connection import connect
from ..host.remote import Remote
from ..host.spec import HostSpec, Target
from ..host.sshconfig import Layer, resolve
from ..job import Node
from ..paths import state_dir
from ..recipe import Recipe
from ..ui import UI


def make_target(recipe: Recipe, spec: HostSpec) -> Target:
    """HOST wins over what the recipe wrote in its ssh section, which wins over ~/.ssh/config for
    that host, which wins over the provider preset and the defaults (see host/sshconfig.py)."""
    ssh = recipe.ssh
    written = Layer(user=ssh.user if recipe.wrote("ssh.user") else None,
                    port=ssh.port if recipe.wrote("ssh.port") else None,
                    key=str(ssh.key) if ssh.key else None)
    return resolve(spec, written, Layer(user=ssh.user, port=ssh.port), host_key=ssh.host_key, wait=ssh.wait)


def _hosts_file(recipe: Recipe) -> Path:
    folder = state_dir() / "hosts"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    return folder / f"{recipe.name}.json"


def remember_host(recipe: Recipe, *nodes: tuple[Target, HostSpec]) -> None:
    """The host (or node group, node 0 first) of the last successful `up`, for commands without HOST.

    An ssh config alias is remembered as typed, so that a later run resolves it (and its jump
    host) again; an address as the endpoint it was resolved to."""
    hosts = [str(spec) if target.alias else target.endpoint for target, spec in nodes]
    first = nodes[0][0]
    # an alias's port comes from the ssh config again; only a plain address keeps the one it had
    port = None if first.alias else first.port
    _hosts_file(recipe).write_text(json.dumps({"host": hosts[0], "port": port, "hosts": hosts}) + "\n")


def last_hosts(recipe: Recipe, ui: UI) -> list[HostSpec]:
    path = _hosts_file(recipe)
    if not path.exists():
        raise UsageError(f"no HOST given and no successful `relaunch up` of recipe {recipe.name} on record",
                         "give the instance as HOST")
    data = json.loads(path.read_text())
    specs = [HostSpec.parse(h) for h in data.get("hosts") or [data["host"]]]
    if len(specs) == 1:
        specs = [HostSpec(specs[0].address, specs[0].user, specs[0].port or data.get("port"))]
    what = "host" if len(specs) == 1 else "node group"
    ui.say(f"using {' '.join(map(str, specs))}, the {what} of the last `relaunch up` of {recipe.name}")
    return specs


def last_host(recipe: Recipe, ui: UI) -> HostSpec:
    return last_hosts(recipe, ui)[0]


def open_host(recipe: Recipe, spec: HostSpec, ui: UI, accept_new_host_key: bool = False, rank: int = 0,
              nnodes: int = 1, master_addr: str = "", booting: bool = False) -> tuple[Node, Remote]:
    """`booting`: the instance may still be booting (`up`): a refused port is waited for
    (host.connection.connect); else it is expected to run, and what waiting cannot mend ends at once."""
    node = Node(make_target(recipe, spec), rank, nnodes, master_addr)
    through = f" through jump host {node.target.jump.label}" if node.target.jump else ""
    ui.say(f"connecting to {node.label}{through}"
           + (f" (waiting up to {node.target.wait:g}s while it boots)" if booting else ""))
    remote = connect(node.target, booting=booting, accept_new_host_key=accept_new_host_key, say=ui.say)
    missing = [name for name in recipe.env.secrets if name not in os.environ]
    if missing:
        ui.warn(f"env.secrets {', '.join(missing)} not set on this machine; not handed to the instance")
    return node, remote


def open_group(recipe: Recipe, specs: list[HostSpec], ui: UI, accept_new_host_key: bool = False,
               booting: bool = False) -> list[tuple[Node, Remote]]:
    """Connect to every node at the same time (node 0 first in the result); all or nothing."""
    if len(specs) == 1:
        return [open_host(recipe, specs[0], ui, accept_new_host_key, booting=booting)]
    master = make_target(recipe, specs[0]).address     # as resolved: an ssh config alias means nothing there
    with ThreadPoolExecutor(max_workers=len(specs), thread_name_prefix="connect") as pool:
        futures = [pool.submit(open_host, recipe, spec, ui, accept_new_host_key, rank, len(specs), master, booting)
                   for rank, spec in enumerate(specs)]
        try:
            outcomes = [(f.result() if f.exception() is None else f.exception()) for f in futures]
        except KeyboardInterrupt:
            processes.CANCEL.set()
            raise
    pairs = [o for o in outcomes if isinstance(o, tuple)]
    failed = [(spec, o) for spec, o in zip(specs, outcomes, strict=True) if not isinstance(o, tuple)]
    if failed:
        for _, remote in pairs:
            remote.close()
        spec, exc = failed[0]
        if isinstance(exc, RelaunchError):
            named = exc.message if exc.message.startswith(f"{make_target(recipe, spec).label}:") else \
                f"{spec}: {exc.message}"               # most messages name their host already
            raise type(exc)(f"{len(failed)} of {len(specs)} nodes could not be reached; first, {named}",
                            exc.hint, exc.refused)
        raise exc  # type: ignore[misc]
    return pairs  # type: ignore[return-value]


@contextlib.contextmanager
def connected(pairs: list[tuple[Node, Remote]]) -> Iterator[dict[str, Remote]]:
    """The group's connections by node label, closed at the end."""
    try:
        yield {node.label: remote for node, remote in pairs}
    finally:
        for _, remote in pairs:
            remote.close()


def group_known_hosts(nodes: list[Node]) -> str:
    """relaunch's recorded host keys of the group's nodes, as a known_hosts file for the nodes."""
    from ..host.known_hosts import KnownHosts
    from ..paths import known_hosts_file

    known = KnownHosts(known_hosts_file())
    return "".join(f"{node.target.known_hosts_name} {key.get_name()} {key.get_base64()}\n"
                   for node in nodes for key in known.recorded(node.target.known_hosts_name))
