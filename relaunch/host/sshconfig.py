"""~/.ssh/config, read by relaunch itself: HOST (an address or a `Host` alias) -> `Target`.

relaunch resolves HostName, User, Port, IdentityFile and ProxyJump once, here, and then hands
paramiko and every ssh subprocess only the resolved values: Fabric is told to read no ssh
config and `ssh` runs with `-F /dev/null`. Both therefore contact exactly the same address and
port, and host keys are recorded and checked under that `[address]:port`, never under the alias
(an alias whose key was recorded under its name would meet a new key as "first contact").

Each value comes from the first of these that gives it:

    the HOST argument (USER@ADDRESS:PORT)
    the recipe's ssh section (what the recipe files or --set wrote)
    ~/.ssh/config for that host
    the provider preset
    the defaults (user root, port 22)

The address is HOST's, or the config's HostName for it. A jump host (ProxyJump) is resolved the
same way from its own `Host` entry; its user defaults to the local user, as with `ssh`.
Everything else in the file is not used; host-key settings in particular (StrictHostKeyChecking,
UserKnownHostsFile, HostKeyAlias) never loosen relaunch's own strict checks.
"""

from __future__ import annotations

import getpass
import glob
import io
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import paramiko
from paramiko.ssh_exception import ConfigParseError

from ..errors import UsageError
from .spec import HostSpec, Target, valid_address, valid_user

ENV_VAR = "RELAUNCH_SSH_CONFIG"
MAX_INCLUDE_DEPTH = 16               # as OpenSSH
_INCLUDE = re.compile(r"^\s*include(?:\s*=\s*|\s+)(.+?)\s*$", re.IGNORECASE)
_BLOCK = re.compile(r"^\s*(host|match)(?:\s*=\s*|\s+)", re.IGNORECASE)


def config_path() -> Path:
    """$RELAUNCH_SSH_CONFIG, else ~/.ssh/config."""
    value = os.environ.get(ENV_VAR)
    return Path(value).expanduser() if value else Path.home() / ".ssh" / "config"


@dataclass(frozen=True)
class Layer:
    """The values one source gives (None: it says nothing about that one)."""

    user: str | None = None
    port: int | None = None
    key: str | None = None


@dataclass(frozen=True)
class HostConfig:
    """What the ssh config says about one name."""

    hostname: str
    user: str | None = None
    port: int | None = None
    identity: str | None = None      # the first IdentityFile that exists, as ssh skips missing ones
    identities_only: bool = False
    proxy_jump: str | None = None


class SSHConfigFile:
    """One parsed ssh config file (with its `Include`s); a missing file says nothing."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.config = paramiko.SSHConfig()
        if not path.exists():
            return
        try:
            self.config.parse(io.StringIO("\n".join(_expanded(path, depth=0))))
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"cannot read the ssh config {path}: {getattr(exc, 'strerror', None) or exc}",
                             f"fix it, or point {ENV_VAR} at another file") from None
        except (ConfigParseError, ValueError) as exc:
            raise UsageError(f"{path}: {exc}", f"fix the line, or point {ENV_VAR} at another file") from None

    def lookup(self, name: str) -> HostConfig:
        try:
            options = self.config.lookup(name)
        except Exception as exc:  # paramiko raises many kinds on odd Match/Canonicalize lines
            raise UsageError(f"{self.path}: Host {name}: {exc}") from None
        where = f"{self.path}: Host {name}"
        hostname = str(options.get("hostname") or name)
        if not valid_address(hostname):
            raise UsageError(f"{where}: HostName {hostname!r} is not an address or host name")
        user = options.get("user")
        if user is not None and not valid_user(user):
            raise UsageError(f"{where}: User {user!r} is not a user name")
        port = None
        if "port" in options:
            text = str(options["port"])
            if not text.isdigit() or not 0 < int(text) < 65536:
                raise UsageError(f"{where}: Port {text!r} is not a number from 1 to 65535")
            port = int(text)
        identity = next((str(Path(f).expanduser()) for f in options.get("identityfile", [])
                         if Path(f).expanduser().is_file()), None)
        jump = options.get("proxyjump")
        if jump is not None and jump.strip().lower() == "none":
            jump = None
        if jump is None and options.get("proxycommand"):
            raise UsageError(f"{where}: ProxyCommand is not supported by relaunch",
                             "reach the host with ProxyJump, or point "
                             f"{ENV_VAR} at a config without the ProxyCommand")
        return HostConfig(hostname=hostname, user=user, port=port, identity=identity,
                          identities_only=str(options.get("identitiesonly", "no")).lower() == "yes",
                          proxy_jump=jump.strip() if jump else None)


def _expanded(path: Path, depth: int) -> list[str]:
    """The file's lines with every `Include` replaced by the lines of the files it names (glob,
    relative to ~/.ssh), as OpenSSH reads them; an Include inside a Host or Match block keeps the
    lines after it in that block."""
    if depth > MAX_INCLUDE_DEPTH:
        raise UsageError(f"{path}: Include nested more than {MAX_INCLUDE_DEPTH} deep")
    out: list[str] = []
    block = ""
    for line in path.read_text(encoding="utf-8").splitlines():
        found = _INCLUDE.match(line)
        if not found:
            if _BLOCK.match(line):
                block = line
            out.append(line)
            continue
        for word in shlex.split(found.group(1)):
            pattern = Path(word).expanduser()
            if not pattern.is_absolute():
                pattern = Path.home() / ".ssh" / pattern
            for name in sorted(glob.glob(str(pattern))):
                if Path(name).is_file():
                    out += _expanded(Path(name), depth + 1)
        if block:
            out.append(block)
    return out


def _jump_target(text: str, config: SSHConfigFile, where: str, wait: float) -> Target:
    if "," in text:
        raise UsageError(f"{where}: ProxyJump {text!r} has several hops; relaunch goes through one jump host")
    try:
        spec = HostSpec.parse(text.removeprefix("ssh://"))
    except UsageError as exc:
        raise UsageError(f"{where}: ProxyJump {text!r}: {exc.message.removeprefix('bad HOST ')}") from None
    jc = config.lookup(spec.address)
    if jc.proxy_jump:
        raise UsageError(f"{where}: the jump host {spec.address} has a ProxyJump of its own ({jc.proxy_jump}); "
                         "relaunch goes through one jump host")
    return Target(address=jc.hostname, user=spec.user or jc.user or getpass.getuser(),
                  port=spec.port or jc.port or 22, key=jc.identity, key_only=jc.identity is None or jc.identities_only,
                  wait=wait,
                  alias=spec.address if jc.hostname != spec.address else None)


def resolve(spec: HostSpec, recipe: Layer, fallback: Layer, *, host_key: str | None = None,
            wait: float = 300, config: SSHConfigFile | None = None) -> Target:
    """HOST > the recipe > the ssh config > `fallback` (the provider preset, else the defaults)."""
    config = config if config is not None else SSHConfigFile(config_path())
    hc = config.lookup(spec.address)
    user = spec.user or recipe.user or hc.user or fallback.user
    port = spec.port or recipe.port or hc.port or fallback.port
    assert user is not None and port is not None, "the fallback layer gives every value"
    where = f"{config.path}: Host {spec.address}"
    return Target(
        address=hc.hostname, user=user, port=port, key=recipe.key or hc.identity, host_key=host_key, wait=wait,
        # the recipe's key is the only one offered; an IdentityFile joins the agent's keys, as in ssh
        key_only=recipe.key is not None or hc.identity is None or hc.identities_only,
        alias=spec.address if hc.hostname != spec.address else None,
        jump=_jump_target(hc.proxy_jump, config, where, wait) if hc.proxy_jump else None,
    )
