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

import base64
import errno
import logging
import os
import re
import select
import shlex
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import paramiko
from fabric import Config, Connection
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
# paramiko waits an hour for a channel to open and forever for the answer to its exec request:
# a host that accepted TCP and then stopped answering (sshd stopped or wedged, a jump host that
# stopped relaying) keeps acknowledging packets, so TCP_USER_TIMEOUT never fires. A healthy sshd
# answers in milliseconds; past this the connection is closed.
CHANNEL_DEADLINE = 30.0
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


def wire(command: str, stdin: bool = True) -> str:
    """The command line sshd is given for `command`: bash, leading its own process group, says
    that group's id on stderr, then runs the command unchanged; without stdin, with /dev/null
    as its stdin, so that no EOF has to be sent for it (see _send_eof)."""
    first = "printf 'relaunch-pgid %s\\n' \"$$\" >&2" + ("" if stdin else "; exec </dev/null")
    return "exec bash -c " + shlex.quote(first + "\n" + command)


def _send_eof(chan: paramiko.Channel) -> None:
    """EOF on the channel's stdin, never after the channel is closed: paramiko's own
    shutdown_write() builds the EOF under the channel's lock and sends it after releasing it, so a
    CLOSE handled in between goes out first, and OpenSSH ends the whole connection ("ieof packet
    referred to nonexistent channel"; paramiko issues #1115, #1705). Sending it under the lock
    keeps it before any CLOSE."""
    with chan.lock:
        if chan.closed or chan.eof_sent or chan.transport is None:
            return
        message = chan._send_eof()
        if message is not None:
            chan.transport._send_user_message(message)


def upload_command(path: str, mode: int) -> str:
    """Write stdin to `path` on the instance: mode set before any byte lands, renamed into place
    at the end, so a lost connection never leaves a half file where it would be used."""
    q, tmp = shlex.quote, f"{path}.relaunch-tmp"
    folder = path.rsplit("/", 1)[0] or "/"
    return (f"umask 077 && mkdir -p -- {q(folder)} && cat > {q(tmp)} && chmod {mode:o} -- {q(tmp)} && "
            f"mv -f -- {q(tmp)} {q(path)}")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, paramiko.ChannelException):
        return f"the jump host could not open a connection to it ({str(exc.text).lower()})"
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


def _hint_for(exc: BaseException | None, is_jump: bool = False) -> str:
    if is_jump and isinstance(exc, paramiko.AuthenticationException):
        return "check the jump host's User and IdentityFile in your ssh config, or load its key into ssh-agent"
    if is_jump:
        return "check the jump host's HostName and Port in your ssh config, and that it is running"
    if isinstance(exc, paramiko.AuthenticationException):
        return "check ssh.user (or USER@ in HOST) and ssh.key; `relaunch providers` lists each provider's user"
    return "check the address and port, that the instance is running, and ssh.wait"


class Remote:
    """An open SSH connection to one instance."""

    def __init__(self, target: Target, conn: Connection, known_hosts: Path, home: str = "",
                 jump: Connection | None = None) -> None:
        self.target = target
        self.conn = conn
        self.known_hosts = known_hosts
        self.home = home
        self.jump = jump                # the jump host's connection, which carries `conn`

    @property
    def label(self) -> str:
        return self.target.label

    @property
    def alive(self) -> bool:
        transport = self.conn.transport
        return transport is not None and transport.is_active()

    def close(self) -> None:
        for conn in (self.conn, self.jump):
            if conn is None:
                continue
            try:
                conn.close()
            except Exception:  # closing a dead connection may raise anything; nothing to save
                log.debug("close failed", exc_info=True)

    def __enter__(self) -> Remote:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- commands -------------------------------------------------------------------------
    def exec(self, command: str, *, deadline: float, stdin: bytes | Path | None = None,
             on_output: Callable[[bytes], None] | None = None,
             cancelled: Callable[[], bool] = processes.interrupted) -> ExecResult:
        """Run `command` (bytes in, bytes out, no pty). At the deadline, or when `cancelled()`
        turns true, its process group on the instance is ended: status None, and on cancel
        Interrupted is raised once the group is gone."""
        transport = self.conn.transport
        if transport is None or not transport.is_active():
            return ExecResult(command, None, b"", b"the SSH connection was lost")
        log.debug("exec on %s: %s", self.label, command)
        try:
            chan = self._channel(transport, wire(command, stdin is not None), min(deadline, CHANNEL_DEADLINE))
        except _Unanswered as exc:
            return ExecResult(command, None, b"", str(exc).encode())
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

    def _channel(self, transport: paramiko.Transport, line: str, deadline: float) -> paramiko.Channel:
        """A session channel running `line`, opened and answered within `deadline` seconds, else
        _Unanswered with the connection closed (the host answers nothing on it any more)."""
        fired: list[bool] = []

        def give_up() -> None:
            fired.append(True)
            transport.close()

        timer = threading.Timer(deadline, give_up)
        timer.daemon = True
        timer.start()
        try:
            chan = transport.open_session(timeout=deadline + 5)     # the timer decides first
            chan.exec_command(line)
            return chan
        except (paramiko.SSHException, OSError, EOFError):
            if fired:
                via = f" through the jump host {self.target.jump.label}" if self.target.jump else ""
                raise _Unanswered(f"connected{via}, but the host did not answer opening an SSH channel within "
                                  f"{deadline:g}s (sshd hung or stopped?); the connection was closed") from None
            raise
        finally:
            timer.cancel()

    def _end_group(self, pgid: int | None) -> None:
        """TERM, then KILL, to a command's process group on the instance (bounded: a few seconds)."""
        if pgid is None or not self.alive:
            return
        script = (f"kill -TERM -- -{pgid} 2>/dev/null || exit 0; "
                  f"for i in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20; do "
                  f"kill -0 -- -{pgid} 2>/dev/null || exit 0; sleep 0.1; done; kill -KILL -- -{pgid} 2>/dev/null; true")
        try:
            chan = self._channel(self.conn.transport, script, 5)  # type: ignore[arg-type]
            chan.settimeout(5)
            deadline = time.monotonic() + 5
            while not chan.exit_status_ready() and time.monotonic() < deadline:
                time.sleep(0.05)
            chan.close()
        except Exception:  # the connection is going away: nothing more to do from here
            log.debug("could not end process group %s on %s", pgid, self.label, exc_info=True)

    def expand(self, path: str) -> str:
        return expand_home(path, self.home)


class _Unanswered(Exception):
    """The host did not answer opening a channel within its deadline; the connection is closed."""


class _Feeder:
    """Writes stdin to the channel in pieces between reads, so a large upload never blocks
    the loop that watches deadlines and output."""

    def __init__(self, chan: paramiko.Channel, stdin: bytes | Path | None) -> None:
        self.chan = chan
        self.file = open(stdin, "rb") if isinstance(stdin, Path) else None
        self.buffer = stdin if isinstance(stdin, bytes) else b""
        self.offset = 0
        self.done = stdin is None          # then the command reads /dev/null (wire): no EOF to send

    def step(self) -> None:
        if self.done:
            return
        if self.offset >= len(self.buffer) and self.file is not None:
            self.buffer, self.offset = self.file.read(1 << 20), 0
        if self.offset >= len(self.buffer):
            self.done = True
            _send_eof(self.chan)
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


def _ssh_options(target: Target, known_hosts: Path) -> list[str]:
    """`ssh` options for one hop: no ssh config read (`-F /dev/null`: the target is already
    resolved), relaunch's known_hosts with strict checking, and the resolved port, user and key."""
    argv = [
        "ssh", "-F", "/dev/null",
        "-o", f"UserKnownHostsFile={known_hosts}",
        "-o", "GlobalKnownHostsFile=/dev/null",
        "-o", "StrictHostKeyChecking=yes",
        "-o", "BatchMode=yes",
        "-o", "ConnectTimeout=20",
        "-o", "ServerAliveInterval=5",
        "-o", "ServerAliveCountMax=3",
        "-p", str(target.port),
        "-l", target.user,
    ]  # fmt: skip
    if target.key:
        # a key with a passphrase comes from ssh-agent (matched by the .pub beside it);
        # IdentitiesOnly: no other key of the agent is offered
        argv += ["-i", str(Path(target.key).expanduser())]
        argv += ["-o", "IdentitiesOnly=yes"] if target.key_only else []
    return argv


def ssh_argv(target: Target, known_hosts: Path) -> list[str]:
    """`ssh` with the same host-key file, strict checking, identity and jump host as the
    connection; the caller appends the resolved address (`target.address`)."""
    argv = _ssh_options(target, known_hosts)
    if target.jump is not None:
        # ProxyJump done by hand: OpenSSH's own -J would start the jump's ssh without these
        # options, checking its key against ~/.ssh/known_hosts instead of relaunch's file.
        # ssh expands %-tokens in a ProxyCommand: literal % in paths are doubled.
        hop = [a.replace("%", "%%") for a in _ssh_options(target.jump, known_hosts)]
        argv += ["-o", "ProxyCommand=" + shlex.join([*hop, "-W", "[%h]:%p", target.jump.address])]
    return argv


def rsync_rsh(target: Target, known_hosts: Path) -> str:
    """The `-e` value for rsync (rsync splits it like a shell would)."""
    return shlex.join(ssh_argv(target, known_hosts))


class _Refused(Exception):
    """One connection attempt failed in a way worth another (boot, network, key not installed yet)."""

    def __init__(self, cause: BaseException, who: str, is_jump: bool = False) -> None:
        super().__init__(f"{who}: {_describe(cause)}")
        self.cause = cause
        self.who = who
        self.is_jump = is_jump


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
        conn.close()
        raise HostKeyError(
            f"{what}: HOST KEY CHANGED: recorded {fingerprint(exc.expected_key)} for {name}, "
            f"the host now offers {fingerprint(exc.key)}; refusing to connect",
            _changed_key_hint(is_jump, name, known.path),
        ) from None
    except HostKeyError:
        conn.close()
        raise
    except (NoValidConnectionsError, paramiko.SSHException, OSError, EOFError) as exc:
        conn.close()
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


def _changed_key_hint(is_jump: bool, name: str, path: Path) -> str:
    if is_jump:
        return (f"the jump host is yours, not a fresh instance: if it was really rebuilt, remove its old key with "
                f"ssh-keygen -R {shlex.quote(name)} -f {shlex.quote(str(path))}")
    return ("a new instance at a reused address has a new key: if you just rented it, run "
            "`relaunch up --accept-new-host-key`, or pin ssh.host_key from the provider's console")


def connect(target: Target, *, accept_new_host_key: bool = False, known_hosts: Path | None = None,
            say: Callable[[str], None] = lambda _m: None) -> Remote:
    """Open a connection (through the jump host, if any), retrying while the instance boots,
    until `target.wait` runs out."""
    from ..paths import known_hosts_file

    path = known_hosts or known_hosts_file()
    agent = _Agent()
    try:
        return _connect(target, KnownHosts(path), path, agent, say, accept_new_host_key)
    finally:
        agent.close()


def _connect(target: Target, known: KnownHosts, path: Path, agent: _Agent,
             say: Callable[[str], None], accept_new_host_key: bool) -> Remote:
    jump = target.jump
    jump_what = f"jump host {jump.label}" if jump else ""
    auth = _auth_kwargs(target, agent)
    jump_auth = _auth_kwargs(jump, agent) if jump else {}
    first_auth_failure: list[float] = []
    announced: list[str] = []

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
        if isinstance(exc, _Refused) and isinstance(exc.cause, paramiko.AuthenticationException):
            return AUTH_GRACE - (time.monotonic() - first_auth_failure[0])
        return None

    def on_retry(exc: BaseException, seconds: float) -> None:
        what = str(exc)
        if not announced or announced[-1] != what:
            say(f"{what}; retrying")
            announced.append(what)

    try:
        return retrying(attempt, transient=lambda e: isinstance(e, _Refused), within=max(target.wait, 0),
                        first=1.0, most=10.0, stop_early=auth_left, on_retry=on_retry)
    except _Refused as exc:
        if isinstance(exc.cause, paramiko.AuthenticationException):
            who = jump if jump is not None and exc.is_jump else target
            raise ConnectError(
                f"{exc.who}: authentication refused for user {who.user}"
                + (f" with key {who.key}" if who.key else " (ssh-agent and default keys)"),
                _hint_for(exc.cause, exc.is_jump)) from None
        raise ConnectError(f"{exc.who}: could not connect within ssh.wait={target.wait:g}s: {_describe(exc.cause)}",
                           _hint_for(exc.cause, exc.is_jump)) from None


def environ_secrets(names: list[str]) -> dict[str, str]:
    """The values of the recipe's `env.secrets`, from this machine's environment."""
    return {name: os.environ[name] for name in names if name in os.environ}
