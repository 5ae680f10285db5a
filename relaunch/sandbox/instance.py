"""Sandbox instances: create, boot, destroy, list, get, run_in, set_link, commands.

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
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from ipaddress import IPv4Network
from pathlib import Path
from typing import Any

from relaunch.errors import RelaunchError, UsageError

from . import boot, freezer, images, network, sshd, users
from .boot import DEFAULT_PATH
from .network import TOOLS, TOOLS_COMMAND_LOG, locked, netns_exists, require_tools, run, veths
from .users import HOMES

RUN_DIR = Path(os.path.abspath(os.environ.get("RELAUNCH_SANDBOX_DIR") or network.MACHINE_DIR))

NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,12}")
DISK_RE = re.compile(r"[1-9][0-9]*[kKmMgG]?")
INDEX_PORT = 8765
VOLUME_SIZE = "8G"  # an image's disk besides home (/workspace ...), unless create() is given another

# Popen objects of the children this process started, so that destroy() can reap them instead
# of leaving zombies behind in a long pytest session.
_children: dict[str, list[subprocess.Popen[bytes]]] = {}


@dataclass(frozen=True)
class Instance:
    name: str
    address: str  # instance IPv4, reachable from this machine
    user: str  # "root" | "ubuntu"
    port: int  # 22; a container image's mapped port: 40000 + slot
    home: str  # "/root" | "/home/ubuntu"
    host_key_fingerprint: str  # "SHA256:..." of its ed25519 host key (as ssh-keygen -lf prints)
    index_url: str | None  # "http://127.0.0.1:PORT/simple/" when an index is served inside it
    image: str = "default"  # the profile (images.PROFILES) it reproduces

    @property
    def host(self) -> str:
        return f"{self.user}@{self.address}:{self.port}"


# ---------------------------------------------------------------------------------------------
# small helpers


def state_dir() -> Path:
    """Where relaunch keeps its own state on this machine: $RELAUNCH_HOME or ~/.local/state/relaunch."""
    env = os.environ.get("RELAUNCH_HOME")
    return Path(env).expanduser() if env else Path.home() / ".local" / "state" / "relaunch"


def default_key() -> Path:
    """The private key sandbox instances accept when create() is given none; made on first use."""
    key = state_dir() / "id_ed25519"
    if not key.exists():
        require_tools(["ssh-keygen"])
        key.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with locked(key.parent / ".key.lock"):
            if not key.exists():
                tmp = key.with_name(f".{key.name}.{os.getpid()}")
                for p in (tmp, tmp.with_suffix(".pub")):
                    p.unlink(missing_ok=True)
                run(
                    ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "relaunch-sandbox", "-f", str(tmp)]
                )
                # public half first: whoever sees the private key may rely on the .pub being there
                os.replace(str(tmp) + ".pub", str(key) + ".pub")
                os.replace(tmp, key)
    key.chmod(0o600)
    return key


def _require_root() -> None:
    if os.geteuid() != 0:
        raise UsageError(
            "sandbox instances need root (network namespaces, mounts, sshd)",
            hint="run as root, e.g. with sudo",
        )


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise UsageError(f"bad sandbox name {name!r}: use 1 to 12 of A-Z a-z 0-9 _ -")


def _folder(name: str) -> Path:
    return RUN_DIR / name


def _start_time(pid: int) -> str | None:
    """Kernel start time of a process: together with the pid it names one process, even after reuse."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may contain spaces and parentheses: split after its last ")"
    return stat.rsplit(")", 1)[1].split()[19]


def _state(pid: int) -> str | None:
    """The state letter of a process (R, S, D, Z ...), None if there is none."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _spawn(name: str, role: str, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    """Start a background process in its own session and remember it in <state>/<role>.pid."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True, close_fds=True
        )
    _children.setdefault(name, []).append(proc)
    (_folder(name) / f"{role}.pid").write_text(f"{proc.pid} {_start_time(proc.pid) or ''}\n")
    return proc


def _log_tail(path: Path, lines: int = 10) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join("  | " + ln for ln in text.strip().splitlines()[-lines:])


# ---------------------------------------------------------------------------------------------
# create


def _public_key(authorized_key: Path | None) -> str:
    """The public key line to authorize: from a .pub file, or the .pub beside a private key."""
    path = Path(authorized_key).expanduser() if authorized_key is not None else default_key()
    candidates = [path] if path.suffix == ".pub" else [path.with_name(path.name + ".pub"), path]
    for cand in candidates:
        try:
            text = cand.read_text().strip()
        except (OSError, UnicodeDecodeError):
            continue
        if re.match(r"(ssh-|ecdsa-|sk-)\S+ [A-Za-z0-9+/=]+", text):
            return text
    raise UsageError(
        f"no SSH public key at {path}",
        hint="pass a public key file (.pub) or a private key with its .pub beside it",
    )


def create(
    name: str,
    *,
    image: str = "default",
    user: str | None = None,
    authorized_key: Path | None = None,
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
    with its .pub beside it) that may log in; default: default_key(). disk: size of the home tmpfs
    ("4G"). volume: size of the image's other disk (/workspace, /lambda/nfs/NAME,
    /opt/dlami/nvme). rate: tc rate of the link both ways ("20mbit"). index_dir: a build_index()
    folder served inside at INDEX_PORT. boot_delay: sshd starts only after that many seconds (the
    address refuses connections meanwhile). key_delay: the key is authorized only after that many
    seconds (auth fails meanwhile). command_log: sshd logs every command it is asked to run, byte
    for byte, for `commands(name)`; a session without a command (a login shell) logs nothing. SFTP
    still works, through /usr/lib/openssh/sftp-server instead of sshd's own: each SFTP session logs
    that program's path as its command. Other subsystems are not supported on such an instance.
    address: this free address of the range (one a destroyed instance had), else the next free one.
    """
    _check_name(name)
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
    _require_root()
    require_tools(list(TOOLS) + (list(TOOLS_COMMAND_LOG) if command_log else []))
    pubkey = _public_key(authorized_key)

    folder = _folder(name)
    boot.check_folder(folder, profile)
    with network.machine_lock():
        owner = network.claimed_dir(name)
        if folder.exists() or owner is not None or netns_exists(name):
            where = f" (in the sandbox dir {owner})" if owner not in (None, RUN_DIR) else ""
            raise UsageError(f"sandbox {name!r} already exists{where}", hint=f"relaunch sandbox destroy {name}")
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
        return _boot(name, folder, slot, net, profile, user, pubkey, {"home": disk, "volume": volume}, rate,
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
    pubkey: str,
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
        (folder / "authorized_keys.pending").write_text(pubkey + "\n")
    else:
        (folder / "authorized_keys").write_text(pubkey + "\n")
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
        _spawn(name, "keys", ["sh", "-c", move], folder / "keys.log")
    if rate is not None:
        network.shape(name, slot, rate)
    meta["index_url"] = _serve_index(name, meta)
    _save(folder, meta)
    return Instance(**{k: meta[k] for k in Instance.__dataclass_fields__})


def _cgroup(meta: dict[str, Any]) -> freezer.Cgroup | None:
    return freezer.Cgroup(meta["cgroup"][0], Path(meta["cgroup"][1])) if meta.get("cgroup") else None


def _boot_sshd(name: str, meta: dict[str, Any], boot_delay: float = 0.0) -> None:
    """Boot sshd (under the image's PID 1) in fresh namespaces; returns once it accepts TCP (at
    once with boot_delay). create() does this once, start() after every stop."""
    folder = _folder(name)
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
        _spawn(name, "boot", ["sh", "-c", delayed], folder / "sshd.log")
    else:
        proc = _spawn(name, "boot", sshd_argv, folder / "sshd.log")
        _wait_for_sshd(name, meta["address"], int(meta["port"]), proc, folder / "sshd.log")


def _serve_index(name: str, meta: dict[str, Any]) -> str | None:
    """Serve the instance's package index (if it has one) inside it; its URL there."""
    if not meta.get("index_dir"):
        return None
    folder = _folder(name)
    server = [
        "ip", "netns", "exec", network.netns(name), sys.executable, "-m", "http.server", str(INDEX_PORT),
        "--bind", "127.0.0.1", "--directory", meta["index_dir"],
    ]  # fmt: skip
    _spawn(name, "index", _in_cgroup(_cgroup(meta), server), folder / "index.log")
    _wait_for_index(name, folder / "index.log")
    return f"http://127.0.0.1:{INDEX_PORT}/simple/"


def _in_cgroup(cgroup: freezer.Cgroup | None, argv: list[str]) -> list[str]:
    """argv, started inside the cgroup (so are its children): it moves itself there, then runs."""
    if cgroup is None:
        return argv
    enter = f'echo $$ > {shlex.quote(str(cgroup.enter_file()))} && exec "$@"'
    return ["sh", "-c", enter, "sh", *argv]


def _save(folder: Path, meta: dict[str, Any]) -> None:
    tmp = folder / "instance.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, folder / "instance.json")


def _meta(name: str) -> dict[str, Any]:
    get(name)
    return json.loads((_folder(name) / "instance.json").read_text())  # type: ignore[no-any-return]


def _wait_for_sshd(
    name: str, address: str, port: int, proc: subprocess.Popen[bytes], log: Path, timeout: float = 20
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RelaunchError(
                f"sandbox {name}: sshd exited (status {proc.returncode}) at start\n{_log_tail(log)}"
            )
        with contextlib.suppress(OSError):
            socket.create_connection((address, port), timeout=0.5).close()
            return
        if time.monotonic() > deadline:
            raise RelaunchError(
                f"sandbox {name}: sshd did not accept connections within {timeout:g}s\n{_log_tail(log)}"
            )
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
        raise RelaunchError(f"sandbox {name}: the package index server did not start\n{_log_tail(log)}")


# ---------------------------------------------------------------------------------------------
# destroy, list, get, run_in, set_link


def _kill_recorded(folder: Path) -> None:
    """Kill the processes recorded in <state>/*.pid (delayed starters live outside the netns)."""
    for pid_file in folder.glob("*.pid"):
        try:
            fields = pid_file.read_text().split()
            pid = int(fields[0])
        except (OSError, ValueError, IndexError):
            continue
        # only the process we started (same pid *and* start time), never a later reuse of the pid
        if pid_file.name != "sshd.pid" and (len(fields) < 2 or _start_time(pid) != fields[1]):
            continue
        if pid_file.name == "sshd.pid" and f"{folder}/".encode() not in _cmdline(pid):
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return b""


def _netns_pids(name: str) -> list[int]:
    if not netns_exists(name):
        return []
    proc = subprocess.run(["ip", "netns", "pids", network.netns(name)], capture_output=True, text=True)
    return [int(p) for p in proc.stdout.split() if p.isdigit() and int(p) != os.getpid()]


def _kill_all(name: str) -> None:
    """SIGKILL every process of the instance: the recorded ones (delayed starters live outside the
    netns), then everything in its netns (sshd, the image's PID 1 and every process under it,
    tmux servers, trainers, nohup'd jobs: `ip netns pids` sees into nested PID namespaces)."""
    folder = _folder(name)
    for cgroup in freezer.of(name):
        if cgroup.frozen():
            cgroup.freeze(False)  # a frozen process does not die until thawed
    # who is there before anything is killed: killing the boot process group or a PID 1 kills others
    killed: dict[int, str | None] = {pid: _start_time(pid) for pid in _netns_pids(name)}
    if folder.exists():
        _kill_recorded(folder)
    deadline = time.monotonic() + 10
    while pids := _netns_pids(name):
        for pid in pids:
            killed.setdefault(pid, _start_time(pid))
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _reap(name)
        if time.monotonic() > deadline:
            raise RelaunchError(f"sandbox {name}: processes {pids} survived SIGKILL")
        time.sleep(0.02)
    # A dying process leaves its namespaces (and `ip netns pids`) before the kernel has released its
    # files: its listening socket still accepts for a moment. Gone means a zombie, or no process.
    deadline = time.monotonic() + 30
    while left := [pid for pid, start in killed.items()
                   if start is not None and _start_time(pid) == start and _state(pid) not in (None, "Z")]:
        _reap(name)
        if time.monotonic() > deadline:
            raise RelaunchError(f"sandbox {name}: processes did not exit 30s after SIGKILL: "
                                + "; ".join(f"{pid} ({_state(pid)}) {_cmdline(pid)[:60]!r}" for pid in left))
        time.sleep(0.02)
    _reap(name, wait=True)
    for pid_file in folder.glob("*.pid"):
        pid_file.unlink()


def destroy(name: str) -> bool:
    """Power off and delete instance `name`: every process in it, its disks, its link, its netns,
    its state. With the last instance of the sandbox dir its address range goes, with the last one
    on this machine the `ubuntu` user's sudoers file, the user itself if the sandbox made it, and
    the mount points it made (each as soon as no instance needs it).

    Idempotent; works on half-created instances. Returns True if anything existed.
    """
    _check_name(name)
    _require_root()
    owner = network.claimed_dir(name)
    if owner not in (None, RUN_DIR):
        raise UsageError(
            f"sandbox {name!r} is in the sandbox dir {owner}",
            hint=f"RELAUNCH_SANDBOX_DIR={owner} relaunch sandbox destroy {name}",
        )
    folder = _folder(name)
    slot: int | None = None
    with contextlib.suppress(OSError, ValueError):
        slot = int((folder / "slot").read_text())
    existed = folder.exists() or netns_exists(name) or (slot is not None and network.link_exists(veths(slot)[0]))

    _kill_all(name)
    for cgroup in freezer.of(name):
        cgroup.remove()
    if folder.exists():
        boot.unmount_disks(folder)

    network.disconnect(name, slot)
    with network.machine_lock():  # under the lock that creates take: who is last is decided once
        shutil.rmtree(folder, ignore_errors=True)
        network.release(name, RUN_DIR)
        boot.release_mount_points(_mount_points_needed())
        if not network.names_everywhere():
            users.restore_ubuntu()
    return existed


def _mount_points_needed() -> set[str]:
    """The mount points of every instance on this machine, of every sandbox dir. Call under
    machine_lock()."""
    needed: set[str] = set()
    for other in network.names_everywhere():
        world = network.claimed_dir(other) or network.MACHINE_DIR
        with contextlib.suppress(OSError, UsageError):
            needed |= set(images.profile((world / other / "image").read_text().strip()).volume_paths(other))
    return needed


def _reap(name: str, wait: bool = False) -> None:
    """Collect exit statuses of children this process started for `name` (no zombies)."""
    for proc in _children.get(name, []):
        if wait:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        else:
            proc.poll()
    if wait:
        _children.pop(name, None)


def _load(folder: Path) -> Instance | None:
    try:
        meta = json.loads((folder / "instance.json").read_text())
        return Instance(
            name=meta["name"],
            address=meta["address"],
            user=meta["user"],
            port=int(meta["port"]),
            home=meta["home"],
            host_key_fingerprint=meta["host_key_fingerprint"],
            index_url=meta.get("index_url"),
            image=meta.get("image", "default"),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def list_instances() -> list[Instance]:
    """Every instance created (by any process) and not yet destroyed, by name."""
    if not RUN_DIR.is_dir():
        return []
    found = (_load(d) for d in sorted(RUN_DIR.iterdir()) if d.is_dir())
    return [inst for inst in found if inst is not None]


def get(name: str) -> Instance:
    _check_name(name)
    inst = _load(_folder(name))
    if inst is None:
        raise UsageError(f"no sandbox named {name!r}", hint="relaunch sandbox list")
    return inst


def state(name: str) -> str:
    """running, stopped or paused."""
    return str(_meta(name).get("state", "running"))


def _recorded_pid(folder: Path, role: str) -> int | None:
    """The process recorded in <folder>/<role>.pid, if it is still the one recorded."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        pid, start = (folder / f"{role}.pid").read_text().split()[:2]
        if _start_time(int(pid)) == start:
            return int(pid)
    return None


def pid1(name: str) -> int | None:
    """This machine's PID of the instance's PID 1 (an image with a PID namespace of its own), or
    None while it is not running: the only child of the boot process (`unshare -f`)."""
    boot_pid = _recorded_pid(_folder(name), "boot")
    if boot_pid is None:
        return None
    with contextlib.suppress(OSError, ValueError, IndexError):
        child = int(Path(f"/proc/{boot_pid}/task/{boot_pid}/children").read_text().split()[0])
        # (not a delayed boot's `sleep`): PID 1 of a namespace below this one
        nspid = next(ln for ln in Path(f"/proc/{child}/status").read_text().splitlines() if ln.startswith("NSpid:"))
        if nspid.split()[1:] == [str(child), "1"]:
            return child
    return None


def _anchor_pid(name: str) -> int:
    """A process in every namespace of the instance, to enter them by: its PID 1, else sshd."""
    folder = _folder(name)
    if get(name).image != "default":
        pid = pid1(name)
        if pid is not None:
            return pid
    else:
        with contextlib.suppress(OSError, ValueError):
            pid = int((folder / "sshd.pid").read_text().split()[0])
            if f"{folder}/".encode() in _cmdline(pid):
                return pid
    raise UsageError(f"sandbox {name!r} is not running (sshd not started yet, stopped, or gone)")


def run_in(name: str, argv: list[str], **kw: object) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
    """Run argv inside the instance (its network, mount and PID namespaces) as root, like a console.

    Keyword arguments go to subprocess.run (capture_output, text, check, input, timeout ...).
    The environment is a clean one like an ssh session's unless `env` is given.
    """
    inst = get(name)
    pid = _anchor_pid(name)
    kw.setdefault("env", {"PATH": DEFAULT_PATH, "HOME": "/root", "USER": "root", "LANG": "C.UTF-8"})
    kw.setdefault("cwd", "/")
    spaces = ["-n", "-m"] + (["-p"] if inst.image != "default" else [])
    return subprocess.run(["nsenter", "-t", str(pid), *spaces, "--", *argv], **kw)  # type: ignore[call-overload]


def commands(name: str) -> list[str]:
    """The commands instance `name` was asked to run over ssh, in the order they arrived, byte for
    byte (bytes that are not UTF-8 come back as surrogate escapes). Needs create(command_log=True)."""
    get(name)
    try:
        data = (_folder(name) / sshd.COMMAND_LOG).read_bytes()
    except FileNotFoundError:
        raise UsageError(
            f"sandbox {name!r} does not log commands", hint="create it with command_log=True"
        ) from None
    # every command ends with a NUL byte; a command being appended right now has none yet
    return [c.decode("utf-8", "surrogateescape") for c in data.split(b"\0")[:-1]]


def set_link(name: str, up: bool) -> None:
    """Take the instance's link down (an outage: packets vanish, connections time out) or up again."""
    inst = get(name)
    meta = _meta(name)
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
    meta = _meta(name)
    network.set_silent(name, int(meta["slot"]), silent, meta.get("rate"))
