"""`relaunch drill`: rehearse an interruption for real, and measure what it costs.

Train until the group has saved a checkpoint and run a few steps past it, copy it off (a `sync`
round, as the copy-off loop would), interrupt (kill the training, or destroy a sandbox node),
evacuate what the survivors hold, resume (on the same nodes, or on others: fewer nodes or GPUs),
and compare the first steps after the resume with the same steps before the interruption, read
from the log with `run.metrics`. The report: steps lost, time to resume, loss and grad-norm
continuity, throughput before and after; a table here and a record in the store's `.relaunch/`.
Exit 0 when the resumed steps reproduce the lost ones within the tolerance, 5 when they do not.
"""

from __future__ import annotations

import json
import re
import shlex
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from .. import processes, scripts
from ..cycle import connected, evacuate, open_group, up
from ..errors import CheckpointError, UsageError
from ..host.spec import HostSpec
from ..job import paths_before_facts, pgid_file, state_folder
from ..manifest import utc_now
from ..recipe import Recipe
from ..savecosts import saves_of, summarize
from ..steps.stop import group_script_for
from ..sync import sync_round
from ..transports import open_store
from ..ui import UI

MARK = scripts.START_MARK
LOOK_EVERY = 1.0


@dataclass
class Drill:
    recipe: str
    before: str                                   # "2 node(s)"
    after: str
    interrupt: str                                # kill | destroy HOST
    interrupted_at: int = 0                       # the last step the log showed before the interruption
    checkpoint: str = ""
    resumed_at: int = 0
    steps_lost: int = 0
    seconds_to_resume: float = 0.0
    throughput_before: float = 0.0                # steps per second
    throughput_after: float = 0.0
    tolerance: float = 1e-4
    rows: list[dict[str, Any]] = field(default_factory=list)
    worst: float = 0.0                            # the largest relative difference seen
    at: str = ""
    blocking_save: float | None = None            # seconds a save stopped training (median; the metric lines)
    saves: int = 0                                # saves in the metric lines before the interruption

    @property
    def continuous(self) -> bool:
        return bool(self.rows) and self.worst <= self.tolerance

    def table(self) -> str:
        out = [f"drill of {self.recipe}: {self.before} -> {self.after}, interrupted ({self.interrupt}) at step "
               f"{self.interrupted_at}",
               f"  resumed from                 {self.checkpoint} (step {self.resumed_at})",
               f"  steps lost                   {self.steps_lost}{blocking_note(self.blocking_save, self.saves)}",
               f"  time to resume               {self.seconds_to_resume:.1f} s (interruption -> first step after it)",
               f"  throughput before / after    {self.throughput_before:.2f} / {self.throughput_after:.2f} steps/s",
               f"  {'step':>6}  {'loss before':>12}  {'loss after':>12}  {'rel. diff':>9}  "
               f"{'grad_norm before':>16}  {'after':>12}  {'rel. diff':>9}"]
        for row in self.rows:
            out.append(f"  {row['step']:>6}  {_num(row['loss_before']):>12}  {_num(row['loss_after']):>12}  "
                       f"{_num(row['loss_diff'], '.1e'):>9}  {_num(row['grad_before']):>16}  "
                       f"{_num(row['grad_after']):>12}  {_num(row['grad_diff'], '.1e'):>9}")
        verdict = (f"continuous: the largest relative difference {self.worst:.1e} <= {self.tolerance:g}"
                   if self.continuous else
                   f"NOT continuous: relative difference {self.worst:.1e} > {self.tolerance:g}" if self.rows
                   else "nothing to compare: no step was both lost and run again")
        out.append(f"  {verdict}")
        return "\n".join(out)


def blocking_note(blocking: float | None, saves: int) -> str:
    """Beside the steps lost: what each save cost the training, when the run logged it."""
    if blocking is None:
        return ""
    from ..interval import format_duration

    return f" (a save blocked training {format_duration(blocking)}: median of {saves} saves in the metric lines)"


def _num(value: float | None, fmt: str = ".6f") -> str:
    return "-" if value is None else format(value, fmt)


def _metrics(recipe: Recipe, log: str) -> dict[int, tuple[float | None, float | None]]:
    """step -> (loss, grad_norm) of the last run in a log (after the last start marker), from its
    whole lines: the training paused (SIGSTOP) mid-line leaves `step 12 loss 0.4` of `0.45`."""
    text = log[log.rfind(MARK):] if MARK in log else log
    m = recipe.run.metrics
    found: dict[int, tuple[float | None, float | None]] = {}
    for line in scripts.whole_lines(text):
        step = re.search(m.step, line)
        if not step:
            continue
        loss = re.search(m.loss, line)
        grad = re.search(m.grad_norm, line) if m.grad_norm else None
        if loss is None and grad is None:
            continue
        found[int(step.group(1))] = (float(loss.group(1)) if loss else None, float(grad.group(1)) if grad else None)
    return found


def _rel(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


class _Watch:
    """Reads node 0's log every second: the steps seen, and when each was first seen."""

    def __init__(self, recipe: Recipe, specs: list[HostSpec], ui: UI) -> None:
        self.recipe, self.specs, self.ui = recipe, specs, ui
        self.seen: dict[int, float] = {}
        self.text = ""                            # the log as last read

    def until(self, what: str, done: Any, deadline: float) -> dict[int, tuple[float | None, float | None]]:
        end = time.monotonic() + deadline
        pairs = open_group(self.recipe, self.specs[:1], self.ui)
        with connected(pairs) as remotes:
            remote = next(iter(remotes.values()))
            log = paths_before_facts(self.recipe, pairs[0][0], remote.home).log
            while True:
                result = remote.exec(f"cat -- {shlex.quote(log)} 2>/dev/null || true", deadline=60)
                self.text = result.text
                found = _metrics(self.recipe, result.text)
                now = time.monotonic()
                for step in found:
                    self.seen.setdefault(step, now)
                if done(found):
                    return found
                if now > end:
                    raise CheckpointError(f"drill: {what} did not happen within {deadline:g}s",
                                          "look at the log (`relaunch status`); the drill changed nothing it cannot "
                                          "undo: rerun `relaunch up` to continue")
                processes.sleep(LOOK_EVERY)

    def rate(self, first: int, last: int) -> float:
        steps = [s for s in self.seen if first <= s <= last]
        if len(steps) < 2:
            return 0.0
        span = self.seen[max(steps)] - self.seen[min(steps)]
        return (max(steps) - min(steps)) / span if span > 0 else 0.0


def run_drill(recipe: Recipe, specs: list[HostSpec], ui: UI, resume_on: list[HostSpec] | None = None,
              interrupt: str = "kill", past: int = 3, after: int = 5, tolerance: float = 1e-4,
              deadline: float = 900) -> Drill:
    resume_on = resume_on or specs
    if interrupt not in ("kill", "destroy"):
        raise UsageError(f"unknown --interrupt {interrupt!r}", "kill or destroy")
    if interrupt == "destroy":
        _destroyable(specs)            # before training starts (and is paused), not after
    drill = Drill(recipe.name, f"{len(specs)} node(s)", f"{len(resume_on)} node(s)", interrupt, tolerance=tolerance,
                  at=utc_now())
    ui.say(f"# drill 1/5: training on {' '.join(map(str, specs))}")
    up(recipe, specs, ui)
    watch = _Watch(recipe, specs, ui)
    store = open_store(recipe)

    def saved_then_more(found: dict[int, Any]) -> bool:
        state = store.read()
        newest = state.manifest.newest() if state.manifest else None
        return newest is not None and bool(found) and max(found) >= newest.step + past

    # the copy-off loop's work, as `sync` does it, until a checkpoint is safe and training ran on.
    # The decision is taken on a frozen world: training paused on every node, a last round copies
    # what it saved, the log is read again. A save that lands between a look and the kill would
    # otherwise leave no step run both before and after (nothing to compare).
    until = time.monotonic() + deadline
    held = False                   # from the STOP's sending to the training's end (the kill) or its CONT
    try:
        while True:
            if time.monotonic() > until:
                raise CheckpointError(f"drill: training was never seen {past} steps past a copied checkpoint while "
                                      f"paused, within {deadline:g}s",
                                      "a save every step leaves no step to lose (raise the interval, or lower "
                                      "--past); the training goes on: `relaunch status` shows it")
            sync_round(recipe, specs, UI(quiet=True))
            before = watch.until("a checkpoint and a few steps after it", lambda f: bool(f), deadline)
            if saved_then_more(before):
                held = True
                _signal(recipe, specs, "STOP", ui)
                sync_round(recipe, specs, UI(quiet=True))
                before = watch.until("the log of the paused training", lambda f: True, deadline)
                if saved_then_more(before):
                    break
                _signal(recipe, specs, "CONT", ui)
                held = False
            processes.sleep(LOOK_EVERY)
        drill.interrupted_at = max(before)
        drill.throughput_before = watch.rate(min(before), max(before))
        costs = summarize(saves_of(watch.text))
        if costs is not None:
            drill.blocking_save, drill.saves = costs.blocking, costs.saves

        ui.say(f"# drill 2/5: interrupting at step {drill.interrupted_at} ({interrupt})")
        interrupted = time.monotonic()
        survivors = _interrupt(recipe, specs, interrupt, ui)
    except BaseException:
        if held:                   # a Ctrl-C or a failure never leaves the training paused
            _let_run(recipe, specs, ui)
        raise

    ui.say(f"# drill 3/5: evacuating {' '.join(map(str, survivors))}")
    try:
        report = evacuate(recipe, survivors, ui)
        drill.checkpoint = report.stored or ""
    except CheckpointError:
        raise
    state = store.read()
    newest = state.manifest.newest() if state.manifest else None
    if newest is None:
        raise CheckpointError("drill: the store holds no checkpoint to resume from")
    drill.checkpoint, drill.resumed_at = newest.name, newest.step
    drill.steps_lost = max(drill.interrupted_at - newest.step, 0)

    ui.say(f"# drill 4/5: resuming on {' '.join(map(str, resume_on))}")
    up(recipe, resume_on, ui, accept_new_host_key=False)
    watch_after = _Watch(recipe, resume_on, ui)
    # every step run twice is compared: the resumed run trains past the interruption, then `after` more
    resumed = watch_after.until(f"{after} steps past step {drill.interrupted_at}, where it was interrupted",
                                lambda f: any(s >= drill.interrupted_at + after for s in f), deadline)
    first_after = min((s for s in resumed if s > newest.step), default=None)
    if first_after is not None:
        drill.seconds_to_resume = watch_after.seen[first_after] - interrupted
    drill.throughput_after = watch_after.rate(newest.step + 1, max(resumed))

    ui.say("# drill 5/5: comparing the steps run twice")
    for step in range(newest.step + 1, drill.interrupted_at + 1):
        if step not in resumed or step not in before:
            continue
        (lb, gb), (la, ga) = before[step], resumed[step]
        row = {"step": step, "loss_before": lb, "loss_after": la, "loss_diff": _rel(lb, la),
               "grad_before": gb, "grad_after": ga, "grad_diff": _rel(gb, ga)}
        drill.rows.append(row)
        drill.worst = max([drill.worst, *(d for d in (row["loss_diff"], row["grad_diff"]) if d is not None)])
    store.write_meta(f"drill-{drill.at.replace(':', '')}.json", json.dumps(asdict(drill), indent=2) + "\n")
    return drill


def _signal(recipe: Recipe, specs: list[HostSpec], signal: str, ui: UI) -> None:
    """`signal` to every process below the training's group leader on every node (the group
    run.sh recorded, as `evacuate --stop` finds it), by parent: torchrun's workers have sessions
    and groups of their own. The leader itself only gets KILL: a job-control shell that sees its
    job stop goes on as if it had ended (writes an exit status, closes the session)."""
    # the whole tree is listed before any signal: a killed parent's children would move to init
    tree = ('todo=$pg; all=; while [ -n "$todo" ]; do next=; for p in $todo; do next="$next $(pgrep -P "$p")"; '
            'done; todo=$(echo $next); all="$all $todo"; done')
    targets = '$all "$pg"' if signal == "KILL" else "$all"
    pairs = open_group(recipe, specs, ui)
    with connected(pairs) as remotes:
        for remote in remotes.values():
            group = group_script_for(recipe.run.session, pgid_file(state_folder(remote.home, recipe.name)))
            remote.exec(f'{group}; [ -n "$pg" ] && {{ {tree}; kill -{signal} {targets}; }} 2>/dev/null; true',
                        deadline=30)


def _let_run(recipe: Recipe, specs: list[HostSpec], ui: UI) -> None:
    """CONT on every node the drill may have paused, each on its own, though the drill was
    interrupted (a Ctrl-C ended every other wait): a node gone (destroyed, silent) is said and the
    others still run on. A node whose training was already killed gets a CONT that finds nothing."""
    with processes.despite_cancel(60):
        for spec in specs:
            try:
                _signal(recipe, [spec], "CONT", ui)
            except Exception as exc:                 # the drill's own error or Ctrl-C is what propagates
                ui.warn(f"{spec}: could not let the paused training run on ({exc}); "
                        f"`relaunch status` shows it, `relaunch up` resumes it")


def _destroyable(specs: list[HostSpec]) -> str:
    """The sandbox node `--interrupt destroy` destroys (the last one), or a UsageError."""
    from .. import sandbox as sb

    if len(specs) == 1:
        raise UsageError("--interrupt destroy needs a group: the last node is destroyed, the others evacuate")
    match = [i for i in sb.list_instances() if i.address == specs[-1].address]
    if not match:
        raise UsageError(f"--interrupt destroy needs a sandbox node; {specs[-1]} is not one",
                         "use --interrupt kill on rented instances")
    return match[0].name


def _interrupt(recipe: Recipe, specs: list[HostSpec], how: str, ui: UI) -> list[HostSpec]:
    """Kill the training on every node at once (a crash, a preemption without notice), or destroy
    the last node (a sandbox node only). Returns the nodes that survive."""
    if how == "kill":
        # SIGKILL: the paused training can run no handler, save nothing more (a crash, a loss)
        _signal(recipe, specs, "KILL", ui)
        pairs = open_group(recipe, specs, ui)
        with connected(pairs) as remotes:
            session = shlex.quote("=" + recipe.run.session)
            for remote in remotes.values():
                remote.exec(f"tmux kill-session -t {session} 2>/dev/null; true", deadline=30)
        return specs
    if how == "destroy":
        from .. import sandbox as sb

        victim = _destroyable(specs)
        sb.destroy(victim)
        ui.say(f"destroyed sandbox node {victim} ({specs[-1]})")
        _signal(recipe, specs[:-1], "CONT", ui)            # the survivors meet the loss running, as in life
        return specs[:-1]
    raise UsageError(f"unknown --interrupt {how!r}", "kill or destroy")
