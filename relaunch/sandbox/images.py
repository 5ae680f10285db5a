"""Sandbox image profiles: the facts of a provider's stock image that relaunch depends on, as data.

`relaunch sandbox create NAME --image PROFILE` builds an instance that shows these facts (boot.py
makes them real: users, PATH, mount and PID namespaces, disks). What no profile can reproduce (a
GPU, the provider's API and console, real disk sizes and speeds, the public network, cloud-init)
is listed in docs/providers.md.

Sources: the providers' documentation, as the catalogue (recipes/providers.yaml) cites it; not tried
on a real box here.
"""

from __future__ import annotations

from dataclasses import dataclass

from relaunch.errors import UsageError

# A container's SSH port is mapped: the instance's sshd listens on MAPPED_PORT_BASE + its slot.
MAPPED_PORT_BASE = 40000
# How long a VM's init waits for its processes after the TERM it sends them before it exits
# (systemd's DefaultTimeoutStopSec); a provider's stop may cut it short (stop's grace).
VM_SHUTDOWN_SECONDS = 90


@dataclass(frozen=True)
class Volume:
    """A disk besides the home folder. `path` may hold {name}, the instance's name."""

    path: str
    survives_stop: bool


@dataclass(frozen=True)
class Image:
    name: str
    kind: str                  # "host" (this machine as it is), "vm" or "container"
    user: str                  # who logs in: "root" | "ubuntu"
    python: str | None         # the only Python on PATH ("3.10"); None: this machine's, as it is
    python_variant: str        # pythons.relocatable variant: "" or "no-venv" (Ubuntu 24.04)
    home_survives_stop: bool
    volumes: tuple[Volume, ...]
    stop_grace: float          # seconds between a stop's SIGTERM and the SIGKILL to everything
    can_pause: bool            # an outbid instance is frozen, not signalled (Vast)
    summary: str

    @property
    def mapped_port(self) -> bool:
        return self.kind == "container"

    @property
    def own_pid_namespace(self) -> bool:
        """Every image but this machine's own has a PID 1 of its own (an init, or a start script)."""
        return self.kind != "host"

    def volume_paths(self, name: str) -> list[str]:
        return [v.path.format(name=name) for v in self.volumes]

    def port(self, slot: int) -> int:
        return MAPPED_PORT_BASE + slot if self.mapped_port else 22

    def survivors(self, name: str, home: str) -> list[str]:
        """The paths whose files survive a stop."""
        kept = [home] if self.home_survives_stop else []
        return kept + [v.path.format(name=name) for v in self.volumes if v.survives_stop]


def _vm(name: str, python: str, summary: str, variant: str = "", volumes: tuple[Volume, ...] = ()) -> Image:
    """A cloud VM: the `ubuntu` user, an init that stops every process on a stop, a root disk (home)
    that survives it."""
    return Image(name, kind="vm", user="ubuntu", python=python, python_variant=variant, home_survives_stop=True,
                 volumes=volumes, stop_grace=30.0, can_pause=False, summary=summary)


def _container(name: str, stop_grace: float, can_pause: bool, summary: str, home_survives_stop: bool) -> Image:
    """A GPU cloud's container: root, a start script as PID 1, /workspace kept, this machine's Python
    (the images ship one); whether a stop wipes the container disk (home) is the provider's."""
    return Image(name, kind="container", user="root", python=None, python_variant="",
                 home_survives_stop=home_survives_stop,
                 volumes=(Volume("/workspace", survives_stop=True),), stop_grace=stop_grace, can_pause=can_pause,
                 summary=summary)


PROFILES: dict[str, Image] = {
    image.name: image
    for image in (
        Image("default", kind="host", user="root", python=None, python_variant="", home_survives_stop=False,
              volumes=(), stop_grace=0.0, can_pause=False,
              summary="this machine as it is (its python3.11; root, or --user ubuntu); a stop kills every process "
                      "at once and wipes home"),
        _vm("ubuntu-22.04", "3.10", "a VM: user ubuntu (passwordless sudo), Python 3.10 only, `python3 -m venv` "
                                    "works; home survives a stop"),
        _vm("ubuntu-24.04", "3.12", "a VM: user ubuntu, Python 3.12 only, no venv module (no ensurepip), "
                                    "externally managed (PEP 668: pip refuses outside a venv); home survives a stop",
            variant="no-venv"),
        _container("runpod", 5.0, False,
                   "a container: root, SSH on a mapped port, /workspace survives a stop, home is wiped; a stop's "
                   "SIGTERM goes to PID 1 only (a start script that drops it), SIGKILL to all 5 s later",
                   home_survives_stop=False),
        _container("vast", 10.0, True,
                   "a container as runpod (SIGKILL 10 s after the TERM), but a stop keeps all of its disk, home "
                   "too; and pause: an outbid instance is frozen (cgroup freezer), not signalled, sshd too; resume "
                   "thaws it", home_survives_stop=True),
        _vm("lambda", "3.10", "a VM: user ubuntu, Python 3.10 only; /lambda/nfs/NAME (the persistent filesystem) "
                              "and home survive a stop",
            volumes=(Volume("/lambda/nfs/{name}", survives_stop=True),)),
        _vm("aws-dlami", "3.10", "a VM: user ubuntu, Python 3.10 only (the Ubuntu 22.04 DLAMI's); /opt/dlami/nvme "
                                 "(the instance store) is wiped by a stop, home (root EBS) survives",
            volumes=(Volume("/opt/dlami/nvme", survives_stop=False),)),
    )
}


def profile(name: str) -> Image:
    try:
        return PROFILES[name]
    except (KeyError, TypeError):
        raise UsageError(f"unknown sandbox image {name!r}: use one of {', '.join(PROFILES)}",
                         hint="relaunch sandbox images") from None
