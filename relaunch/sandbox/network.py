"""The network of sandbox instances: slots, namespaces, veth pairs, routes, link state and rate.

Instance N (a "slot", 1..254) is the network namespace `rl-<name>` joined to this machine by the
veth pair rlv<N>h (this machine's side, 10.213.N.1/30) and rlv<N>i (inside, 10.213.N.2/30).
Slots are allocated under a file lock, because several processes create instances at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

from relaunch.errors import RelaunchError, UsageError

RUN_DIR = Path("/run/relaunch-sandbox")
SUBNET = "10.213"  # instance N gets 10.213.N.0/30: .1 on this machine, .2 inside
TOOLS = {  # command -> Debian package that provides it
    "ip": "iproute2",
    "tc": "iproute2",
    "unshare": "util-linux",
    "nsenter": "util-linux",
    "mount": "mount",
    "ssh-keygen": "openssh-client",
    "/usr/sbin/sshd": "openssh-server",
}


def run(argv: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    """Run a local command; a failure becomes a RelaunchError naming the command and its output."""
    proc = subprocess.run(argv, capture_output=True, text=True, **kw)  # type: ignore[call-overload]
    if proc.returncode != 0:
        out = (proc.stderr or proc.stdout or "").strip()
        raise RelaunchError(f"sandbox: `{shlex.join(argv)}` failed (exit {proc.returncode}): {out}")
    return proc


def require_tools(tools: list[str]) -> None:
    for tool in tools:
        if shutil.which(tool) is None:
            pkg = TOOLS.get(tool, tool)
            raise UsageError(f"sandbox needs `{tool}`, which is not installed", hint=f"apt-get install {pkg}")


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive flock: slot allocation and user setup must not race between processes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def netns(name: str) -> str:
    return f"rl-{name}"


def veths(slot: int) -> tuple[str, str]:
    """The veth pair of a slot: this machine's side, the instance's side."""
    return f"rlv{slot}h", f"rlv{slot}i"


def netns_exists(name: str) -> bool:
    return Path("/run/netns", netns(name)).exists()


def link_exists(dev: str) -> bool:
    return Path("/sys/class/net", dev).exists()


def allocate_slot(folder: Path) -> int:
    """A free small integer N (1..254), written to folder/slot. Call under the slots lock."""
    used: set[int] = set()
    for slot_file in RUN_DIR.glob("*/slot"):
        with contextlib.suppress(OSError, ValueError):
            used.add(int(slot_file.read_text()))
    for dev in Path("/sys/class/net").iterdir():
        m = re.fullmatch(r"rlv(\d+)[hi]", dev.name)
        if m:
            used.add(int(m.group(1)))
    for slot in range(1, 255):
        if slot not in used:
            (folder / "slot").write_text(f"{slot}\n")
            return slot
    raise UsageError(
        "no free sandbox slot (254 instances exist)", hint="relaunch sandbox list / destroy NAME"
    )


def addresses(slot: int) -> tuple[str, str]:
    """This machine's side and the instance's address of a slot."""
    return f"{SUBNET}.{slot}.1", f"{SUBNET}.{slot}.2"


def connect(name: str, slot: int) -> str:
    """The namespace of instance `name`, its veth pair and routes. Returns the instance's address."""
    ns = netns(name)
    host_dev, inst_dev = veths(slot)
    gateway, address = addresses(slot)
    # The whole sandbox range is unreachable except through an instance's own link: without this,
    # a packet for a destroyed (or not yet created) instance would leave by the default route.
    run(["ip", "route", "replace", "unreachable", f"{SUBNET}.0.0/16"])
    run(["ip", "netns", "add", ns])
    run(["ip", "link", "add", host_dev, "type", "veth", "peer", "name", inst_dev, "netns", ns])
    run(["ip", "addr", "add", f"{gateway}/30", "dev", host_dev])
    run(["ip", "link", "set", host_dev, "up"])
    run(["ip", "netns", "exec", ns, "ip", "addr", "add", f"{address}/30", "dev", inst_dev])
    run(["ip", "netns", "exec", ns, "ip", "link", "set", inst_dev, "up"])
    run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"])
    # services on this machine's side of any instance's link (a test S3 or Hub server) are
    # reachable from every instance, the way a datacenter's object store is; nothing else is
    run(["ip", "netns", "exec", ns, "ip", "route", "add", f"{SUBNET}.0.0/16", "via", gateway])
    return address


def disconnect(name: str, slot: int | None) -> None:
    """Delete the veth pair and the namespace (its processes must be gone already)."""
    if slot is not None and link_exists(veths(slot)[0]):
        subprocess.run(["ip", "link", "del", veths(slot)[0]], capture_output=True)
    if netns_exists(name):
        run(["ip", "netns", "del", netns(name)])


def shape(name: str, slot: int, rate: str) -> None:
    """Limit the link to `rate` (a tc rate like "20mbit") both ways."""
    host_dev, inst_dev = veths(slot)
    for prefix, dev in (([], host_dev), (["ip", "netns", "exec", netns(name)], inst_dev)):
        tc = [*prefix, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", str(rate)]
        proc = subprocess.run([*tc, "burst", "32kbit", "latency", "400ms"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise UsageError(f"bad rate {rate!r}: {proc.stderr.strip()}", hint="use a tc rate like 20mbit")


def set_link_state(name: str, slot: int, up: bool) -> None:
    """Take the instance's side of the link down (packets vanish) or up again."""
    host_dev, inst_dev = veths(slot)
    run(["ip", "netns", "exec", netns(name), "ip", "link", "set", inst_dev, "up" if up else "down"])
    if up:
        # neighbour entries that failed during the outage would answer "no route to host" for a
        # while; a recovered link should work at once, like a recovered instance
        run(["ip", "neigh", "flush", "dev", host_dev])
        run(["ip", "netns", "exec", netns(name), "ip", "neigh", "flush", "dev", inst_dev])
