"""Sandbox instances: create, boot, destroy, list, get, run_in, set_link, commands.

An instance is a Linux network namespace `rl-<name>` joined to this machine by a veth pair, with a
real OpenSSH sshd listening on its own address. sshd runs in a private mount namespace where the
user's home is an empty tmpfs (the instance's "disk"), /tmp is private, and this machine's pip
configuration is masked (a real instance has none). Every instance gets a fresh ed25519 host key,
like a new cloud instance, and reaches no package registry: `index.build_index` prepares a local
PEP 503 index on this machine that the instance can serve to itself. Its network is `network`'s.

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
import pwd
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

from . import network
from .network import TOOLS, TOOLS_COMMAND_LOG, locked, netns_exists, require_tools, run, veths

RUN_DIR = Path(os.path.abspath(os.environ.get("RELAUNCH_SANDBOX_DIR") or network.MACHINE_DIR))

NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,12}")
DISK_RE = re.compile(r"[1-9][0-9]*[kKmMgG]?")
INDEX_PORT = 8765
SSH_PORT = 22
USERS = {"root": "/root", "ubuntu": "/home/ubuntu"}
# sshd hands sessions this PATH; commands run with run_in get the same, so they see what ssh sees.
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
COMMAND_LOG, LOG_COMMAND = "commands.log", "log-command"  # in the instance's folder
SFTP_SERVER = "/usr/lib/openssh/sftp-server"
SUDOERS = Path("/etc/sudoers.d/relaunch-sandbox")  # the sandbox's own name: removed with the last instance
SUDOERS_TMP = SUDOERS.with_name(".relaunch-sandbox.tmp")  # sudo ignores names containing "."
# Global pip configuration of this machine points at local disks (find-links, constraints); a
# fresh cloud image has none, so these are masked inside the instance.
PIP_CONFIG_DIRS = [Path("/etc/xdg/pip")]
PIP_CONFIG_FILES = [Path("/etc/pip.conf")]

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
    with network.machine_lock():
        _ensure_user("ubuntu", USERS["ubuntu"])
        rule = "ubuntu ALL=(ALL) NOPASSWD:ALL\n"
        if not SUDOERS.exists() or SUDOERS.read_text() != rule:
            SUDOERS_TMP.write_text(rule)
            SUDOERS_TMP.chmod(0o440)
            os.replace(SUDOERS_TMP, SUDOERS)
        entry = pwd.getpwnam("ubuntu")
        return entry.pw_uid, entry.pw_gid


def _user_record(user: str) -> Path:
    return network.MACHINE_DIR / f".user-{user}.json"


def _ensure_user(user: str, home: str) -> None:
    """`user` exists, is not locked, and its home (the mount point of its disk) exists. What has to
    change for that is recorded before it is done, for _restore_user. Call under machine_lock()."""
    record = _user_record(user)
    changes: dict[str, Any] = {"created": False, "password": None, "home": False}
    with contextlib.suppress(OSError, ValueError):
        changes = json.loads(record.read_text())
    exists = _has_user(user)
    # With `UsePAM no`, sshd refuses even key logins for a "locked" account (shadow password
    # starting with "!", which is what useradd leaves). "*" means: no password, not locked.
    password = _shadow_password(user) if exists else "!"
    changes["created"] = changes["created"] or not exists
    if password.startswith("!") and not changes["created"] and changes["password"] is None:
        changes["password"] = password
    changes["home"] = changes["home"] or not Path(home).exists()
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(changes) + "\n")
    record.chmod(0o600)  # it may hold a password hash
    if not exists:
        require_tools(["useradd"])
        run(["useradd", "-M", "-d", home, "-s", "/bin/bash", user])
    if password.startswith("!"):
        run(["usermod", "-p", "*", user])
    Path(home).mkdir(parents=True, exist_ok=True)


def _restore_user(user: str, home: str) -> None:
    """Undo what _ensure_user changed: delete the user if it made it, else lock it again as it was;
    remove the home folder if it made it. Call under machine_lock(), with no instance left."""
    record = _user_record(user)
    try:
        changes = json.loads(record.read_text())
    except (OSError, ValueError):
        return
    if changes["created"]:
        if _has_user(user):
            run(["userdel", user])
    elif changes["password"] is not None and _shadow_password(user) == "*":
        # through stdin: a hash on a command line would be visible in `ps`
        run(["chpasswd", "-e"], input=f"{user}:{changes['password']}\n")
    if changes["home"]:
        with contextlib.suppress(OSError):
            Path(home).rmdir()  # only if empty: nothing of anyone else's goes
    record.unlink()


def _restore_machine() -> None:
    """With the last instance on this machine gone: undo what the sandbox changed outside /run.
    Call under machine_lock()."""
    for path in (SUDOERS, SUDOERS_TMP):
        path.unlink(missing_ok=True)
    _restore_user("ubuntu", USERS["ubuntu"])


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


def _sshd_config(folder: Path, address: str, command_log: bool) -> str:
    return "\n".join(
        [
            f"ListenAddress {address}",
            f"Port {SSH_PORT}",
            f"HostKey {folder}/ssh_host_ed25519_key",
            # the key this machine was given, and the user's own file, as on a cloud image
            f"AuthorizedKeysFile {folder}/authorized_keys .ssh/authorized_keys",
            f"PidFile {folder}/sshd.pid",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "PermitRootLogin prohibit-password",
            "UsePAM no",
            "PrintMotd no",
            "PrintLastLog no",
            "X11Forwarding no",
            # Fabric's put/get speak SFTP; the in-process server needs no binary from the image,
            # but a forced command cannot run it: a logged instance runs the server program
            *(
                [f"ForceCommand {shlex.quote(str(folder / LOG_COMMAND))}", f"Subsystem sftp {SFTP_SERVER}"]
                if command_log
                else ["Subsystem sftp internal-sftp"]
            ),
            "",
        ]
    )


def _log_command_script(log: Path) -> str:
    """sshd runs this instead of what the client asked for (ForceCommand), as the login user."""
    quoted = shlex.quote(str(log))
    return f"""#!/bin/sh
# Log the client's command, then run it exactly as sshd would have without a ForceCommand.
if [ -n "${{SSH_ORIGINAL_COMMAND+set}}" ]; then
    # channels run at once: the lock keeps one command's bytes together
    {{ flock 9 && printf '%s\\0' "$SSH_ORIGINAL_COMMAND" >&9; }} 9>>{quoted} ||
        {{ echo "relaunch sandbox: cannot log the command" >&2; exit 255; }}
    exec "$SHELL" -c "$SSH_ORIGINAL_COMMAND"
fi
exec "$SHELL" -l
"""


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
    command_log: bool = False,
    address: str | None = None,
) -> Instance:
    """Create and boot instance `name`; returns once sshd accepts TCP (at once with boot_delay).

    authorized_key: public key file (or a private key with its .pub beside it) that may log in;
    default: default_key(). disk: size of the home tmpfs ("4G"). rate: tc rate of the link both
    ways ("20mbit"). index_dir: a build_index() folder served inside at INDEX_PORT. boot_delay:
    sshd starts only after that many seconds (the address refuses connections meanwhile).
    key_delay: the key is authorized only after that many seconds (auth fails meanwhile).
    command_log: sshd logs every command it is asked to run, byte for byte, for `commands(name)`;
    a session without a command (a login shell) logs nothing. SFTP still works, through
    /usr/lib/openssh/sftp-server instead of sshd's own: each SFTP session logs that program's path
    as its command. Other subsystems are not supported on such an instance. address: this free
    address of the range (one a destroyed instance had), else the next free one.
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
    require_tools(list(TOOLS) + (list(TOOLS_COMMAND_LOG) if command_log else []))
    pubkey = _public_key(authorized_key)

    folder = _folder(name)
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
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            network.release(name, RUN_DIR)
            raise
    try:
        return _boot(
            name, folder, slot, net, user, pubkey, disk, rate, index_dir, boot_delay, key_delay, command_log
        )
    except BaseException:
        # a half-created instance must leave nothing behind
        destroy(name)
        raise


def _boot(
    name: str,
    folder: Path,
    slot: int,
    net: IPv4Network,
    user: str,
    pubkey: str,
    disk: str,
    rate: str | None,
    index_dir: Path | None,
    boot_delay: float,
    key_delay: float,
    command_log: bool,
) -> Instance:
    folder.chmod(0o755)
    home = USERS[user]
    ids = _ensure_ubuntu() if user == "ubuntu" else None
    host_dev, inst_dev = veths(slot)
    address = network.addresses(slot, net)[1]
    ns = network.netns(name)

    # a fresh host key: every instance is a new machine as far as ssh is concerned
    key = folder / "ssh_host_ed25519_key"
    run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"root@{ns}", "-f", str(key)])
    fingerprint = run(["ssh-keygen", "-lf", f"{key}.pub"]).stdout.split()[1]
    (folder / "sshd_config").write_text(_sshd_config(folder, address, command_log))
    if command_log:
        forced = folder / LOG_COMMAND
        forced.write_text(_log_command_script(folder / COMMAND_LOG))
        forced.chmod(0o755)
        # appended to by the login user's sessions, read from this machine; writable by no one else
        (folder / COMMAND_LOG).touch(mode=0o644)
        os.chown(folder / COMMAND_LOG, *(ids or (0, 0)))
    (folder / "empty").write_text("")
    if key_delay > 0:
        (folder / "authorized_keys.pending").write_text(pubkey + "\n")
    else:
        (folder / "authorized_keys").write_text(pubkey + "\n")
    for f in ("authorized_keys", "authorized_keys.pending"):
        with contextlib.suppress(FileNotFoundError):
            (folder / f).chmod(0o644)  # read by sshd as the login user

    network.connect(name, slot, net)

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
        network.shape(name, slot, rate)

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
    meta = {**asdict(inst), "slot": slot, "range": str(net), "veth": [host_dev, inst_dev], "disk": disk,
            "rate": rate, "index_dir": str(index_dir) if index_dir else None, "command_log": command_log,
            "created": time.time()}  # fmt: skip
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


def destroy(name: str) -> bool:
    """Power off and delete instance `name`: every process in it, its link, its netns, its state.
    With the last instance of the sandbox dir its address range goes, with the last one on this
    machine the `ubuntu` user's sudoers file and the user itself if the sandbox made it.

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

    network.disconnect(name, slot)
    with network.machine_lock():  # under the lock that creates take: who is last is decided once
        shutil.rmtree(folder, ignore_errors=True)
        network.release(name, RUN_DIR)
        if not network.names_everywhere():
            _restore_machine()
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


def commands(name: str) -> list[str]:
    """The commands instance `name` was asked to run over ssh, in the order they arrived, byte for
    byte (bytes that are not UTF-8 come back as surrogate escapes). Needs create(command_log=True)."""
    get(name)
    try:
        data = (_folder(name) / COMMAND_LOG).read_bytes()
    except FileNotFoundError:
        raise UsageError(
            f"sandbox {name!r} does not log commands", hint="create it with command_log=True"
        ) from None
    # every command ends with a NUL byte; a command being appended right now has none yet
    return [c.decode("utf-8", "surrogateescape") for c in data.split(b"\0")[:-1]]


def set_link(name: str, up: bool) -> None:
    """Take the instance's link down (an outage: packets vanish, connections time out) or up again."""
    inst = get(name)
    meta = json.loads((_folder(name) / "instance.json").read_text())
    network.set_link_state(name, int(meta["slot"]), up, IPv4Network(meta["range"]) if meta.get("range") else None)
    if up:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                socket.create_connection((inst.address, SSH_PORT), timeout=0.5).close()
                return
            time.sleep(0.1)
        raise RelaunchError(f"sandbox {name}: sshd not reachable 20s after the link came back up")


def set_silent(name: str, silent: bool) -> None:
    """Drop every packet to and from the instance without a word (a machine that lost power:
    nothing answers, nothing is refused), or let them pass again. Its processes go on."""
    get(name)
    meta = json.loads((_folder(name) / "instance.json").read_text())
    network.set_silent(name, int(meta["slot"]), silent, meta.get("rate"))
