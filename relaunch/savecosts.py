"""What saving costs a run, read from its log: the metric line `relaunch.train.Checkpointer` prints
on rank 0 for every committed save,

    relaunch.checkpoint: step=20 name=step-00000020 blocking_s=0.0123 write_s=0.5310 step_s=0.3012
                         bytes=3145728 world_size=4          (one line)

blocking_s: how long the save stopped training (the copy of the state; a write still in flight
from the save before); write_s: from then until the checkpoint was committed (the background
write and the rename); step_s: the mean training step since the save before (`-` unknown).

Pure: log text in, numbers out. `relaunch interval` feeds the Badput model with them, `status`
shows the run's Badput now, `drill` the blocking time beside the steps lost.
"""

from __future__ import annotations

import re
import shlex
import statistics
from dataclasses import dataclass
from itertools import pairwise

from .scripts import START_MARK, whole_lines
from .train import CHECKPOINT_METRIC

READ_LINES = 4000                       # the newest lines of those read; a run saves once per line
_FIELD = re.compile(r"(\w+)=(\S+)")


@dataclass(frozen=True)
class Save:
    step: int
    name: str
    blocking: float          # seconds the save stopped training
    write: float             # seconds from then until committed
    step_time: float | None  # the mean step since the save before
    bytes: int
    world_size: int

    @property
    def save_time(self) -> float:
        """From the save's start until the checkpoint is committed: what a failure meanwhile costs."""
        return self.blocking + self.write


def read_command(log: str) -> str:
    """What `status` and `interval` run on the instance: the log's start lines and metric lines,
    of its whole lines only. grep ends every line it prints with a newline, also a last one still
    being written, which would parse as other numbers (`write_s=0.5` of `write_s=0.5310`): the log
    is read up to the size it had, and when its last byte then was not a newline, without that line
    (a log is only appended to: those bytes stay as they were)."""
    pattern = f"^{START_MARK}|{CHECKPOINT_METRIC}".replace(".", r"\.")
    q = shlex.quote(log)
    upto = f'head -c "$n" -- {q}'
    return (f"n=$(stat -c %s -- {q} 2>/dev/null) || n=0; "
            f'{{ if [ "$n" -gt 0 ] && [ -n "$(tail -c +"$n" -- {q} | head -c 1)" ]; '
            f"then {upto} | sed '$d'; else {upto}; fi; }} 2>/dev/null | "
            f"grep -a -E -e {shlex.quote(pattern)} | tail -n {READ_LINES}")


def parse_line(line: str) -> Save | None:
    """One metric line, or None for any other line (or a metric line that does not parse)."""
    at = line.find(CHECKPOINT_METRIC)
    if at < 0:
        return None
    fields = dict(_FIELD.findall(line[at + len(CHECKPOINT_METRIC):]))
    try:
        step_time = None if fields.get("step_s", "-") == "-" else float(fields["step_s"])
        return Save(int(fields["step"]), fields.get("name", ""), float(fields["blocking_s"]), float(fields["write_s"]),
                    step_time, int(fields.get("bytes", 0)), int(fields.get("world_size", 0)))
    except (KeyError, ValueError):
        return None


def saves_of(log: str) -> list[Save]:
    """The saves of the newest run (after the last start line) that logged any, in log order."""
    runs: list[list[Save]] = [[]]
    for line in whole_lines(log):
        if line.startswith(START_MARK):
            runs.append([])
            continue
        save = parse_line(line)
        if save is not None:
            runs[-1].append(save)
    return next((run for run in reversed(runs) if run), [])


@dataclass(frozen=True)
class SaveCosts:
    """The medians of a run's saves: the inputs of the Badput model, as the run logged them."""

    saves: int
    blocking: float
    write: float
    save_time: float            # blocking + write, per save
    step_time: float | None
    every: int | None           # steps between two saves (the run's interval)
    bytes: int                  # of the newest save, all ranks together
    world_size: int


def summarize(saves: list[Save]) -> SaveCosts | None:
    if not saves:
        return None
    steps = [s.step_time for s in saves if s.step_time is not None and s.step_time > 0]
    gaps = [b.step - a.step for a, b in pairwise(saves) if b.step > a.step]
    return SaveCosts(saves=len(saves), blocking=statistics.median(s.blocking for s in saves),
                     write=statistics.median(s.write for s in saves),
                     save_time=statistics.median(s.save_time for s in saves),
                     step_time=statistics.median(steps) if steps else None,
                     every=round(statistics.median(gaps)) if gaps else None,
                     bytes=saves[-1].bytes, world_size=saves[-1].world_size)
