"""The exposure: what losing the instance right now would cost, measured by the watch at every
look: how many steps (and seconds of training) the store's newest verified checkpoint is behind
the newest complete one in node 0's checkpoint.dir. Pure: the looks give the instance's side, the
last round's report the store's. It only informs: a round's verdict comes from the store's bytes.

Worth a line when the copies fall behind the saves: a checkpoint completed while the one before
it was not verified yet (BEHIND of them unverified), again at each further one, and once when the
store caught up. Not at every look, nor for a save a round copies in time: that round's own line
says its lag.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from ..history import iso
from ..job import Lag
from ..layouts import Checkpoint

BEHIND = 2          # complete checkpoints on the instance not verified in the store: the copies fall behind


@dataclass(kw_only=True)
class Exposure(Lag):
    behind: int = 0       # complete checkpoints seen on the instance newer than the store's newest verified
    at: str = ""          # when it was measured (UTC)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Exposure:
        """From `as_dict()` (the watch's state file), the computed fields left out."""
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})

    def words(self) -> str:
        minutes = f", {self.lag_seconds / 60:.1f} min" if self.lag_seconds is not None else ""
        stored = f"{self.stored} (step {self.stored_step})" if self.stored else "nothing"
        return (f"{self.lag_steps} steps{minutes} (newest on the instance: {self.newest}; newest verified in the "
                f"store: {stored})")


class Meter:
    """The exposure look by look, the most it has been, and when it is worth a line."""

    def __init__(self) -> None:
        self.unverified: set[int] = set()      # steps of complete checkpoints seen, newer than the store's newest
        self.now: Exposure | None = None
        self.worst: Exposure | None = None
        self._said: int | None = None           # the newest step when "behind" was last said (None: caught up)

    def reset(self) -> None:
        """Other instances now (a recovery): their steps go on from the checkpoint they restored."""
        self.unverified.clear()
        self._said = None

    def measure(self, complete: Sequence[Checkpoint], stored: Lag) -> Exposure | None:
        """The exposure now, from node 0's complete checkpoints (oldest first) and the last round's
        report: the store's newest verified, and the instance's newest as the round saw it (newer
        than the look's when a save came between the look and the round)."""
        if not complete:
            return None
        floor = stored.stored_step if stored.stored_step is not None else -1
        seen_steps = {c.step for c in complete}
        if stored.newest_step is not None:
            # a save the round saw after the look is on the instance and not verified either
            seen_steps.add(stored.newest_step)
        self.unverified = {step for step in self.unverified | seen_steps if step > floor}
        newest = complete[-1]
        seen = Lag(newest=newest.name, newest_step=newest.step,
                   newest_mtime=max((e.mtime for e in newest.files), default=None))
        if stored.newest_step is not None and stored.newest_step > newest.step:
            seen = stored
        now = Exposure(newest=seen.newest, newest_step=seen.newest_step, newest_mtime=seen.newest_mtime,
                       stored=stored.stored, stored_step=stored.stored_step, stored_written_at=stored.stored_written_at,
                       behind=len(self.unverified), at=iso(time.time()))
        self.now = now
        if self.worst is None or (now.lag_steps or 0) > (self.worst.lag_steps or 0):
            self.worst = now
        return now

    def news(self) -> str | None:
        """"behind" when the copies fall (further) behind the saves, "caught up" once they no longer
        do, None when nothing changed that is worth a line."""
        now = self.now
        if now is None:
            return None
        if now.behind >= BEHIND and now.newest_step != self._said:
            self._said = now.newest_step
            return "behind"
        if now.behind < BEHIND and self._said is not None:
            self._said = None
            return "caught up"
        return None
