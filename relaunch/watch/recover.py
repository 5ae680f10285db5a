"""What `watch` asks of the user's provider tooling, on this machine: `recover.command` (rent a
replacement, print its HOST) and `recover.alive` (does the provider still run HOST?).

recover.command, and what its answer allows next (nothing is ever rented twice by accident):
- exit non-zero: nothing was rented; another attempt, with backoff, up to recover.attempts;
- exit 0 with `HOST [SHA256:FINGERPRINT]` on its last line: a new instance, just rented by the
  user's own command: its host key is accepted for that address (the key an earlier instance
  left there belonged to a machine that is gone), or pinned when the command printed it;
- exit 0 without a HOST on its last line: it may have rented something it did not name, so the
  watch stops, quotes what it printed, and rents nothing more;
- ended at recover.timeout: it may have rented an instance already (it was waiting for it to
  boot), so it is never run again: a HOST on the last line it printed is used as if it had
  exited 0, anything else stops the watch quoting what it printed.

recover.alive, asked before an instance counts as lost: exit 0 = the provider still runs HOST
(unreachable from here is this machine's trouble or a passing one: nothing is rented), 1 = it
does not (lost), anything else or no answer within ALIVE_DEADLINE = it cannot tell: asked again
later, nothing rented meanwhile.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, replace

from .. import processes
from ..errors import ConnectError, RelaunchError
from ..host.spec import HostSpec
from ..host.sshconfig import SSHConfigFile, config_path
from ..recipe import Recipe, render_context, render_shell_at
from ..recipe.model import SSH
from ..ui import UI, redact

ALIVE_DEADLINE = 60.0
TAIL = 5                 # lines of a command's output quoted in a message


@dataclass(frozen=True)
class Rented:
    spec: HostSpec
    pin: str | None          # the host key fingerprint the command printed, else None (accept the new key)
    note: str = ""           # said beside it (the command was ended at its timeout after printing it)


class RentedNothing(ConnectError):
    """recover.command failed (exit non-zero): nothing was rented, another attempt may follow."""


class RecoverStopped(ConnectError):
    """recover.command exited 0 without naming a HOST, or was ended at its timeout without naming
    one: no more attempts (it may have rented one)."""


def looks_like_host(address: str) -> bool:
    """An IP address, a DNS name with a dot, or a Host alias of the ssh config: not a word such as
    `OK` or `done` that a script prints on success."""
    try:
        ipaddress.ip_address(address.split("%", 1)[0])
        return True
    except ValueError:
        pass
    if "." in address.strip("."):
        return True
    try:
        return SSHConfigFile(config_path()).lookup(address).hostname != address
    except RelaunchError:
        return False


def parse_rented(stdout: str) -> Rented | str:
    """The HOST (and fingerprint) on recover.command's last line, or why that line is not one."""
    lines = [ln.strip() for ln in stdout.splitlines() if ln.strip()]
    if not lines:
        return "it printed nothing"
    words = lines[-1].split()
    if len(words) > 2:
        return f"its last line {lines[-1]!r} is more than HOST [SHA256:FINGERPRINT]"
    try:
        spec = HostSpec.parse(words[0])
        pin = SSH.model_validate({"host_key": words[1]}).host_key if len(words) > 1 else None
    except (RelaunchError, ValueError) as exc:
        first = (exc.message if isinstance(exc, RelaunchError) else str(exc)).splitlines()[0]
        return f"its last line {lines[-1]!r} is not HOST [SHA256:FINGERPRINT]: {first}"
    if not looks_like_host(spec.address):
        return (f"its last line {lines[-1]!r} is not a HOST: {spec.address!r} is neither an address, nor a name "
                "with a dot, nor an ~/.ssh/config alias")
    return Rented(spec, pin)


def _environment(recipe: Recipe, values: dict[str, str], **more: str) -> dict[str, str]:
    return {**os.environ, **values, "RELAUNCH_RECIPE": str(recipe.source), "RELAUNCH_NAME": recipe.name,
            **{f"RELAUNCH_{k.upper()}": v for k, v in more.items()}}


def _tail(done: processes.Completed) -> str:
    lines = [ln for ln in (done.text + "\n" + done.err).splitlines() if ln.strip()][-TAIL:]
    return redact(" | ".join(lines)) if lines else "no output"


def rent(recipe: Recipe, ui: UI, attempt: int, lost_host: str, cause: str) -> Rented:
    """Run recover.command once: the replacement it rented, or RentedNothing / RecoverStopped."""
    recover = recipe.recover
    assert recover.command is not None
    text, values = render_shell_at(recipe, "recover.command", render_context(recipe, host=lost_host))
    env = _environment(recipe, values, lost_host=lost_host, cause=cause, attempt=str(attempt))
    done = processes.run(["bash", "-c", text], deadline=recover.timeout, env=env, cwd=recipe.source.parent,
                         on_stderr=lambda data: ui.detail(data.decode(errors="replace").rstrip()))
    if done.timed_out:
        # it may have rented already: never run again; what it printed is used, or quoted
        ended = f"recover.command did not finish within recover.timeout={recover.timeout:g}s and was ended"
        printed = parse_rented(done.text)
        if isinstance(printed, Rented):
            return replace(printed, note=f"{ended} after it printed {printed.spec}: that instance is used, and "
                                         "the command is not run again")
        raise RecoverStopped(f"{ended}; it may have rented an instance meanwhile, and {printed}; it printed: "
                             f"{_tail(done)}",
                             "look at your provider's console and destroy what you do not want; nothing more is "
                             "rented. Raise recover.timeout, or make the command print HOST as soon as it has one",
                             refused=True)
    if done.status != 0:
        raise RentedNothing(f"recover.command failed (exit {done.status}): {_tail(done)}",
                            "try the command by hand; it must print the new HOST on its last line")
    found = parse_rented(done.text)
    if isinstance(found, str):
        raise RecoverStopped(f"recover.command exited 0 but {found}; it printed: {_tail(done)}",
                             "it may have rented an instance: look at your provider's console, destroy what you do "
                             "not want, and make the command print HOST [SHA256:FINGERPRINT] as its last line; "
                             "nothing more is rented", refused=True)
    return found


@dataclass(frozen=True)
class Alive:
    """recover.alive's answer about one HOST."""

    running: bool | None     # True: the provider runs it; False: it does not; None: cannot tell
    said: str                # in words, with the command's own last lines


def ask_alive(recipe: Recipe, host: str) -> Alive:
    alive = recipe.recover.alive
    assert alive is not None
    text, values = render_shell_at(recipe, "recover.alive", render_context(recipe, host=host))
    try:
        done = processes.run(["bash", "-c", text], deadline=ALIVE_DEADLINE, env=_environment(recipe, values, host=host),
                             cwd=recipe.source.parent)
    except OSError as exc:
        return Alive(None, f"recover.alive could not run: {exc}")
    if done.timed_out:
        return Alive(None, f"recover.alive gave no answer within {ALIVE_DEADLINE:g}s")
    if done.status == 0:
        return Alive(True, f"recover.alive says the provider still runs {host} (exit 0: {_tail(done)})")
    if done.status == 1:
        return Alive(False, f"recover.alive says the provider no longer runs {host} (exit 1: {_tail(done)})")
    return Alive(None, f"recover.alive cannot tell (exit {done.status}: {_tail(done)}); 0 means running, 1 gone")
