"""What `relaunch drill --watch` measured, from the world alone: the steps in the training logs
(read with `run.metrics`, each at the time its line reached this machine: follow.py) and the
interruptions the watch wrote into the store's history. Pure: lines and records in, numbers out.

The logs make runs (a host's log between two `=== relaunch: start` lines), ordered by their first
step. Between one run and the next is an interruption:

- time without training: from the last step of the run before to the first step of the run after;
- steps lost: the steps the run before trained that the run after trained again (the first step
  after, minus one, is the step it resumed from); a step skipped (resumed past the last step
  before) breaks continuity;
- time re-doing lost steps: what the run before spent on steps that were trained again later.

Over the wall time (the drill's first step to its last), productive training is what is left:
the time that trained the steps that count. Goodput = productive / wall; the badput is the time
without training plus the time spent on steps trained twice, the vocabulary of ML goodput
reports (Google's "ML Productivity Goodput", the badput of restarts and of rolled-back steps).
Each interruption is matched with the history record the watch wrote for it (the one declared
between the start of the run before and the first step after), which says what the watch saw:
its cause, the steps lost it counted, whether the save after a notice made the deadline.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from ..history import Interruption
from ..recipe.model import Metrics
from ..savecosts import parse_line
from .by_hand import MARK, _num, _rel, blocking_note
from .follow import Line


@dataclass
class Run:
    """The steps of one run on one host: step -> (epoch seen, loss, grad_norm)."""

    host: str
    steps: dict[int, tuple[float, float | None, float | None]] = field(default_factory=dict)
    late: set[int] = field(default_factory=set)   # steps whose line was read late (follow.Line.late)

    @property
    def first(self) -> int:
        return min(self.steps)

    @property
    def last(self) -> int:
        return max(self.steps)

    def at(self, step: int) -> float:
        return self.steps[step][0]

    @property
    def began(self) -> float:
        return self.at(self.first)

    @property
    def ended(self) -> float:
        return self.at(self.last)


def runs_of(lines: list[Line], metrics: Metrics) -> list[Run]:
    """The runs the lines show, ordered by their first step's time (runs without a step dropped)."""
    step_re, loss_re = re.compile(metrics.step), re.compile(metrics.loss)
    grad_re = re.compile(metrics.grad_norm) if metrics.grad_norm else None
    runs: list[Run] = []
    current: dict[str, Run] = {}
    for line in sorted(lines, key=lambda ln: ln.at):
        if line.text.startswith(MARK):
            current[line.host] = Run(line.host)
            runs.append(current[line.host])
            continue
        step = step_re.search(line.text)
        if not step:
            continue
        loss = loss_re.search(line.text)
        grad = grad_re.search(line.text) if grad_re else None
        if loss is None and grad is None:
            continue
        run = current.get(line.host)
        if run is None:                 # following began after its start line
            run = current[line.host] = Run(line.host)
            runs.append(run)
        number = int(step.group(1))
        if number not in run.steps:
            run.steps[number] = (line.at, float(loss.group(1)) if loss else None,
                                 float(grad.group(1)) if grad else None)
            if line.late:
                run.late.add(number)
    return sorted((r for r in runs if r.steps), key=lambda r: r.began)


@dataclass
class Gap:
    """One interruption: the logs on both sides of it, and the watch's record of it."""

    before_host: str
    after_host: str
    last_before: int
    last_before_at: float
    first_after: int
    first_after_at: float
    seconds_without_training: float
    steps_lost: int                   # trained before, trained again after
    skipped: int                      # steps never trained: resumed past the last step before
    redo_seconds: float = 0.0         # what the run before spent on the steps lost
    approximate: bool = False         # a step line on either side was read late: its time is when it was read
    record: dict[str, Any] | None = None     # the history record (history.Interruption.as_dict())
    rows: list[dict[str, Any]] = field(default_factory=list)    # the steps trained twice, compared
    worst: float = 0.0

    @property
    def resumed_from(self) -> int:
        return self.first_after - 1

    @property
    def cause(self) -> str:
        return str(self.record.get("cause")) if self.record else "?"

    @property
    def recovered(self) -> bool:
        return self.record is not None and self.record.get("resumed_epoch") is not None

    def continuous(self, tolerance: float) -> bool:
        return self.skipped == 0 and self.worst <= tolerance

    @property
    def deadline_ok(self) -> bool:
        return self.record is None or self.record.get("made_deadline") is not False


@dataclass
class Measured:
    """The drill's report: goodput over the wall time, and each interruption."""

    recipe: str
    hosts: list[str]
    injected: list[str]                    # "notice", "lost": what the drill did, in order
    tolerance: float
    at: str = ""
    first_step: int = 0
    last_step: int = 0
    wall_seconds: float = 0.0              # the first step the drill saw to its last
    productive_seconds: float = 0.0
    without_training_seconds: float = 0.0
    redo_seconds: float = 0.0
    steps_trained: int = 0                 # step lines seen, each run's counted
    steps_lost: int = 0
    interruptions: list[Gap] = field(default_factory=list)
    unmatched: list[dict[str, Any]] = field(default_factory=list)   # records with no run after them
    added: list[str] = field(default_factory=list)        # what the drill added for its length
    rented: list[str] = field(default_factory=list)       # what recover.command rented meanwhile
    left: list[str] = field(default_factory=list)         # what is left, in words
    blocking_save: float | None = None     # seconds a save stopped training (median; the metric lines)
    saves: int = 0                         # saves in the metric lines the drill saw
    mode: str = "--watch"                  # how the drill ran: --watch, or --job (a job under a scheduler)

    @property
    def goodput(self) -> float:
        return self.productive_seconds / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def badput(self) -> float:
        return 1.0 - self.goodput if self.wall_seconds > 0 else 0.0

    def failures(self) -> list[str]:
        """Why the drill does not pass, in words (empty: it passes)."""
        out = []
        seen = [g.cause for g in self.interruptions]
        for kind in self.injected:
            if kind not in seen:
                out.append(f"the {kind} was not followed by training again (no run after it in the logs)")
        for n, gap in enumerate(self.interruptions, 1):
            if not gap.recovered:
                out.append(f"interruption {n}: no record of the watch bringing training back")
            if gap.skipped:
                out.append(f"interruption {n}: {gap.skipped} step(s) never trained (resumed at step "
                           f"{gap.first_after}, the last step before was {gap.last_before})")
            if gap.worst > self.tolerance:
                out.append(f"interruption {n}: the steps trained again differ by {gap.worst:.1e} > {self.tolerance:g}")
            if not gap.deadline_ok:
                out.append(f"interruption {n}: the save after the notice was NOT verified before its deadline")
        for record in self.unmatched:
            out.append(f"{record.get('cause')} at {record.get('at')}: recorded, but no training after it")
        return out

    @property
    def passed(self) -> bool:
        return not self.failures()

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for gap, raw in zip(self.interruptions, data["interruptions"], strict=True):
            raw.update(resumed_from=gap.resumed_from, cause=gap.cause, recovered=gap.recovered,
                       continuous=gap.continuous(self.tolerance))
        return {**data, "goodput": round(self.goodput, 4), "badput": round(self.badput, 4), "passed": self.passed,
                "failures": self.failures()}

    def table(self) -> str:
        wall = self.wall_seconds or math.nan

        def share(seconds: float) -> str:
            return f"{100 * seconds / wall:5.1f} %"

        out = [f"drill {self.mode} of {self.recipe}: {' then '.join(WORDS.get(k, k) for k in self.injected)}, "
               f"on {' '.join(self.hosts)}",
               f"  wall time                    {self.wall_seconds:.1f} s (step {self.first_step} to step "
               f"{self.last_step}, as the logs showed them)",
               f"  productive training          {self.productive_seconds:.1f} s  goodput "
               f"{share(self.productive_seconds)}",
               f"  time without training        {self.without_training_seconds:.1f} s  badput "
               f"{share(self.without_training_seconds)}",
               f"  re-doing lost steps          {self.redo_seconds:.1f} s  badput {share(self.redo_seconds)}",
               f"  steps trained / lost         {self.steps_trained} / {self.steps_lost}"
               f"{blocking_note(self.blocking_save, self.saves)}"]
        # the record's hosts (a group's node that was lost); the logs' (node 0's) without a record
        hosts = [((g.record or {}).get("host") or g.before_host, (g.record or {}).get("resumed_host") or g.after_host)
                 for g in self.interruptions]
        w1 = max([len("interrupted"), *(len(a) for a, _ in hosts)])
        w2 = max([len("resumed on"), *(len(b) for _, b in hosts)])
        out.append(f"  {'':2}{'cause':<7} {'interrupted':<{w1}} {'resumed on':<{w2}} {'last step':>9} {'from step':>9} "
                   f"{'lost':>4} {'recorded':>8} {'no training':>11} {'re-doing':>8}  deadline")
        for n, (g, (gone, back)) in enumerate(zip(self.interruptions, hosts, strict=True), 1):
            record = g.record or {}
            made = record.get("made_deadline")
            recorded = record.get("steps_lost")
            out.append(f"  {n:<2}{g.cause:<7} {gone:<{w1}} {back:<{w2}} {g.last_before:>9} "
                       f"{g.resumed_from:>9} {g.steps_lost:>4} {'-' if recorded is None else recorded:>8} "
                       f"{g.seconds_without_training:>9.1f}{'~' if g.approximate else ' '}s {g.redo_seconds:>6.1f} s  "
                       + ("-" if made is None else "made" if made else "MISSED"))
        if any(g.approximate for g in self.interruptions):
            out.append("  ~: a step line beside it was read late (after a reconnection): its time is when it was read")
        compared = [(n, row) for n, g in enumerate(self.interruptions, 1) for row in g.rows]
        if compared:
            out.append(f"  {'':2}{'step':>6}  {'loss before':>12}  {'loss after':>12}  {'rel. diff':>9}  "
                       f"{'grad_norm before':>16}  {'after':>12}  {'rel. diff':>9}")
            for n, row in compared:
                out.append(f"  {n:<2}{row['step']:>6}  {_num(row['loss_before']):>12}  {_num(row['loss_after']):>12}  "
                           f"{_num(row['loss_diff'], '.1e'):>9}  {_num(row['grad_before']):>16}  "
                           f"{_num(row['grad_after']):>12}  {_num(row['grad_diff'], '.1e'):>9}")
        worst = max((g.worst for g in self.interruptions), default=0.0)
        problems = self.failures()
        if problems:
            out += [f"  NOT passed: {problem}" for problem in problems]
        else:
            out.append("  passed: every interruption recovered, no step skipped, "
                       + (f"the steps trained twice agree (largest relative difference {worst:.1e} <= "
                          f"{self.tolerance:g})" if compared else "no step trained twice"))
        return "\n".join(out)


WORDS = {"notice": "a reclaim notice", "lost": "a silent loss", "signal": "an engine's stop signal"}


def measure(report: Measured, lines: list[Line], metrics: Metrics, records: list[Interruption]) -> Measured:
    """Fill `report` from the followed lines and the watch's history records (those since the drill began)."""
    saves = [save for save in (parse_line(line.text) for line in lines) if save is not None]
    if saves:
        report.blocking_save, report.saves = statistics.median(s.blocking for s in saves), len(saves)
    runs = runs_of(lines, metrics)
    if not runs:
        return report
    report.first_step, report.last_step = runs[0].first, runs[-1].last
    report.wall_seconds = runs[-1].ended - runs[0].began
    report.steps_trained = sum(len(r.steps) for r in runs)
    # a step counts where it was trained last: the steps a later run trained again are lost
    limit = math.inf
    productive = [0.0] * len(runs)
    redo = [0.0] * len(runs)
    for i in range(len(runs) - 1, -1, -1):
        run = runs[i]
        kept = [s for s in run.steps if s <= limit]
        last_kept_at = run.at(max(kept)) if kept else run.began
        productive[i] = last_kept_at - run.began
        redo[i] = run.ended - last_kept_at
        limit = min(limit, run.first - 1)
    report.productive_seconds = sum(productive)
    usable = sorted((r for r in records if r.cause != "rebalance"), key=lambda r: r.at_epoch)
    used: set[str] = set()
    for i, (before, after) in enumerate(zip(runs, runs[1:], strict=False)):
        gap = Gap(before.host, after.host, before.last, before.ended, after.first, after.began,
                  seconds_without_training=round(after.began - before.ended, 3),
                  steps_lost=max(before.last - (after.first - 1), 0), skipped=max(after.first - before.last - 1, 0),
                  redo_seconds=round(redo[i], 3),
                  approximate=before.last in before.late or after.first in after.late)
        record = next((r for r in usable if r.id not in used and before.began < r.at_epoch <= after.began), None)
        if record is not None:
            used.add(record.id)
            gap.record = record.as_dict()
        for step in range(after.first, before.last + 1):
            if step not in before.steps or step not in after.steps:
                continue
            (_, lb, gb), (_, la, ga) = before.steps[step], after.steps[step]
            row = {"step": step, "loss_before": lb, "loss_after": la, "loss_diff": _rel(lb, la),
                   "grad_before": gb, "grad_after": ga, "grad_diff": _rel(gb, ga)}
            gap.rows.append(row)
            gap.worst = max([gap.worst, *(d for d in (row["loss_diff"], row["grad_diff"]) if d is not None)])
        report.interruptions.append(gap)
    report.without_training_seconds = round(sum(g.seconds_without_training for g in report.interruptions), 3)
    report.redo_seconds = round(sum(redo), 3)
    report.steps_lost = sum(g.steps_lost for g in report.interruptions)
    report.unmatched = [r.as_dict() for r in usable if r.id not in used]
    report.wall_seconds, report.productive_seconds = round(report.wall_seconds, 3), round(report.productive_seconds, 3)
    return report
