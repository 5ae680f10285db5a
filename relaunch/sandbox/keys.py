"""The public keys a sandbox instance accepts.

A provider lets in the keys its user uploaded, and a README's commands name no key: ssh and
relaunch then offer the user's ssh-agent keys and ~/.ssh/id_*. So `relaunch sandbox create`
authorizes those (`users_keys`) besides the sandbox's own key (records.default_key), unless it is
given one key to authorize instead.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import pwd
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from relaunch.errors import UsageError

# a public key as authorized_keys holds it: type, base64 blob, an optional comment
KEY_RE = re.compile(r"(ssh-|ecdsa-|sk-)\S+ [A-Za-z0-9+/=]+")


@dataclass(frozen=True)
class PublicKey:
    line: str    # "ssh-ed25519 AAAA... comment"
    source: str  # where it was found: a .pub file (~/ for the home running relaunch) or "ssh-agent"

    @property
    def blob(self) -> str:
        return self.line.split()[1]

    @property
    def fingerprint(self) -> str:
        """As `ssh-keygen -l` and `ssh-add -l` print it."""
        digest = hashlib.sha256(base64.b64decode(self.blob)).digest()
        return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def is_public_key(line: str) -> bool:
    """A plain public key (a certificate is no authorized_keys line by itself)."""
    if not KEY_RE.match(line) or "-cert-" in line.split()[0]:
        return False
    try:
        base64.b64decode(line.split()[1], validate=True)
    except binascii.Error:
        return False
    return True


def public_key_line(path: Path) -> str:
    """The public key line of a .pub file, or of the .pub beside a private key."""
    path = Path(path).expanduser()
    candidates = [path] if path.suffix == ".pub" else [path.with_name(path.name + ".pub"), path]
    for cand in candidates:
        try:
            text = cand.read_text().strip()
        except (OSError, UnicodeDecodeError):
            continue
        if is_public_key(text):
            return text
    raise UsageError(
        f"no SSH public key at {path}",
        hint="pass a public key file (.pub) or a private key with its .pub beside it",
    )


def _homes() -> list[Path]:
    """The home running relaunch and, under sudo, the home of the user who ran sudo: their keys are
    the ones their own ssh and relaunch offer."""
    homes = [Path.home()]
    sudo_user = os.environ.get("SUDO_USER")
    if sudo_user:
        try:
            homes.append(Path(pwd.getpwnam(sudo_user).pw_dir))
        except KeyError:
            pass
    return list(dict.fromkeys(homes))


def _shown(path: Path) -> str:
    home = Path.home()
    return f"~/{path.relative_to(home)}" if path.is_relative_to(home) else str(path)


def _agent_lines() -> list[str]:
    """The public keys ssh-agent (SSH_AUTH_SOCK) holds; none when there is no agent."""
    if not os.environ.get("SSH_AUTH_SOCK"):
        return []
    try:
        proc = subprocess.run(["ssh-add", "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return proc.stdout.splitlines() if proc.returncode == 0 else []  # 1: the agent holds none


def users_keys() -> list[PublicKey]:
    """The user's own public keys: ~/.ssh/id_*.pub, then those ssh-agent holds; each once."""
    found: list[PublicKey] = []
    for home in _homes():
        for pub in sorted((home / ".ssh").glob("id_*.pub")):
            try:
                line = pub.read_text().strip()
            except (OSError, UnicodeDecodeError):
                continue
            if is_public_key(line):
                found.append(PublicKey(line, _shown(pub)))
    found += [PublicKey(line.strip(), "ssh-agent") for line in _agent_lines() if is_public_key(line.strip())]
    unique: dict[str, PublicKey] = {}
    for key in found:
        unique.setdefault(key.blob, key)
    return list(unique.values())
