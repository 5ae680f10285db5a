"""relaunch's own known_hosts file, shared by paramiko and every ssh subprocess.

Fabric accepts every host key out of the box (AutoAddPolicy, no known_hosts loaded). Here:
first contact with an address and port records its key (trust on first use) and shows the
fingerprint; a pinned `ssh.host_key` must match; a different key at a recorded address is
refused unless the caller explicitly accepts the new one (`up --accept-new-host-key`). Keys are
named by what is contacted (`address`, or `[address]:port`), as OpenSSH names them, never by an
ssh config alias: rsync's ssh checks the same file under the same names.
"""

from __future__ import annotations

import base64
import hashlib
import os
import threading
from collections.abc import Callable
from pathlib import Path

import paramiko

from ..errors import HostKeyError

_lock = threading.Lock()


def fingerprint(key: paramiko.PKey) -> str:
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


class KnownHosts:
    def __init__(self, path: Path) -> None:
        self.path = path

    def _load(self) -> paramiko.HostKeys:
        keys = paramiko.HostKeys()
        if self.path.exists():
            keys.load(str(self.path))
        return keys

    def recorded(self, name: str) -> list[paramiko.PKey]:
        entry = self._load().lookup(name)
        return list(entry.values()) if entry else []

    def record(self, name: str, key: paramiko.PKey) -> None:
        """Replace whatever was recorded for `name` with `key`."""
        with _lock:
            keys = self._load()
            keys.pop(name, None)
            keys.add(name, key.get_name(), key)
            self._save(keys)

    def _save(self, keys: paramiko.HostKeys) -> None:
        """0600, written to a temp file and renamed: a crash never leaves a half file."""
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = self.path.with_name(f"{self.path.name}.tmp{os.getpid()}")
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
        keys.save(str(tmp))
        os.replace(tmp, self.path)


class TrustPolicy(paramiko.MissingHostKeyPolicy):
    """Called by paramiko only for a host with no key loaded into the client."""

    def __init__(self, known: KnownHosts, name: str, pin: str | None, say: Callable[[str], None],
                 shown: str | None = None, replacing: bool = False) -> None:
        self.known, self.name, self.pin, self.say = known, name, pin, say
        self.shown = shown              # how messages name the host (with its alias); default: `name`
        self.replacing = replacing      # a key is recorded and was not loaded: --accept-new-host-key

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        seen = fingerprint(key)
        if hostname != self.name:
            # paramiko names the host by what it contacted; recording under another name would
            # make every later connection "first contact" again
            raise HostKeyError(f"{hostname}: the host key would be recorded as {self.name}; refusing")
        hostname = self.shown or hostname
        if self.replacing and (self.pin is None or seen == self.pin):
            self.say(f"forgot the recorded host key of {self.name} (--accept-new-host-key)")
        if self.pin is not None:
            if seen != self.pin:
                raise HostKeyError(
                    f"{hostname}: host key {seen} does not match the pinned ssh.host_key {self.pin}",
                    "check the fingerprint in the provider's console; someone may be in the middle",
                )
            self.known.record(self.name, key)
            self.say(f"host key of {hostname} matches the pin {seen}")
            return
        self.known.record(self.name, key)
        self.say(f"first contact with {hostname}: recorded host key {key.get_name()} {seen}")
