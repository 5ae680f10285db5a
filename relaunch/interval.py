"""`relaunch interval`: how often to save so that a failure costs at most a budget of the run.

The model: at each failure (on average every MTBI seconds) the run loses the time
to save a checkpoint, S, plus half an interval of training, N*T/2, so

    Badput(N) = (S + N*T/2) / MTBI

with N the interval in steps and T the time of one step. It grows with N, so the answer is the
largest N that keeps Badput within the budget B: N = floor(2*(B*MTBI - S)/T). Young/Daly's
optimum sqrt(2*S*MTBI), which also counts the time spent saving, is printed beside it for
reference.

An asynchronous save has two times, and they cost the run differently. S is from the save's
start until the checkpoint is committed (the blocking part plus the background write): a failure
in that window loses the interval before it too, so S stays in the failure term. The blocking
part, C, stops training at every save, failure or not: C/(N*T) of the training time. When C
is known (measured, or --blocking-time), it is added:

    Badput(N) = (S + N*T/2) / MTBI + C / (N*T)

and the largest N within the budget solves a quadratic in x = N*T: x^2 - 2(B*MTBI - S)x +
2*C*MTBI <= 0. With C = 0 it is the formula above. Young/Daly's optimum then uses C, the cost
each save has for the training.

Step, save and blocking time can be measured on an instance: from the metric lines
`relaunch.train.Checkpointer` writes into the run's log (relaunch/savecosts.py), or else from
the checkpoints' file mtimes (`measure`: pure, tested with hand-made listings).
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import asdict, dataclass, replace
from decimal import Decimal
from itertools import pairwise
from typing import TYPE_CHECKING, Any

from .errors import CheckpointError, UsageError
from .layouts import Checkpoint
from .savecosts import SaveCosts

if TYPE_CHECKING:
    from .history import Interruption
    from .host.spec import HostSpec
    from .recipe import Recipe
    from .ui import UI

# -- units ------------------------------------------------------------------------------------
# Decimal, so that 700ms is 0.7 and not 0.7000000000000001
_UNIT_SECONDS = {"ms": Decimal("0.001"), "s": Decimal(1), "sec": Decimal(1), "m": Decimal(60), "min": Decimal(60),
                 "h": Decimal(3600), "d": Decimal(86400)}
_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)"
_PART = re.compile(rf"({_NUMBER})(ms|sec|min|s|m|h|d)")
_BARE = re.compile(_NUMBER)
_DURATION_HINT = "for example 1.2s, 90s, 90 (seconds), 250ms, 5m, 6h, 2d or 1h30m"
LOG_DEADLINE = 30.0      # reading the run's metric lines on the instance


def parse_duration(text: str, option: str = "duration") -> float:
    """`1.2s`, `90s`, `90` (seconds), `250ms`, `5m`, `6h`, `2d`, `1h30m` -> seconds.

    Anything else is a UsageError naming `option`. Zero is allowed here; callers that need a
    positive value say so themselves.
    """
    raw = text.strip().lower().replace(" ", "")
    if _BARE.fullmatch(raw):
        return float(raw)
    total, pos = Decimal(0), 0
    for m in _PART.finditer(raw):
        if m.start() != pos:
            break
        total += Decimal(m.group(1)) * _UNIT_SECONDS[m.group(2)]
        pos = m.end()
    if raw and pos == len(raw):
        return float(total)
    raise UsageError(f"{option}: {text!r} is not a duration", _DURATION_HINT)


def parse_fraction(text: str, option: str = "--badput") -> float:
    """`5%` or `0.05` -> 0.05; must lie strictly between 0 and 1 (a bare `5` is refused, not 500%)."""
    raw = text.strip().replace(" ", "")
    percent = raw.endswith("%")
    number = raw[:-1] if percent else raw
    if not _BARE.fullmatch(number):
        raise UsageError(f"{option}: {text!r} is not a fraction", "for example 5% or 0.05")
    value = float(number) / 100 if percent else float(number)
    if not 0 < value < 1:
        hint = f"did you mean {number}%?" if not percent and 1 <= value < 100 else "for example 5% or 0.05"
        raise UsageError(f"{option}: {text!r} must be more than 0% and less than 100%", hint)
    return value


def format_duration(seconds: float) -> str:
    """Short and readable: 50ms, 0.25s, 1.5s, 90s, 34 min, 6h, 2d."""
    if seconds < 0.1:
        return f"{seconds * 1000:.3g}ms"
    if seconds < 120:
        return f"{seconds:.3g}s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.3g} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.3g}h"
    return f"{seconds / 86400:.3g}d"


def format_percent(fraction: float) -> str:
    return f"{fraction * 100:.3g}%"


# -- the model --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Interval:
    steps: int
    seconds: float   # of training between two saves: steps * step_time
    badput: float    # a fraction: 0.05 is 5%


def check_inputs(step_time: float | None, save_time: float | None, mtbi: float, blocking: float = 0.0) -> None:
    """UsageError for values the model cannot use (None: not known yet, to be measured)."""
    if step_time is not None and not step_time > 0:
        raise UsageError(f"--step-time must be more than 0 (got {step_time:g}s)")
    if save_time is not None and not save_time >= 0:
        raise UsageError(f"--save-time must not be negative (got {save_time:g}s)")
    if not blocking >= 0:
        raise UsageError(f"--blocking-time must not be negative (got {blocking:g}s)")
    if not mtbi > 0:
        raise UsageError(f"--mtbi must be more than 0 (got {mtbi:g}s)")


def badput(step_time: float, save_time: float, mtbi: float, every_steps: int, blocking: float = 0.0) -> float:
    """(S + N*T/2) / MTBI + C/(N*T): the fraction of the run failures and saving cost when
    saving every N steps (C, the blocking time of a save: 0 unless known)."""
    check_inputs(step_time, save_time, mtbi, blocking)
    if every_steps < 1:
        raise UsageError(f"--every must be at least 1 step (got {every_steps})")
    return (save_time + every_steps * step_time / 2) / mtbi + blocking / (every_steps * step_time)


def interval(step_time: float, save_time: float, mtbi: float, every_steps: int, blocking: float = 0.0) -> Interval:
    """The Interval of saving every N steps."""
    return Interval(every_steps, every_steps * step_time, badput(step_time, save_time, mtbi, every_steps, blocking))


def best_interval(step_time: float, save_time: float, mtbi: float, budget: float, blocking: float = 0.0) -> Interval:
    """The LARGEST N >= 1 with Badput(N) <= budget. Without a blocking time C:
    N = floor(2*(budget*MTBI - S)/T); with one, x = N*T is at most the larger root of
    x^2 - 2(budget*MTBI - S)x + 2*C*MTBI, and the budget must leave room for C at all.

    UsageError when no N is within the budget (saving alone eats it).
    """
    check_inputs(step_time, save_time, mtbi, blocking)
    if not 0 < budget < 1:
        raise UsageError(f"--badput must be more than 0% and less than 100% (got {budget:g})")
    room = budget * mtbi - save_time
    if blocking > 0:
        discriminant = room * room - 2 * blocking * mtbi
        exact = (room + math.sqrt(discriminant)) / step_time if room > 0 and discriminant >= 0 else 0.0
    else:
        exact = 2 * room / step_time
    # a hair of slack so that an exact boundary (1360.0 computed as 1359.9999999) is not lost
    steps = math.floor(exact + 1e-9 * max(1.0, abs(exact)))
    if steps < 1 or badput(step_time, save_time, mtbi, steps, blocking) > budget * (1 + 1e-9):
        at = max(steps, 1)
        every = "saving every step" if at == 1 else f"the best interval ({at} steps)"
        blocked = f", blocking {format_duration(blocking)}" if blocking else ""
        raise UsageError(
            f"saving takes too long for that MTBI: even {every} gives Badput "
            f"{format_percent(badput(step_time, save_time, mtbi, at, blocking))} "
            f"(save {format_duration(save_time)}{blocked}, step {format_duration(step_time)}, "
            f"MTBI {format_duration(mtbi)}), over the {format_percent(budget)} budget",
            "save faster (smaller or asynchronous checkpoints), or accept a larger --badput",
        )
    return interval(step_time, save_time, mtbi, steps, blocking)


def young_daly(step_time: float, save_time: float, mtbi: float, blocking: float = 0.0) -> Interval:
    """Young/Daly's optimum interval sqrt(2*C*MTBI), in seconds and (rounded, >= 1) steps, with C
    the cost of one save to the training: its blocking time when known, else the save time.

    `seconds` is the optimum itself; `badput` is the Badput model at those steps.
    """
    check_inputs(step_time, save_time, mtbi, blocking)
    seconds = math.sqrt(2 * (blocking or save_time) * mtbi)
    steps = max(1, round(seconds / step_time))
    return Interval(steps, seconds, badput(step_time, save_time, mtbi, steps, blocking))


# -- measuring from checkpoint timestamps -----------------------------------------------------
@dataclass(frozen=True)
class Measured:
    step_time: float
    save_time: float
    samples: int            # consecutive checkpoint pairs (metric lines: saves) the step time is the median of
    save_measured: bool     # False: save_time is the one given, not read from the files
    source: str = "checkpoint mtimes"     # or "metric lines": the Checkpointer's, in the run's log
    blocking_time: float | None = None    # metric lines: the median blocking part of a save
    write_time: float | None = None       # metric lines: the median background write (and commit)


def measure_lines(costs: SaveCosts) -> Measured:
    """The Badput inputs a run logged (relaunch.train.Checkpointer's metric lines): medians over its saves.

    The step time needs two saves, or one after a restore (the line says `step_s=-` when unknown).
    """
    if costs.step_time is None:
        raise CheckpointError(
            f"the run's metric lines hold {costs.saves} save(s) and no step time yet",
            "let training save once more, or give --step-time yourself",
        )
    return Measured(costs.step_time, costs.save_time, costs.saves, True, "metric lines", costs.blocking, costs.write)


def measure(checkpoints: list[Checkpoint], save_time: float | None = None) -> Measured:
    """Step time and save time from the mtimes of complete checkpoints (oldest first by step).

    Save time: per checkpoint with two or more files, its newest mtime minus its oldest (a lower
    bound: the first file's own write time is not seen); the median over checkpoints. A
    checkpoint that is one file has no start time, so then `save_time` must be given.
    Step time: for each consecutive pair, (newest mtime difference - save time) / step
    difference, as training ran those steps and then saved; the median over pairs.
    Pairs that make no sense (same step, a negative result: files restored from a store keep
    their old mtimes) are left out. Fewer than two checkpoints, or no usable pair: exit 5.
    """
    if len(checkpoints) < 2:
        found = f"found {len(checkpoints)}" if checkpoints else "found none"
        raise CheckpointError(
            f"measuring needs at least 2 complete checkpoints on the instance; {found}",
            "let training save twice more, or give --step-time and --save-time yourself",
        )
    if save_time is None:
        spans = [max(f.mtime for f in c.files) - min(f.mtime for f in c.files)
                 for c in checkpoints if len(c.files) >= 2]
        if not spans:
            raise UsageError(
                "these checkpoints are single files: their timestamps show when saving ended, not "
                "when it started, so the save time cannot be measured",
                "give --save-time (the step time is then measured from the checkpoints)",
            )
        save_time = statistics.median(spans)
        save_measured = True
    else:
        save_measured = False

    per_step = []
    for older, newer in pairwise(checkpoints):
        steps = newer.step - older.step
        if steps <= 0 or not older.files or not newer.files:
            continue
        elapsed = max(f.mtime for f in newer.files) - max(f.mtime for f in older.files)
        value = (elapsed - save_time) / steps
        if value > 0:
            per_step.append(value)
    if not per_step:
        raise CheckpointError(
            f"no two consecutive checkpoints give a step time ({len(checkpoints)} checkpoints; their "
            "timestamps do not grow with the step, or saving took longer than the time between them)",
            "give --step-time yourself",
        )
    return Measured(statistics.median(per_step), save_time, len(per_step), save_measured)


# -- what the command prints ------------------------------------------------------------------
@dataclass(frozen=True)
class NoticeFit:
    """Does saving plus copying fit inside the notice window of the recipe's provider?"""

    provider: str
    window: float            # seconds, as documented (recipes/providers.yaml)
    save_time: float
    copy_time: float | None  # None: not known (no notice handled yet, no --copy-time)

    @property
    def needed(self) -> float:
        return self.save_time + (self.copy_time or 0.0)

    @property
    def fits(self) -> bool:
        return self.needed <= self.window

    def line(self) -> str:
        copy = (f" + copy {format_duration(self.copy_time)}" if self.copy_time is not None
                else " (copy time not known yet: give --copy-time, or let `relaunch watch` measure one)")
        head = f"save {format_duration(self.save_time)}{copy}"
        if self.fits:
            return f"a reclaim notice on {self.provider} gives {format_duration(self.window)}: {head} fits"
        return (f"warning: {head} = {format_duration(self.needed)} does NOT fit in the {format_duration(self.window)} "
                f"reclaim notice of {self.provider}: a notice would lose the save it asks for (save faster, "
                "smaller or asynchronous checkpoints, or a store closer to the instance)")

    def as_dict(self) -> dict[str, Any]:
        return {"provider": self.provider, "window": self.window, "save_time": self.save_time,
                "copy_time": self.copy_time, "needed": self.needed, "fits": self.fits}


@dataclass(frozen=True)
class Result:
    step_time: float
    save_time: float
    mtbi: float
    budget: float
    interval: Interval       # the best one, or the one given with --every
    given: bool              # True: `interval` is the --every one
    young_daly: Interval
    measured: Measured | None = None
    host: str = ""
    measured_fields: tuple[str, ...] = ()   # of "step_time", "save_time": the ones taken from `measured`
    mtbi_gaps: int = 0                      # > 0: the MTBI is the mean of that many gaps in the store's history
    notice: NoticeFit | None = None
    blocking_time: float = 0.0              # what each save stops training for (0: not known, not counted)

    @property
    def within_budget(self) -> bool:
        return self.interval.badput <= self.budget * (1 + 1e-9)

    def lines(self) -> list[str]:
        iv = self.interval
        blocked = f", blocking {format_duration(self.blocking_time)}" if self.blocking_time else ""
        inputs = (f"step {format_duration(self.step_time)}, save {format_duration(self.save_time)}{blocked}, "
                  f"MTBI {format_duration(self.mtbi)} (budget {format_percent(self.budget)})")
        out = []
        m = self.measured
        if m is not None and self.measured_fields and m.source == "metric lines":
            what = {"step_time": f"step {format_duration(m.step_time)}",
                    "save_time": f"save {format_duration(m.save_time)}",
                    "blocking_time": f"blocking {format_duration(m.blocking_time or 0.0)}"}
            parts = [what[name] for name in self.measured_fields]
            if "save_time" in self.measured_fields and m.write_time is not None:
                parts.append(f"background write {format_duration(m.write_time)}")
            out.append(f"measured on {self.host}, the run's metric lines (medians of {m.samples} saves): "
                       f"{', '.join(parts)}")
        elif m is not None and self.measured_fields:
            what = {"step_time": f"step {format_duration(m.step_time)} (median of {m.samples} checkpoint pairs)",
                    "save_time": f"save {format_duration(m.save_time)}"}
            out.append(f"measured on {self.host}: {', '.join(what[name] for name in self.measured_fields)}")
        verdict = "" if not self.given else (" - within budget" if self.within_budget else " - OVER budget")
        if self.mtbi_gaps:
            out.append(f"MTBI {format_duration(self.mtbi)}: measured from {self.mtbi_gaps + 1} interruptions in the "
                       "store's history (.relaunch/history.jsonl), the mean running time between them")
        out.append(f"save every {iv.steps} steps ({iv.seconds / 60:.1f} min): Badput {format_percent(iv.badput)} "
                   f"with {inputs}{verdict}")
        if self.blocking_time:
            saving = self.blocking_time / iv.seconds
            out.append(f"  of which saving {format_percent(saving)} (blocking / interval) and failures "
                       f"{format_percent(iv.badput - saving)} ((save + interval/2) / MTBI)")
        yd = self.young_daly
        formula = "sqrt(2*C*MTBI), C the blocking time," if self.blocking_time else "sqrt(2*S*MTBI)"
        out.append(f"Young/Daly optimum {formula} for reference: every {format_duration(yd.seconds)} "
                   f"({yd.steps} steps, Badput {format_percent(yd.badput)})")
        if self.notice is not None:
            out.append(self.notice.line())
        return out

    def as_dict(self) -> dict[str, Any]:
        return {
            "step_time": self.step_time, "save_time": self.save_time, "mtbi": self.mtbi, "budget": self.budget,
            "interval": asdict(self.interval), "given": self.given, "within_budget": self.within_budget,
            "young_daly": asdict(self.young_daly),
            "measured": None if self.measured is None else {"host": self.host, **asdict(self.measured)},
            "measured_fields": list(self.measured_fields),
            "mtbi_from": "history" if self.mtbi_gaps else "given", "mtbi_gaps": self.mtbi_gaps,
            "notice": None if self.notice is None else self.notice.as_dict(),
            "blocking_time": self.blocking_time,
        }


def compute(step_time: float | None, save_time: float | None, mtbi: float, budget: float,
            every: int | None = None, measured: Measured | None = None, host: str = "",
            blocking: float | None = None) -> Result:
    """The command's answer. A step or save time left None is taken from `measured`; with the
    save time, the blocking time too when the run logged it (else 0: not counted)."""
    fields = []
    if step_time is None or save_time is None:
        if measured is None:
            raise UsageError("give --step-time and --save-time, or RECIPE HOST to measure them "
                             "from the checkpoints on the instance")
        if step_time is None:
            step_time = measured.step_time
            fields.append("step_time")
        if save_time is None:
            save_time = measured.save_time
            fields.append("save_time")
            if blocking is None and measured.blocking_time is not None:
                blocking = measured.blocking_time
                fields.append("blocking_time")
    blocking = blocking or 0.0
    chosen = (interval(step_time, save_time, mtbi, every, blocking) if every is not None
              else best_interval(step_time, save_time, mtbi, budget, blocking))
    return Result(step_time, save_time, mtbi, budget, chosen, every is not None,
                  young_daly(step_time, save_time, mtbi, blocking), measured, host, tuple(fields),
                  blocking_time=blocking)


def measure_instance(recipe: Recipe, spec: HostSpec, ui: UI, save_time: float | None) -> tuple[Measured, str]:
    """Connect like `up`; the Checkpointer's metric lines in the run's log when it wrote them,
    else the complete checkpoints under checkpoint.dir, `measure`d by their mtimes."""
    from .cycle import open_host
    from .gather import gather
    from .savecosts import read_command, saves_of, summarize
    from .steps.checkpoint import instance_checkpoints

    node, remote = open_host(recipe, spec, ui)
    with remote:
        job = gather(remote, recipe, node)
        lines = remote.exec(read_command(job.paths.log), deadline=LOG_DEADLINE)
        costs = summarize(saves_of(lines.text)) if lines.ok else None
        if costs is not None and costs.step_time is not None:
            ui.say(f"[{job.host}] {costs.saves} saves in the metric lines of {job.paths.log}")
            return measure_lines(costs), job.host
        checkpoints = instance_checkpoints(job)
        ui.say(f"[{job.host}] {len(checkpoints)} complete checkpoints in {job.paths.ckpt_dir}")
        return measure(checkpoints, save_time), job.host


# -- from the store's history and the provider's notice ---------------------------------------
def history_of(recipe: Recipe) -> list[Interruption]:
    from .history import read_history
    from .transports import open_store

    return read_history(open_store(recipe))


def measured_mtbi(recipe: Recipe, entries: list[Interruption]) -> tuple[float, int]:
    """The mean time between interruptions on record (UsageError below two of them)."""
    from .history import mean_time_between

    found = mean_time_between(entries)
    if found is None:
        raise UsageError(f"give --mtbi: the store's history of recipe {recipe.name} holds {len(entries)} "
                         "interruption(s); measuring the mean time between them needs two",
                         "`relaunch watch` records every interruption; until there are two, give --mtbi (e.g. 6h)")
    return found


def notice_fit(recipe: Recipe, save_time: float, copy_time: float | None) -> NoticeFit | None:
    """How saving plus copying compares with the documented notice window of the recipe's provider."""
    from .recipe import load_providers

    provider = load_providers().get(recipe.provider) if recipe.provider else None
    if provider is None or not provider.notice_window:
        return None
    return NoticeFit(provider.name, provider.notice_window, save_time, copy_time)


def with_history(result: Result, gaps: int, notice: NoticeFit | None) -> Result:
    return replace(result, mtbi_gaps=gaps, notice=notice)


# -- a running training's Badput, for `relaunch status` -----------------------------------------
@dataclass(frozen=True)
class BadputNow:
    """What the run pays for checkpoints at its present interval: saving's own cost (the
    blocking time every interval) and, once the MTBI is known, what failures cost."""

    costs: SaveCosts
    interruptions: int                  # on record in the store's history
    mtbi: float | None = None           # the mean time between them (two or more)
    mtbi_gaps: int = 0

    @property
    def interval_seconds(self) -> float | None:
        c = self.costs
        return c.every * c.step_time if c.every and c.step_time else None

    @property
    def saving(self) -> float | None:
        seconds = self.interval_seconds
        return self.costs.blocking / seconds if seconds else None

    @property
    def failures(self) -> float | None:
        seconds = self.interval_seconds
        return (self.costs.save_time + seconds / 2) / self.mtbi if seconds and self.mtbi else None

    @property
    def total(self) -> float | None:
        return None if self.saving is None or self.failures is None else self.saving + self.failures

    def lines(self) -> list[str]:
        c = self.costs
        every = (f"every {c.every} steps ({format_duration(self.interval_seconds)} of training)"
                 if self.interval_seconds else "interval not known yet (one save so far)")
        out = [f"saving: {every}, blocking {format_duration(c.blocking)} + background write "
               f"{format_duration(c.write)} per save (medians of {c.saves} saves, {c.bytes / 1e6:.3g} MB)"]
        seen = f"{self.interruptions} interruption(s) on record"
        if self.saving is None:
            out.append(f"Badput now: not known until the interval is; {seen}")
        elif self.failures is None:
            out.append(f"Badput now: saving {format_percent(self.saving)}; failures not known: {seen} "
                       "(the MTBI needs two; `relaunch interval RECIPE --mtbi M` for a guess)")
        else:
            assert self.total is not None and self.mtbi is not None
            out.append(f"Badput now: {format_percent(self.total)} = saving {format_percent(self.saving)} + failures "
                       f"{format_percent(self.failures)} (MTBI {format_duration(self.mtbi)} from {seen})")
        return out

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self.costs), "interval_seconds": self.interval_seconds, "interruptions": self.interruptions,
                "mtbi": self.mtbi, "mtbi_gaps": self.mtbi_gaps, "saving": self.saving, "failures": self.failures,
                "badput": self.total}


def badput_now(costs: SaveCosts, entries: list[Interruption]) -> BadputNow:
    from .history import INTERRUPTIONS, mean_time_between

    found = mean_time_between(entries)
    counted = sum(1 for e in entries if e.cause in INTERRUPTIONS)
    return BadputNow(costs, counted, *(found or (None, 0)))
