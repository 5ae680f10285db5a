"""`relaunch run RECIPE`: the job's own command inside a scheduler that rents, places and requeues
(Slurm, SkyPilot, dstack, a Kubernetes Job). On this node, no SSH: restore the newest verified
checkpoint (restore.py), run the training in the foreground (training.py), copy each checkpoint it
saves into the store, verified (copying.py; group.py on several nodes), and on the engine's stop
signal or a cloud notice ask it to save, copy and verify that save, and exit before the engine's
SIGKILL with EXIT_REQUEUE, the code the engine is told to requeue on.

Signals: until the training starts, a stop signal interrupts what relaunch is doing (nothing half
written is trusted) and the job exits EXIT_REQUEUE. From then on the handlers only record it; the
main loop turns it into the save (the stop's steps below), whatever relaunch was doing, and a
second signal changes nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field
from types import FrameType
from typing import Any

from .. import history, processes
from ..errors import EnvError, EvacuationError, RelaunchError
from ..recipe import Recipe
from ..steps.evacuate import Report
from ..steps.guard import guard_paths
from ..train import parse_signal
from ..transports import Store, open_store
from ..ui import UI
from . import records
from .copying import Copier, one_node_round
from .engine import Placement, placement
from .group import Follower, Leader
from .node import NodeShell, node_target
from .notices import notice_since, start_guard, stop_guard
from .restore import check_store, prepare
from .training import Training

EXIT_REQUEUE = 75          # EX_TEMPFAIL: stopped by the engine or a notice, the save verified: requeue me
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
TICK = 0.2
MIN_RESERVE = 3.0          # seconds kept for the stop's copy at least (more when copies took longer)


@dataclass
class Outcome:
    exit: int                         # 0 the training finished; EXIT_REQUEUE stopped with its save verified
    why: str
    node: str
    engine: str
    restored: str = ""                # the checkpoint this run resumed from ("" fresh start)
    step: int = 0
    stopped_by: str = ""              # the signal or notice that asked for the save
    training_exit: int | None = None
    saved: str | None = None          # the newest checkpoint verified in the store at the end
    saved_step: int | None = None
    seconds: dict[str, float] = field(default_factory=dict)   # save, copy: how long the stop's steps took

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Stop:
    cause: str            # signal | notice
    detail: str
    at: float
    deadline: float


class Signals:
    """The engine's stop signals, recorded by handlers that do nothing else (they run in the main
    thread between two bytecodes, wherever it is); the main loop looks every TICK."""

    def __init__(self) -> None:
        self.got: list[tuple[int, float]] = []

    def install(self) -> None:
        processes.RELAYED.clear()           # a SIGTERM is the engine's stop from now on, not a cancel
        # relaunch's own commands (a copy, a hash) outlive the engine's signal to every process of the job
        processes.SHIELDED[:] = ["TERM", "INT", "HUP", "USR1", "USR2"]
        for number in STOP_SIGNALS:
            signal.signal(number, self._on)

    def _on(self, signum: int, frame: FrameType | None) -> None:
        self.got.append((signum, time.time()))


def scontrol(args: list[str]) -> str:
    try:
        done = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout if done.returncode == 0 else ""


def run(recipe: Recipe, ui: UI, grace: float | None = None) -> Outcome:
    place = placement(os.environ, scontrol)
    shell = NodeShell(node_target(place.node))
    store = open_store(recipe)
    check_store(recipe, place, store)
    ui.say(f"{place.label}: {place.job or 'no scheduler seen: one node'}; store {store.label}")
    job, executor = prepare(recipe, place, shell, store, ui)
    leader = place.rank == 0
    if leader:
        records.lost_before(store, place, ui)
        records.write_job(store, place, "running", job.step or None, ui)
    outcome = Outcome(1, "", place.label, place.engine or "none", job.checkpoint, job.step)
    signals = Signals()
    signals.install()
    training = Training(job, guard_paths(job).notice, lock=bool(recipe.env.lock), timeline=leader)
    training.start()
    ui.ok(f"{place.label}: training started" + (f" from {job.checkpoint} (step {job.step})" if job.checkpoint else
                                                 " (fresh start)"))
    guard = start_guard(job)
    group: Leader | Follower | None = None
    if place.nnodes > 1:
        group = (Leader if leader else Follower)(job, shell, store, executor, place, ui)
    copier = None
    if isinstance(group, Leader):
        copier = Copier(job, shell, group.round, ui, after=lambda r: _heartbeat(store, place, training, ui),
                        newest=group.newest)
    elif leader:
        copier = Copier(job, shell, one_node_round(job, shell, store, executor, ui), ui,
                        after=lambda r: _heartbeat(store, place, training, ui))
    if copier is not None:
        copier.start()
    elif isinstance(group, Follower):
        group.start()
    try:
        stop = _supervise(job.recipe, place, store, training, signals, ui, grace, leader)
        if stop is None:
            return _ended(outcome, place, store, training, copier, group, ui)
        return _stopped(outcome, stop, place, store, training, copier, group, ui)
    finally:
        stop_guard(guard)


def _heartbeat(store: Store, place: Placement, training: Training, ui: UI) -> None:
    try:
        records.write_job(store, place, "running", training.last_step, ui)
    except RelaunchError as exc:
        ui.warn(f"could not write {records.JOB} to {store.label}: {exc.message}")


def _supervise(recipe: Recipe, place: Placement, store: Store, training: Training, signals: Signals, ui: UI,
               grace: float | None, leader: bool) -> Stop | None:
    """Until the training ends (None) or something asks it to stop."""
    window = grace if grace is not None else place.grace if place.grace is not None else recipe.run.stop.timeout
    completed = False
    while True:
        if signals.got:
            number, at = signals.got[0]
            name = signal.Signals(number).name
            return Stop("signal", f"{name} from {place.job or 'outside'}", at, at + window)
        notice = notice_since(training.job, training.started)
        if notice is not None:
            at = float(notice["seen_at"])
            deadline = float(notice.get("deadline") or at + window)
            return Stop("notice", f"{notice.get('source')}: {notice.get('detail')}", at, deadline)
        if training.poll() is not None:
            return None
        if leader and not completed and training.first_step_at is not None:
            completed = True
            threading.Thread(target=records.resumed, args=(store, place, training.first_step_at, ui),
                             name="history", daemon=True).start()
        time.sleep(TICK)


def _final_round(copier: Copier | None, group: Leader | Follower | None, final: bool, ui: UI,
                 deadline: float | None = None) -> Report | None:
    if copier is not None:
        if isinstance(group, Leader):
            group.stopping.set()            # a round waiting for the other nodes' parts gives up: the stop's goes first
        copier.finish()
        return copier.run_round(final, deadline)
    if isinstance(group, Follower):
        group.finish(deadline)
    return None


def _ended(outcome: Outcome, place: Placement, store: Store, training: Training, copier: Copier | None,
           group: Leader | Follower | None, ui: UI) -> Outcome:
    """The training ended by itself: its last checkpoints copied, then its own exit status."""
    status = training.wait(30) or 0
    training.ended(status)
    outcome.training_exit = status
    try:
        report = _final_round(copier, group, status == 0, ui, time.time() + 600)
    except RelaunchError as exc:        # the training's own failure is what this run reports (exit 4)
        if status == 0:
            raise
        report = None
        ui.warn(f"{place.label}: copying the last checkpoints failed too: {exc.message.splitlines()[0]}")
    if report is not None:
        outcome.saved, outcome.saved_step = report.stored, report.stored_step
    if place.rank == 0:
        records.write_job(store, place, "finished" if status == 0 else "failed", training.last_step, ui)
    if status != 0:
        raise EnvError(f"{place.label}: the training exited with status {status} (no stop was asked for)",
                       f"its output is above and in {training.job.paths.log}; the store holds "
                       f"{outcome.saved or 'no checkpoint'}: rerunning resumes from it")
    outcome.exit, outcome.why = 0, "the training finished"
    return outcome


def _stopped(outcome: Outcome, stop: Stop, place: Placement, store: Store, training: Training,
             copier: Copier | None, group: Leader | Follower | None, ui: UI) -> Outcome:
    """Ask the training to save (run.stop.signal to its process group), wait for it within what the
    engine leaves, then copy and verify that save, and say so before the SIGKILL."""
    recipe = training.job.recipe
    outcome.stopped_by = stop.detail
    left = stop.deadline - time.time()
    ui.warn(f"{place.label}: {stop.detail}: asking the training to save and exit (SIG{recipe.run.stop.signal}); "
            f"{left:.0f}s until the end")
    asked = time.time()
    training.stop(int(parse_signal(recipe.run.stop.signal)))
    reserve = min(max(MIN_RESERVE, 2 * (copier.seconds if copier else 0.0)), max(stop.deadline - asked, 0) / 2)
    until = min(asked + recipe.run.stop.timeout, stop.deadline - reserve)
    status = training.wait(until - time.time())
    outcome.seconds["save"] = round(time.time() - asked, 1)
    if status is None:
        ui.warn(f"{place.label}: the training has not exited {outcome.seconds['save']:.0f}s after the signal; "
                "copying the newest complete checkpoint there is")
    else:
        training.ended(status)
        outcome.training_exit = status
        ui.say(f"{place.label}: the training exited with status {status} after {outcome.seconds['save']:.1f}s")
    copying = time.time()
    verified, why = False, ""
    report = None
    try:
        report = _final_round(copier, group, True, ui, stop.deadline)
        if report is not None:
            verified, why = report.safe, report.why
        elif isinstance(group, Follower):           # node 0's verdict of the group's copy
            verified, why = group.verified, group.why
    except RelaunchError as exc:        # a store that fails or went silent: the save is not verified (exit 6, not 5)
        why = exc.message.splitlines()[0]
    outcome.seconds["copy"] = round(time.time() - copying, 1)
    if report is not None:
        outcome.saved, outcome.saved_step = report.stored, report.stored_step
    if place.rank == 0:
        _record_stop(store, place, stop, training, report, verified, ui)
    if not verified:
        raise EvacuationError(f"{place.label}: the save after {stop.detail} is NOT verified in the store: {why}",
                              "the next run resumes from the newest checkpoint the store verified before it")
    outcome.exit = EXIT_REQUEUE
    outcome.why = f"stopped by {stop.detail}; the save is verified in the store: requeue me"
    ui.ok(f"{place.label}: {why}; exiting {EXIT_REQUEUE} (requeue) "
          f"{max(stop.deadline - time.time(), 0):.0f}s before the end")
    return outcome


def _record_stop(store: Store, place: Placement, stop: Stop, training: Training, report: Report | None,
                 verified: bool, ui: UI) -> None:
    """The interruption in the store's history; completed by the run after this one."""
    try:
        entry = history.Interruption.start(place.label, stop.cause, stop.detail, stop.at, training.last_step,
                                           report.stored_step if report else None)
        entry.deadline = history.iso(stop.deadline)
        entry.made_deadline = verified and time.time() <= stop.deadline
        entry.copy_seconds = round(time.time() - stop.at, 1)
        entry.nodes_before = place.nnodes
        history.record(store, entry, ui)
        records.write_job(store, place, "stopped", training.last_step, ui)
    except RelaunchError as exc:
        ui.warn(f"could not record the stop in {store.label}'s history: {exc.message}")
