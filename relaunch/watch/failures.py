"""How the watch words a failure in one line, and which failures it recovers from."""

from __future__ import annotations

from ..errors import HostKeyError, Interrupted, RelaunchError, UsageError
from ..ui import redact


def first_line(exc: BaseException) -> str:
    message = exc.message if isinstance(exc, RelaunchError) else str(exc)
    return redact(message).splitlines()[0] if message else type(exc).__name__


def recoverable(exc: BaseException) -> bool:
    """Worth another try: not a bad recipe, a refused host key, Ctrl-C or a refusal."""
    return isinstance(exc, RelaunchError) and not isinstance(exc, (UsageError, Interrupted, HostKeyError)) \
        and not exc.refused
