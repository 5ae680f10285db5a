"""The processes the sandbox starts for an instance: started in sessions of their own and recorded
with their start time (<folder>/<role>.pid), so that a later process ends exactly those, never a
reuse of the pid; and the instance's PID 1 found again."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

from . import network
from .network import netns_exists
from .records import folder_of

# Popen objects of the children this process started, so that destroy() can reap them instead
# of leaving zombies behind in a long pytest session.
children: dict[str, list[subprocess.Popen[bytes]]] = {}


def start_time(pid: int) -> str | None:
    """Kernel start time of a process: together with the pid it names one process, even after reuse."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may contain spaces and parentheses: split after its last ")"
    return stat.rsplit(")", 1)[1].split()[19]


def process_state(pid: int) -> str | None:
    """The state letter of a process (R, S, D, Z ...), None if there is none."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def spawn(name: str, role: str, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    """Start a background process in its own session and remember it in <state>/<role>.pid."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True, close_fds=True
        )
    children.setdefault(name, []).append(proc)
    (folder_of(name) / f"{role}.pid").write_text(f"{proc.pid} {start_time(proc.pid) or ''}\n")
    return proc


def log_tail(path: Path, lines: int = 10) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join("  | " + ln for ln in text.strip().splitlines()[-lines:])


def kill_recorded(folder: Path) -> None:
    """Kill the processes recorded in <state>/*.pid (delayed starters live outside the netns)."""
    for pid_file in folder.glob("*.pid"):
        # only the process we started, never a later reuse of the pid
        pid = sshd_pid(folder) if pid_file.stem == "sshd" else recorded_pid(folder, pid_file.stem)
        if pid is None:
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return b""


def netns_pids(name: str) -> list[int]:
    if not netns_exists(name):
        return []
    proc = subprocess.run(["ip", "netns", "pids", network.netns(name)], capture_output=True, text=True)
    return [int(p) for p in proc.stdout.split() if p.isdigit() and int(p) != os.getpid()]


def reap(name: str, wait: bool = False) -> None:
    """Collect exit statuses of children this process started for `name` (no zombies)."""
    for proc in children.get(name, []):
        if wait:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        else:
            proc.poll()
    if wait:
        children.pop(name, None)


def recorded_pid(folder: Path, role: str) -> int | None:
    """The process recorded in <folder>/<role>.pid, if it is still the one recorded."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        pid, start = (folder / f"{role}.pid").read_text().split()[:2]
        if start_time(int(pid)) == start:
            return int(pid)
    return None


def sshd_pid(folder: Path) -> int | None:
    """The sshd that <folder>/sshd.pid names, if that is still this instance's sshd (sshd writes the
    file itself, without a start time, a moment after it starts to accept connections)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        pid = int((folder / "sshd.pid").read_text().split()[0])
        if f"{folder}/".encode() in cmdline(pid):
            return pid
    return None


def pid1(name: str) -> int | None:
    """This machine's PID of the instance's PID 1 (an image with a PID namespace of its own), or
    None while it is not running: the only child of the boot process (`unshare -f`)."""
    boot_pid = recorded_pid(folder_of(name), "boot")
    if boot_pid is None:
        return None
    with contextlib.suppress(OSError, ValueError, IndexError):
        child = int(Path(f"/proc/{boot_pid}/task/{boot_pid}/children").read_text().split()[0])
        # (not a delayed boot's `sleep`): PID 1 of a namespace below this one
        nspid = next(ln for ln in Path(f"/proc/{child}/status").read_text().splitlines() if ln.startswith("NSpid:"))
        if nspid.split()[1:] == [str(child), "1"]:
            return child
    return None
