"""Actions: what a step would do on a host, shown by `relaunch plan`, run by `relaunch up`.

A step plans from read-only facts and returns actions; an action with `skip` set says why
nothing needs doing. Planning changes nothing, so `plan` and `up --dry-run` show exactly
the commands and rendered scripts `up` would run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Action:
    step: str
    title: str
    shown: str = ""                          # exact command(s) or rendered script
    run: Callable[[], None] | None = None
    skip: str | None = None                  # the reason nothing needs doing

    def describe(self) -> str:
        head = f"[{self.step}] {self.title}"
        if self.skip:
            return f"{head}: nothing to do ({self.skip})"
        if not self.shown:
            return head
        body = "\n".join("    " + line for line in self.shown.rstrip().splitlines())
        return f"{head}\n{body}"


def run_actions(actions: list[Action], say: Callable[[str, str], None]) -> None:
    """Run each action; say (step, reason) for those with nothing to do."""
    for action in actions:
        if action.skip is not None:
            say(action.step, action.skip)
        elif action.run is not None:
            action.run()
