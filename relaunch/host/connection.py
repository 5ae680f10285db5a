"""SSH connections to an instance: patient while it boots, strict about host keys.

`connect()` returns a `Remote`: one paramiko transport (opened through Fabric) with keepalive,
byte-exact command execution, SFTP uploads with safe modes, and the matching `ssh` argv for
subprocesses (rsync) that use the same known_hosts file with strict checking.
"""

from __future__ import annotations

import logging
import os
import select
import shlex
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import paramiko
from fabric import Connection
from paramiko.ssh_exception import NoValidConnectionsError

from ..errors import ConnectError, HostKeyError, RelaunchError, remote_failure
from .known_hosts import KnownHosts, TrustPolicy, fingerprint
from .spec import Target

log = logging.getLogger("relaunch.host")

KEEPALIVE = 10
# A dead peer (preempted instance, pulled cable) must fail a step in seconds, not after the
# kernel's ~15 minutes of TCP retransmissions: keepalives keep data in flight and
# TCP_USER_TIMEOUT aborts the socket when it stays unacknowledged.
TCP_USER_TIMEOUT_MS = 30_000
AUTH_GRACE = 60.0


@dataclass
class ExecResult:
    command: str
    status: int | None
    stdout: bytes
    stderr: bytes

    @property
    def ok(self) -> bool:
        return self.status == 0

    @property
    def text(self) -> str:
        return self.stdout.decode(errors="replace")

    @property
    def output(self) -> str:
        return (self.stdout + b"\n" + self.stderr).decode(errors="replace")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, NoValidConnectionsError):
        return "connection refused (sshd not listening yet?)"
    if isinstance(exc, paramiko.AuthenticationException):
        return f"authentication failed ({exc}); the key may not be installed yet"
    if isinstance(exc, paramiko.SSHException) and "banner" in str(exc):
        return "port open but no SSH banner yet (sshd starting?)"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return "timed out"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return f"{type(exc).__name__}: {exc}"


def _hint_for(exc: BaseException | None) -> str:
    if isinstance(exc, paramiko.AuthenticationException):
        return "check ssh.user (or USER@ in HOST) and ssh.key; `relaunch providers` lists each provider's user"
    return "check the address and port, that the instance is running, and ssh.wait"


class Remote:
    """An open SSH connection to one instance."""

    def __init__(self, target: Target, conn: Connection, known_hosts: Path, home: str = "") -> None:
        self.target = target
        self.conn = conn
        self.known_hosts = known_hosts
        self.home = home
        self._sftp: paramiko.SFTPClient | None = None

    @property
    def label(self) -> str:
        return self.target.label

    @property
    def alive(self) -> bool:
        transport = self.conn.transport
        return transport is not None and transport.is_active()

    @property
    def transport(self) -> paramiko.Transport:
        transport = self.conn.transport
        if transport is None or not transport.is_active():
            raise ConnectError(f"{self.label}: the SSH connection was lost")
        return transport

    def close(self) -> None:
        try:
            if self._sftp is not None:
                self._sftp.close()
            self.conn.close()
        except Exception:  # closing a dead connection may raise anything; nothing to save
            log.debug("close failed", exc_info=True)

    def __enter__(self) -> Remote:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- commands -------------------------------------------------------------------------
    def exec(self, command: str, stdin: bytes | None = None, timeout: float | None = None,
             on_output: Callable[[bytes], None] | None = None) -> ExecResult:
        """Run `command` through the login shell; bytes in, bytes out, never a pty."""
        try:
            chan = self.transport.open_session()
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise ConnectError(f"{self.label}: the SSH connection was lost ({_describe(exc)})") from exc
        out, err = bytearray(), bytearray()
        deadline = time.monotonic() + timeout if timeout else None
        try:
            chan.exec_command(command)
            if stdin is not None:
                chan.sendall(stdin)
            chan.shutdown_write()
            while True:
                if chan.recv_ready():
                    data = chan.recv(65536)
                    out += data
                    if on_output:
                        on_output(data)
                elif chan.recv_stderr_ready():
                    data = chan.recv_stderr(65536)
                    err += data
                    if on_output:
                        on_output(data)
                elif chan.exit_status_ready():
                    break
                elif chan.closed or not self.transport.is_active():
                    return ExecResult(command, None, bytes(out), bytes(err))
                else:
                    if deadline and time.monotonic() > deadline:
                        chan.close()
                        return ExecResult(command, None, bytes(out), bytes(err) + b"\n(timed out)")
                    select.select([chan], [], [], 0.5)
            # drain what arrived together with the exit status
            while chan.recv_ready():
                out += chan.recv(65536)
            while chan.recv_stderr_ready():
                err += chan.recv_stderr(65536)
            return ExecResult(command, chan.recv_exit_status(), bytes(out), bytes(err))
        except (OSError, EOFError, paramiko.SSHException) as exc:
            log.debug("exec failed: %s", command, exc_info=True)
            return ExecResult(command, None, bytes(out), bytes(err) + f"\n{_describe(exc)}".encode())
        finally:
            chan.close()

    def check(self, command: str, step: str, error: type[RelaunchError], stdin: bytes | None = None,
              display: str | None = None, hint: str | None = None, timeout: float | None = None,
              on_output: Callable[[bytes], None] | None = None) -> ExecResult:
        """Run and raise `error` (host, step, command, exit, last lines) unless it exits 0.

        `display` replaces the command in messages, for commands whose text is long or private.
        """
        result = self.exec(command, stdin=stdin, timeout=timeout, on_output=on_output)
        if result.status is None and not self.alive:
            # not the step's fault: the instance went away (a retry loop may wait for it)
            raise ConnectError(f"{self.label}: {step}: the SSH connection was lost", hint)
        if not result.ok:
            raise remote_failure(error, self.label, step, display or command, result.status, result.output,
                                 hint)
        return result

    # -- files ----------------------------------------------------------------------------
    @property
    def sftp(self) -> paramiko.SFTPClient:
        if self._sftp is None:
            self._sftp = paramiko.SFTPClient.from_transport(self.transport)
        assert self._sftp is not None
        return self._sftp

    def put_bytes(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Write a file on the instance; the mode is set before any byte is written.

        The file is written beside its final name and renamed, so a lost connection never
        leaves a half file where it would be used.
        """
        tmp = f"{path}.relaunch-tmp"
        with self.sftp.open(tmp, "wb") as handle:
            handle.chmod(mode)
            handle.write(data)
        self.sftp.posix_rename(tmp, path)

    def put_file(self, local: Path, path: str, mode: int | None = None) -> None:
        tmp = f"{path}.relaunch-tmp"
        self.sftp.put(str(local), tmp)
        self.sftp.chmod(tmp, mode if mode is not None else (local.stat().st_mode & 0o777))
        self.sftp.posix_rename(tmp, path)

    def expand(self, path: str) -> str:
        return expand_home(path, self.home)

    # -- subprocess ssh -------------------------------------------------------------------
    def ssh_argv(self) -> list[str]:
        """`ssh` with the same host-key file, strict checking and identity as this connection."""
        return ssh_argv(self.target, self.known_hosts)


def expand_home(path: str, home: str) -> str:
    """`~` and `~/x` on the instance, against its home (SFTP and quoted shell words do not expand it)."""
    if path == "~":
        return home
    if path.startswith("~/"):
        return home.rstrip("/") + path[1:]
    return path


def ssh_argv(target: Target, known_hosts: Path) -> list[str]:
    argv = [
        "ssh",
        "-o", f"UserKnownHostsFile={known_hosts}",
        "-o", "GlobalKnownHostsFile=/dev/null",
        "-o", "StrictHostKeyChecking=yes",
        "-o", "BatchMode=yes",
        "-o", "ConnectTimeout=20",
        "-o", "ServerAliveInterval=5",
        "-o", "ServerAliveCountMax=3",
        "-p", str(target.port),
        "-l", target.user,
    ]
    if target.key:
        argv += ["-i", str(Path(target.key).expanduser()), "-o", "IdentitiesOnly=yes"]
    return argv


def rsync_rsh(target: Target, known_hosts: Path) -> str:
    """The `-e` value for rsync (rsync splits it like a shell would)."""
    return shlex.join(ssh_argv(target, known_hosts))


def connect(target: Target, *, accept_new_host_key: bool = False, known_hosts: Path | None = None,
            say: Callable[[str], None] = lambda _m: None) -> Remote:
    """Open a connection, retrying while the instance boots, until `target.wait` runs out."""
    from ..paths import known_hosts_file

    path = known_hosts or known_hosts_file()
    known = KnownHosts(path)
    name = target.known_hosts_name
    if accept_new_host_key and known.forget(name):
        say(f"forgot the recorded host key of {name} (--accept-new-host-key)")
    recorded = known.recorded(name)

    connect_kwargs: dict[str, object] = {"banner_timeout": 15, "auth_timeout": 20}
    if target.key:
        key = Path(target.key).expanduser()
        if not key.is_file():
            raise ConnectError(f"ssh.key {key} does not exist", "fix ssh.key or leave it out to use ssh-agent")
        connect_kwargs.update(key_filename=[str(key)], allow_agent=False, look_for_keys=False)
    deadline = time.monotonic() + max(target.wait, 0)
    first_auth_failure: float | None = None
    delay, announced = 1.0, ""
    while True:
        conn = Connection(
            host=target.address,
            user=target.user,
            port=target.port,
            connect_timeout=15,
            connect_kwargs=connect_kwargs,
        )
        client = conn.client
        client.set_missing_host_key_policy(TrustPolicy(known, name, target.host_key, say))
        # With a pin, the pin decides (the policy checks it); otherwise the recorded key does.
        if target.host_key is None:
            for key in recorded:
                client.get_host_keys().add(name, key.get_name(), key)
        try:
            conn.open()
            transport = conn.transport
            assert transport is not None
            transport.set_keepalive(KEEPALIVE)
            sock = transport.sock
            if isinstance(sock, socket.socket) and hasattr(socket, "TCP_USER_TIMEOUT"):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, TCP_USER_TIMEOUT_MS)
            remote = Remote(target, conn, path)
            result = remote.exec('printf %s "$HOME"', timeout=60)
            if not result.ok or not result.text.startswith("/"):
                raise ConnectError(f"{target.label}: connected, but could not run a command: "
                                   f"{result.output.strip()[:200]}")
            remote.home = result.text
            return remote
        except paramiko.BadHostKeyException as exc:
            conn.close()
            raise HostKeyError(
                f"{target.label}: HOST KEY CHANGED: recorded {fingerprint(exc.expected_key)}, "
                f"the host now offers {fingerprint(exc.key)}; refusing to connect",
                "a new instance at a reused address has a new key: if you just rented it, run "
                "`relaunch up --accept-new-host-key`, or pin ssh.host_key from the provider's console",
            ) from None
        except HostKeyError:
            conn.close()
            raise
        except (NoValidConnectionsError, paramiko.SSHException, OSError, EOFError) as exc:
            conn.close()
            what = _describe(exc)
            remaining = deadline - time.monotonic()
            if isinstance(exc, paramiko.AuthenticationException):
                # cloud-init installs the key within a minute of sshd starting; a wrong key or
                # user should not keep the user waiting for all of ssh.wait
                first_auth_failure = first_auth_failure or time.monotonic()
                remaining = min(remaining, AUTH_GRACE - (time.monotonic() - first_auth_failure))
            if remaining <= 0:
                raise ConnectError(
                    f"{target.label}: could not connect within ssh.wait={target.wait:g}s: {what}",
                    _hint_for(exc),
                ) from None
            if what != announced:
                say(f"{target.label}: {what}; retrying for up to {remaining:.0f}s")
                announced = what
            log.debug("connect attempt failed", exc_info=True)
            time.sleep(min(delay, max(remaining, 0.1)))
            delay = min(delay * 1.6, 10.0)


def environ_secrets(names: list[str]) -> dict[str, str]:
    """The values of the recipe's `env.secrets`, from this machine's environment."""
    return {name: os.environ[name] for name in names if name in os.environ}
