"""What the sandbox records of an instance, and where: `RUN_DIR/<name>/instance.json` (read by
list_instances, get, state), and the key instances accept by default."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relaunch.errors import UsageError
from relaunch.paths import state_dir

from . import network
from .network import locked, require_tools, run

RUN_DIR = Path(os.path.abspath(os.environ.get("RELAUNCH_SANDBOX_DIR") or network.MACHINE_DIR))


NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,12}")


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


def require_root() -> None:
    if os.geteuid() != 0:
        raise UsageError(
            "sandbox instances need root (network namespaces, mounts, sshd)",
            hint="run as root, e.g. with sudo",
        )


def check_name(name: str) -> None:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise UsageError(f"bad sandbox name {name!r}: use 1 to 12 of A-Z a-z 0-9 _ -")


def folder_of(name: str) -> Path:
    return RUN_DIR / name


def save_meta(folder: Path, meta: dict[str, Any]) -> None:
    tmp = folder / "instance.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, folder / "instance.json")


def meta_of(name: str) -> dict[str, Any]:
    get(name)
    return json.loads((folder_of(name) / "instance.json").read_text())  # type: ignore[no-any-return]


def load(folder: Path) -> Instance | None:
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
    found = (load(d) for d in sorted(RUN_DIR.iterdir()) if d.is_dir())
    return [inst for inst in found if inst is not None]


def get(name: str) -> Instance:
    check_name(name)
    inst = load(folder_of(name))
    if inst is None:
        raise UsageError(f"no sandbox named {name!r}", hint="relaunch sandbox list")
    return inst


def state(name: str) -> str:
    """running, stopped or paused."""
    return str(meta_of(name).get("state", "running"))
