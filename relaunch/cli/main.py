"""The entry point: parse, run one command, turn its error into an exit code (and with --json,
the same failure as the document's fields); Ctrl-C and SIGTERM unwind once."""

from __future__ import annotations

import faulthandler
import io
import logging
import signal
import sys
from types import FrameType

import click

from .. import processes
from ..errors import EvacuationError, Interrupted, RelaunchError
from ..paths import debug_log_file
from ..ui import redact, setup_logging
from .common import cli, document, print_document

log = logging.getLogger("relaunch")


_unwinding = False          # the one Ctrl-C (or SIGTERM) that unwinds was seen, or the command is over


def _interrupt(signum: int, frame: FrameType | None) -> None:
    """Ctrl-C or a SIGTERM: every wait in relaunch ends (CANCEL), then the main thread unwinds.
    Only once: a second Ctrl-C must not cut short the cleanup (credentials removed, the exit code
    and its message) that the first one started.

    This runs in the main thread between two bytecodes, wherever it is. Inside the code of a
    module that holds locks by hand it neither sets CANCEL nor raises: a lock may be held there
    (`CANCEL.wait()` holds CANCEL's, and `CANCEL.set()` would wait for itself forever) or half
    released (a KeyboardInterrupt there leaves it broken: "release unlocked lock"), or just
    acquired before its `try` (paramiko's pipes, logging's handlers: a KeyboardInterrupt there
    leaves it held for good, and the next thread to take it, paramiko's transport closing the
    channel, waits forever while holding the channel's lock that relaunch's own close then waits
    for). The relay thread sets CANCEL (`processes.relay_signals`), and the wait the main thread
    is in ends on it with Interrupted, as a Ctrl-C ends every other thread's waits: relaunch calls
    paramiko only from loops that look at CANCEL."""
    global _unwinding
    if _unwinding:
        return
    _unwinding = True
    if _inside_lock_holders(frame):
        return
    processes.CANCEL.set()              # CANCEL's lock is only ever held inside threading's code
    raise KeyboardInterrupt


_LOCK_HOLDERS = ("threading", "paramiko", "logging")


def _inside_lock_holders(frame: FrameType | None) -> bool:
    while frame is not None:
        module = str(frame.f_globals.get("__name__", ""))
        if module.split(".", 1)[0] in _LOCK_HOLDERS:
            return True
        frame = frame.f_back
    return False


def install_signal_handlers() -> None:
    global _unwinding
    _unwinding = False
    processes.relay_signals()
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        # a relaunch that seems hung: `kill -USR1 PID` prints where each of its threads is, on stderr
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    except (AttributeError, ValueError, io.UnsupportedOperation):
        pass                            # a stderr with no file behind it (relaunch called in-process)


def wants_json(argv: list[str]) -> bool:
    """Was `--json` given to the command? Read from argv before click parses it, so that a usage
    error can answer in JSON too; a `--json` that is the value of another option does not count."""
    command: click.Command = cli
    takes_value: set[str] = set()
    tokens = iter(argv)
    for token in tokens:
        if token == "--":
            return False
        if token == "--json":
            return True
        if token in takes_value:
            next(tokens, None)
        elif isinstance(command, click.Group) and token in command.commands:
            command = command.commands[token]
            takes_value = {opt for p in command.params if isinstance(p, click.Option) and not p.is_flag
                           and not p.count for opt in p.opts}
    return False


def fail(as_json: bool, message: str, hint: str | None, code: int, refused: bool = False) -> int:
    """The exit code of a failure, and with --json its JSON on stdout (the text already went to stderr);
    `refused`: the other side said no (credentials, no room, a conflicting writer): a retry changes nothing."""
    if as_json:
        print_document({"error": message, "hint": hint or None, "exit": code, "refused": refused})
    return code


def main(argv: list[str] | None = None) -> int:
    global _unwinding
    try:
        setup_logging(str(debug_log_file()))
    except OSError:
        pass
    install_signal_handlers()
    try:
        return _main(argv)
    finally:
        # the work and its exit code are decided: a Ctrl-C now must not turn them into a kill by signal
        _unwinding = True


def _main(argv: list[str] | None) -> int:
    args = list(argv if argv is not None else sys.argv[1:])
    command = args[:1]
    as_json = wants_json(args)
    not_verified = "evacuation NOT verified: DO NOT destroy the instance"
    document.clear()
    try:
        done = cli.main(args=args, prog_name="relaunch", standalone_mode=False)
        print_document()
        # a command that ends with an exit code of its own (`run`'s 75: requeue me) raises click's
        # Exit, which click turns into this return value when it does not exit itself
        return done if isinstance(done, int) else 0
    except click.exceptions.Exit as exc:
        print_document()
        return exc.exit_code
    except click.ClickException as exc:
        exc.show()
        where = exc.ctx.command_path if isinstance(exc, click.UsageError) and exc.ctx else "relaunch"
        return fail(as_json, exc.format_message(), f"`{where} --help` shows the usage", 2)
    except (KeyboardInterrupt, Interrupted, click.exceptions.Abort):  # click turns Ctrl-C into Abort
        message = "interrupted: nothing half-written is trusted; rerun to continue"
        if command == ["watch"]:
            message = "watch stopped (Ctrl-C); the training was not touched and goes on"
        click.echo(message, err=True)
        if command == ["evacuate"]:
            click.echo(not_verified, err=True)
        return fail(as_json, message, not_verified if command == ["evacuate"] else None, Interrupted.exit_code)
    except RelaunchError as exc:
        log.debug("error", exc_info=True)
        if exc.result is not None and not document:
            document[:] = [exc.result]
        click.echo(redact(f"Error: {exc.message}"), err=True)
        if exc.hint:
            click.echo(redact(f"hint: {exc.hint}"), err=True)
        return fail(as_json, exc.message, exc.hint, exc.exit_code, exc.refused)
    except Exception as exc:  # a bug: one line here, the trace in the debug log
        log.exception("internal error")
        message = f"internal error: {type(exc).__name__}: {exc}"
        click.echo(redact(f"Error: {message} (full trace in {debug_log_file()})"), err=True)
        if command == ["evacuate"]:
            click.echo(not_verified, err=True)
            return fail(as_json, message, not_verified, EvacuationError.exit_code)
        return fail(as_json, message, f"full trace in {debug_log_file()}", 1)


def entry() -> None:
    sys.exit(main())
