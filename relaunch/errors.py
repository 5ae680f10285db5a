"""One error hierarchy, mapped to the contract's exit codes at the CLI edge.

Every error carries a one-line message and an optional hint for the user. Nothing here
prints; `relaunch.cli` turns an error into `Error: ...` plus the hint and the exit code.
"""

from __future__ import annotations


class RelaunchError(Exception):
    exit_code = 1

    def __init__(self, message: str, hint: str | None = None, refused: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        # the other side says no (credentials, no room, a conflicting writer, a missing repo or
        # bucket): trying again changes nothing, unlike a dropped connection or a 5xx
        self.refused = refused
        # what the command had found when it failed (an evacuation's report): --json prints it, the
        # error being fields of it
        self.result: dict[str, object] | None = None

    def __str__(self) -> str:
        return self.message


class UsageError(RelaunchError):
    """Bad usage or a bad recipe; nothing was contacted."""

    exit_code = 2


class RecipeError(UsageError):
    """A recipe problem, located as `file:line: key.path: message`."""

    def __init__(
        self,
        message: str,
        file: str | None = None,
        line: int | None = None,
        key: str | None = None,
        hint: str | None = None,
    ) -> None:
        self.file, self.line, self.key = file, line, key
        where = ""
        if file:
            where = f"{file}:{line}: " if line else f"{file}: "
        if key:
            where += f"{key}: "
        super().__init__(where + message, hint)


class ConnectError(RelaunchError):
    """Unreachable, timed out, auth failed, host key refused."""

    exit_code = 3


class HostKeyError(ConnectError):
    pass


class EnvError(RelaunchError):
    """The instance's environment failed: preflight, install, setup, or the command died at start."""

    exit_code = 4


class CheckpointError(RelaunchError):
    """Checkpoint transfer failed or no usable checkpoint (nothing lost; rerunning resumes)."""

    exit_code = 5


class EvacuationError(RelaunchError):
    """Evacuation not verified: DO NOT destroy the instance."""

    exit_code = 6


class Interrupted(RelaunchError):
    exit_code = 130


def shorten(text: str, limit: int = 300) -> str:
    """One line of at most `limit` characters, cut between words so that a path stays whole."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = text.rfind(" ", 0, limit - 4)
    return text[: cut if cut > limit // 2 else limit - 4] + " ..."


def remote_failure(
    cls: type[RelaunchError],
    host: str,
    step: str,
    command: str,
    exit_status: int | None,
    output: str,
    hint: str | None = None,
    tail: int = 15,
) -> RelaunchError:
    """Fabric's fixed failure block, as one of our errors: host, step, command, exit code, last lines."""
    lines = [ln for ln in output.rstrip().splitlines() if ln.strip()][-tail:]
    status = "no exit status (connection lost)" if exit_status is None else f"exit {exit_status}"
    message = f"{host}: {step} failed ({status}): {command}"
    if lines:
        message += "\n" + "\n".join("  | " + ln for ln in lines)
    return cls(message, hint)
