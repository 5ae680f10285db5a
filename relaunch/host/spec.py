"""HOST on the command line: ADDRESS, USER@ADDRESS or USER@ADDRESS:PORT (IPv6 in brackets), where
ADDRESS may also be a `Host` alias of ~/.ssh/config; and the `Target` it resolves to."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import UsageError

_USER = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")
# a name or an IPv4 address; never a leading "-", which ssh would read as an option
_ADDR = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class HostSpec:
    address: str
    user: str | None = None
    port: int | None = None

    @classmethod
    def parse(cls, text: str) -> HostSpec:
        raw = text.strip()
        if not raw:
            raise UsageError("HOST is empty", "give ADDRESS, USER@ADDRESS, USER@ADDRESS:PORT or an ~/.ssh/config alias")
        user = None
        if "@" in raw:
            user, raw = raw.rsplit("@", 1)
            if not _USER.match(user):
                raise UsageError(f"bad user in HOST {text!r}: {user!r}")
        port_text = None
        if raw.startswith("["):
            end = raw.find("]")
            if end < 0:
                raise UsageError(f"bad HOST {text!r}: unclosed '[' around an IPv6 address")
            address, rest = raw[1:end], raw[end + 1 :]
            if rest:
                if not rest.startswith(":"):
                    raise UsageError(f"bad HOST {text!r}: expected ':PORT' after ']'")
                port_text = rest[1:]
            if not re.match(r"^[0-9A-Fa-f:.%a-z0-9]+$", address) or ":" not in address:
                raise UsageError(f"bad HOST {text!r}: {address!r} is not an IPv6 address")
        else:
            if raw.count(":") > 1:
                raise UsageError(f"bad HOST {text!r}", "put an IPv6 address in brackets: USER@[ADDR]:PORT")
            address, _, port_text = raw.partition(":")
            port_text = port_text or None
            if not _ADDR.match(address):
                raise UsageError(f"bad HOST {text!r}: {address!r} is not an address or host name")
        port = None
        if port_text is not None:
            if not port_text.isdigit() or not 0 < int(port_text) < 65536:
                raise UsageError(f"bad HOST {text!r}: port {port_text!r} is not a number from 1 to 65535")
            port = int(port_text)
        return cls(address=address, user=user, port=port)

    def __str__(self) -> str:
        addr = f"[{self.address}]" if ":" in self.address else self.address
        text = f"{self.user}@{addr}" if self.user else addr
        return f"{text}:{self.port}" if self.port else text


def valid_address(text: str) -> bool:
    """A host name, an IPv4 address or a bare IPv6 address: safe to hand to ssh as its host."""
    if ":" in text:
        return bool(re.match(r"^[0-9A-Fa-f:.]+(%[A-Za-z0-9_.-]+)?$", text))
    return bool(_ADDR.match(text))


def valid_user(text: str) -> bool:
    return bool(_USER.match(text))


@dataclass(frozen=True)
class Target:
    """Where to connect: the address and port actually contacted, as whom, with which key, and
    through which jump host, after HOST, the recipe and ~/.ssh/config are combined (see
    `sshconfig.resolve`). Host keys are recorded and checked under `known_hosts_name`, which
    names what is contacted, never the alias the user typed."""

    address: str
    user: str
    port: int
    key: str | None = None
    host_key: str | None = None
    wait: float = 300
    key_only: bool = True              # offer `key` alone (ssh's IdentitiesOnly); else ssh-agent's keys too
    alias: str | None = None           # the ~/.ssh/config Host name the user gave, when it differs
    jump: Target | None = None         # ProxyJump: connect there first, then through it
    local: bool = False                # the node relaunch itself runs on (`relaunch run`): no SSH at all

    @property
    def endpoint(self) -> str:
        addr = f"[{self.address}]" if ":" in self.address else self.address
        return f"{self.user}@{addr}" + (f":{self.port}" if self.port != 22 else "")

    @property
    def label(self) -> str:
        """What the user sees: `user@addr[:port]`, or `alias (user@addr[:port])`."""
        return f"{self.alias} ({self.endpoint})" if self.alias else self.endpoint

    @property
    def known_hosts_name(self) -> str:
        """How OpenSSH (and paramiko) name this host in known_hosts."""
        return self.address if self.port == 22 else f"[{self.address}]:{self.port}"
