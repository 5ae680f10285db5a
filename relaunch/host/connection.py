"""SSH connections to an instance: patient while it boots, strict about host keys, and every
command with a deadline and in a process group of its own that relaunch can end.

`connect()` returns a `Remote`: one paramiko transport (opened through Fabric) with keepalive.
`Remote.exec` runs a command line exactly as given, through `exec bash -c`, so that the shell
sshd starts for it leads a process group (sshd puts each session in a new one) whose id comes
back first on stderr: a deadline, a Ctrl-C or a failed sibling step ends that whole group on
the instance, not just the SSH channel. Files go up through the same commands (`upload_command`),
so what `relaunch plan` shows is all that ever runs.
"""

from __future__ import annotations

import errno
import logging
import os
import re
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

from .. import processes
from ..errors import ConnectError, HostKeyError, Interrupted, shorten
from ..retry import retrying
from .known_hosts import KnownHosts, TrustPolicy, fingerprint
from .spec import Target

log = logging.getLogger("relaunch.host")

KEEPALIVE = 10
# A dead peer (preempted instance, pulled cable) must fail a step in seconds, not after the
# kernel's ~15 minutes of TCP retransmissions: keepalives keep data in flight and
# TCP_USER_TIMEOUT aborts the socket when it stays unacknowledged.
TCP_USER_TIMEOUT_MS = 30_000
# cloud-init installs the key a few seconds after sshd starts; a key that is still refused after
# this long is the wrong key or user, and the user hears so at once instead of after ssh.wait
AUTH_GRACE = 20.0
PGID_LINE = re.compile(rb"relaunch-pgid (\d+)\n")
HOME_COMMAND = 'printf %s "$HOME"'


@dataclass
class ExecResult:
    command: str
    status: int | None              # None: no exit status (connection lost, deadline, cancelled)
    stdout: bytes
    stderr: bytes
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.status == 0

    @property
    def text(self) -> str:
        return self.stdout.decode(errors="replace")

    @property
    def output(self) -> str:
        return (self.stdout + b"\n" + self.stderr).decode(errors="replace")


def wire(command: str) -> str:
    """The command line sshd is given for `command`: bash, leading its own process group, says
    that group's id on stderr, then runs the command unchanged."""
    return "exec bash -c " + shlex.quote("printf 'relaunch-pgid %s\\n' \"$$\" >&2\n" + command)


def upload_command(path: str, mode: int) -> str:
    """Write stdin to `path` on the instance: mode set before any byte lands, renamed into place
    at the end, so a lost connection never leaves a half file where it would be used."""
    q, tmp = shlex.quote, f"{path}.relaunch-tmp"
    folder = path.rsplit("/", 1)[0] or "/"
    return (f"umask 077 && mkdir -p -- {q(folder)} && cat > {q(tmp)} && chmod {mode:o} -- {q(tmp)} && "
            f"mv -f -- {q(tmp)} {q(path)}")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, NoValidConnectionsError):
        causes = list(exc.errors.values())
        if causes and all(getattr(c, "errno", None) != errno.ECONNREFUSED for c in causes):
            return _describe(causes[0])
        return "connection refused (sshd not listening yet?)"
    if isinstance(exc, paramiko.AuthenticationException):
        return f"authentication failed ({exc}); the key may not be installed yet"
    if isinstance(exc, paramiko.SSHException) and "banner" in str(exc):
        return "port open but no SSH banner yet (sshd starting?)"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return "timed out"
    if isinstance(exc, OSError) and exc.errno in (errno.EINVAL, errno.ENETUNREACH, errno.EHOSTUNREACH):
        # a blackhole or missing route answers EINVAL at once: to the user, the host is unreachable
        return "no route to the host (unreachable)"
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

    @property
    def label(self) -> str:
        return self.target.label

    @property
    def alive(self) -> bool:
        transport = self.conn.transport
        return transport is not None and transport.is_active()

    def close(self) -> None:
        try:
            self.conn.close()
        except Exception:  # closing a dead connection may raise anything; nothing to save
            log.debug("close failed", exc_info=True)

    def __enter__(self) -> Remote:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- commands -------------------------------------------------------------------------
    def exec(self, command: str, *, deadline: float, stdin: bytes | Path | None = None,
             on_output: Callable[[bytes], None] | None = None,
             cancelled: Callable[[], bool] = processes.CANCEL.is_set) -> ExecResult:
        """Run `command` (bytes in, bytes out, no pty). At the deadline, or when `cancelled()`
        turns true, its process group on the instance is ended: status None, and on cancel
        Interrupted is raised once the group is gone."""
        transport = self.conn.transport
        if transport is None or not transport.is_active():
            return ExecResult(command, None, b"", b"the SSH connection was lost")
        log.debug("exec on %s: %s", self.label, command)
        try:
            chan = transport.open_session()
            chan.exec_command(wire(command))
        except (paramiko.SSHException, OSError, EOFError) as exc:
            return ExecResult(command, None, b"", f"the SSH connection was lost ({_describe(exc)})".encode())
        out, err = bytearray(), bytearray()
        pgid: int | None = None
        end = time.monotonic() + deadline
        feeding = _Feeder(chan, stdin)
        try:
            while True:
                if cancelled():
                    self._end_group(pgid)
                    raise Interrupted("interrupted")
                if time.monotonic() > end:
                    self._end_group(pgid)
                    return ExecResult(command, None, bytes(out), bytes(err) + b"\n(deadline reached)", True)
                feeding.step()
                progressed = False
                if chan.recv_ready():
                    data = chan.recv(65536)
                    out += data
                    progressed = True
                    if on_output:
                        on_output(data)
                if chan.recv_stderr_ready():
                    data = chan.recv_stderr(65536)
                    progressed = True
                    if pgid is None:
                        err += data
                        found = PGID_LINE.search(err)
                        if found:
                            pgid = int(found.group(1))
                            del err[found.start():found.end()]
                            data = bytes(err)
                        else:
                            data = b""
                    else:
                        err += data
                    if on_output and data:
                        on_output(data)
                if progressed:
                    continue
                if chan.exit_status_ready():
                    break
                if chan.closed or not transport.is_active():
                    return ExecResult(command, None, bytes(out), bytes(err) + b"\nthe SSH connection was lost")
                select.select([chan], [], [], 0.2 if feeding.done else 0.01)
            while chan.recv_ready():
                out += chan.recv(65536)
            while chan.recv_stderr_ready():
                err += chan.recv_stderr(65536)
            if pgid is None and PGID_LINE.search(err):
                found = PGID_LINE.search(err)
                assert found is not None
                del err[found.start():found.end()]
            return ExecResult(command, chan.recv_exit_status(), bytes(out), bytes(err))
        except KeyboardInterrupt:
            self._end_group(pgid)
            raise
        except (OSError, EOFError, paramiko.SSHException) as exc:
            log.debug("exec failed: %s", command, exc_info=True)
            return ExecResult(command, None, bytes(out), bytes(err) + f"\n{_describe(exc)}".encode())
        finally:
            feeding.close()
            chan.close()

    def _end_group(self, pgid: int | None) -> None:
        """TERM, then KILL, to a command's process group on the instance (bounded: a few seconds)."""
        if pgid is None or not self.alive:
            return
        script = (f"kill -TERM -- -{pgid} 2>/dev/null || exit 0; "
                  f"for i in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20; do "
                  f"kill -0 -- -{pgid} 2>/dev/null || exit 0; sleep 0.1; done; kill -KILL -- -{pgid} 2>/dev/null; true")
        try:
            chan = self.conn.transport.open_session()  # type: ignore[union-attr]
            chan.settimeout(5)
            chan.exec_command(script)
            deadline = time.monotonic() + 5
            while not chan.exit_status_ready() and time.monotonic() < deadline:
                time.sleep(0.05)
            chan.close()
        except Exception:  # the connection is going away: nothing more to do from here
            log.debug("could not end process group %s on %s", pgid, self.label, exc_info=True)

    def expand(self, path: str) -> str:
        return expand_home(path, self.home)


class _Feeder:
    """Writes stdin to the channel in pieces between reads, so a large upload never blocks
    the loop that watches deadlines and output."""

    def __init__(self, chan: paramiko.Channel, stdin: bytes | Path | None) -> None:
        self.chan = chan
        self.file = open(stdin, "rb") if isinstance(stdin, Path) else None
        self.buffer = stdin if isinstance(stdin, bytes) else b""
        self.offset = 0
        self.done = stdin is None
        if self.done:
            chan.shutdown_write()

    def step(self) -> None:
        if self.done:
            return
        if self.offset >= len(self.buffer) and self.file is not None:
            self.buffer, self.offset = self.file.read(1 << 20), 0
        if self.offset >= len(self.buffer):
            self.done = True
            self.chan.shutdown_write()
            self.close()
            return
        if self.chan.send_ready():
            self.offset += self.chan.send(self.buffer[self.offset:self.offset + 65536])

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def expand_home(path: str, home: str) -> str:
    """`~` and `~/x` on the instance, against its home (quoted shell words do not expand it)."""
    if path == "~":
        return home
    if path.startswith("~/"):
        return home.rstrip("/") + path[1:]
    return path


def ssh_argv(target: Target, known_hosts: Path) -> list[str]:
    """`ssh` with the same host-key file, strict checking and identity as the connection."""
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


class _Refused(Exception):
    """One connection attempt failed in a way worth another (boot, network, key not installed yet)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(_describe(cause))
        self.cause = cause


def connect(target: Target, *, accept_new_host_key: bool = False, known_hosts: Path | None = None,
            say: Callable[[str], None] = lambda _m: None) -> Remote:
    """Open a connection, retrying while the instance boots, until `target.wait` runs out."""
    from ..paths import known_hosts_file

    path = known_hosts or known_hosts_file()
    known = KnownHosts(path)
    name = target.known_hosts_name
    if accept_new_host_key and known.forget(name):
        say(f"forgot the recorded host key of {name} (--accept-new-host-key)")

    connect_kwargs: dict[str, object] = {"banner_timeout": 15, "auth_timeout": 20}
    if target.key:
        key = Path(target.key).expanduser()
        if not key.is_file():
            raise ConnectError(f"ssh.key {key} does not exist", "fix ssh.key or leave it out to use ssh-agent")
        connect_kwargs.update(key_filename=[str(key)], allow_agent=False, look_for_keys=False)
    first_auth_failure: list[float] = []
    announced: list[str] = []

    def attempt() -> Remote:
        processes.check_cancel()
        conn = Connection(host=target.address, user=target.user, port=target.port, connect_timeout=15,
                          connect_kwargs=connect_kwargs)
        client = conn.client
        client.set_missing_host_key_policy(TrustPolicy(known, name, target.host_key, say))
        # With a pin, the pin decides (the policy checks it); otherwise the recorded key does.
        if target.host_key is None:
            for recorded in known.recorded(name):
                client.get_host_keys().add(name, recorded.get_name(), recorded)
        try:
            conn.open()
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
            log.debug("connect attempt failed", exc_info=True)
            if isinstance(exc, paramiko.AuthenticationException) and not first_auth_failure:
                first_auth_failure.append(time.monotonic())
            raise _Refused(exc) from exc
        transport = conn.transport
        assert transport is not None
        transport.set_keepalive(KEEPALIVE)
        sock = transport.sock
        if isinstance(sock, socket.socket) and hasattr(socket, "TCP_USER_TIMEOUT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, TCP_USER_TIMEOUT_MS)
        remote = Remote(target, conn, path)
        result = remote.exec(HOME_COMMAND, deadline=60)
        if not result.ok or not result.text.startswith("/"):
            conn.close()
            raise ConnectError(f"{target.label}: connected, but could not run a command: "
                               f"{shorten(result.output, 200)}")
        remote.home = result.text
        return remote

    def auth_left(exc: BaseException) -> float | None:
        # cloud-init installs the key within a minute of sshd starting; a wrong key or user
        # should not keep the user waiting for all of ssh.wait
        if isinstance(exc, _Refused) and isinstance(exc.cause, paramiko.AuthenticationException):
            return AUTH_GRACE - (time.monotonic() - first_auth_failure[0])
        return None

    def on_retry(exc: BaseException, seconds: float) -> None:
        what = str(exc)
        if not announced or announced[-1] != what:
            say(f"{target.label}: {what}; retrying")
            announced.append(what)

    try:
        return retrying(attempt, transient=lambda e: isinstance(e, _Refused), within=max(target.wait, 0),
                        first=1.0, most=10.0, stop_early=auth_left, on_retry=on_retry)
    except _Refused as exc:
        if isinstance(exc.cause, paramiko.AuthenticationException):
            raise ConnectError(
                f"{target.label}: authentication refused for user {target.user}"
                + (f" with key {target.key}" if target.key else " (ssh-agent and default keys)"),
                _hint_for(exc.cause)) from None
        raise ConnectError(f"{target.label}: could not connect within ssh.wait={target.wait:g}s: {exc}",
                           _hint_for(exc.cause)) from None


def environ_secrets(names: list[str]) -> dict[str, str]:
    """The values of the recipe's `env.secrets`, from this machine's environment."""
    return {name: os.environ[name] for name in names if name in os.environ}
