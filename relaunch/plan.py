"""Actions: what relaunch does on a host, as values. Steps make them, `relaunch plan` shows them,
the executor runs them; the text `plan` shows is rendered from the same fields the executor uses.

An action runs one of: a shell command on the instance (`command`, with `stdin`), a program on
this machine (`argv`), or a method of the store in this process (`call` with `args`). One that
has none of them only says something (`say`), or says why nothing needs doing (`skip`).
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

INSTANCE = "instance"
LOCAL = "local"

# Exit categories of a failed action (the contract's exit codes, see errors.py)
FAILS_AS = ("connect", "env", "checkpoint", "evacuate")


@dataclass(frozen=True)
class Ref:
    """In `args` or `stdin`: the result an earlier action produced under this name (or one part of it)."""

    name: str
    part: str = ""


@dataclass(frozen=True)
class Action:
    step: str                       # preflight | env | checkpoint | launch | evacuate | stop
    title: str                      # what it does, in words
    where: str = INSTANCE           # INSTANCE or LOCAL
    command: str = ""               # on the instance: the exact shell command line
    argv: tuple[str, ...] = ()      # on this machine: the exact program and arguments
    call: str = ""                  # on this machine, in-process: "store.<method>"
    args: dict[str, Any] = field(default_factory=dict, hash=False)
    stdin: bytes | Path | Ref | None = None   # bytes, a local file streamed in, or an earlier result
    host: str = ""                  # in a node group: the node it runs on (its label); "" = the only one
    secret: tuple[str, ...] = ()    # names of secrets in stdin: shown as *** only
    deadline: float = 60.0          # seconds before it is ended and counts as failed
    retry: bool = False             # safe to run again after a transient failure
    produces: str = ""              # name of its result, for later actions' Ref
    parse: str = ""                 # how output becomes the result: "hashes:sha256", "text", "lines"
    expect: dict[str, str] | None = field(default=None, hash=False)  # with hashes: the values required
    fails_as: str = "env"           # exit category when it fails (FAILS_AS)
    lane: str = ""                  # actions in different lanes next to each other run at the same time
    needs: tuple[str, ...] = ()     # results of other lanes' actions it waits for before it runs
    say: str = ""                   # printed when it starts
    done: str = ""                  # printed when it succeeded
    skip: str = ""                  # why nothing needs doing: runs nothing
    progress: str = ""              # "rsync" | "rclone" | "hashes": a bar fed by the program's output;
                                    # "time": one that only shows it is still going
    size: int = 0                   # bytes it moves (for the bar)
    always: bool = False            # also runs after an earlier action of its lane failed (cleanup)
    # exit status (or "re:REGEX" on the output) -> transient | vanished | full | partial (rsync 23)
    outcomes: dict[int | str, str] = field(default_factory=dict, hash=False)
    explain: str = ""               # "store.<method>(status, output)": the store's words for a failure
    room: str = ""                  # where "no space left" means no room ("in the store ...")
    hint: str = ""                  # what the user can do when it fails

    @property
    def runs(self) -> bool:
        return not self.skip and bool(self.command or self.argv or self.call)

    def describe(self) -> str:
        """How `relaunch plan` shows it: the exact command, argv or call, and its stdin."""
        lane = f" [{self.lane} lane]" if self.lane else ""
        node = f"[{self.host}] " if self.host else ""
        head = f"{node}[{self.step}] {self.title}{lane}"
        if self.skip:
            return f"{head}: nothing to do ({self.skip})"
        if not self.runs:
            return f"{head}: {self.say}" if self.say else head
        limits = ("in this process" if self.call else f"deadline {self.deadline:g}s") + (
            ", retried when it fails on the way" if self.retry else "") + (
            ", also after a failure or Ctrl-C" if self.always else "")
        lines = [f"{head} ({limits})"]
        if self.command:
            lines += _indent(f"{self.where}$ ", self.command)
        elif self.argv:
            lines += _indent(f"{self.where}$ ", shlex.join(self.argv))
        else:
            shown = ", ".join(f"{k}={_value(v)}" for k, v in self.args.items())
            lines.append(f"    {self.where}: {self.call}({shown})")
        if isinstance(self.stdin, Path):
            lines.append(f"    stdin: the local file {self.stdin}")
        elif isinstance(self.stdin, Ref):
            lines.append(f"    stdin: <{self.stdin.name}>" + (" (not shown)" if self.secret else ""))
        elif self.stdin is not None and self.secret:
            lines.append(f"    stdin: {len(self.stdin)} bytes holding {', '.join(self.secret)} (not shown)")
        elif self.stdin is not None:
            text = self.stdin.decode(errors="replace")
            if "\0" in text:
                items = [p for p in text.split("\0") if p]
                lines.append(f"    stdin: {len(items)} NUL-separated path(s): " + ", ".join(items[:5])
                             + (", ..." if len(items) > 5 else ""))
            else:
                lines.append("    stdin:")
                lines += ["      " + ln for ln in text.rstrip("\n").splitlines()]
        if self.expect is not None:
            lines.append(f"    then: {len(self.expect)} {self.parse.partition(':')[2]} value(s) must equal the store's")
        return "\n".join(lines)


def _indent(prompt: str, text: str) -> list[str]:
    first, *rest = text.splitlines() or [""]
    return [f"    {prompt}{first}", *("      " + ln for ln in rest)]


def _value(value: Any) -> str:
    if isinstance(value, Ref):
        return f"<{value.name}>"
    if isinstance(value, (list, tuple, set)) and len(value) > 4:
        return f"[{len(value)} items]"
    if hasattr(value, "name") and not isinstance(value, (str, Path)):
        return str(value.name)
    return repr(str(value)) if isinstance(value, Path) else repr(value)


@dataclass
class Plan:
    """What `up` does on one host: the read-only commands that gathered the facts, then actions."""

    host: str
    reads: list[str] = field(default_factory=list)
    actions: list[Action] = field(default_factory=list)

    def extend(self, actions: Iterable[Action]) -> None:
        self.actions.extend(actions)

    def render(self) -> str:
        out = [f"# plan for {self.host}: {sum(a.runs for a in self.actions)} actions; nothing has changed yet",
               "# read first (changes nothing):"]
        out += [f"#   instance$ {read}" + ("    (stdin: templates/facts.sh with the recipe's values)"
                                         if read == "bash -s" else "") for read in self.reads]
        out += [a.describe() for a in self.actions]
        return "\n".join(out)

    def as_dict(self) -> dict[str, Any]:
        return {"host": self.host, "reads": self.reads, "actions": [action_dict(a) for a in self.actions]}


def action_dict(a: Action) -> dict[str, Any]:
    stdin: str | None
    if isinstance(a.stdin, Path):
        stdin = f"<file {a.stdin}>"
    elif isinstance(a.stdin, Ref):
        stdin = f"<{a.stdin.name}>"
    elif a.stdin is None:
        stdin = None
    else:
        stdin = "<secret>" if a.secret else a.stdin.decode(errors="replace")
    return {"step": a.step, "title": a.title, "where": a.where, "command": a.command or None,
            "argv": list(a.argv) or None, "call": a.call or None, "stdin": stdin,
            "deadline": None if a.call or not a.runs else a.deadline,
            "retry": a.retry, "lane": a.lane or None, "skip": a.skip or None, **({"host": a.host} if a.host else {}),
            **({"always": True} if a.always else {}), **({"needs": list(a.needs)} if a.needs else {}),
            **({"produces": a.produces} if a.produces else {}), **({"fails_as": a.fails_as} if a.runs else {})}
