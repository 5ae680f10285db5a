"""Sandbox instances: create (and boot), destroy. What is recorded of them is records.py's, the
processes started for them processes.py's, reaching into a running one console.py's.

An instance is a Linux network namespace `rl-<name>` joined to this machine by a veth pair, with a
real OpenSSH sshd listening on its own address. sshd runs in a private mount namespace where the
user's home is an empty tmpfs (the instance's "disk"), /tmp is private, and this machine's pip
configuration is masked (a real instance has none). Every instance gets a fresh ed25519 host key,
like a new cloud instance, and reaches no package registry: `index.build_index` prepares a local
PEP 503 index on this machine that the instance can serve to itself. Its network is `network`'s.
An image profile (images.py) adds its own PID 1, Python, disks and port (boot.py); power.py stops,
starts, pauses and resumes it.

Everything needed to find an instance again lives in `RUN_DIR/<name>/` (the CLI creates in one
process and destroys in another). RUN_DIR, the sandbox dir, is /run/relaunch-sandbox unless
$RELAUNCH_SANDBOX_DIR names another: a separate set of instances with its own address range and
its own last instance (a test can empty its own dir while other sessions keep theirs). It must be
a folder of its own that sshd can read inside an instance: /root, /tmp and the `ubuntu` user's
home are masked there, /run is not.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from ipaddress import IPv4Network
from pathlib import Path
from typing import Any

from relaunch.errors import RelaunchError, UsageError

from . import boot, freezer, images, journal, network, pythons, sshd, users
from .keys import is_public_key, public_key_line
from .network import TOOLS, TOOLS_COMMAND_LOG, netns_exists, require_tools, run, veths
from .processes import (
    cmdline,
    kill_recorded,
    log_tail,
    netns_pids,
    process_state,
    reap,
    spawn,
    sshd_pid,
    start_time,
)
from .records import RUN_DIR, Instance, check_name, default_key, folder_of, list_instances, require_root, save_meta
from .users import HOMES

DISK_RE = re.compile(r"[1-9][0-9]*[kKmMgG]?")
INDEX_PORT = 8765
INDEX_URL = f"http://127.0.0.1:{INDEX_PORT}/simple/"  # the index served inside, as the instance sees it
VOLUME_SIZE = "8G"  # an image's disk besides home (/workspace ...), unless create() is given another


# ---------------------------------------------------------------------------------------------
# small helpers


# ---------------------------------------------------------------------------------------------
# create


def _authorized_lines(authorized_key: Path | None, also: Sequence[str]) -> str:
    """authorized_keys' text: the key given (default: the sandbox's own), then `also`, each once."""
    lines = [public_key_line(authorized_key if authorized_key is not None else default_key())]
    for line in also:
        if not is_public_key(line):
            raise UsageError(f"not an SSH public key: {line[:40]!r}")
        lines.append(line)
    blobs: dict[str, str] = {}
    for line in lines:
        blobs.setdefault(line.split()[1], line)
    return "".join(f"{line}\n" for line in blobs.values())


def create(
    name: str,
    *,
    image: str = "default",
    user: str | None = None,
    authorized_key: Path | None = None,
    also_authorize: Sequence[str] = (),
    disk: str = "4G",
    volume: str = VOLUME_SIZE,
    rate: str | None = None,
    index_dir: Path | None = None,
    boot_delay: float = 0.0,
    key_delay: float = 0.0,
    command_log: bool = False,
    address: str | None = None,
) -> Instance:
    """Create and boot instance `name`; returns once sshd accepts TCP (at once with boot_delay).

    image: a profile of images.PROFILES, the facts of a provider's stock image (see boot.py);
    "default" is this machine as it is. user: who logs in, root or ubuntu (default: the image's;
    an image other than the default has one). authorized_key: public key file (or a private key
    with its .pub beside it) that may log in; default: default_key(). also_authorize: more public
    key lines that may log in (the user's own: keys.users_keys()). disk: size of the home tmpfs
    ("4G"). volume: size of the image's other disk (/workspace, /lambda/nfs/NAME,
    /opt/dlami/nvme). rate: tc rate of the link both ways ("20mbit"). index_dir: a build_index()
    folder served inside at INDEX_PORT. boot_delay: sshd starts only after that many seconds (the
    address refuses connections meanwhile). key_delay: the key is authorized only after that many
    seconds (auth fails meanwhile), or when release_key(name) is called. command_log: sshd logs
    every command it is asked to run, byte for byte, for `commands(name)`; a session without a
    command (a login shell) logs nothing. SFTP still works, through /usr/lib/openssh/sftp-server
    instead of sshd's own: each SFTP session logs that program's path as its command. Other
    subsystems are not supported on such an instance.
    address: this free address of the range (one a destroyed instance had), else the next free one.
    """
    check_name(name)
    profile = images.profile(image)
    if user is None:
        user = profile.user
    if user not in HOMES:
        raise UsageError(f"bad sandbox user {user!r}: use root or ubuntu")
    if profile.own_pid_namespace and user != profile.user:
        raise UsageError(f"the image {image} logs in as {profile.user}, not {user}", hint="leave out --user")
    for label, size in (("disk", disk), ("volume", volume)):
        if not isinstance(size, str) or not DISK_RE.fullmatch(size):
            raise UsageError(f"bad {label} size {size!r}: use a number with K, M or G, like 4G")
    for label, value in (("boot_delay", boot_delay), ("key_delay", key_delay)):
        if not isinstance(value, (int, float)) or value < 0:
            raise UsageError(f"bad {label} {value!r}: use a number of seconds >= 0")
    if index_dir is not None:
        index_dir = Path(index_dir).expanduser().resolve()
        if not (index_dir / "simple").is_dir():
            raise UsageError(
                f"no package index at {index_dir} (no simple/ folder)", hint="build it with build_index()"
            )
    require_root()
    require_tools(list(TOOLS) + (list(TOOLS_COMMAND_LOG) if command_log else []))
    authorized = _authorized_lines(authorized_key, also_authorize)

    folder = folder_of(name)
    boot.check_folder(folder, profile)
    with network.machine_lock():
        owner = network.claimed_dir(name)
        if folder.exists() or owner is not None or netns_exists(name):
            where = f" (in the sandbox dir {owner})" if owner not in (None, RUN_DIR) else ""
            raise UsageError(f"sandbox {name!r} already exists{where}", hint=f"relaunch sandbox destroy {name}")
        if name in orphans():
            raise UsageError(f"sandbox {name!r} left changes on this machine that no record under /run names any "
                             "more (a reboot, or a destroy that was killed)", hint="relaunch sandbox clean")
        RUN_DIR.mkdir(parents=True, exist_ok=True)
        RUN_DIR.chmod(0o755)  # sshd reads authorized_keys as the login user
        folder.mkdir(mode=0o755)
        try:
            slot, net = network.claim(name, folder, address)
            # which mount points it needs, for the last one out (destroy) even before it booted
            (folder / "image").write_text(f"{image}\n")
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            network.release(name, RUN_DIR)
            raise
    try:
        return _boot(name, folder, slot, net, profile, user, authorized, {"home": disk, "volume": volume}, rate,
                     index_dir, boot_delay, key_delay, command_log)
    except BaseException:
        # a half-created instance must leave nothing behind
        destroy(name)
        raise


def _boot(
    name: str,
    folder: Path,
    slot: int,
    net: IPv4Network,
    image: images.Image,
    user: str,
    authorized: str,
    sizes: dict[str, str],
    rate: str | None,
    index_dir: Path | None,
    boot_delay: float,
    key_delay: float,
    command_log: bool,
) -> Instance:
    """Make the instance (key, sshd, link, disks, layers) and power it on."""
    folder.chmod(0o755)
    home = HOMES[user]
    ids = users.ensure_ubuntu() if user == "ubuntu" else None
    host_dev, inst_dev = veths(slot)
    address = network.addresses(slot, net)[1]
    port = image.port(slot)
    ns = network.netns(name)

    # a fresh host key: every instance is a new machine as far as ssh is concerned
    key = folder / "ssh_host_ed25519_key"
    run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"root@{ns}", "-f", str(key)])
    fingerprint = run(["ssh-keygen", "-lf", f"{key}.pub"]).stdout.split()[1]
    (folder / "sshd_config").write_text(
        sshd.config(folder, address, port, command_log, pid_file=not image.own_pid_namespace))
    if command_log:
        forced = folder / sshd.LOG_COMMAND
        forced.write_text(sshd.log_command_script(folder / sshd.COMMAND_LOG))
        forced.chmod(0o755)
        # appended to by the login user's sessions, read from this machine; writable by no one else
        (folder / sshd.COMMAND_LOG).touch(mode=0o644)
        os.chown(folder / sshd.COMMAND_LOG, *(ids or (0, 0)))
    (folder / "empty").write_text("")
    if key_delay > 0:
        (folder / "authorized_keys.pending").write_text(authorized)
    else:
        (folder / "authorized_keys").write_text(authorized)
    for f in ("authorized_keys", "authorized_keys.pending"):
        with contextlib.suppress(FileNotFoundError):
            (folder / f).chmod(0o644)  # read by sshd as the login user

    network.connect(name, slot, net)

    # what the image adds to this machine's filesystem: mount points, kept disks, PATH, its PID 1
    with network.machine_lock():
        boot.ensure_mount_points(image.volume_paths(name))
    boot.mount_disks(folder, image, name, home, sizes, ids)
    layers = boot.make_layers(folder, image)
    if image.own_pid_namespace:
        boot.pid1_script(folder, image)
    cgroup = None
    if image.can_pause:
        cgroup = freezer.create(name)

    inst = Instance(name, address, user, port, home, fingerprint, None, image.name)
    meta = {**asdict(inst), "slot": slot, "range": str(net), "veth": [host_dev, inst_dev], "disk": sizes["home"],
            "volume": sizes["volume"], "rate": rate, "index_dir": str(index_dir) if index_dir else None,
            "command_log": command_log, "ids": list(ids) if ids else None, "layers": layers,
            "cgroup": [cgroup.kind, str(cgroup.path)] if cgroup else None, "state": "running",
            "created": time.time()}  # fmt: skip
    _boot_sshd(name, meta, boot_delay)
    if key_delay > 0:
        # like cloud-init installing the key a while after sshd is up
        move = (
            f"sleep {float(key_delay)}; mv -f {shlex.quote(str(folder))}/authorized_keys.pending "
            + shlex.quote(str(folder / "authorized_keys"))
        )
        spawn(name, "keys", ["sh", "-c", move], folder / "keys.log")
    if rate is not None:
        network.shape(name, slot, rate)
    meta["index_url"] = _serve_index(name, meta)
    save_meta(folder, meta)
    return Instance(**{k: meta[k] for k in Instance.__dataclass_fields__})


def _cgroup(meta: dict[str, Any]) -> freezer.Cgroup | None:
    return freezer.Cgroup(meta["cgroup"][0], Path(meta["cgroup"][1])) if meta.get("cgroup") else None


def _boot_sshd(name: str, meta: dict[str, Any], boot_delay: float = 0.0) -> None:
    """Boot sshd (under the image's PID 1) in fresh namespaces; returns once it accepts TCP (at
    once with boot_delay). create() does this once, start() after every stop."""
    folder = folder_of(name)
    image = images.profile(meta.get("image", "default"))
    ids = (meta["ids"][0], meta["ids"][1]) if meta.get("ids") else None
    sizes = {"home": meta["disk"], "volume": meta.get("volume", VOLUME_SIZE)}
    layers = [(str(t), str(layer)) for t, layer in meta.get("layers") or []]
    script = boot.script(folder, name, image, meta["user"], meta["home"], sizes, ids, layers)

    # sshd in a private mount namespace: empty home, private /tmp, no pip config of this machine
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    sshd_argv = _in_cgroup(_cgroup(meta), boot.argv(name, image, script))
    if boot_delay > 0:
        # like a booting VM: the address answers (refusing connections) before sshd is there
        delayed = f"sleep {float(boot_delay)}; exec {shlex.join(sshd_argv)}"
        spawn(name, "boot", ["sh", "-c", delayed], folder / "sshd.log")
    else:
        proc = spawn(name, "boot", sshd_argv, folder / "sshd.log")
        _wait_for_sshd(name, meta["address"], int(meta["port"]), proc, folder / "sshd.log",
                       pid_folder=None if image.own_pid_namespace else folder)


def _serve_index(name: str, meta: dict[str, Any]) -> str | None:
    """Serve the instance's package index (if it has one) inside it; its URL there."""
    if not meta.get("index_dir"):
        return None
    folder = folder_of(name)
    server = [
        "ip", "netns", "exec", network.netns(name), sys.executable, "-m", "http.server", str(INDEX_PORT),
        "--bind", "127.0.0.1", "--directory", meta["index_dir"],
    ]  # fmt: skip
    spawn(name, "index", _in_cgroup(_cgroup(meta), server), folder / "index.log")
    _wait_for_index(name, folder / "index.log")
    return INDEX_URL


def _in_cgroup(cgroup: freezer.Cgroup | None, argv: list[str]) -> list[str]:
    """argv, started inside the cgroup (so are its children): it moves itself there, then runs."""
    if cgroup is None:
        return argv
    enter = f'echo $$ > {shlex.quote(str(cgroup.enter_file()))} && exec "$@"'
    return ["sh", "-c", enter, "sh", *argv]


def _wait_for_sshd(
    name: str, address: str, port: int, proc: subprocess.Popen[bytes], log: Path, timeout: float = 20,
    pid_folder: Path | None = None,
) -> None:
    """Until sshd accepts TCP and, when it writes a pid file (pid_folder), has written it: a console
    command (run_in) right after create() enters the instance by that pid."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RelaunchError(
                f"sandbox {name}: sshd exited (status {proc.returncode}) at start\n{log_tail(log)}"
            )
        with contextlib.suppress(OSError):
            socket.create_connection((address, port), timeout=0.5).close()
            if pid_folder is None or sshd_pid(pid_folder) is not None:
                return
        if time.monotonic() > deadline:
            what = "accept connections" if pid_folder is None else "accept connections and write its pid file"
            raise RelaunchError(f"sandbox {name}: sshd did not {what} within {timeout:g}s\n{log_tail(log)}")
        time.sleep(0.05)


def _wait_for_index(name: str, log: Path, timeout: float = 20) -> None:
    """The index server listens on the instance's own loopback: probe it from inside the netns."""
    probe = (
        "import socket, sys, time\n"
        f"end = time.monotonic() + {timeout}\n"
        "while time.monotonic() < end:\n"
        "    try:\n"
        f"        socket.create_connection(('127.0.0.1', {INDEX_PORT}), 0.5).close(); sys.exit(0)\n"
        "    except OSError:\n"
        "        time.sleep(0.05)\n"
        "sys.exit(1)\n"
    )
    proc = subprocess.run(
        ["ip", "netns", "exec", network.netns(name), sys.executable, "-c", probe], capture_output=True
    )
    if proc.returncode != 0:
        raise RelaunchError(f"sandbox {name}: the package index server did not start\n{log_tail(log)}")


# ---------------------------------------------------------------------------------------------
# destroy, list, get, run_in, set_link


def _kill_all(name: str, folder: Path) -> None:
    """SIGKILL every process of the instance: the recorded ones (delayed starters live outside the
    netns), then everything in its netns (sshd, the image's PID 1 and every process under it,
    tmux servers, trainers, nohup'd jobs: `ip netns pids` sees into nested PID namespaces)."""
    for cgroup in freezer.of(name):
        if cgroup.frozen():
            cgroup.freeze(False)  # a frozen process does not die until thawed
    # who is there before anything is killed: killing the boot process group or a PID 1 kills others
    killed: dict[int, str | None] = {pid: start_time(pid) for pid in netns_pids(name)}
    if folder.exists():
        kill_recorded(folder)
    deadline = time.monotonic() + 10
    while pids := netns_pids(name):
        for pid in pids:
            killed.setdefault(pid, start_time(pid))
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        reap(name)
        if time.monotonic() > deadline:
            raise RelaunchError(f"sandbox {name}: processes {pids} survived SIGKILL")
        time.sleep(0.02)
    # A dying process leaves its namespaces (and `ip netns pids`) before the kernel has released its
    # files: its listening socket still accepts for a moment. Gone means a zombie, or no process.
    deadline = time.monotonic() + 30
    while left := [pid for pid, start in killed.items()
                   if start is not None and start_time(pid) == start and process_state(pid) not in (None, "Z")]:
        reap(name)
        if time.monotonic() > deadline:
            raise RelaunchError(f"sandbox {name}: processes did not exit 30s after SIGKILL: "
                                + "; ".join(f"{pid} ({process_state(pid)}) {cmdline(pid)[:60]!r}" for pid in left))
        time.sleep(0.02)
    reap(name, wait=True)
    for pid_file in folder.glob("*.pid"):
        pid_file.unlink()


def destroy(name: str) -> bool:
    """Power off and delete instance `name`: every process in it, its disks, its link, its netns,
    its state. With the last instance of the sandbox dir its address range goes, with the last one
    on this machine the `ubuntu` user's sudoers file, the user itself if the sandbox made it, and
    the mount points it made (each as soon as no instance needs it).

    Idempotent; works on half-created instances. Returns True if anything existed.
    """
    check_name(name)
    require_root()
    owner = network.claimed_dir(name)
    if owner not in (None, RUN_DIR):
        raise UsageError(
            f"sandbox {name!r} is in the sandbox dir {owner}",
            hint=f"RELAUNCH_SANDBOX_DIR={owner} relaunch sandbox destroy {name}",
        )
    return _teardown(name, folder_of(name), _slot(folder_of(name)))[0]


def _slot(folder: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int((folder / "slot").read_text())
    return None


def _teardown(name: str, folder: Path, slot: int | None) -> tuple[bool, list[str]]:
    """destroy() of the instance `name` whose folder is `folder` (in its sandbox dir) and whose link
    is that of `slot` (None: its namespace takes the link with it): (whether anything existed, what
    it undid on this machine besides the instance, in words)."""
    existed = folder.exists() or netns_exists(name) or (slot is not None and network.link_exists(veths(slot)[0]))

    _kill_all(name, folder)
    for cgroup in freezer.of(name):
        cgroup.remove()
    if folder.exists():
        boot.unmount_disks(folder)

    network.disconnect(name, slot)
    with network.machine_lock():  # under the lock that creates take: who is last is decided once
        shutil.rmtree(folder, ignore_errors=True)
        network.release(name, folder.parent)
        undone = [f"removed the folder {p}" for p in boot.release_mount_points(_mount_points_needed())]
        if not network.names_everywhere():
            undone += users.restore_ubuntu()
    return existed, undone


@dataclass
class Cleaned:
    """What `clean` undid, and what it kept (with why), in words."""

    undone: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)


def orphans() -> dict[str, dict[str, Any]]:
    """The instances the journal records that no sandbox dir claims any more: their records under
    /run are gone (a reboot empties it; a destroy killed half-way), what they changed may be left.
    Call under machine_lock()."""
    return {name: entry for name, entry in journal.read()["instances"].items()
            if isinstance(entry, dict) and network.claimed_dir(name) is None}


def clean() -> Cleaned:
    """Undo what the sandbox changed on this machine, as far as nothing still needs it: destroy
    every instance of this sandbox dir; remove what instances whose records are gone left (their
    processes, namespace, link, cgroup, disks, folder); delete the range routes no sandbox dir uses
    and the mount points no instance needs; and, once no instance is left on this machine (of any
    sandbox dir), the sudoers file, the accounts as they were, and the caches and folders it made.
    Works from the journal (journal.py), which a reboot keeps."""
    require_root()
    done = Cleaned()
    for name in sorted(network.instance_names(RUN_DIR) | {i.name for i in list_instances()}):
        check_name(name)
        existed, undone = _teardown(name, folder_of(name), _slot(folder_of(name)))
        if existed:
            done.undone.append(f"destroyed the instance {name}")
        done.undone += undone
    with network.machine_lock():
        left_behind = orphans()
    for name, entry in sorted(left_behind.items()):
        world = Path(str(entry.get("dir") or RUN_DIR))
        # its link only through its namespace: its slot may be another instance's by now
        _, undone = _teardown(name, world / name, None)
        done.undone += [f"removed what the instance {name} of {world} left (its records under /run were gone)", *undone]
    with network.machine_lock():
        recorded = journal.read()
        for net in recorded["routes"]:
            if network.release_range(IPv4Network(net)):
                done.undone.append(f"deleted the route `unreachable {net}`")
        done.undone += [f"removed the folder {p}" for p in boot.release_mount_points(_mount_points_needed())]
        others = sorted(network.names_everywhere())
        if others:
            by_dir: dict[Path, list[str]] = {}
            for other in others:
                by_dir.setdefault(network.claimed_dir(other) or network.MACHINE_DIR, []).append(other)
            for world, names in sorted(by_dir.items()):
                env = "" if world == network.MACHINE_DIR else f"RELAUNCH_SANDBOX_DIR={world} "
                command = f"{env}relaunch sandbox clean"
                done.kept.append(f"the instances {', '.join(names)} of the sandbox dir {world} (`{command}`)")
            kept = [*recorded["files"], *[f"the user {u}" for u in recorded["users"]],
                    *[f"the cache {c}" for c in recorded["caches"]]]
            if kept:
                done.kept.append(f"while they run: {', '.join(kept)}")
            return done
        done.undone += users.restore_ubuntu()
        done.undone += [text for user in journal.read()["users"] if (text := users.restore_user(user))]
        for path in journal.read()["files"]:
            if Path(path).exists():
                Path(path).unlink()
                done.undone.append(f"removed {path}")
            journal.forget("files", path)
        for path in journal.read()["caches"]:
            if pythons.remove_cache(Path(path)):
                done.undone.append(f"removed the cache {path}")
            journal.forget("caches", path)
    return done


def _mount_points_needed() -> set[str]:
    """The mount points of every instance on this machine, of every sandbox dir. Call under
    machine_lock()."""
    needed: set[str] = set()
    for other in network.names_everywhere():
        world = network.claimed_dir(other) or network.MACHINE_DIR
        with contextlib.suppress(OSError, UsageError):
            needed |= set(images.profile((world / other / "image").read_text().strip()).volume_paths(other))
    return needed
