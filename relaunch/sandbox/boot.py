"""What an instance is made of on this machine, and the script that boots it.

Every instance runs sshd in a mount namespace of its own, entered through its network namespace.
The default image is this machine as it is: sshd is the namespace's first process, the home folder
an empty tmpfs, /tmp private. Every other image (images.py) adds:

- Its own PID namespace, whose PID 1 is the image's: a VM's `init`, which on SIGTERM stops every
  process (TERM, then up to VM_SHUTDOWN_SECONDS) and exits, as a shutdown does; or a container's
  `start.sh`, which sets no handler for SIGTERM, so the kernel drops the TERM a stop sends to PID 1
  and nothing else hears it. PIDs inside are not this machine's: sshd writes no PID file, and the
  host side finds PID 1 as the only child of the boot process (`unshare -f`).
- Disks. One that survives a stop is a tmpfs mounted on this machine under the instance's folder
  (`disks/`), bind-mounted into the namespace; one a stop wipes is a tmpfs made inside the
  namespace, gone with it. Mount points missing on this machine (/workspace, /lambda/nfs/NAME,
  /opt/dlami/nvme) are made, recorded, and removed when no instance needs them any more (only if
  empty).
- PATH as the image has it: a read-only overlay on /usr/bin (and any other PATH folder that needs
  one) whose upper layer, in the instance's folder (`layers/`), holds whiteouts (character device
  0:0) for this machine's python3*, pip*, pydoc* ..., symlinks python3 and pythonX.Y to the image's
  Python (pythons.relocatable), and an `apt-get`/`apt` that refuses: an instance shares this
  machine's /usr, and a package installed in it would change this machine. Its standard library
  shows as /usr/lib/pythonX.Y (an overlay on /usr/lib), where a venv looks for it.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
import stat
import subprocess
from pathlib import Path

from relaunch.errors import UsageError

from . import journal, network, pythons
from .images import VM_SHUTDOWN_SECONDS, Image
from .network import run

# sshd hands sessions this PATH; commands run with run_in get the same, so they see what ssh sees.
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Global pip configuration of this machine points at local disks (find-links, constraints); a
# fresh cloud image has none, so these are masked inside the instance.
PIP_CONFIG_DIRS = [Path("/etc/xdg/pip")]
PIP_CONFIG_FILES = [Path("/etc/pip.conf")]
# This machine's Python programs, hidden from PATH on an image with a Python of its own.
PYTHON_PROGRAMS = ("python*", "pip*", "pydoc*", "py3*", "pygettext3*", "2to3*", "idle*", "easy_install*")
APT_PROGRAMS = ("apt-get", "apt")
PID1 = {"vm": "init", "container": "start.sh"}

APT_STUB = """#!/bin/sh
echo "$(basename "$0"): refused on a relaunch sandbox instance: it shares this machine's /usr, so a package" \\
     "installed here would be installed on this machine" >&2
exit 100
"""

# PID 1 of a VM image. Reaps orphans (bash waits for any child), exits when sshd does.
INIT = """#!/bin/bash
# usage: init SHUTDOWN_SECONDS COMMAND... (the command is sshd)
# On SIGTERM, as a VM's shutdown: TERM to every process, wait for them up to SHUTDOWN_SECONDS, exit
# (what is left dies with PID 1).
limit=$(($1 * 10)); shift
others() {
    local p s
    for p in /proc/[0-9]*; do
        p=${p#/proc/}
        [ "$p" = 1 ] && continue
        read -r s < "/proc/$p/stat" 2>/dev/null || continue
        s=${s##*) }
        [ "${s%% *}" = Z ] || return 0
    done
    return 1
}
shutdown() {
    echo "init: SIGTERM: stopping every process"
    kill -TERM -1 2>/dev/null
    n=0
    while others && [ $n -lt $limit ]; do sleep 0.1; n=$((n + 1)); done
    exit 0
}
trap shutdown TERM
"$@" &
wait $!
"""

# PID 1 of a container image, as a pod's start script: no handler for SIGTERM (so the kernel drops
# the one a stop sends it), sshd in the background, then a wait.
START = """#!/bin/bash
"$@" &
wait $!
"""


def _q(path: Path | str) -> str:
    return shlex.quote(str(path))


def check_folder(folder: Path, image: Image) -> None:
    """overlayfs takes its layers as one option string: no ':' ',' or '\\' in the folder's path."""
    if image.own_pid_namespace and any(c in str(folder) for c in ":,\\ \t\n"):
        raise UsageError(f"the sandbox dir {folder.parent} cannot hold an instance of the image {image.name}: "
                         "its path has a ':', ',', '\\' or a space", hint="set RELAUNCH_SANDBOX_DIR to another folder")


# -- disks --------------------------------------------------------------------------------------

def disks(image: Image, name: str, home: str, sizes: dict[str, str]) -> list[tuple[str, str, bool, str]]:
    """(label, mount point, survives a stop, size) of the instance's disks: its home, then its
    volumes. sizes: {"home": ..., "volume": ...}."""
    found = [("home", home, image.home_survives_stop, sizes["home"])]
    for i, volume in enumerate(image.volumes):
        found.append((f"volume-{i}", volume.path.format(name=name), volume.survives_stop, sizes["volume"]))
    return found


def _tmpfs_options(size: str, user_ids: tuple[int, int] | None, private: bool) -> str:
    """A disk of the login user: root's (user_ids None), or the `ubuntu` user's (uid, gid)."""
    owner = f",uid={user_ids[0]},gid={user_ids[1]}" if user_ids else ""
    return f"size={size},mode={'700' if private else '755'}{owner}"


def mount_disks(folder: Path, image: Image, name: str, home: str, sizes: dict[str, str],
                user_ids: tuple[int, int] | None) -> None:
    """Mount on this machine the disks that survive a stop (once: a start finds them mounted)."""
    for label, _path, survives, size in disks(image, name, home, sizes):
        target = folder / "disks" / label
        if not survives or os.path.ismount(target):
            continue
        target.mkdir(parents=True, exist_ok=True)
        # root's home is 700, as /root is
        run(["mount", "-t", "tmpfs", "-o", _tmpfs_options(size, user_ids, label == "home" and not user_ids),
             f"relaunch-{label}", str(target)])


def unmount_disks(folder: Path) -> None:
    """Unmount every mount of this machine under the instance's folder (its processes are gone)."""
    prefix = str(folder) + "/"
    for line in reversed(Path("/proc/self/mountinfo").read_text().splitlines()):
        # the kernel writes a space as \040, a backslash as \134 ...
        mount_point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), line.split()[4])
        if mount_point.startswith(prefix):
            if subprocess.run(["umount", mount_point], capture_output=True).returncode != 0:
                run(["umount", "--lazy", mount_point])


def ensure_mount_points(paths: list[str]) -> None:
    """Make the folders of `paths` that this machine lacks, recording each in the journal before it
    is made. Call under machine_lock()."""
    for path in paths:
        parts = Path(path).parts
        for depth in range(2, len(parts) + 1):
            folder = Path(*parts[:depth])
            if folder.exists():
                continue
            journal.add("folders", str(folder))
            folder.mkdir(mode=0o755)


def release_mount_points(needed: set[str]) -> list[str]:
    """Remove the folders the sandbox made that no instance needs (`needed`: the mount points of
    every instance left), deepest first, each only if empty; returns those removed. Call under
    machine_lock()."""
    removed = []
    for path in sorted(journal.read()["folders"], key=lambda p: -len(Path(p).parts)):
        if any(n == path or n.startswith(path.rstrip("/") + "/") for n in needed):
            continue
        try:
            Path(path).rmdir()
            removed.append(path)
        except FileNotFoundError:
            pass
        except OSError:
            pass  # someone put files there: theirs now, left alone
        journal.forget("folders", path)
    return removed


# -- PATH -----------------------------------------------------------------------------------------

def _path_folders() -> list[str]:
    """The folders of DEFAULT_PATH, each once (/bin is /usr/bin on a merged-/usr machine)."""
    seen: list[str] = []
    for entry in DEFAULT_PATH.split(":"):
        real = os.path.realpath(entry)
        if os.path.isdir(real) and real not in seen:
            seen.append(real)
    return seen


def make_layers(folder: Path, image: Image) -> list[tuple[str, str]]:
    """Build the upper layers of the folders the image changes; [(folder, layer)] to overlay."""
    if not image.own_pid_namespace:
        return []
    # name -> what it is in the layer: "hide" (a whiteout), "apt" (the stub), or a symlink's target
    changes: dict[str, dict[str, str]] = {}
    for target in _path_folders():
        names = sorted(os.listdir(target))
        found = changes.setdefault(target, {})
        if image.python:
            found.update({n: "hide" for n in names if any(fnmatch.fnmatch(n, p) for p in PYTHON_PROGRAMS)})
        found.update({n: "apt" for n in APT_PROGRAMS if n in names or target == "/usr/bin"})
    if image.python:
        build = pythons.relocatable(image.python, image.python_variant)
        changes["/usr/bin"].update({"python3": str(build.executable), f"python{image.python}": str(build.executable)})
        # the standard library where the image has it: a venv's python (pyvenv.cfg: home = /usr/bin)
        # finds its prefix by looking for lib/pythonX.Y/os.py above /usr/bin, not through the symlink
        changes["/usr/lib"] = {f"python{image.python}": str(build.root / "lib" / f"python{image.python}")}
    layers = []
    for target, entries in changes.items():
        if not entries:
            continue
        layer = folder / "layers" / target.strip("/").replace("/", "-")
        layer.mkdir(parents=True)
        for n, what in entries.items():
            if what == "hide":
                os.mknod(layer / n, stat.S_IFCHR | 0o600, os.makedev(0, 0))  # overlayfs's whiteout
            elif what == "apt":
                (layer / n).write_text(APT_STUB)
                (layer / n).chmod(0o755)
            else:
                (layer / n).symlink_to(what)
        layers.append((target, str(layer)))
    return layers


# -- the boot script ----------------------------------------------------------------------------

def pid1_script(folder: Path, image: Image) -> Path:
    """Write the image's PID 1 into the instance's folder (executed directly: its name is its comm)."""
    path = folder / PID1[image.kind]
    path.write_text(INIT if image.kind == "vm" else START)
    path.chmod(0o755)
    return path


def script(folder: Path, name: str, image: Image, user: str, home: str, sizes: dict[str, str],
           user_ids: tuple[int, int] | None, layers: list[tuple[str, str]]) -> str:
    """Shell run as the first process of the new mount namespace: the mounts, then sshd (the
    default image) or the image's PID 1 with sshd under it."""
    lines = ["set -e"]
    for label, path, survives, size in disks(image, name, home, sizes):
        if survives:
            lines.append(f"mount --bind {_q(folder / 'disks' / label)} {_q(path)}")
        else:
            options = _tmpfs_options(size, user_ids, private=label == "home" and user == "root")
            lines.append(f"mount -t tmpfs -o {options} relaunch-{'disk' if label == 'home' else label} {_q(path)}")
    lines.append("mount -t tmpfs -o mode=1777 relaunch-tmp /tmp")
    for d in PIP_CONFIG_DIRS:
        if d.is_dir():
            lines.append(f"mount -t tmpfs -o mode=755,size=1m relaunch-mask {_q(d)}")
    for f in PIP_CONFIG_FILES:
        if f.is_file():
            lines.append(f"mount --bind {_q(folder / 'empty')} {_q(f)}")
    for target, layer in layers:
        lines.append(f"mount -t overlay overlay -o ro,lowerdir={_q(layer + ':' + target)} {_q(target)}")
    sshd = f"/usr/sbin/sshd -D -e -f {_q(folder / 'sshd_config')}"
    if image.own_pid_namespace:
        pid1 = _q(folder / PID1[image.kind])
        lines.append(f"exec {pid1} {VM_SHUTDOWN_SECONDS} {sshd}" if image.kind == "vm" else f"exec {pid1} {sshd}")
    else:
        lines.append(f"exec {sshd}")
    return "; ".join(lines)


def argv(name: str, image: Image, boot_script: str) -> list[str]:
    """The boot process: into the network namespace, then new mount (and PID) namespaces."""
    pid_ns = ["-p", "-f", "--mount-proc"] if image.own_pid_namespace else []
    return ["ip", "netns", "exec", network.netns(name), "unshare", "-m", *pid_ns, "--propagation", "private",
            "--", "sh", "-c", boot_script]
