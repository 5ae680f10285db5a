"""rsync over the same SSH settings as the connection: the transport for a store on this machine.

rsync is called with an argument list (no local shell), `--secluded-args` so remote paths are
not split or expanded by the remote shell, and the strict known_hosts file via `-e`.
"""

from __future__ import annotations

import logging
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from ..host.connection import rsync_rsh
from ..host.spec import Target
from ..ui import UI

log = logging.getLogger("relaunch.rsync")

# Exit codes worth another try (FACTS.md): stream/timeout errors and ssh dropping out.
RETRYABLE = {10, 12, 30, 35, 255}
VANISHED = 24
MEANING = {
    1: "syntax or usage error", 2: "protocol incompatibility", 3: "errors selecting files",
    5: "error starting the client-server protocol", 10: "error in socket I/O",
    11: "error in file I/O (disk full?)", 12: "error in the rsync data stream", 20: "interrupted",
    23: "partial transfer", 24: "some source files vanished", 30: "timeout in data send/receive",
    35: "timeout waiting for daemon connection", 255: "ssh failed",
}


@dataclass
class RsyncResult:
    status: int
    output: str

    @property
    def ok(self) -> bool:
        return self.status == 0

    @property
    def meaning(self) -> str:
        return MEANING.get(self.status, f"exit {self.status}")


class Rsync:
    def __init__(self, target: Target, known_hosts: Path, ui: UI) -> None:
        self.target, self.known_hosts, self.ui = target, known_hosts, ui

    def remote(self, path: str) -> str:
        addr = f"[{self.target.address}]" if ":" in self.target.address else self.target.address
        return f"{addr}:{path}"

    def argv(self, *args: str) -> list[str]:
        return ["rsync", "-a", "-s", "--info=progress2", "--no-inc-recursive", "--timeout=60",
                "-e", rsync_rsh(self.target, self.known_hosts), *args]

    def run(self, argv: list[str], description: str, total: int, stdin: bytes | None = None,
            attempts: int = 3) -> RsyncResult:
        """Run rsync with a progress bar; retry stream errors (it resumes what is there)."""
        result = RsyncResult(0, "")
        for attempt in range(1, attempts + 1):
            log.debug("rsync: %s", argv)
            with self.ui.transfer(description, total) as bar:
                proc = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                if stdin is not None:
                    assert proc.stdin is not None
                    proc.stdin.write(stdin)
                    proc.stdin.close()
                assert proc.stdout is not None
                while chunk := proc.stdout.read1(4096):  # type: ignore[attr-defined]
                    bar.feed(chunk)
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                status = proc.wait()
            result = RsyncResult(status, err)
            if status not in RETRYABLE or attempt == attempts:
                break
            self.ui.warn(f"rsync: {result.meaning}; retrying ({attempt}/{attempts - 1})")
            time.sleep(2 * attempt)
        return result

    def push_argv(self, local: Path, remote_path: str) -> list[str]:
        """Copy a file or folder from this machine to `remote_path` (its full new name)."""
        src = f"{local}/" if local.is_dir() else str(local)
        dest = f"{remote_path}/" if local.is_dir() else remote_path
        return self.argv("--mkpath", src, self.remote(dest))

    def push(self, local: Path, remote_path: str, description: str, total: int) -> RsyncResult:
        return self.run(self.push_argv(local, remote_path), description, total)

    def pull_files(self, remote_root: str, files: list[str], local_root: Path, description: str,
                   total: int, extra: list[str] | None = None) -> RsyncResult:
        """Copy exactly `files` (relative to remote_root) into local_root, keeping their paths."""
        local_root.mkdir(parents=True, exist_ok=True)
        listing = b"\0".join(f.encode() for f in files) + b"\0"
        argv = self.argv(*(extra or []), "--from0", "--files-from=-", self.remote(remote_root.rstrip("/") + "/"),
                         f"{local_root}/")
        return self.run(argv, description, total, stdin=listing)
