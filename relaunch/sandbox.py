"""Throwaway local "cloud GPU instances" (without the GPU) for trying recipes and for tests.

An instance is a Linux network namespace `rl-<name>` joined to this machine by a veth pair, with a
real OpenSSH sshd listening on its own address. sshd runs in a private mount namespace where the
user's home is an empty tmpfs (the instance's "disk"), /tmp is private, and this machine's pip
configuration is masked (a real instance has none). Every instance gets a fresh ed25519 host key,
like a new cloud instance, and reaches no package registry: `build_index` prepares a local PEP 503
index on this machine that the instance can serve to itself.

Everything needed to find an instance again lives in `/run/relaunch-sandbox/<name>/` (the CLI
creates in one process and destroys in another). That folder is under /run on purpose: /root and
/tmp are masked inside the instance, /run is not, so sshd can read its config and keys there.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import html
import json
import os
import pwd
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from relaunch.errors import RelaunchError, UsageError

RUN_DIR = Path("/run/relaunch-sandbox")
NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,12}")
DISK_RE = re.compile(r"[1-9][0-9]*[kKmMgG]?")
SUBNET = "10.213"  # instance N gets 10.213.N.0/30: .1 on this machine, .2 inside
INDEX_PORT = 8765
SSH_PORT = 22
USERS = {"root": "/root", "ubuntu": "/home/ubuntu"}
# sshd hands sessions this PATH; commands run with run_in get the same, so they see what ssh sees.
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SUDOERS = Path("/etc/sudoers.d/relaunch-sandbox")
# Global pip configuration of this machine points at local disks (find-links, constraints); a
# fresh cloud image has none, so these are masked inside the instance.
PIP_CONFIG_DIRS = [Path("/etc/xdg/pip")]
PIP_CONFIG_FILES = [Path("/etc/pip.conf")]
TOOLS = {  # command -> Debian package that provides it
    "ip": "iproute2",
    "tc": "iproute2",
    "unshare": "util-linux",
    "nsenter": "util-linux",
    "mount": "mount",
    "ssh-keygen": "openssh-client",
    "/usr/sbin/sshd": "openssh-server",
}

# Popen objects of the children this process started, so that destroy() can reap them instead
# of leaving zombies behind in a long pytest session.
_children: dict[str, list[subprocess.Popen[bytes]]] = {}


@dataclass(frozen=True)
class Instance:
    name: str
    address: str  # instance IPv4, reachable from this machine
    user: str  # "root" | "ubuntu"
    port: int  # 22
    home: str  # "/root" | "/home/ubuntu"
    host_key_fingerprint: str  # "SHA256:..." of its ed25519 host key (as ssh-keygen -lf prints)
    index_url: str | None  # "http://127.0.0.1:PORT/simple/" when an index is served inside it

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
        _require_tools(["ssh-keygen"])
        key.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with _locked(key.parent / ".key.lock"):
            if not key.exists():
                tmp = key.with_name(f".{key.name}.{os.getpid()}")
                for p in (tmp, tmp.with_suffix(".pub")):
                    p.unlink(missing_ok=True)
                _run(
                    ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "relaunch-sandbox", "-f", str(tmp)]
                )
                # public half first: whoever sees the private key may rely on the .pub being there
                os.replace(str(tmp) + ".pub", str(key) + ".pub")
                os.replace(tmp, key)
    key.chmod(0o600)
    return key


def _run(argv: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    """Run a local command; a failure becomes a RelaunchError naming the command and its output."""
    proc = subprocess.run(argv, capture_output=True, text=True, **kw)  # type: ignore[call-overload]
    if proc.returncode != 0:
        out = (proc.stderr or proc.stdout or "").strip()
        raise RelaunchError(f"sandbox: `{shlex.join(argv)}` failed (exit {proc.returncode}): {out}")
    return proc


def _require_tools(tools: list[str]) -> None:
    for tool in tools:
        if shutil.which(tool) is None:
            pkg = TOOLS.get(tool, tool)
            raise UsageError(f"sandbox needs `{tool}`, which is not installed", hint=f"apt-get install {pkg}")


def _require_root() -> None:
    if os.geteuid() != 0:
        raise UsageError(
            "sandbox instances need root (network namespaces, mounts, sshd)",
            hint="run as root, e.g. with sudo",
        )


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise UsageError(f"bad sandbox name {name!r}: use 1 to 12 of A-Z a-z 0-9 _ -")


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive flock: slot allocation and user setup must not race between processes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _netns(name: str) -> str:
    return f"rl-{name}"


def _folder(name: str) -> Path:
    return RUN_DIR / name


def _veths(slot: int) -> tuple[str, str]:
    return f"rlv{slot}h", f"rlv{slot}i"


def _netns_exists(name: str) -> bool:
    return Path("/run/netns", _netns(name)).exists()


def _link_exists(dev: str) -> bool:
    return Path("/sys/class/net", dev).exists()


def _start_time(pid: int) -> str | None:
    """Kernel start time of a process: together with the pid it names one process, even after reuse."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may contain spaces and parentheses: split after its last ")"
    return stat.rsplit(")", 1)[1].split()[19]


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


def _ensure_ubuntu() -> tuple[int, int]:
    """The `ubuntu` user as on cloud images: exists, not locked, passwordless sudo."""
    with _locked(RUN_DIR / ".users.lock"):
        if not _has_user("ubuntu"):
            _require_tools(["useradd"])
            _run(["useradd", "-M", "-d", "/home/ubuntu", "-s", "/bin/bash", "ubuntu"])
        # With `UsePAM no`, sshd refuses even key logins for a "locked" account (shadow password
        # starting with "!", which is what useradd leaves). "*" means: no password, not locked.
        if _shadow_password("ubuntu").startswith("!"):
            _run(["usermod", "-p", "*", "ubuntu"])
        rule = "ubuntu ALL=(ALL) NOPASSWD:ALL\n"
        if not SUDOERS.exists() or SUDOERS.read_text() != rule:
            tmp = SUDOERS.with_name(".relaunch-sandbox.tmp")  # sudo ignores names containing "."
            tmp.write_text(rule)
            tmp.chmod(0o440)
            os.replace(tmp, SUDOERS)
        Path("/home/ubuntu").mkdir(parents=True, exist_ok=True)  # the mount point of its disk
        entry = pwd.getpwnam("ubuntu")
        return entry.pw_uid, entry.pw_gid


def _has_user(user: str) -> bool:
    try:
        pwd.getpwnam(user)
    except KeyError:
        return False
    return True


def _shadow_password(user: str) -> str:
    for line in Path("/etc/shadow").read_text().splitlines():
        fields = line.split(":")
        if fields[0] == user and len(fields) > 1:
            return fields[1]
    return ""


def _allocate_slot(name: str) -> int:
    """A free small integer N (1..254): veth names rlv<N>h/i and subnet 10.213.N.0/30."""
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
            (_folder(name) / "slot").write_text(f"{slot}\n")
            return slot
    raise UsageError(
        "no free sandbox slot (254 instances exist)", hint="relaunch sandbox list / destroy NAME"
    )


def _sshd_config(folder: Path, address: str) -> str:
    return "\n".join(
        [
            f"ListenAddress {address}",
            f"Port {SSH_PORT}",
            f"HostKey {folder}/ssh_host_ed25519_key",
            f"AuthorizedKeysFile {folder}/authorized_keys",
            f"PidFile {folder}/sshd.pid",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "PermitRootLogin prohibit-password",
            "UsePAM no",
            "PrintMotd no",
            "PrintLastLog no",
            "X11Forwarding no",
            # Fabric's put/get speak SFTP; the in-process server needs no binary from the image.
            "Subsystem sftp internal-sftp",
            "",
        ]
    )


def _mount_script(folder: Path, user: str, home: str, disk: str, ids: tuple[int, int] | None) -> str:
    """Shell run inside the new mount namespace before sshd: the private disk and /tmp."""
    if user == "root":
        home_opts = f"size={disk},mode=700"
    else:
        assert ids is not None
        home_opts = f"size={disk},mode=755,uid={ids[0]},gid={ids[1]}"
    lines = [
        "set -e",
        f"mount -t tmpfs -o {home_opts} relaunch-disk {shlex.quote(home)}",
        "mount -t tmpfs -o mode=1777 relaunch-tmp /tmp",
    ]
    for d in PIP_CONFIG_DIRS:
        if d.is_dir():
            lines.append(f"mount -t tmpfs -o mode=755,size=1m relaunch-mask {shlex.quote(str(d))}")
    for f in PIP_CONFIG_FILES:
        if f.is_file():
            lines.append(f"mount --bind {shlex.quote(str(folder / 'empty'))} {shlex.quote(str(f))}")
    return "; ".join(lines)


def create(
    name: str,
    *,
    user: str = "root",
    authorized_key: Path | None = None,
    disk: str = "4G",
    rate: str | None = None,
    index_dir: Path | None = None,
    boot_delay: float = 0.0,
    key_delay: float = 0.0,
) -> Instance:
    """Create and boot instance `name`; returns once sshd accepts TCP (at once with boot_delay).

    authorized_key: public key file (or a private key with its .pub beside it) that may log in;
    default: default_key(). disk: size of the home tmpfs ("4G"). rate: tc rate of the link both
    ways ("20mbit"). index_dir: a build_index() folder served inside at INDEX_PORT. boot_delay:
    sshd starts only after that many seconds (the address refuses connections meanwhile).
    key_delay: the key is authorized only after that many seconds (auth fails meanwhile).
    """
    _check_name(name)
    if user not in USERS:
        raise UsageError(f"bad sandbox user {user!r}: use root or ubuntu")
    if not isinstance(disk, str) or not DISK_RE.fullmatch(disk):
        raise UsageError(f"bad disk size {disk!r}: use a number with K, M or G, like 4G")
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
    _require_tools(list(TOOLS))
    pubkey = _public_key(authorized_key)

    folder = _folder(name)
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    RUN_DIR.chmod(0o755)  # sshd reads authorized_keys as the login user
    with _locked(RUN_DIR / ".slots.lock"):
        if folder.exists() or _netns_exists(name):
            raise UsageError(f"sandbox {name!r} already exists", hint=f"relaunch sandbox destroy {name}")
        folder.mkdir(mode=0o755)
        try:
            slot = _allocate_slot(name)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
    try:
        return _boot(name, folder, slot, user, pubkey, disk, rate, index_dir, boot_delay, key_delay)
    except BaseException:
        # a half-created instance must leave nothing behind
        destroy(name)
        raise


def _boot(
    name: str,
    folder: Path,
    slot: int,
    user: str,
    pubkey: str,
    disk: str,
    rate: str | None,
    index_dir: Path | None,
    boot_delay: float,
    key_delay: float,
) -> Instance:
    folder.chmod(0o755)
    home = USERS[user]
    ids = _ensure_ubuntu() if user == "ubuntu" else None
    host_dev, inst_dev = _veths(slot)
    gateway, address = f"{SUBNET}.{slot}.1", f"{SUBNET}.{slot}.2"
    ns = _netns(name)

    # a fresh host key: every instance is a new machine as far as ssh is concerned
    key = folder / "ssh_host_ed25519_key"
    _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"root@{ns}", "-f", str(key)])
    fingerprint = _run(["ssh-keygen", "-lf", f"{key}.pub"]).stdout.split()[1]
    (folder / "sshd_config").write_text(_sshd_config(folder, address))
    (folder / "empty").write_text("")
    if key_delay > 0:
        (folder / "authorized_keys.pending").write_text(pubkey + "\n")
    else:
        (folder / "authorized_keys").write_text(pubkey + "\n")
    for f in ("authorized_keys", "authorized_keys.pending"):
        with contextlib.suppress(FileNotFoundError):
            (folder / f).chmod(0o644)  # read by sshd as the login user

    # The whole sandbox range is unreachable except through an instance's own link: without this,
    # a packet for a destroyed (or not yet created) instance would leave by the default route.
    _run(["ip", "route", "replace", "unreachable", f"{SUBNET}.0.0/16"])
    # the network: namespace, veth pair, addresses
    _run(["ip", "netns", "add", ns])
    _run(["ip", "link", "add", host_dev, "type", "veth", "peer", "name", inst_dev, "netns", ns])
    _run(["ip", "addr", "add", f"{gateway}/30", "dev", host_dev])
    _run(["ip", "link", "set", host_dev, "up"])
    _run(["ip", "netns", "exec", ns, "ip", "addr", "add", f"{address}/30", "dev", inst_dev])
    _run(["ip", "netns", "exec", ns, "ip", "link", "set", inst_dev, "up"])
    _run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"])
    # services on this machine's side of any instance's link (a test S3 or Hub server) are
    # reachable from every instance, the way a datacenter's object store is; nothing else is
    _run(["ip", "netns", "exec", ns, "ip", "route", "add", f"{SUBNET}.0.0/16", "via", gateway])

    # sshd in a private mount namespace: empty home, private /tmp, no pip config of this machine
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    script = (
        _mount_script(folder, user, home, disk, ids) + f"; exec /usr/sbin/sshd -D -e -f {folder}/sshd_config"
    )
    sshd_argv = ["ip", "netns", "exec", ns, "unshare", "-m", "--propagation", "private", "--", "sh", "-c"]
    sshd_argv.append(script)
    if boot_delay > 0:
        # like a booting VM: the address answers (refusing connections) before sshd is there
        delayed = f"sleep {float(boot_delay)}; exec {shlex.join(sshd_argv)}"
        _spawn(name, "boot", ["sh", "-c", delayed], folder / "sshd.log")
    else:
        proc = _spawn(name, "boot", sshd_argv, folder / "sshd.log")
        _wait_for_sshd(name, address, proc, folder / "sshd.log")
    if key_delay > 0:
        # like cloud-init installing the key a while after sshd is up
        move = (
            f"sleep {float(key_delay)}; mv -f {shlex.quote(str(folder))}/authorized_keys.pending "
            + shlex.quote(str(folder / "authorized_keys"))
        )
        _spawn(name, "keys", ["sh", "-c", move], folder / "keys.log")

    if rate is not None:
        for prefix, dev in (([], host_dev), (["ip", "netns", "exec", ns], inst_dev)):
            tc = [*prefix, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", str(rate)]
            proc_tc = subprocess.run(
                [*tc, "burst", "32kbit", "latency", "400ms"], capture_output=True, text=True
            )
            if proc_tc.returncode != 0:
                raise UsageError(
                    f"bad rate {rate!r}: {proc_tc.stderr.strip()}", hint="use a tc rate like 20mbit"
                )

    index_url = None
    if index_dir is not None:
        server = [
            "ip", "netns", "exec", ns, sys.executable, "-m", "http.server", str(INDEX_PORT),
            "--bind", "127.0.0.1", "--directory", str(index_dir),
        ]  # fmt: skip
        _spawn(name, "index", server, folder / "index.log")
        _wait_for_index(name, folder / "index.log")
        index_url = f"http://127.0.0.1:{INDEX_PORT}/simple/"

    inst = Instance(name, address, user, SSH_PORT, home, fingerprint, index_url)
    meta = {**asdict(inst), "slot": slot, "veth": [host_dev, inst_dev], "disk": disk, "rate": rate,
            "index_dir": str(index_dir) if index_dir else None, "created": time.time()}  # fmt: skip
    tmp = folder / "instance.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, folder / "instance.json")
    return inst


def _wait_for_sshd(
    name: str, address: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 20
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RelaunchError(
                f"sandbox {name}: sshd exited (status {proc.returncode}) at start\n{_log_tail(log)}"
            )
        with contextlib.suppress(OSError):
            socket.create_connection((address, SSH_PORT), timeout=0.5).close()
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
        ["ip", "netns", "exec", _netns(name), sys.executable, "-c", probe], capture_output=True
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
    if not _netns_exists(name):
        return []
    proc = subprocess.run(["ip", "netns", "pids", _netns(name)], capture_output=True, text=True)
    return [int(p) for p in proc.stdout.split() if p.isdigit() and int(p) != os.getpid()]


def destroy(name: str) -> bool:
    """Power off and delete instance `name`: every process in it, its link, its netns, its state.

    Idempotent; works on half-created instances. Returns True if anything existed.
    """
    _check_name(name)
    _require_root()
    folder = _folder(name)
    ns = _netns(name)
    slot: int | None = None
    with contextlib.suppress(OSError, ValueError):
        slot = int((folder / "slot").read_text())
    existed = folder.exists() or _netns_exists(name) or (slot is not None and _link_exists(_veths(slot)[0]))

    if folder.exists():
        _kill_recorded(folder)
    # everything started over ssh (tmux servers, trainers, nohup'd jobs) lives in the netns
    deadline = time.monotonic() + 10
    while pids := _netns_pids(name):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _reap(name)
        if time.monotonic() > deadline:
            raise RelaunchError(f"sandbox {name}: processes {pids} survived SIGKILL")
        time.sleep(0.02)
    _reap(name, wait=True)

    if slot is not None and _link_exists(_veths(slot)[0]):
        subprocess.run(["ip", "link", "del", _veths(slot)[0]], capture_output=True)
    if _netns_exists(name):
        _run(["ip", "netns", "del", ns])
    shutil.rmtree(folder, ignore_errors=True)
    return existed


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


def _sshd_pid(name: str) -> int:
    folder = _folder(name)
    with contextlib.suppress(OSError, ValueError):
        pid = int((folder / "sshd.pid").read_text().split()[0])
        if f"{folder}/".encode() in _cmdline(pid):
            return pid
    raise UsageError(f"sandbox {name!r} is not running (sshd not started yet, or gone)")


def run_in(name: str, argv: list[str], **kw: object) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
    """Run argv inside the instance (its network and mount namespaces) as root, like a console.

    Keyword arguments go to subprocess.run (capture_output, text, check, input, timeout ...).
    The environment is a clean one like an ssh session's unless `env` is given.
    """
    get(name)
    pid = _sshd_pid(name)
    kw.setdefault("env", {"PATH": DEFAULT_PATH, "HOME": "/root", "USER": "root", "LANG": "C.UTF-8"})
    kw.setdefault("cwd", "/")
    return subprocess.run(["nsenter", "-t", str(pid), "-n", "-m", "--", *argv], **kw)  # type: ignore[call-overload]


def set_link(name: str, up: bool) -> None:
    """Take the instance's link down (an outage: packets vanish, connections time out) or up again."""
    inst = get(name)
    slot = int((_folder(name) / "slot").read_text())
    host_dev, inst_dev = _veths(slot)
    _run(["ip", "netns", "exec", _netns(name), "ip", "link", "set", inst_dev, "up" if up else "down"])
    if up:
        # neighbour entries that failed during the outage would answer "no route to host" for a
        # while; a recovered link should work at once, like a recovered instance
        _run(["ip", "neigh", "flush", "dev", host_dev])
        _run(["ip", "netns", "exec", _netns(name), "ip", "neigh", "flush", "dev", inst_dev])
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                socket.create_connection((inst.address, SSH_PORT), timeout=0.5).close()
                return
            time.sleep(0.1)
        raise RelaunchError(f"sandbox {name}: sshd not reachable 20s after the link came back up")


# ---------------------------------------------------------------------------------------------
# the local package index


def _normalize(project: str) -> str:
    return re.sub(r"[-_.]+", "-", project).lower()


def _project_of(filename: str) -> str | None:
    """Project name from a wheel or sdist file name (PEP 427 / PEP 625), normalized."""
    if filename.endswith(".whl"):
        return _normalize(filename.split("-", 1)[0])
    for ext in (".tar.gz", ".zip", ".tar.bz2", ".tgz"):
        if filename.endswith(ext):
            stem = filename[: -len(ext)]
            return _normalize(stem.rsplit("-", 1)[0]) if "-" in stem else None
    return None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _write_simple_index(dest: Path) -> None:
    """PEP 503 pages under dest/simple/ for every file in dest/files/, with #sha256= fragments."""
    hashes_file = dest / ".sha256.json"  # hashing torch every time would cost seconds
    try:
        known: dict[str, list[object]] = json.loads(hashes_file.read_text())
    except (OSError, ValueError):
        known = {}
    projects: dict[str, list[tuple[str, str]]] = {}
    hashes: dict[str, list[object]] = {}
    for f in sorted((dest / "files").iterdir()):
        project = _project_of(f.name)
        if project is None or not f.is_file():
            continue
        st = f.stat()
        entry = known.get(f.name)
        if entry and entry[0] == st.st_size and entry[1] == st.st_mtime_ns:
            digest = str(entry[2])
        else:
            digest = _sha256(f)
        hashes[f.name] = [st.st_size, st.st_mtime_ns, digest]
        projects.setdefault(project, []).append((f.name, digest))

    new = dest / "simple.new"
    shutil.rmtree(new, ignore_errors=True)
    new.mkdir()
    links = "".join(f'<a href="{p}/">{p}</a><br>\n' for p in sorted(projects))
    (new / "index.html").write_text(_page("Simple index", links))
    for project, files in projects.items():
        (new / project).mkdir()
        anchors = "".join(
            f'<a href="../../files/{html.escape(fn)}#sha256={d}">{html.escape(fn)}</a><br>\n'
            for fn, d in files
        )
        (new / project / "index.html").write_text(_page(f"Links for {project}", anchors))
    old = dest / "simple.old"
    shutil.rmtree(old, ignore_errors=True)
    if (dest / "simple").exists():
        os.replace(dest / "simple", old)
    os.replace(new, dest / "simple")
    shutil.rmtree(old, ignore_errors=True)
    hashes_file.write_text(json.dumps(hashes))


def _page(title: str, body: str) -> str:
    return (
        '<!DOCTYPE html>\n<html><head><meta name="pypi:repository-version" content="1.0">'
        f"<title>{title}</title></head>\n<body><h1>{title}</h1>\n{body}</body></html>\n"
    )


def build_index(
    requirements: list[Path], dest: Path | None = None, extra: list[str] | tuple[str, ...] = ()
) -> Path:
    """Download the requirement files (+ extra requirement strings, + uv and pip) on this machine
    into dest/files and write a PEP 503 simple index to dest/simple/. Returns dest.

    Cached: a call with the same inputs as an earlier one downloads nothing.
    Default dest: ~/.cache/relaunch/index.
    """
    dest = Path(dest).expanduser() if dest is not None else Path.home() / ".cache" / "relaunch" / "index"
    reqs = [Path(r).expanduser().resolve() for r in requirements]
    from relaunch.transports.tools import TOOL_PACKAGES

    wanted = [*extra, "pip", *TOOL_PACKAGES.values()]  # the tools relaunch installs on an instance
    key = hashlib.sha256()
    for r in reqs:
        try:
            key.update(r.read_bytes() + b"\0")
        except OSError as e:
            raise UsageError(f"cannot read requirements file {r}: {e.strerror}") from None
    key.update(json.dumps([sorted(wanted), list(sys.version_info[:2]), sys.platform]).encode())
    marker = dest / ".built" / key.hexdigest()

    dest.mkdir(parents=True, exist_ok=True)
    with _locked(dest / ".lock"):  # two test sessions building at once must not interleave
        if marker.exists() and (dest / "simple" / "index.html").exists():
            return dest
        (dest / "files").mkdir(exist_ok=True)
        argv = [sys.executable, "-m", "pip", "download", "--progress-bar", "off"]
        argv += ["--dest", str(dest / "files")]
        for r in reqs:
            argv += ["-r", str(r)]
        argv += wanted
        proc = subprocess.run(argv, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = "\n".join("  | " + ln for ln in proc.stderr.strip().splitlines()[-15:])
            raise RelaunchError(f"build_index: pip download failed (exit {proc.returncode})\n{tail}")
        _write_simple_index(dest)
        marker.parent.mkdir(exist_ok=True)
        marker.write_text(json.dumps({"requirements": [str(r) for r in reqs], "extra": wanted}) + "\n")
    return dest
