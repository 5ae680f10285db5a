"""The network of sandbox instances: address ranges, slots, namespaces, veth pairs, routes, link
state, silence and rate.

An instance holds a slot N (1..254, unique on this machine) and lives in the network namespace
`rl-<name>`, joined to this machine by the veth pair rlv<N>h (this machine's side, X.Y.N.1/30) and
rlv<N>i (inside, X.Y.N.2/30). X.Y.0.0/16 is the range of its sandbox dir (see `instance.RUN_DIR`):
the first of CANDIDATES that overlaps no address or route of this machine, chosen with the dir's
first instance, recorded in <dir>/.range and kept while the dir has an instance. While it is in use
this machine has an `unreachable` route for it, removed with the dir's last instance.

Several processes create and destroy instances at once, in one sandbox dir or several: every
decision (a name, a slot, a range, which instance is the last) is taken under one machine-wide
lock, and every instance of every dir is claimed in MACHINE_DIR/.claims/<name>.json (names and
slots are unique on the machine: namespaces and links are).
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterable, Iterator, Mapping
from ipaddress import IPv4Network, ip_network
from pathlib import Path

from filelock import FileLock

from relaunch.errors import RelaunchError, UsageError

from . import journal

# Bookkeeping shared by every process and every sandbox dir (the default dir lives there too).
MACHINE_DIR = Path("/run/relaunch-sandbox")
CLAIMS = MACHINE_DIR / ".claims"
LOCK = MACHINE_DIR / ".slots.lock"  # the name older versions lock too, so they never race with this one
# Private /16s an instance's range is chosen from, in this order.
CANDIDATES = tuple(
    IPv4Network(n)
    for n in ("10.213.0.0/16", "10.214.0.0/16", "10.215.0.0/16", "10.216.0.0/16",
              "172.28.0.0/16", "172.29.0.0/16", "172.30.0.0/16", "172.31.0.0/16")
)  # fmt: skip
# A sandbox dir with instances but no .range file was filled by an older version: it used this.
LEGACY_RANGE = CANDIDATES[0]
TOOLS = {  # command -> Debian package that provides it
    "ip": "iproute2",
    "tc": "iproute2",
    "unshare": "util-linux",
    "nsenter": "util-linux",
    "mount": "mount",
    "ssh-keygen": "openssh-client",
    "/usr/sbin/sshd": "openssh-server",
}
# needed only by instances that log commands (see instance.create)
TOOLS_COMMAND_LOG = {"flock": "util-linux", "/usr/lib/openssh/sftp-server": "openssh-sftp-server"}


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
            pkg = {**TOOLS, **TOOLS_COMMAND_LOG}.get(tool, tool)
            raise UsageError(f"sandbox needs `{tool}`, which is not installed", hint=f"apt-get install {pkg}")


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock for every process of this machine, held until the block ends."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(path):
        yield


def netns(name: str) -> str:
    return f"rl-{name}"


def veths(slot: int) -> tuple[str, str]:
    """The veth pair of a slot: this machine's side, the instance's side."""
    return f"rlv{slot}h", f"rlv{slot}i"


def netns_exists(name: str) -> bool:
    return Path("/run/netns", netns(name)).exists()


def link_exists(dev: str) -> bool:
    return Path("/sys/class/net", dev).exists()


def machine_lock() -> contextlib.AbstractContextManager[None]:
    """The lock under which every process takes names, slots and ranges, and decides what is last."""
    return locked(LOCK)


def choose_range(routes: Iterable[Mapping[str, object]], taken: Iterable[IPv4Network] = ()) -> IPv4Network:
    """The first of CANDIDATES that overlaps none of `routes` and none of the ranges `taken`.

    routes: this machine's IPv4 routes as `ip -j -4 route show table all` lists them (every address
    is there too, as a `local` route). The default route is no network, and an `unreachable` route
    for a candidate is a sandbox's own: the ranges other sandbox dirs use come in `taken`, and one
    that none uses was left by a sandbox that is gone.
    """
    busy = list(taken)
    for route in routes:
        try:
            net = ip_network(str(route.get("dst")), strict=False)
        except ValueError:  # "default", or nothing
            continue
        if net.version == 4 and not (route.get("type") == "unreachable" and net in CANDIDATES):
            busy.append(net)
    for cand in CANDIDATES:
        if not any(cand.overlaps(net) for net in busy):
            return cand
    raise UsageError(
        "no free address range for sandbox instances: "
        + ", ".join(map(str, CANDIDATES))
        + " all overlap addresses or routes of this machine",
        hint="ip -4 route show table all",
    )


def instance_names(world: Path) -> set[str]:
    """The instances of a sandbox dir: its folders holding a slot file (written when claimed)."""
    return {p.parent.name for p in world.glob("*/slot")}


def _claims() -> dict[str, Path]:
    """name -> sandbox dir of every instance claimed on this machine. The folder is the truth: a
    claim whose folder is gone (its destroy was killed half-way) counts for nothing."""
    found = {}
    for path in CLAIMS.glob("*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            world = Path(json.loads(path.read_text())["dir"])
            if (world / path.stem / "slot").exists():
                found[path.stem] = world
    return found


def claimed_dir(name: str) -> Path | None:
    """The sandbox dir instance `name` belongs to, whichever it is; None if no dir has it."""
    return _claims().get(name)


def names_everywhere() -> set[str]:
    """Every instance on this machine, of every sandbox dir (older versions claimed nothing, but
    they only used the default dir)."""
    return set(_claims()) | instance_names(MACHINE_DIR)


def sandbox_dirs() -> set[Path]:
    """The default sandbox dir and every dir with an instance claimed on this machine."""
    return {MACHINE_DIR, *_claims().values()}


def _recorded_range(world: Path) -> IPv4Network | None:
    with contextlib.suppress(OSError, ValueError):
        return IPv4Network((world / ".range").read_text().strip())
    return None


def range_of(world: Path) -> IPv4Network | None:
    """The range a sandbox dir's instances use; None while it has none."""
    recorded = _recorded_range(world)
    return recorded if recorded is not None else (LEGACY_RANGE if instance_names(world) else None)


NEXT_SLOT = MACHINE_DIR / ".next-slot"


def _used_slots() -> set[int]:
    used = set()
    for world in sandbox_dirs():
        for slot_file in world.glob("*/slot"):
            with contextlib.suppress(OSError, ValueError):
                used.add(int(slot_file.read_text()))
    for dev in Path("/sys/class/net").iterdir():
        m = re.fullmatch(r"rlv(\d+)[hi]", dev.name)
        if m:
            used.add(int(m.group(1)))
    return used


def _free_slot() -> int:
    """The next free slot after the last one given (round robin, as a PID): a slot just freed is
    not given again at once, so that an address stays the one who freed it asks for (`address=`),
    as a provider hands a released address to the next instance of the same account."""
    used = _used_slots()
    start = 1
    with contextlib.suppress(OSError, ValueError):
        start = int(NEXT_SLOT.read_text())
    if not 1 <= start <= 254:
        start = 1
    for slot in [*range(start, 255), *range(1, start)]:
        if slot not in used:
            NEXT_SLOT.write_text(f"{slot % 254 + 1}\n")
            return slot
    raise UsageError("no free sandbox slot (254 instances exist)", hint="relaunch sandbox list / destroy NAME")


def slot_of(address: str, net: IPv4Network) -> int:
    """The slot whose instance address is `address` in range `net` (X.Y.N.2 -> N)."""
    for slot in range(1, 255):
        if addresses(slot, net)[1] == address:
            return slot
    raise UsageError(f"{address} is no sandbox instance address of the range {net}",
                     hint=f"an instance address is {addresses(1, net)[1]}, {addresses(2, net)[1]}, ...")


def claim(name: str, folder: Path, address: str | None = None) -> tuple[int, IPv4Network]:
    """Claim instance `name`, whose folder in its sandbox dir was just made: a slot (the one of
    `address` when given, refused when taken), and the dir's range (chosen now if the dir has
    none). Call under machine_lock(). Returns (slot, range)."""
    world = folder.parent
    net = range_of(world)
    if net is None:
        taken = [r for w in sandbox_dirs() - {world} if (r := range_of(w)) is not None]
        routes = json.loads(run(["ip", "-j", "-4", "route", "show", "table", "all"]).stdout or "[]")
        net = choose_range(routes, taken)
    (world / ".range").write_text(f"{net}\n")
    if address is None:
        slot = _free_slot()
    else:
        slot = slot_of(address, net)
        if slot in _used_slots():
            raise UsageError(f"the sandbox address {address} is taken", hint="relaunch sandbox list")
    # recorded where a reboot (or a kill) does not lose it, before anything is made (journal.py)
    with journal.changing() as data:
        data["instances"][name] = {"dir": str(world), "slot": slot}
        if str(net) not in data["routes"]:
            data["routes"].append(str(net))
    (folder / "slot").write_text(f"{slot}\n")
    CLAIMS.mkdir(parents=True, exist_ok=True)
    (CLAIMS / f"{name}.json").write_text(json.dumps({"dir": str(world)}) + "\n")
    # The whole range is unreachable except through an instance's own link: without this, a packet
    # for a destroyed (or not yet created) instance would leave by the default route.
    run(["ip", "route", "replace", "unreachable", str(net)])
    return slot, net


def release(name: str, world: Path) -> None:
    """Drop the claim of instance `name` of sandbox dir `world`, whose folder is gone; with the dir's
    last instance its range goes too. Call under machine_lock()."""
    (CLAIMS / f"{name}.json").unlink(missing_ok=True)
    journal.forget("instances", name)
    net = _recorded_range(world)
    if net is not None and not instance_names(world):
        (world / ".range").unlink(missing_ok=True)
        release_range(net)


def release_range(net: IPv4Network) -> bool:
    """Delete the `unreachable` route of `net` unless a sandbox dir still uses the range; whether it
    went. Call under machine_lock()."""
    if any(range_of(w) == net for w in sandbox_dirs()):
        return False
    subprocess.run(["ip", "route", "del", "unreachable", str(net)], capture_output=True)  # maybe gone
    journal.forget("routes", str(net))
    return True


def addresses(slot: int, net: IPv4Network) -> tuple[str, str]:
    """This machine's side and the instance's address of a slot in range `net`: X.Y.N.1, X.Y.N.2."""
    base = net.network_address + 256 * slot
    return str(base + 1), str(base + 2)


def connect(name: str, slot: int, net: IPv4Network) -> str:
    """The namespace of instance `name`, its veth pair and routes. Returns the instance's address."""
    ns = netns(name)
    host_dev, inst_dev = veths(slot)
    gateway, address = addresses(slot, net)
    run(["ip", "netns", "add", ns])
    run(["ip", "link", "add", host_dev, "type", "veth", "peer", "name", inst_dev, "netns", ns])
    run(["ip", "addr", "add", f"{gateway}/30", "dev", host_dev])
    run(["ip", "link", "set", host_dev, "up"])
    # instances of one sandbox dir reach each other, as the nodes of one cloud network do
    # (torchrun's rendezvous, a checkpoint fanned out between nodes): forwarding on this link
    # only, never machine-wide
    Path(f"/proc/sys/net/ipv4/conf/{host_dev}/forwarding").write_text("1\n")
    run(["ip", "netns", "exec", ns, "ip", "addr", "add", f"{address}/30", "dev", inst_dev])
    run(["ip", "netns", "exec", ns, "ip", "link", "set", inst_dev, "up"])
    run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"])
    # services on this machine's side of any instance's link (a test S3 or Hub server) are
    # reachable from every instance of the sandbox dir, the way a datacenter's object store is;
    # nothing else is
    run(["ip", "netns", "exec", ns, "ip", "route", "add", str(net), "via", gateway])
    return address


def disconnect(name: str, slot: int | None) -> None:
    """Delete the veth pair and the namespace (its processes must be gone already)."""
    if slot is not None and link_exists(veths(slot)[0]):
        subprocess.run(["ip", "link", "del", veths(slot)[0]], capture_output=True)
    if netns_exists(name):
        run(["ip", "netns", "del", netns(name)])


def shape(name: str, slot: int, rate: str) -> None:
    """Limit the link between this machine and the instance to `rate` (a tc rate like "20mbit"),
    both ways; traffic between instances (a node group's own network) stays fast, as between the
    nodes of one datacenter. Addresses ending in .1 are this machine's side of every link."""
    host_dev, inst_dev = veths(slot)
    # (device, command prefix, offset of the address that says "this machine": source leaving
    # this machine, destination leaving the instance)
    for prefix, dev, offset in (([], host_dev, 12), (["ip", "netns", "exec", netns(name)], inst_dev, 16)):
        steps = [
            ["qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "20"],
            ["class", "replace", "dev", dev, "parent", "1:", "classid", "1:10", "htb", "rate", str(rate),
             "burst", "32kb", "quantum", "1514"],
            ["class", "replace", "dev", dev, "parent", "1:", "classid", "1:20", "htb", "rate", "10gbit",
             "quantum", "60000"],
            ["filter", "replace", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match", "u32",
             "0x00000001", "0x000000ff", "at", str(offset), "flowid", "1:10"],
        ]
        for step in steps:
            proc = subprocess.run([*prefix, "tc", *step], capture_output=True, text=True)
            if proc.returncode != 0:
                raise UsageError(f"bad rate {rate!r}: {proc.stderr.strip()}", hint="use a tc rate like 20mbit")


# a token bucket of 8 bit/s with no room: every packet is dropped without a word (no `netem` or `prio`
# here, and a blackhole route is not silent: local senders get EINVAL at once)
SILENT = ["tbf", "rate", "8bit", "burst", "10", "limit", "1"]


def set_silent(name: str, slot: int, silent: bool, rate: str | None = None) -> None:
    """Drop every packet of the instance's link, both ways, as a machine that lost power does
    (connections neither fail nor answer), or let them pass again (shaped to `rate` again when
    the link was)."""
    host_dev, inst_dev = veths(slot)
    for prefix, dev in (([], host_dev), (["ip", "netns", "exec", netns(name)], inst_dev)):
        if silent:
            run([*prefix, "tc", "qdisc", "replace", "dev", dev, "root", *SILENT])
        else:
            subprocess.run([*prefix, "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
    if not silent and rate:
        shape(name, slot, rate)


def set_link_state(name: str, slot: int, up: bool, net: IPv4Network | None = None) -> None:
    """Take the instance's side of the link down (packets vanish) or up again; `net`, the range,
    to restore its route to the other instances' links (the kernel drops it with the link)."""
    host_dev, inst_dev = veths(slot)
    run(["ip", "netns", "exec", netns(name), "ip", "link", "set", inst_dev, "up" if up else "down"])
    if up and net is not None:
        run(["ip", "netns", "exec", netns(name), "ip", "route", "replace", str(net), "via", addresses(slot, net)[0]])
    if up:
        # neighbour entries that failed during the outage would answer "no route to host" for a
        # while; a recovered link should work at once, like a recovered instance
        run(["ip", "neigh", "flush", "dev", host_dev])
        run(["ip", "netns", "exec", netns(name), "ip", "neigh", "flush", "dev", inst_dev])
