"""Pause: freeze every process of an instance, as Vast does to an outbid interruptible instance.

The processes are stopped by the kernel's cgroup freezer, not signalled: nothing inside can tell,
sshd included (a connection gets no answer), and after a thaw each goes on where it was, same PID.
An instance that can pause is booted inside a cgroup of its own, in whichever
hierarchy this machine has: cgroup v2 (`cgroup.freeze`) or the v1 `freezer` controller
(`freezer.state`). Its name, `relaunch-sandbox-<name>`, is all destroy needs to find it (instance
names are unique on this machine). Its processes are children of the boot process, so they are all in it.

A v1-frozen process does not die of SIGKILL until thawed: destroy and stop thaw first.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

from relaunch.errors import RelaunchError, UsageError

KINDS = ("v2", "v1")  # preferred first


@dataclass(frozen=True)
class Cgroup:
    kind: str   # "v2" | "v1"
    path: Path  # the instance's cgroup folder

    def freeze(self, frozen: bool, timeout: float = 10) -> None:
        """Freeze or thaw every process in it; returns once the kernel says it is done."""
        if self.kind == "v2":
            (self.path / "cgroup.freeze").write_text("1\n" if frozen else "0\n")
        else:
            (self.path / "freezer.state").write_text("FROZEN\n" if frozen else "THAWED\n")
        deadline = time.monotonic() + timeout
        while self.frozen() != frozen:
            if time.monotonic() > deadline:
                raise RelaunchError(f"the cgroup {self.path} was not {'frozen' if frozen else 'thawed'} "
                                    f"within {timeout:g}s")
            time.sleep(0.02)

    def frozen(self) -> bool:
        try:
            if self.kind == "v2":
                return "frozen 1" in (self.path / "cgroup.events").read_text().splitlines()
            return (self.path / "freezer.state").read_text().strip() == "FROZEN"
        except OSError:
            return False

    def enter_file(self) -> Path:
        """Writing a PID here moves that process (and then its future children) into the cgroup."""
        return self.path / "cgroup.procs"

    def remove(self) -> None:
        """Thaw (a frozen process cannot exit) and remove it; it must hold no process by then."""
        if not self.path.exists():
            return
        with contextlib.suppress(OSError):
            if self.frozen():
                self.freeze(False)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as e:  # EBUSY while the last killed process is being reaped
                if time.monotonic() > deadline:
                    raise RelaunchError(f"cannot remove the cgroup {self.path}: {e.strerror}") from None
                time.sleep(0.05)


def hierarchies() -> dict[str, Path]:
    """kind -> mount point of each hierarchy that can freeze, as /proc/self/mountinfo lists them."""
    found: dict[str, Path] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            fields = line.split(" - ", 1)
            if len(fields) != 2:
                continue
            mount_point = fields[0].split()[4]
            fstype, _source, options = (fields[1].split() + ["", ""])[:3]
            if fstype == "cgroup2" and "v2" not in found:
                found["v2"] = Path(mount_point)
            elif fstype == "cgroup" and "freezer" in options.split(",") and "v1" not in found:
                found["v1"] = Path(mount_point)
    return found


def create(name: str, prefer: tuple[str, ...] | None = None) -> Cgroup:
    """The cgroup of instance `name`, made in the first hierarchy of `prefer` (default: KINDS) that
    this machine has."""
    found = hierarchies()
    for kind in prefer or KINDS:
        if kind in found:
            cgroup = Cgroup(kind, found[kind] / f"relaunch-sandbox-{name}")
            cgroup.path.mkdir(exist_ok=True)
            if kind == "v2" and not (cgroup.path / "cgroup.freeze").exists():  # a kernel before 5.2
                cgroup.path.rmdir()
                continue
            return cgroup
    raise UsageError("this machine has no cgroup freezer (cgroup v2, or the v1 freezer controller), which pause "
                     "needs", hint="mount one, e.g. mount -t cgroup2 none /sys/fs/cgroup/unified")


def of(name: str) -> list[Cgroup]:
    """The cgroups instance `name` has (any hierarchy; none unless its image pauses)."""
    found = [Cgroup(kind, root / f"relaunch-sandbox-{name}") for kind, root in hierarchies().items()]
    return [cgroup for cgroup in found if cgroup.path.is_dir()]
