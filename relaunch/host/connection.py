"""SSH connections to an instance: patient while it boots, quick about what waiting cannot mend,
strict about host keys.

`connect()` returns a `Remote` (remote.py: the commands run on it): one paramiko transport
(opened through Fabric) with keepalive.
"""

from __future__ import annotations

import base64
import errno
import logging
import os
import re
import shlex
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import paramiko
from fabric import Config, Connection
from paramiko.ssh_exception import NoValidConnectionsError

from .. import processes
from ..errors import ConnectError, HostKeyError, shorten
from ..retry import retrying
from .known_hosts import KnownHosts, TrustPolicy, fingerprint
from .remote import Remote, describe_failure
from .spec import Target
from .ssh_argv import DEFAULT_KEYS

log = logging.getLogger("relaunch.host")

KEEPALIVE = 10
# A dead peer (preempted instance, pulled cable) must fail a step in seconds, not after the
# kernel's ~15 minutes of TCP retransmissions: keepalives keep data in flight and
# TCP_USER_TIMEOUT aborts the socket when it stays unacknowledged.
TCP_USER_TIMEOUT_MS = 30_000
# cloud-init installs the key a few seconds after sshd starts; a key that is still refused after
# this long is the wrong key or user, and the user hears so at once instead of after ssh.wait
AUTH_GRACE = 20.0
# while a connection waits, a line this often says for what, how long is left, and how to stop
PROGRESS_EVERY = 15.0
HOME_COMMAND = 'printf %s "$HOME"'
# paramiko's words when it had no key at all to offer (no key file, none in ssh-agent or ~/.ssh)
NO_KEY = "No authentication methods available"
KEY_HINT = ("--set ssh.key=PATH (or ssh.key in the recipe) names the key this instance accepts; or load it into "
            "ssh-agent with ssh-add PATH")

# What one failed attempt met, as far as waiting goes: "no key" and "no route" never mend; "auth",
# "refused" and "unreachable" mend only on an instance that is still booting (sshd not started, the
# key not installed by cloud-init yet, the instance not on its network yet); anything else ("wait":
# a timeout, no banner yet, a reset) may mend on any instance: an overloaded sshd, a network blip.
NEVER = frozenset({"no key", "no route"})
WHILE_BOOTING = frozenset({"auth", "refused", "unreachable"})


def _kind(cause: BaseException) -> str:
    if isinstance(cause, paramiko.AuthenticationException):
        return "auth"
    if isinstance(cause, paramiko.SSHException) and str(cause) == NO_KEY:
        return "no key"
    if isinstance(cause, paramiko.ChannelException):    # the jump host could not reach it
        return "refused"
    if isinstance(cause, NoValidConnectionsError):      # paramiko's refused or host unreachable
        refused = any(getattr(c, "errno", None) == errno.ECONNREFUSED for c in cause.errors.values())
        return "refused" if refused else "unreachable"
    if isinstance(cause, OSError) and cause.errno in (errno.ENETUNREACH, errno.EINVAL):
        return "no route"                               # no route on this machine (EINVAL: a blackhole)
    return "wait"


def _hint_for(exc: BaseException | None, is_jump: bool = False) -> str:
    if is_jump and isinstance(exc, paramiko.AuthenticationException):
        return "check the jump host's User and IdentityFile in your ssh config, or load its key into ssh-agent"
    if is_jump:
        return "check the jump host's HostName and Port in your ssh config, and that it is running"
    if isinstance(exc, paramiko.AuthenticationException):
        return ("check the user (the USER@ in the provider's connect command: give it in HOST or ssh.user; "
                f"`relaunch providers` lists each provider's) and the key: {KEY_HINT}")
    return ("check the address and the port (the provider shows them as root@ADDRESS:PORT: give that as HOST), "
            "that the instance is running, and ssh.wait")


class _Refused(Exception):
    """One connection attempt failed; `kind` says whether waiting may mend it (see NEVER)."""

    def __init__(self, cause: BaseException, who: str, is_jump: bool = False) -> None:
        super().__init__(f"{who}: {describe_failure(cause)}")
        self.cause = cause
        self.who = who
        self.is_jump = is_jump
        self.kind = _kind(cause)

    def mendable(self, booting: bool) -> bool:
        """Worth another attempt: an instance that is still booting (`up`) may yet start sshd or
        get its key; one expected to be running (every other command), and a jump host (yours,
        not a fresh instance), refuse for good."""
        if self.kind in NEVER:
            return False
        return self.kind not in WHILE_BOOTING or (booting and not self.is_jump)


class _Waiting:
    """What the user hears while `connect` waits: each new reason once as it comes, and every
    PROGRESS_EVERY seconds after the last line, what is awaited, the time left and that Ctrl-C
    stops it (from a thread of its own: one attempt may block for up to a minute)."""

    def __init__(self, target: Target, say: Callable[[str], None]) -> None:
        self.target, self.say = target, say
        self.started = self.said = time.monotonic()
        self.why = self.of = ""
        self.until = 0.0
        self.heard: set[str] = set()
        self.done = threading.Event()
        self.ticker: threading.Thread | None = None

    def failed(self, exc: BaseException, until: float | None = None, of: str = "") -> None:
        """`until`, `of`: when this kind of failure stops being waited for, and what that limit
        is, when it comes before ssh.wait's end (a refused key's grace)."""
        self.why = describe_failure(exc.cause) if isinstance(exc, _Refused) else str(exc)
        end = self.started + self.target.wait
        self.until, self.of = (until, of) if until is not None and until < end else \
            (end, f"ssh.wait={self.target.wait:g}s")
        if str(exc) not in self.heard:                 # alternating reasons are each said once
            self.heard.add(str(exc))
            self._say(f"{exc}; retrying")
        if self.ticker is None:
            self.ticker = threading.Thread(target=self._tick, name="connect-progress", daemon=True)
            self.ticker.start()

    def _tick(self) -> None:
        while not self.done.wait(max(self.said + PROGRESS_EVERY - time.monotonic(), 0.1)):
            if time.monotonic() - self.said >= PROGRESS_EVERY - 0.1:
                left = max(self.until - time.monotonic(), 0)
                self._say(f"{self.target.label}: still waiting for SSH: {self.why}; {left:.0f}s left of "
                          f"{self.of}, Ctrl-C stops")

    def _say(self, text: str) -> None:
        self.said = time.monotonic()
        self.say(text)

    def close(self) -> None:
        self.done.set()


def public_blob(key: Path) -> bytes | None:
    """The public half of a private key file, as ssh finds it: `KEY.pub` beside it, else the
    header of OpenSSH's own format (unencrypted even when the key has a passphrase)."""
    pub = key.with_name(key.name + ".pub")
    try:
        if pub.is_file():
            fields = pub.read_text().split()
            return base64.b64decode(fields[1]) if len(fields) >= 2 else None
        text = key.read_text(errors="replace")
    except (OSError, ValueError):
        return None
    found = re.search(r"-----BEGIN OPENSSH PRIVATE KEY-----(.*?)-----END", text, re.S)
    if not found:
        return None
    try:
        data = base64.b64decode("".join(found.group(1).split()))
        magic = b"openssh-key-v1\0"
        if not data.startswith(magic):
            return None
        msg = paramiko.Message(data[len(magic):])
        for _ in range(3):          # cipher, kdf, kdf options
            msg.get_string()
        return msg.get_binary() if msg.get_int() >= 1 else None
    except (ValueError, paramiko.SSHException, IndexError):
        return None


class _Agent:
    """ssh-agent (SSH_AUTH_SOCK), asked only when a key file cannot be used by itself."""

    def __init__(self) -> None:
        self.agent: paramiko.Agent | None = None

    def find(self, blob: bytes | None) -> paramiko.AgentKey | None:
        if blob is None:
            return None
        try:
            if self.agent is None:
                self.agent = paramiko.Agent()
            return next((k for k in self.agent.get_keys() if blob in (k.blob, k.asbytes())), None)
        except (paramiko.SSHException, OSError):   # not an agent at SSH_AUTH_SOCK, or it went away
            log.debug("ssh-agent did not answer", exc_info=True)
            return None

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()


def _auth_kwargs(target: Target, agent: _Agent) -> dict[str, object]:
    """How paramiko authenticates to `target`, as `ssh` does with the same options: without a
    key, ssh-agent and the default keys; with one, that key, from the file or, when it has a
    passphrase, from ssh-agent (relaunch never asks for passphrases), and the agent's other keys
    too unless `key_only` (IdentitiesOnly)."""
    if not target.key:
        return {}
    key = Path(target.key).expanduser()
    if not key.is_file():
        raise ConnectError(f"ssh.key {key} does not exist", "fix ssh.key or leave it out to use ssh-agent")
    only: dict[str, object] = {"look_for_keys": False, **({"allow_agent": False} if target.key_only else {})}
    try:
        paramiko.PKey.from_path(key)
    except Exception as exc:  # a passphrase (TypeError from cryptography), or a kind paramiko cannot read
        held = agent.find(public_blob(key))
        if held is not None:
            log.debug("key %s: using its ssh-agent identity (%s)", key, type(exc).__name__)
            return {"pkey": held, **only}
        if not target.key_only:
            return only                  # as ssh does: the agent's keys, without this one
        locked = isinstance(exc, (TypeError, paramiko.PasswordRequiredException))
        why = "has a passphrase" if locked else f"cannot be read ({exc})"
        where = "no ssh-agent is running (SSH_AUTH_SOCK is not set)" if not os.environ.get("SSH_AUTH_SOCK") \
            else "ssh-agent does not hold it"
        raise ConnectError(f"the key {key} {why} and {where}",
                           f"load it into ssh-agent first: ssh-add {shlex.quote(str(key))}") from None
    return {"key_filename": [str(key)], **only}


def _open(target: Target, what: str, known: KnownHosts, auth: dict[str, object], say: Callable[[str], None], *,
          is_jump: bool = False, sock: object = None, first_auth_failure: list[float] | None = None,
          replace: bool = False) -> Connection:
    """One connection attempt to one hop, its host key checked under the name of what is
    contacted (`[address]:port`): the recorded key, else the pin, else trust on first use.
    `replace` (--accept-new-host-key): the recorded key is replaced by the one the host offers,
    only once it offers one (a failure before that leaves the file as it was)."""
    name = target.known_hosts_name
    # Fabric must not read ~/.ssh/config itself: `target` is already resolved from it, and a
    # second resolution would contact another address than the one whose key is checked.
    config = Config(ssh_config=paramiko.SSHConfig())
    connect_kwargs: dict[str, object] = {"banner_timeout": 15, "auth_timeout": 20, **auth}
    if sock is not None:
        connect_kwargs["sock"] = sock
    conn = Connection(host=target.address, user=target.user, port=target.port, connect_timeout=15,
                      connect_kwargs=connect_kwargs, config=config)
    client = conn.client
    shown = ("jump host " if is_jump else "") + (f"{name} ({target.alias})" if target.alias else name)
    replacing = replace and bool(known.recorded(name))
    client.set_missing_host_key_policy(TrustPolicy(known, name, target.host_key, say, shown, replacing))
    # With a pin, the pin decides (the policy checks it); otherwise the recorded key does.
    if target.host_key is None and not replace:
        for recorded in known.recorded(name):
            client.get_host_keys().add(name, recorded.get_name(), recorded)
    try:
        conn.open()
    except paramiko.BadHostKeyException as exc:
        _discard(conn)
        raise HostKeyError(
            f"{what}: HOST KEY CHANGED: recorded {fingerprint(exc.expected_key)} for {name}, "
            f"the host now offers {fingerprint(exc.key)}; refusing to connect",
            _changed_key_hint(is_jump, name, known.path),
        ) from None
    except HostKeyError:
        _discard(conn)
        raise
    except (NoValidConnectionsError, paramiko.SSHException, OSError, EOFError) as exc:
        _discard(conn)
        log.debug("connect attempt to %s failed", what, exc_info=True)
        if isinstance(exc, paramiko.AuthenticationException) and first_auth_failure is not None \
                and not first_auth_failure:
            first_auth_failure.append(time.monotonic())
        raise _Refused(exc, what, is_jump) from exc
    transport = conn.transport
    assert transport is not None
    transport.set_keepalive(KEEPALIVE)
    raw = transport.sock
    if isinstance(raw, socket.socket) and hasattr(socket, "TCP_USER_TIMEOUT"):
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, TCP_USER_TIMEOUT_MS)
    return conn


def _discard(conn: Connection) -> None:
    """Close a connection whose open() failed. Fabric's close() does nothing then (it knows no
    transport yet), but paramiko's stays open when the failure came after the TCP connect (a
    refused key, no key, a bad host key): sshd keeps each such connection, unauthenticated, for
    its LoginGraceTime (2 min), and past MaxStartups (10) drops new ones before their banner."""
    conn.close()
    conn.client.close()


def _changed_key_hint(is_jump: bool, name: str, path: Path) -> str:
    if is_jump:
        return (f"the jump host is yours, not a fresh instance: if it was really rebuilt, remove its old key with "
                f"ssh-keygen -R {shlex.quote(name)} -f {shlex.quote(str(path))}")
    return ("a new instance at a reused address has a new key: if you just rented it, run "
            "`relaunch up --accept-new-host-key`, or pin ssh.host_key from the provider's console")


def connect(target: Target, *, booting: bool = False, accept_new_host_key: bool = False,
            known_hosts: Path | None = None, say: Callable[[str], None] = lambda _m: None) -> Remote:
    """Open a connection (through the jump host, if any), retrying what waiting may mend until
    `target.wait` runs out. `booting`: the instance may still be booting (`up`), so a refused
    port is waited for, and a refused key for AUTH_GRACE; otherwise (an instance expected to
    run) they end the wait at once, as no key and no route always do."""
    from ..paths import known_hosts_file

    path = known_hosts or known_hosts_file()
    agent = _Agent()
    waiting = _Waiting(target, say)
    try:
        return _connect(target, KnownHosts(path), path, agent, say, accept_new_host_key, booting, waiting)
    finally:
        waiting.close()
        agent.close()


def _connect(target: Target, known: KnownHosts, path: Path, agent: _Agent, say: Callable[[str], None],
             accept_new_host_key: bool, booting: bool, waiting: _Waiting) -> Remote:
    jump = target.jump
    jump_what = f"jump host {jump.label}" if jump else ""
    auth = _auth_kwargs(target, agent)
    jump_auth = _auth_kwargs(jump, agent) if jump else {}
    first_auth_failure: list[float] = []

    def attempt() -> Remote:
        processes.check_cancel()
        hop: Connection | None = None
        sock = None
        if jump is not None:
            hop = _open(jump, jump_what, known, jump_auth, say, is_jump=True, first_auth_failure=first_auth_failure)
            try:
                assert hop.transport is not None
                sock = hop.transport.open_channel("direct-tcpip", (target.address, target.port), ("", 0),
                                                  timeout=15)
            except (paramiko.SSHException, OSError, EOFError) as exc:
                hop.close()
                log.debug("the jump host could not reach %s", target.label, exc_info=True)
                raise _Refused(exc, f"{target.label} through {jump_what}") from exc
        try:
            conn = _open(target, target.label, known, auth, say, sock=sock, first_auth_failure=first_auth_failure,
                         replace=accept_new_host_key)
        except BaseException:
            if hop is not None:
                hop.close()
            raise
        remote = Remote(target, conn, path, jump=hop)
        # a first command that comes back without its answer has been seen under heavy load: once more
        for _ in range(2):
            result = remote.exec(HOME_COMMAND, deadline=60)
            if result.ok and result.text.startswith("/"):
                remote.home = result.text
                return remote
            log.debug("%s: %s answered status %s, stdout %r, stderr %r", target.label, HOME_COMMAND,
                      result.status, result.stdout[:200], result.stderr[:200])
        remote.close()
        status = "no exit status" if result.status is None else f"exit {result.status}"
        raise ConnectError(f"{target.label}: connected, but could not run a command ({status}, its home "
                           f"{result.text[:60]!r}): {shorten(result.output, 200) or 'no output'}")

    def auth_left(exc: BaseException) -> float | None:
        # cloud-init installs the key within a minute of sshd starting; a wrong key or user
        # should not keep the user waiting for all of ssh.wait
        if isinstance(exc, _Refused) and exc.kind == "auth":
            return AUTH_GRACE - (time.monotonic() - first_auth_failure[0])
        return None

    def grace(exc: BaseException) -> tuple[float | None, str]:
        if isinstance(exc, _Refused) and exc.kind == "auth":
            return first_auth_failure[0] + AUTH_GRACE, f"the {AUTH_GRACE:g}s a new instance's key may take"
        return None, ""

    try:
        return retrying(attempt, transient=lambda e: isinstance(e, _Refused) and e.mendable(booting),
                        within=max(target.wait, 0), first=1.0, most=10.0, stop_early=auth_left,
                        on_retry=lambda exc, _s: waiting.failed(exc, *grace(exc)))
    except _Refused as exc:
        raise _failure(exc, jump if jump is not None and exc.is_jump else target, target.wait, booting) from None


def _failure(exc: _Refused, who: Target, wait: float, booting: bool) -> ConnectError:
    """The error that ends the wait (ssh.wait ran out, or waiting cannot mend it), with the fix in its hint."""
    if exc.kind == "auth":
        return ConnectError(f"{exc.who}: authentication refused for user {who.user}"
                            + (f" with key {who.key}" if who.key else " (ssh-agent and default keys)"),
                            _hint_for(exc.cause, exc.is_jump))
    if exc.kind == "no key":
        agent = "ssh-agent offers none" if os.environ.get("SSH_AUTH_SOCK") else \
            "no ssh-agent runs (SSH_AUTH_SOCK is not set)"
        why = (f"the key {who.key} cannot be used by itself (a passphrase?) and {agent}" if who.key else
               f"no ssh.key is set, {agent}, and ~/.ssh has no {', '.join(DEFAULT_KEYS[:-1])} or {DEFAULT_KEYS[-1]}")
        return ConnectError(f"{exc.who}: no SSH key to offer as {who.user}: {why}",
                            "give the jump host's key as its IdentityFile in your ssh config, or ssh-add it"
                            if exc.is_jump else KEY_HINT)
    if exc.mendable(booting):
        return ConnectError(f"{exc.who}: could not connect within ssh.wait={wait:g}s: "
                            f"{describe_failure(exc.cause)}", _hint_for(exc.cause, exc.is_jump))
    if exc.is_jump:
        return ConnectError(f"{exc.who}: {describe_failure(exc.cause)}", _hint_for(exc.cause, exc.is_jump))
    if exc.kind == "refused" and not isinstance(exc.cause, paramiko.ChannelException):
        return ConnectError(
            f"{exc.who}: connection refused on port {who.port}: the address answers, but no sshd listens there",
            "give the SSH port the provider shows (its connect command reads root@ADDRESS:PORT or ssh -p PORT) "
            "as HOST USER@ADDRESS:PORT or ssh.port; `relaunch up` waits for an instance that is still booting")
    if exc.kind == "no route":
        return ConnectError(f"{exc.who}: {describe_failure(exc.cause)}",
                            "check the address (the provider's console shows it) and that this machine reaches "
                            "its network (a private address needs its VPN)")
    return ConnectError(f"{exc.who}: {describe_failure(exc.cause)}",
                        "check the address (the provider's console shows it) and that the instance is running; "
                        "`relaunch up` waits for an instance that is still booting")
