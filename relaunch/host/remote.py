"""Commands on an open SSH connection to an instance: every command with a deadline and in a
process group of its own that relaunch can end.

`Remote.exec` runs a command line exactly as given, through `exec bash -c`, so that the shell
sshd starts for it leads a process group (sshd puts each session in a new one) whose id comes
back first on stderr: a deadline, a Ctrl-C or a failed sibling step ends that whole group on
the instance, not just the SSH channel. Files go up through the same commands (`upload_command`),
so what `relaunch plan` shows is all that ever runs.
"""

from __future__ import annotations

import errno
import logging
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
from fabric import Connection
from paramiko.ssh_exception import NoValidConnectionsError

from .. import processes
from ..errors import Interrupted
from .spec import Target

log = logging.getLogger("relaunch.host")

# paramiko waits an hour for a channel to open and forever for the answer to its exec request:
# a host that accepted TCP and then stopped answering (sshd stopped or wedged, a jump host that
# stopped relaying) keeps acknowledging packets, so TCP_USER_TIMEOUT never fires. A healthy sshd
# answers in milliseconds; past this the connection is closed.
CHANNEL_DEADLINE = 30.0
PGID_LINE = re.compile(rb"relaunch-pgid (\d+)\n")


@dataclass
class ExecResult(processes.Finished):
    command: str
    status: int | None              # None: no exit status (connection lost, deadline, cancelled)
    stdout: bytes
    stderr: bytes
    timed_out: bool = False


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


def describe_failure(exc: BaseException) -> str:
    """Why a connection or a channel failed, in the user's words (connect and exec both say it)."""
    if isinstance(exc, paramiko.ChannelException):
        return f"the jump host could not open a connection to it ({str(exc.text).lower()})"
    if isinstance(exc, NoValidConnectionsError):
        causes = list(exc.errors.values())
        if causes and all(getattr(c, "errno", None) != errno.ECONNREFUSED for c in causes):
            return describe_failure(causes[0])
        return "connection refused (sshd not listening yet?)"
    if isinstance(exc, paramiko.AuthenticationException):
        return f"authentication failed ({exc}); the key may not be installed yet"
    if isinstance(exc, paramiko.SSHException) and "banner" in str(exc):
        # paramiko raises this from inside its read: a timeout, or the other side closing first
        if isinstance(exc.__context__, (socket.timeout, TimeoutError)):
            return "port open but no SSH banner came (sshd starting or overloaded, or not an SSH port)"
        return ("port open but closed before any SSH banner (sshd starting, or turning connections away: "
                "MaxStartups, PerSourcePenalties)")
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return "timed out"
    if isinstance(exc, OSError) and exc.errno in (errno.EINVAL, errno.ENETUNREACH, errno.EHOSTUNREACH):
        # a blackhole or missing route answers EINVAL at once: to the user, the host is unreachable
        return "no route to the host (unreachable)"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return f"{type(exc).__name__}: {exc}"


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
            return ExecResult(command, None, b"", f"the SSH connection was lost ({describe_failure(exc)})".encode())
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
            status = chan.recv_exit_status()
            if status == -1 and not transport.is_active():
                # the channel ended with the connection (another lane gave up on the host and closed
                # it): no exit status came, which paramiko reports as -1, as if the command had said so
                return ExecResult(command, None, bytes(out), bytes(err) + b"\nthe SSH connection was lost")
            return ExecResult(command, status, bytes(out), bytes(err))
        except KeyboardInterrupt:
            self._end_group(pgid)
            raise
        except (OSError, EOFError, paramiko.SSHException) as exc:
            log.debug("exec failed: %s", command, exc_info=True)
            return ExecResult(command, None, bytes(out), bytes(err) + f"\n{describe_failure(exc)}".encode())
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
