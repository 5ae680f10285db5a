"""rsync over the same SSH settings as the connection: how bytes move between this machine and
an instance. Only argv builders and the meaning of rsync's exit codes; the executor runs them.

rsync is called with an argument list (no local shell), `-s` (`--secluded-args`) so remote paths
are not split or expanded by the remote shell, and the strict known_hosts file via `-e`.
"""

from __future__ import annotations

from pathlib import Path

from ..host.spec import Target
from ..host.ssh_argv import rsync_rsh
from .folder import RSYNC_PARTIAL

# Exit codes worth another try: stream/timeout errors and ssh dropping out. 24: files vanished
# on the sending side (a trainer rotating checkpoints). 23: a partial transfer, which is files
# that were gone before they were sent (rotated too) or any other error on some file (permission
# denied, an I/O error): rsync's own lines tell which (`partial`). 11: I/O error, e.g. a full disk.
TRANSIENT = (10, 12, 30, 35, 255)
OUTCOMES: dict[int | str, str] = {**{s: "transient" for s in TRANSIENT}, 24: "vanished", 23: "partial", 11: "full"}
PUSH_OUTCOMES: dict[int | str, str] = {**{s: "transient" for s in TRANSIENT}, 11: "full"}
MEANING = {
    1: "syntax or usage error", 2: "protocol incompatibility", 3: "errors selecting files",
    5: "error starting the client-server protocol", 10: "error in socket I/O",
    11: "error in file I/O (disk full?)", 12: "error in the rsync data stream", 20: "interrupted",
    23: "partial transfer", 24: "some source files vanished", 30: "timeout in data send/receive",
    35: "timeout waiting for daemon connection", 255: "ssh failed",
}
GONE = ("No such file or directory", "file has vanished")
KNOCK_ON = ("Broken pipe", "connection unexpectedly closed")   # one side ended early because of it


def error_lines(output: str) -> list[str]:
    """rsync's own error lines (`rsync: [sender] send_files failed to open "...": Permission denied
    (13)`), without its summary (`rsync error: some files/attrs were not transferred ...`)."""
    return [ln.strip() for ln in output.splitlines()
            if ln.startswith(("rsync: ", "file has vanished: ")) and not ln.startswith("rsync error:")]


def only_vanished(output: str) -> bool:
    """Whether a partial transfer (exit 23) lost only files that were gone on the sending side:
    a trainer's rotation, not a copy that failed. No explanation at all is not that."""
    lines = error_lines(output)
    gone = [ln for ln in lines if any(g in ln for g in GONE) and "[receiver]" not in ln and "[generator]" not in ln]
    return bool(gone) and all(ln in gone or any(k in ln for k in KNOCK_ON) for ln in lines)


DEADLINE_PER_GIB = 600.0          # seconds per GiB: a 15 Mbit/s link, the slowest we plan for


def deadline_for(total: int) -> float:
    return float(round(300.0 + DEADLINE_PER_GIB * total / 1024**3))


def remote_path(target: Target, path: str) -> str:
    if target.local:
        return path                     # `relaunch run`: the instance is this machine
    addr = f"[{target.address}]" if ":" in target.address else target.address
    return f"{addr}:{path}"


def base_argv(target: Target, known_hosts: Path) -> list[str]:
    ssh = [] if target.local else ["-e", rsync_rsh(target, known_hosts)]
    return ["rsync", "-a", "-s", "--info=progress2", "--no-inc-recursive", "--timeout=60",
            f"--partial-dir={RSYNC_PARTIAL}", *ssh]


def push_argv(target: Target, known_hosts: Path, local: Path, dest: str, is_dir: bool,
              some: bool = False) -> tuple[str, ...]:
    """Copy a file or folder from this machine to `dest` on the instance (its full new name);
    `some`: only the folder's NUL-separated paths on stdin."""
    src = f"{local}/" if is_dir else str(local)
    to = f"{dest}/" if is_dir else dest
    only = ("--from0", "--files-from=-") if some else ()
    return (*base_argv(target, known_hosts), *only, "--mkpath", src, remote_path(target, to))


def pull_argv(target: Target, known_hosts: Path, remote_root: str, local_root: Path,
              extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Copy exactly the NUL-separated paths on stdin (relative to remote_root) into local_root."""
    return (*base_argv(target, known_hosts), *extra, "--mkpath", "--from0", "--files-from=-",
            remote_path(target, remote_root.rstrip("/") + "/"), f"{local_root}/")


SPLIT_MIN = 64 << 20     # below this many bytes, one more SSH connection costs more than it saves


def split(files: list[tuple[str, int]], streams: int) -> list[list[str]]:
    """Files (path, size) in at most `streams` groups of about equal bytes, largest first."""
    total = sum(size for _, size in files)
    count = max(1, min(streams, len(files), max(1, total // SPLIT_MIN)))
    groups: list[tuple[int, list[str]]] = [(0, []) for _ in range(count)]
    for path, size in sorted(files, key=lambda f: (-f[1], f[0])):
        i = min(range(count), key=lambda k: groups[k][0])
        groups[i] = (groups[i][0] + size, [*groups[i][1], path])
    return [sorted(paths) for _, paths in groups if paths]
