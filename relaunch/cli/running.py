"""The commands that act on a run: up, plan, evacuate, sync, watch, run (inside a job), status, freeze."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ..errors import EvacuationError, UsageError
from ..host.spec import HostSpec
from ..ui import UI, redact
from .common import cli, common, emit, load

if TYPE_CHECKING:                        # the model loads pydantic: not on every start
    from ..recipe import Recipe


def hosts_or_last(recipe: Recipe, hosts: tuple[str, ...], ui: UI) -> list[HostSpec]:
    """The HOSTs given, else the ones the recipe's last `up` used (evacuate, sync, watch, status)."""
    from .. import cycle

    return [HostSpec.parse(h) for h in hosts] if hosts else cycle.last_hosts(recipe, ui)


@cli.command(short_help="Bring fresh instance(s) back to training")
@click.argument("recipe")
@click.argument("hosts", nargs=-1, required=True)
@click.option("--dry-run", is_flag=True, help="Show what would run, change nothing (same as `relaunch plan`).")
@click.option("--accept-new-host-key", is_flag=True,
              help="The address was reused by a new instance: forget its recorded host key and record the new one.")
@click.option("--checkpoint", "checkpoint", metavar="NAME", default=None,
              help="Resume from this checkpoint (a name in the store's manifest) instead of the newest.")
@common
def up(recipe: str, hosts: tuple[str, ...], dry_run: bool, accept_new_host_key: bool, checkpoint: str | None,
       overrides: tuple[str, ...], as_json: bool, verbose: bool, yes: bool) -> None:
    """Bring fresh instance(s) back to training: connect, rebuild the env, restore the newest
    complete checkpoint, start the command in tmux. HOST is ADDRESS, USER@ADDRESS or USER@ADDRESS:PORT,
    or a Host alias from ~/.ssh/config."""
    from .. import cycle

    r = load(recipe, overrides)
    specs = [HostSpec.parse(h) for h in hosts]
    ui = UI(verbose=verbose)
    results = cycle.up(r, specs, ui, dry_run=dry_run, accept_new_host_key=accept_new_host_key, checkpoint=checkpoint)
    if dry_run:
        show_plans(results, as_json)
        return
    emit(as_json, [res.as_dict() for res in results])


def show_plans(results: list[Any], as_json: bool) -> None:
    """`plan` and `up --dry-run`: the plan each host's executor would run, exactly."""
    plans = [result.plan for result in results if result.plan is not None]
    if as_json:
        emit(True, [plan.as_dict() for plan in plans] if len(plans) != 1 else plans[0].as_dict())
        return
    for result in results:
        if result.plan is None:
            click.echo(f"# {result.host}: {result.status}; `up` would change nothing")
        else:
            click.echo(redact(result.plan.render()))


@cli.command(short_help="What `up` would do on HOST, changing nothing")
@click.argument("recipe")
@click.argument("hosts", nargs=-1, required=True)
@click.option("--checkpoint", "checkpoint", metavar="NAME", default=None,
              help="Plan the resume from this checkpoint instead of the newest.")
@common
def plan(recipe: str, hosts: tuple[str, ...], checkpoint: str | None, overrides: tuple[str, ...], as_json: bool,
         verbose: bool, yes: bool) -> None:
    """What `up` would do on HOST (or a node group, node 0 first): the exact commands and rendered scripts,
    changing nothing."""
    from .. import cycle

    r = load(recipe, overrides)
    ui = UI(verbose=verbose)
    show_plans(cycle.up(r, [HostSpec.parse(h) for h in hosts], ui, dry_run=True, checkpoint=checkpoint), as_json)


@cli.command(short_help="Copy checkpoints off, verify every byte: safe to destroy")
@click.argument("recipe")
@click.argument("hosts", nargs=-1)
@click.option("--stop", is_flag=True, help="First ask training to save and exit (run.stop), then evacuate.")
@click.option("--allow-empty", is_flag=True,
              help="Accept an instance with no complete checkpoint although training made progress (that "
                   "progress is lost when it is destroyed).")
@common
def evacuate(recipe: str, hosts: tuple[str, ...], stop: bool, allow_empty: bool, overrides: tuple[str, ...],
             as_json: bool, verbose: bool, yes: bool) -> None:
    """Before destroying an instance: copy its checkpoints, env lock and log off it, verify every
    byte, check that the store holds the newest one now, then say `safe to destroy` (exit 0). Any
    failure, or training progress with no checkpoint to copy: exit 6, DO NOT destroy. A checkpoint
    saved meanwhile gets another round (3 in all); a training that ended by then, one more for its
    last save; one that still saves faster than the copies: exit 6 (use --stop)."""
    from .. import cycle

    r = load(recipe, overrides, lock_needed=False)
    ui = UI(verbose=verbose)
    specs = hosts_or_last(r, hosts, ui)
    spec = " ".join(map(str, specs))
    report = cycle.evacuate(r, specs, ui, stop=stop, allow_empty=allow_empty)
    newest = f"{report.newest} (step {report.newest_step})" if report.newest else "no checkpoint yet"
    ui.say(f"store {report.store}: copied {len(report.copied)}, already there {len(report.already)}, "
           f"newest on the instance: {newest}; {report.why}")
    emit(as_json, report.as_dict())
    if not report.safe:         # the verdict alone decides; nothing else may say "safe"
        raise EvacuationError(f"{report.why}\nevacuation NOT verified: DO NOT destroy the instance")
    ui.ok(f"safe to destroy {spec}")


@cli.command(short_help="Copy new complete checkpoints off while training runs")
@click.argument("recipe")
@click.argument("hosts", nargs=-1)
@click.option("--every", type=float, default=None, help="Seconds between rounds (default checkpoint.every).")
@click.option("--once", is_flag=True, help="One round, then exit (0 verified, 6 not).")
@common
def sync(recipe: str, hosts: tuple[str, ...], every: float | None, once: bool, overrides: tuple[str, ...],
         as_json: bool, verbose: bool, yes: bool) -> None:
    """Copy new complete checkpoints off the instance while training runs, verified, round after
    round (the same copy + verify as evacuate). One line per round; Ctrl-C stops cleanly."""
    from ..sync import sync as sync_loop

    r = load(recipe, overrides, lock_needed=False)
    ui = UI(verbose=verbose)
    specs = hosts_or_last(r, hosts, ui)
    rounds: list[dict[str, Any]] = []

    def each_round(line: str) -> None:
        # a round's report as it comes, on stderr with the progress; stdout gets one document
        click.echo(line, err=True)
        rounds.append(json.loads(line))
        emit(as_json, rounds[-1] if once else {"rounds": rounds})

    sync_loop(r, specs, ui, every if every is not None else r.checkpoint.every, once,
              emit=each_round if as_json else None)


@cli.command(short_help="Sync, answer reclaim notices, replace a lost instance")
@click.argument("recipe")
@click.argument("hosts", nargs=-1)
@click.option("--take-over", is_flag=True,
              help="Take the store from another watch whose lease is still fresh (one that is gone for good).")
@common
def watch(recipe: str, hosts: tuple[str, ...], take_over: bool, overrides: tuple[str, ...], as_json: bool,
          verbose: bool, yes: bool) -> None:
    """Everything `sync` does, plus: a look at every node's guard every guard.every seconds, never held
    up by a copy; a sync round as each checkpoint is saved (at least every checkpoint.every seconds),
    and the exposure (the steps the store is behind the instance) said when the copies fall behind
    the saves; on a reclaim notice, the save after it is evacuated at once and whether it made the
    deadline is said; when an instance is lost (recover.lost_after, and recover.alive if set), run
    recover.command and `up` on the HOST it prints (a node group with recover.shrink goes on on the
    nodes left and grows back), then watch that. One watch per recipe and store. One line per step
    (--json: each event a JSON line on stderr as it comes; stdout gets one document at the end, how
    the watch ended and every event). Ctrl-C stops the watch, never the training."""
    from ..watch import watch as watch_loop

    r = load(recipe, overrides)
    ui = UI(verbose=verbose)
    specs = hosts_or_last(r, hosts, ui)
    events: list[dict[str, Any]] = []

    def each_event(line: str) -> None:
        # each event as it comes, on stderr with the lines; stdout gets one document at the end
        click.echo(line, err=True)
        events.append(json.loads(line))

    # the document a failure or Ctrl-C prints: the events so far (this very list), none before the first
    emit(as_json, {"events": events})
    outcome = watch_loop(r, specs, ui, emit=each_event if as_json else None, overrides=list(overrides),
                         take_over=take_over)
    emit(as_json, {**outcome.as_dict(), "events": events})


@cli.command("run", short_help="The job's own command inside a scheduler, on the node")
@click.argument("recipe")
@click.option("--grace", type=click.FloatRange(min=0), default=None, metavar="SECONDS",
              help="Seconds the engine leaves between its stop signal and its SIGKILL (default: Slurm's KillWait; "
                   "30 under Kubernetes, 10 under dstack; else run.stop.timeout). A notice's own deadline wins.")
@common
def run_in_job(recipe: str, grace: float | None, overrides: tuple[str, ...], as_json: bool, verbose: bool,
               yes: bool) -> None:
    """The job's own command inside a scheduler (Slurm, SkyPilot, dstack, a Kubernetes Job): on this node,
    no SSH. Restore the newest verified checkpoint from the store (and the env from env.lock, when the
    recipe has one), run the training in the foreground, copy each checkpoint it saves into the store,
    verified. On the engine's stop signal (SIGTERM, SIGINT, SIGUSR1, SIGUSR2) or a cloud notice: ask the
    training to save (run.stop), copy and verify that save, and exit 75 (requeue me) before the engine's
    SIGKILL. Exit 0 when the training finishes; on several nodes (srun) node ranks and node 0's
    address come from the engine and each node copies its own part. See docs/schedulers.md."""
    import signal

    from ..errors import Interrupted
    from ..injob import EXIT_REQUEUE
    from ..injob import run as run_here
    from .main import _interrupt

    r = load(recipe, overrides)
    if not isinstance(r.checkpoint.remote, Path):
        # the node is this machine: an rclone or hf store is reached from here, not through a relay
        r = load(recipe, (*overrides, "checkpoint.via=instance"))
    ui = UI(verbose=verbose)
    for number in (signal.SIGUSR1, signal.SIGUSR2):    # until the training starts: like a SIGTERM
        signal.signal(number, _interrupt)
    try:
        outcome = run_here(r, ui, grace)
    except (KeyboardInterrupt, Interrupted):
        message = (f"stopped before the training started: nothing half-written is trusted; exit {EXIT_REQUEUE} "
                   "(requeue me)")
        ui.warn(message)
        emit(as_json, {"exit": EXIT_REQUEUE, "why": message})
        raise click.exceptions.Exit(EXIT_REQUEUE) from None
    emit(as_json, outcome.as_dict())
    if outcome.exit:
        raise click.exceptions.Exit(outcome.exit)


@cli.command(short_help="Is training alive; checkpoints on it and stored; free disk")
@click.argument("recipe")
@click.argument("hosts", nargs=-1)
@click.option("--lines", default=10, show_default=True, help="Log lines to show.")
@common
def status(recipe: str, hosts: tuple[str, ...], lines: int, overrides: tuple[str, ...], as_json: bool,
           verbose: bool, yes: bool) -> None:
    """Is training alive, its last log lines, GPUs, newest checkpoint on the instance vs newest
    verified in the store (the lag: what a loss right now would cost), free disk, env drift, and
    the watch of this run on this machine (its last round, the exposure it measured). Exit 0 alive,
    4 not, 3 unreachable."""
    from ..errors import EnvError
    from ..status import group_status, render, render_group
    from ..status import status as get_status

    r = load(recipe, overrides, lock_needed=False)
    ui = UI(verbose=verbose)
    specs = hosts_or_last(r, hosts, ui)
    if len(specs) > 1:
        statuses = group_status(r, specs, ui, lines)
        if as_json:
            emit(True, [s.as_dict() for s in statuses])
        else:
            click.echo(render_group(statuses, r))
        down = [s.host for s in statuses if not s.alive]
        unseen = [s for s in statuses if s.unseen]
        if unseen:
            raise EnvError(f"{unseen[0].host}: {unseen[0].unseen}"
                           + (f" (and {len(down) - 1} more node(s) not seen running)" if len(down) > 1 else ""),
                           unseen[0].unseen_hint)
        if down:
            raise EnvError(f"training is not running on {', '.join(down)} (tmux session {r.run.session})",
                           "`relaunch up RECIPE HOST...` starts the group again from the newest checkpoint")
        return
    result = get_status(r, specs[0], ui, lines)
    if as_json:
        emit(True, result.as_dict())
    else:
        click.echo(render(result, r))
    if result.unseen:
        raise EnvError(f"{result.host}: {result.unseen}", result.unseen_hint)
    if not result.alive:
        raise EnvError(f"{result.host}: training is not running (tmux session {r.run.session})",
                       "see the log lines above; `relaunch up` starts it again from the newest checkpoint")


@cli.command(short_help="Pin the instance venv's pip freeze into the recipe's lock")
@click.argument("recipe")
@click.argument("host", required=False)
@common
def freeze(recipe: str, host: str | None, overrides: tuple[str, ...], as_json: bool, verbose: bool,
           yes: bool) -> None:
    """Write the instance venv's `pip freeze` into the recipe's lock file (requirements.lock beside a
    recipe that names none, and env.lock added to it), and the package indexes its pip and uv use into
    the recipe (env.index_url, env.extra_index_urls). Writing what did not exist needs no prompt;
    replacing what exists shows the diff first and asks (or needs --yes)."""
    from .. import cycle
    from ..freeze import instance_freeze, plan_freeze, write_lock, write_text

    r = load(recipe, overrides, lock_needed=False)
    ui = UI(verbose=verbose)
    spec = HostSpec.parse(host) if host else cycle.last_host(r, ui)
    new, found = instance_freeze(r, spec, ui)
    plan = plan_freeze(r, new, found)
    for text in plan.warnings:
        ui.warn(text)
    change, path = plan.change, plan.lock
    indexes: dict[str, Any] = {"recipe": str(r.source), "changed": change is not None and change.indexes,
                               "index_url": change.index_url if change else r.env.index_url,
                               "extra_index_urls": change.extra if change else r.env.extra_index_urls,
                               "found_on_instance": change.found.where if change and change.indexes else {}}
    result = {"lock": str(path), "changed": plan.writes_lock, "created": plan.old is None, "packages": len(new),
              "lock_added_to_recipe": bool(change and change.lock), "indexes": indexes}
    if not plan.writes_lock and change is None:
        ui.say(f"{path} already matches the instance ({len(new)} packages), and the recipe names its indexes")
        emit(as_json, result)
        return
    if change is not None and change.lock:
        ui.say(f"the recipe names no lock (env.lock): the instance's packages go to {path}, and "
               f"`lock: {change.lock}` under env: in {change.path}")
    # on stderr with --json: stdout holds the one JSON document
    shown = plan.diff()
    if shown:
        click.echo(redact("\n".join(shown)), err=as_json)
    if change is not None and change.indexes:
        ui.say(f"the instance's indexes: {change.found.shown()}")
    what = plan.what()
    if plan.asks and not yes:
        if not sys.stdin.isatty():
            raise UsageError(f"not writing {what}: it replaces what is there (the diff above), and there is no "
                             "terminal to ask on", "rerun with --yes to replace it")
        if not click.confirm(f"write {what}?", default=True, err=True):
            raise UsageError("nothing written")
    try:
        if plan.writes_lock:
            write_lock(path, new)
            ui.ok(f"wrote {plan.lock_words()}")
        if change is not None:
            write_text(change.path, change.new)
            ui.ok(f"wrote {plan.recipe_words()}")
    except OSError as exc:           # a read-only folder, a full disk: the user's to fix, not a crash
        raise UsageError(f"could not write {exc.filename or path}: {exc.strerror or exc}",
                         "make the recipe's folder writable (or free space), then rerun `relaunch freeze`") from exc
    emit(as_json, result)
