"""The command line: parse, call one library function, print. Errors become exit codes here.

Progress goes to stderr; results for scripts (`--json`) to stdout. A bug shows one line and
leaves the full trace in the debug log.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from click.shell_completion import CompletionItem

from . import processes
from .errors import EvacuationError, Interrupted, RelaunchError, UsageError
from .host.spec import HostSpec
from .paths import debug_log_file
from .ui import UI, redact, setup_logging

log = logging.getLogger("relaunch")


def complete_keys(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    """`--set <TAB>`: the recipe's dotted keys, each ready for its value (`checkpoint.keep=`)."""
    from .recipe.loader import recipe_keys

    if "=" in incomplete:
        return []
    return [CompletionItem(f"{key}=") for key in recipe_keys() if key.startswith(incomplete)]


def complete_providers(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    from .recipe import load_providers

    return [CompletionItem(name) for name in load_providers() if name.startswith(incomplete)]


def common(func: Callable[..., Any]) -> Callable[..., Any]:
    func = click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE", shell_complete=complete_keys,
                        help="Override a recipe value (repeatable), e.g. --set checkpoint.keep=3.")(func)
    func = click.option("--json", "as_json", is_flag=True,
                        help="One JSON document on stdout: the result, and on failure the same with error, hint, "
                             "exit and refused; progress stays on stderr.")(func)
    func = click.option("-v", "--verbose", is_flag=True, help="Show the instance's output live.")(func)
    func = click.option("--yes", is_flag=True, help="Do not prompt.")(func)
    return func


def load(recipe_path: str, overrides: tuple[str, ...]) -> Any:
    from .recipe import check_recipe, load_recipe

    recipe = load_recipe(recipe_path, list(overrides))
    check_recipe(recipe)        # templates too: a typo is exit 2 before any host is contacted
    # secret values never reach the screen or the debug log, whatever prints them
    redact.add(os.environ.get(name, "") for name in recipe.env.secrets)
    redact.add_urls([u for u in (recipe.env.index_url, *recipe.env.extra_index_urls, recipe.env.python_mirror) if u])
    return recipe


# The one JSON document a command prints with --json: its result, set by emit() (the last call
# wins) and printed when the command ends; when it fails, the same document with the error as its
# fields (error, hint, exit, refused), never a second one.
_document: list[Any] = []


def emit(as_json: bool, data: Any) -> None:
    if as_json:
        _document[:] = [data]


def _print_document(error: dict[str, Any] | None = None) -> None:
    if not _document and error is None:
        return
    doc: Any = _document[0] if _document else {}
    if error is not None:
        doc = {**doc, **error} if isinstance(doc, dict) else {"results": doc, **error}
    click.echo(redact(json.dumps(doc, indent=2)))


def show_version(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    from .versions import versions

    found = versions()
    width = max(map(len, found))
    for name, version in found.items():
        click.echo(f"{name:<{width}}  {version}")
    ctx.exit()


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=show_version,
              help="Show relaunch's version and those of the tools it drives (ssh, rsync, tmux, rclone, hf, uv).")
def cli() -> None:
    """Make a rented cloud GPU disposable: evacuate before you destroy, `up` on the next one."""


@cli.command()
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
    from . import cycle

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


@cli.command()
@click.argument("recipe")
@click.argument("hosts", nargs=-1, required=True)
@click.option("--checkpoint", "checkpoint", metavar="NAME", default=None,
              help="Plan the resume from this checkpoint instead of the newest.")
@common
def plan(recipe: str, hosts: tuple[str, ...], checkpoint: str | None, overrides: tuple[str, ...], as_json: bool,
         verbose: bool, yes: bool) -> None:
    """What `up` would do on HOST (or a node group, node 0 first): the exact commands and rendered scripts,
    changing nothing."""
    from . import cycle

    r = load(recipe, overrides)
    ui = UI(verbose=verbose)
    show_plans(cycle.up(r, [HostSpec.parse(h) for h in hosts], ui, dry_run=True, checkpoint=checkpoint), as_json)


@cli.command()
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
    failure, or training progress with no checkpoint to copy: exit 6, DO NOT destroy."""
    from . import cycle

    r = load(recipe, overrides)
    ui = UI(verbose=verbose)
    specs = [HostSpec.parse(h) for h in hosts] if hosts else cycle.last_hosts(r, ui)
    spec = " ".join(map(str, specs))
    report = cycle.evacuate(r, specs, ui, stop=stop, allow_empty=allow_empty)
    newest = f"{report.newest} (step {report.newest_step})" if report.newest else "no checkpoint yet"
    ui.say(f"store {report.store}: copied {len(report.copied)}, already there {len(report.already)}, "
           f"newest on the instance: {newest}; {report.why}")
    emit(as_json, report.as_dict())
    if not report.safe:         # the verdict alone decides; nothing else may say "safe"
        raise EvacuationError(f"{report.why}\nevacuation NOT verified: DO NOT destroy the instance")
    ui.ok(f"safe to destroy {spec}")


@cli.command()
@click.argument("recipe")
@click.argument("hosts", nargs=-1)
@click.option("--every", type=float, default=None, help="Seconds between rounds (default checkpoint.every).")
@click.option("--once", is_flag=True, help="One round, then exit (0 verified, 6 not).")
@common
def sync(recipe: str, hosts: tuple[str, ...], every: float | None, once: bool, overrides: tuple[str, ...],
         as_json: bool, verbose: bool, yes: bool) -> None:
    """Copy new complete checkpoints off the instance while training runs, verified, round after
    round (the same copy + verify as evacuate). One line per round; Ctrl-C stops cleanly."""
    from . import cycle
    from .sync import sync as sync_loop

    r = load(recipe, overrides)
    ui = UI(verbose=verbose)
    specs = [HostSpec.parse(h) for h in hosts] if hosts else cycle.last_hosts(r, ui)
    rounds: list[dict[str, Any]] = []

    def each_round(line: str) -> None:
        # a round's report as it comes, on stderr with the progress; stdout gets one document
        click.echo(line, err=True)
        rounds.append(json.loads(line))
        emit(as_json, rounds[-1] if once else {"rounds": rounds})

    sync_loop(r, specs, ui, every if every is not None else r.checkpoint.every, once,
              emit=each_round if as_json else None)


@cli.command()
@click.argument("recipe")
@click.argument("hosts", nargs=-1)
@click.option("--take-over", is_flag=True,
              help="Take the store from another watch whose lease is still fresh (one that is gone for good).")
@common
def watch(recipe: str, hosts: tuple[str, ...], take_over: bool, overrides: tuple[str, ...], as_json: bool,
          verbose: bool, yes: bool) -> None:
    """Everything `sync` does, plus: a look at every node's guard every guard.every seconds, never held
    up by a copy; on a reclaim notice, the save after it is evacuated at once and whether it made the
    deadline is said; when an instance is lost (recover.lost_after, and recover.alive if set), run
    recover.command and `up` on the HOST it prints (a node group with recover.shrink goes on on the
    nodes left and grows back), then watch that. One watch per recipe and store. One line per step
    (--json: each event a JSON line on stderr as it comes; stdout gets one document at the end, how
    the watch ended and every event). Ctrl-C stops the watch, never the training."""
    from . import cycle
    from .watch import watch as watch_loop

    r = load(recipe, overrides)
    ui = UI(verbose=verbose)
    specs = [HostSpec.parse(h) for h in hosts] if hosts else cycle.last_hosts(r, ui)
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


@cli.command()
@click.argument("recipe")
@click.argument("hosts", nargs=-1)
@click.option("--lines", default=10, show_default=True, help="Log lines to show.")
@common
def status(recipe: str, hosts: tuple[str, ...], lines: int, overrides: tuple[str, ...], as_json: bool,
           verbose: bool, yes: bool) -> None:
    """Is training alive, its last log lines, GPUs, newest checkpoint on the instance vs newest
    verified in the store (the lag), free disk, env drift. Exit 0 alive, 4 not, 3 unreachable."""
    from . import cycle
    from .errors import EnvError
    from .status import group_status, render, render_group, status as get_status

    r = load(recipe, overrides)
    ui = UI(verbose=verbose)
    specs = [HostSpec.parse(h) for h in hosts] if hosts else cycle.last_hosts(r, ui)
    if len(specs) > 1:
        statuses = group_status(r, specs, ui, lines)
        if as_json:
            emit(True, [s.as_dict() for s in statuses])
        else:
            click.echo(render_group(statuses, r))
        down = [s.host for s in statuses if not s.alive]
        if down:
            raise EnvError(f"training is not running on {', '.join(down)} (tmux session {r.run.session})",
                           "`relaunch up RECIPE HOST...` starts the group again from the newest checkpoint")
        return
    result = get_status(r, specs[0], ui, lines)
    if as_json:
        emit(True, result.as_dict())
    else:
        click.echo(render(result, r))
    if not result.alive:
        raise EnvError(f"{result.host}: training is not running (tmux session {r.run.session})",
                       "see the log lines above; `relaunch up` starts it again from the newest checkpoint")


@cli.command()
@click.argument("recipe")
@click.argument("host", required=False)
@common
def freeze(recipe: str, host: str | None, overrides: tuple[str, ...], as_json: bool, verbose: bool,
           yes: bool) -> None:
    """Write the instance venv's `pip freeze` into the recipe's lock file, and the package indexes
    its pip and uv use into the recipe (env.index_url, env.extra_index_urls), showing the diffs first."""
    from . import cycle
    from .freeze import (index_change, instance_freeze, local_version_warning, lock_diff, lock_path, write_lock,
                         write_text)

    r = load(recipe, overrides)
    ui = UI(verbose=verbose)
    path = lock_path(r)
    spec = HostSpec.parse(host) if host else cycle.last_host(r, ui)
    new, found = instance_freeze(r, spec, ui)
    old = path.read_text().splitlines() if path.exists() else []
    diff = lock_diff(old, new, path)
    change, warnings = index_change(r, found)
    for text in warnings:
        ui.warn(text)
    warning = local_version_warning(r, new, change.index_url if change else None)
    if warning:
        ui.warn(warning)
    indexes: dict[str, Any] = {"recipe": str(r.source), "changed": change is not None,
                               "index_url": change.index_url if change else r.env.index_url,
                               "extra_index_urls": change.extra if change else r.env.extra_index_urls,
                               "found_on_instance": change.found.where if change else {}}
    if not diff and change is None:
        ui.say(f"{path} already matches the instance ({len(new)} packages), and the recipe names its indexes")
        emit(as_json, {"lock": str(path), "changed": False, "packages": len(new), "indexes": indexes})
        return
    shown = [*diff, *(change.diff() if change else [])]
    # on stderr with --json: stdout holds the one JSON document
    click.echo(redact("\n".join(shown)), err=as_json)
    if change is not None:
        ui.say(f"the instance's indexes: {change.found.shown()}")
    what = " and ".join(([f"{len(new)} packages to {path}"] if diff else []) +
                        ([f"the indexes to {change.path}"] if change else []))
    if not yes:
        if not sys.stdin.isatty():
            raise UsageError(f"not writing {what} without a prompt", "rerun with --yes")
        if not click.confirm(f"write {what}?", default=True, err=True):
            raise UsageError("nothing written")
    if diff:
        write_lock(path, new)
        ui.ok(f"wrote {path} ({len(new)} packages)")
    if change is not None:
        write_text(change.path, change.new)
        ui.ok(f"wrote env.index_url / env.extra_index_urls in {change.path}")
    emit(as_json, {"lock": str(path), "changed": bool(diff), "packages": len(new), "indexes": indexes})


@cli.command()
@click.argument("host")
@click.option("-o", "--output", "output", type=click.Path(dir_okay=False), default="recipe.yaml", show_default=True,
              help="Where to write the recipe; the lock and the program's files go beside it (never over other bytes).")
@click.option("--name", default=None, help="The recipe's name (default: the tmux or screen session's name).")
@click.option("--session", default=None, metavar="S",
              help="Which run, when several could be the training: a tmux or screen session name, or a pid.")
@click.option("--accept-new-host-key", is_flag=True,
              help="The address was reused by a new instance: forget its recorded host key and record the new one.")
@common
def adopt(host: str, output: str, name: str | None, session: str | None, accept_new_host_key: bool,
          overrides: tuple[str, ...], as_json: bool, verbose: bool, yes: bool) -> None:
    """Turn a run started by hand on HOST (in tmux, screen, or on its own) into a recipe: its command,
    workdir, venv and pip freeze (the lock), checkpoint folder and layout, GPUs, environment variables
    (secrets by name only), SSH user; the program's files are copied beside the recipe. Every fact is
    printed with its evidence, every guess marked. Read-only on the instance. --set values go into the
    recipe (e.g. --set ssh.key=KEY, --set checkpoint.remote=rclone:...)."""
    from .adopt import adopt as adopt_run, render

    ui = UI(verbose=verbose)
    chooser = ask_which if sys.stdin.isatty() and not yes else None
    result = adopt_run(HostSpec.parse(host), ui, output=Path(output), name=name, session=session,
                       overrides=overrides, choose=chooser, accept_new_host_key=accept_new_host_key)
    if as_json:
        emit(True, result.as_dict())
        click.echo(render(result), err=True)
        return
    click.echo(render(result))


def ask_which(lines: list[str]) -> int:
    """The prompt `adopt` shows when several runs could be the training: the index of the answer."""
    click.echo(f"{len(lines)} runs could be the training:", err=True)
    for n, line in enumerate(lines, 1):
        click.echo(f"  {n}) {line}", err=True)
    return int(click.prompt(f"which one? [1-{len(lines)}]", type=click.IntRange(1, len(lines)), err=True)) - 1


@cli.command()
@click.argument("recipe")
@click.option("--explain", is_flag=True,
              help="Print the merged recipe with, for every value, where it came from (file:line, preset, "
                   "default, --set).")
@common
def check(recipe: str, explain: bool, overrides: tuple[str, ...], as_json: bool, verbose: bool, yes: bool) -> None:
    """Validate a recipe (extends resolved, templates rendered) without touching any host."""
    from .recipe import check_recipe
    from .recipe.explain import explain as explained, explain_text
    from .recipe.render import disk_findings

    r = load(recipe, overrides)
    notes = check_recipe(r)
    warnings, disk_notes = disk_findings(r)
    notes += disk_notes
    for warning in warnings:
        click.echo(f"warning: {warning}", err=True)
    for note in notes:
        click.echo(f"note: {note}", err=True)
    if explain and not as_json:
        click.echo(redact(explain_text(r)), nl=False)
    click.echo(f"{recipe}: ok (recipe {r.name})", err=as_json or explain)
    result: dict[str, Any] = {"ok": True, "name": r.name, "notes": notes, "warnings": warnings}
    if explain:
        result |= {"files": r.files, "values": [e.as_dict() for e in explained(r)]}
    emit(as_json, result)


@cli.command()
@click.argument("path", required=False, type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--provider", default=None, shell_complete=complete_providers,
              help="Preset for the SSH user and port (see `relaunch providers`).")
@click.option("--layout", type=click.Choice(["auto", "files", "hf-trainer", "dcp", "deepspeed", "lightning",
                                             "accelerate"]), default=None, help="How the checkpoints look.")
@click.option("--remote", default=None, metavar="REMOTE",
              help="The store: a local path, rclone:REMOTE:PATH or hf:OWNER/REPO[/SUBFOLDER].")
@click.option("--output", "-o", "output", type=click.Path(dir_okay=False, allow_dash=True), default=None,
              hidden=True, help="Same as PATH (the older spelling).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable result on stdout.")
def init(path: str | None, provider: str | None, layout: str | None, remote: str | None, output: str | None,
         as_json: bool) -> None:
    """Write a commented starter recipe to PATH (default recipe.yaml here; `-` prints it), never over an
    existing file. What it writes passes `relaunch check`."""
    from pydantic import ValidationError

    from .recipe import starter_recipe
    from .recipe.model import Checkpoint

    if path is not None and output is not None and path != output:
        raise UsageError(f"two places to write: {path} and --output {output}", "give PATH only")
    target = path or output or "recipe.yaml"
    if remote is not None:
        try:
            Checkpoint.model_validate({"remote": remote})
        except ValidationError as exc:
            raise UsageError(f"--remote: {exc.errors()[0]['msg'].removeprefix('Value error, ')}") from None
    shown = "recipe.yaml" if target == "-" else os.path.basename(target)
    text = starter_recipe(provider, layout, remote, path=shown)
    if target == "-":
        click.echo(text, nl=False)
        return
    out = Path(target)
    try:
        with out.open("x", encoding="utf-8") as f:  # "x": refuses an existing file, atomically
            f.write(text)
    except FileExistsError:
        raise UsageError(f"{out} exists; not overwriting it", "give another PATH, or remove the file") from None
    except OSError as exc:
        raise UsageError(f"cannot write {out}: {exc.strerror or exc}") from None
    click.echo(f"wrote {out}; next: edit it, then `relaunch check {out}`", err=True)
    emit(as_json, {"wrote": str(out)})


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable result on stdout.")
def providers(as_json: bool) -> None:
    """List the provider presets: SSH user and port, whether the disk survives a stop, which disks a
    stop or a reclaim wipes, the reclaim notice the instance gets, one note, and the documentation
    each fact comes from. Each has a base recipe, `extends: [providers/NAME]`."""
    from .recipe import load_providers

    presets = load_providers()
    if as_json:
        emit(True, {n: p.as_dict() for n, p in presets.items()})
        return
    yes_no = {True: "yes", False: "no", None: "?"}
    click.echo(f"{'provider':<14} {'user':<11} {'port':<5} {'disk kept':<10} {'notice':<8} notes")
    for name, p in presets.items():
        click.echo(f"{name:<14} {p.user or '?':<11} {p.port or '?'!s:<5} {yes_no[p.disk_survives_stop]:<10} "
                   f"{p.reclaim_notice or '?':<8} {p.notes}")
        for disk in p.disks:
            fate = ", ".join(f"{what} {getattr(disk, what)}" for what in ("stop", "reclaim") if getattr(disk, what))
            click.echo(f"{'':<14} disk {disk.path} ({disk.name}): {fate or 'fate not documented'}")
        for source in p.sources:
            click.echo(f"{'':<14} source: {source}")
    click.echo("? = not known from a source (recipes/providers.yaml says where each value comes from)")


@cli.command()
@click.argument("recipe", required=False)
@click.argument("host", required=False)
@click.option("--step-time", metavar="T", help="One training step, e.g. 1.2s (else measured on RECIPE HOST).")
@click.option("--save-time", metavar="S", help="Saving one checkpoint, e.g. 90s (else measured on RECIPE HOST): "
              "from its start until it is complete, an asynchronous save's background write included.")
@click.option("--blocking-time", metavar="C", help="The part of a save that stops training, e.g. 2s: adds C/(N*T), "
              "saving's own cost, to the Badput (else measured with the save time from the metric lines of "
              "relaunch.train.Checkpointer, or not counted).")
@click.option("--mtbi", metavar="M", help="Mean time between interruptions, e.g. 6h (else measured from the "
              "history of interruptions in RECIPE's store).")
@click.option("--copy-time", metavar="C", help="Copying one checkpoint off, e.g. 40s (else the median the history "
              "measured after reclaim notices): checked with the save time against the provider's notice window.")
@click.option("--badput", "budget", metavar="B", default="5%", show_default=True,
              help="Budget: the largest share of the run a failure may cost, e.g. 5% or 0.05.")
@click.option("--every", type=click.IntRange(min=1), metavar="N", default=None,
              help="Instead: the Badput of saving every N steps.")
@common
def interval(recipe: str | None, host: str | None, step_time: str | None, save_time: str | None,
             blocking_time: str | None, mtbi: str | None, copy_time: str | None, budget: str, every: int | None,
             overrides: tuple[str, ...], as_json: bool, verbose: bool, yes: bool) -> None:
    """The checkpoint interval (steps and minutes) that keeps Badput = (S + N*T/2)/MTBI under B
    (plus C/(N*T) with a blocking time C).
    Durations: 1.2s, 90s, 90, 250ms, 5m, 6h, 2d, 1h30m. With RECIPE [HOST] instead of --step-time
    and --save-time, they are measured on the instance: from the metric lines a
    relaunch.train.Checkpointer writes into the run's log (step, save and blocking time), else
    from the checkpoint timestamps; without
    --mtbi, the MTBI is measured from the interruptions `relaunch watch` recorded in RECIPE's
    store. With RECIPE, warns when saving plus copying does not fit the provider's notice window."""
    from . import interval as iv

    if mtbi is None and recipe is None:
        raise UsageError("give --mtbi, the mean time between interruptions (e.g. --mtbi 6h), or RECIPE to "
                         "measure it from the history of interruptions in its store")
    t = iv.parse_duration(step_time, "--step-time") if step_time is not None else None
    s = iv.parse_duration(save_time, "--save-time") if save_time is not None else None
    blocking = iv.parse_duration(blocking_time, "--blocking-time") if blocking_time is not None else None
    m = iv.parse_duration(mtbi, "--mtbi") if mtbi is not None else None
    c = iv.parse_duration(copy_time, "--copy-time") if copy_time is not None else None
    b = iv.parse_fraction(budget, "--badput")
    iv.check_inputs(t, s, m if m is not None else 1.0, blocking or 0.0)
    r = load(recipe, overrides) if recipe is not None else None
    gaps, entries = 0, None
    if r is not None and m is None:
        entries = iv.history_of(r)
        m, gaps = iv.measured_mtbi(r, entries)
    assert m is not None
    measured, where = None, ""
    if (t is None or s is None) and r is not None:
        from . import cycle

        ui = UI(verbose=verbose)
        spec = HostSpec.parse(host) if host else cycle.last_host(r, ui)
        measured, where = iv.measure_instance(r, spec, ui, s)
    elif r is not None:
        click.echo("note: --step-time and --save-time given; nothing to measure on the instance", err=True)
    result = iv.compute(t, s, m, b, every, measured, where, blocking)
    notice = None
    if r is not None and iv.notice_fit(r, result.save_time, c) is not None:
        if c is None:
            from .history import copy_time as measured_copy

            c = measured_copy(entries if entries is not None else iv.history_of(r))
        notice = iv.notice_fit(r, result.save_time, c)
    result = iv.with_history(result, gaps, notice)
    if as_json:
        emit(True, result.as_dict())
        return
    for line in result.lines():
        click.echo(line)


def watch_kinds(ctx: click.Context, param: click.Parameter, value: str | None) -> list[str] | None:
    """`--watch` (a notice, then a silent loss), `--watch=notice` or `--watch=lost`."""
    if value is None:
        return None
    kinds = {"all": ["notice", "lost"], "notice": ["notice"], "lost": ["lost"]}
    if value not in kinds:
        raise click.BadParameter(f"{value!r} is not notice or lost: write --watch, --watch=notice or --watch=lost "
                                 "(after the hosts, --watch alone takes no value)")
    return kinds[value]


@cli.command()
@click.argument("recipe")
@click.argument("hosts", nargs=-1, required=True)
@click.option("--resume-on", "resume_on", multiple=True, metavar="HOST",
              help="Resume on these nodes instead (repeatable, node 0 first): fewer nodes, other GPUs.")
@click.option("--interrupt", type=click.Choice(["kill", "destroy"]), default="kill", show_default=True,
              help="kill: the training dies on every node; destroy: the last node goes (sandbox nodes only).")
@click.option("--watch", "watch_for", is_flag=False, flag_value="all", default=None, metavar="[=notice|lost]",
              callback=watch_kinds,
              help="The unattended path instead: the real `relaunch watch` beside training, a reclaim notice (the "
                   "guard's file: source), then a silent loss (sandbox instances only); --watch=notice or "
                   "--watch=lost for one. Prints time without training, steps lost and goodput. Needs "
                   "recover.command.")
@click.option("--notice-seconds", type=click.FloatRange(min=1), default=120, show_default=True,
              help="--watch: the drill's notice is this many seconds ahead of its deadline.")
@click.option("--keep", is_flag=True,
              help="--watch: leave the sandbox instances recover.command rented (else evacuated and destroyed).")
@click.option("--past", type=click.IntRange(min=1), default=3, show_default=True,
              help="Steps to run past the copied checkpoint before the interruption (the steps lost).")
@click.option("--tolerance", type=float, default=1e-4, show_default=True,
              help="Largest relative difference of loss and grad norm that still counts as continuous.")
@click.option("--deadline", type=float, default=900, show_default=True, help="Seconds each wait may take.")
@common
def drill(recipe: str, hosts: tuple[str, ...], resume_on: tuple[str, ...], interrupt: str,
          watch_for: list[str] | None, notice_seconds: float, keep: bool, past: int, tolerance: float,
          deadline: float, overrides: tuple[str, ...], as_json: bool, verbose: bool, yes: bool) -> None:
    """Rehearse an interruption for real: train to a checkpoint, interrupt, evacuate, resume
    (optionally on fewer nodes or GPUs), and compare the steps run twice (run.metrics). Prints
    steps lost, time to resume, loss and grad-norm continuity, throughput; exit 5 when the
    resumed steps do not reproduce the lost ones. With --watch, the watch does the recovering:
    see docs/spot.md."""
    from .errors import CheckpointError

    r = load(recipe, overrides)
    ui = UI(verbose=verbose)
    if watch_for is not None:
        ctx = click.get_current_context()
        given = [f"--{name.replace('_', '-')}" for name in ("resume_on", "interrupt")
                 if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT]
        if given:
            raise UsageError(f"{' and '.join(given)} {'does' if len(given) == 1 else 'do'} not go with --watch: the "
                             "watch decides where training resumes, and the drill raises a notice and a silent loss")
        from .drill import run_watched_drill

        measured = run_watched_drill(r, [HostSpec.parse(h) for h in hosts], ui, list(overrides), watch_for, past,
                                     tolerance=tolerance, deadline=deadline, notice_seconds=notice_seconds,
                                     keep=keep)
        click.echo(measured.table(), err=as_json)
        if not measured.passed:
            raise CheckpointError(f"drill --watch: {measured.failures()[0]}",
                                  "the table above, the watch's lines and the store's .relaunch/drill-*.json say "
                                  "more; check that training restores its optimizer and data order, and run.metrics")
        emit(as_json, measured.as_dict())
        return
    from .drill import run_drill

    result = run_drill(r, [HostSpec.parse(h) for h in hosts], ui,
                       [HostSpec.parse(h) for h in resume_on] or None, interrupt, past, tolerance=tolerance,
                       deadline=deadline)
    if as_json:
        emit(True, {**result.__dict__, "continuous": result.continuous})
    click.echo(result.table(), err=as_json)
    if not result.continuous:
        raise CheckpointError("drill: the resumed run does not reproduce the steps it lost" if result.rows else
                              "drill: no step was run both before and after the interruption",
                              "check that training restores its optimizer and data order, and run.metrics")


@cli.command()
@click.option("--workdir", type=click.Path(file_okay=False), default="relaunch-demo", show_default=True,
              help="Where the recipe, train.py and the store go (an earlier demo's folder is cleared).")
@click.option("--keep", is_flag=True, help="Leave the second instance (demo-b) running at the end.")
@click.option("--json", "as_json", is_flag=True, help="Print {\"ok\": true} on stdout at the end.")
def demo(workdir: str, keep: bool, as_json: bool) -> None:
    """The whole story on two local sandbox instances (Linux, root): up, evacuate, destroy, up on a
    new instance, resumed. Prints and runs the real commands; about a minute."""
    from .demo import run_demo

    run_demo(Path(workdir), keep=keep)
    emit(as_json, {"ok": True, "workdir": workdir})


# -- sandbox -------------------------------------------------------------------------------
@cli.group()
def sandbox() -> None:
    """Throwaway local instances (Linux, root): own address, real sshd, empty private disk; --image
    reproduces a provider's stock image, and stop/start/pause/resume do what its provider does."""


def _image_names() -> list[str]:
    from .sandbox.images import PROFILES

    return list(PROFILES)


@sandbox.command("create")
@click.argument("name")
@click.option("--image", type=click.Choice(_image_names()), default="default", show_default=True,
              help="Reproduce a provider's stock image (see `relaunch sandbox images`); default: this machine as it "
                   "is.")
@click.option("--user", type=click.Choice(["root", "ubuntu"]), default=None,
              help="The login user: root, or ubuntu with passwordless sudo (as on cloud images); default: root on the "
                   "default image, and each other image has its own.")
@click.option("--disk", default="4G", show_default=True, help="Size of the instance's private home (tmpfs).")
@click.option("--volume", default="8G", show_default=True,
              help="Size of the image's other disk (/workspace, /lambda/nfs/NAME, /opt/dlami/nvme; tmpfs).")
@click.option("--rate", default=None, help="Shape the link, e.g. 100mbit (tc tbf).")
@click.option("--key", "key", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Public key to authorize (default: relaunch's sandbox key).")
@click.option("--index", "index", type=click.Path(exists=True, file_okay=False), default=None,
              help="Serve this package index (a folder with simple/) inside the instance on 127.0.0.1:8765.")
@click.option("--address", default=None,
              help="This free address of the sandbox's range (one a destroyed instance had: providers reuse "
                   "addresses); default: the next free one.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable result on stdout.")
def sandbox_create(name: str, image: str, user: str | None, disk: str, volume: str, rate: str | None,
                   key: str | None, index: str | None, address: str | None, as_json: bool) -> None:
    """Create instance NAME and print how to reach it."""
    from . import sandbox as sb

    inst = sb.create(name, image=image, user=user, authorized_key=Path(key) if key else None, disk=disk,
                     volume=volume, rate=rate, index_dir=Path(index) if index else None, address=address)
    if as_json:
        emit(True, {**inst.__dict__, "host": inst.host, "key": str(sb.default_key()) if key is None else None})
        return
    click.echo(f"{inst.name}: {inst.host}  host key {inst.host_key_fingerprint}"
               + (f"  image {inst.image}" if inst.image != "default" else ""))
    if key is None:
        click.echo(f"  ssh key: {sb.default_key()}  (recipe: --set ssh.key={sb.default_key()})")
    if inst.index_url:
        click.echo(f"  package index inside the instance: {inst.index_url}")


@sandbox.command("destroy")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable result on stdout.")
def sandbox_destroy(name: str, as_json: bool) -> None:
    """Destroy instance NAME: its processes, disk, address and namespace."""
    from . import sandbox as sb

    destroyed = sb.destroy(name)
    if as_json:
        emit(True, {"name": name, "destroyed": destroyed})
        return
    click.echo(f"{name}: {'destroyed' if destroyed else 'no such instance'}")


@sandbox.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable result on stdout.")
def sandbox_list(as_json: bool) -> None:
    """List the sandbox instances."""
    from . import sandbox as sb

    instances = sb.list_instances()
    if as_json:
        emit(True, [{**i.__dict__, "host": i.host, "state": sb.state(i.name)} for i in instances])
        return
    for inst in instances:
        click.echo(f"{inst.name:<14} {inst.host:<27} {inst.image:<13} {sb.state(inst.name):<8} "
                   f"{inst.host_key_fingerprint}")


@sandbox.command("images")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable result on stdout.")
def sandbox_images(as_json: bool) -> None:
    """The image profiles `create --image` takes, and what each reproduces."""
    from .sandbox.images import PROFILES

    if as_json:
        emit(True, [{"name": i.name, "kind": i.kind, "user": i.user, "python": i.python,
                     "home_survives_stop": i.home_survives_stop, "can_pause": i.can_pause,
                     "stop_grace": i.stop_grace, "mapped_port": i.mapped_port,
                     "volumes": [{"path": v.path, "survives_stop": v.survives_stop} for v in i.volumes],
                     "summary": i.summary} for i in PROFILES.values()])
        return
    for image in PROFILES.values():
        click.echo(f"{image.name:<13} {image.summary}")


@sandbox.command("stop")
@click.argument("name")
@click.option("--grace", type=click.FloatRange(min=0), default=None,
              help="Seconds from the stop's SIGTERM to the SIGKILL of everything left (default: the image's: "
                   "runpod 5, vast 10, VMs 30, default 0).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable result on stdout.")
def sandbox_stop(name: str, grace: float | None, as_json: bool) -> None:
    """Stop instance NAME as its provider does: what survives a stop stays, the rest is wiped."""
    from . import sandbox as sb

    used = sb.stop(name, grace=grace)
    if as_json:
        emit(True, {"name": name, "state": "stopped", "grace": used})
        return
    click.echo(f"{name}: stopped")


@sandbox.command("start")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable result on stdout.")
def sandbox_start(name: str, as_json: bool) -> None:
    """Start a stopped instance NAME again: same address, host key, port and surviving disks."""
    from . import sandbox as sb

    sb.start(name)
    inst = sb.get(name)
    if as_json:
        emit(True, {**inst.__dict__, "host": inst.host, "state": "running"})
        return
    click.echo(f"{name}: running  {inst.host}")


@sandbox.command("pause")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable result on stdout.")
def sandbox_pause(name: str, as_json: bool) -> None:
    """Freeze every process of instance NAME, as Vast pauses an outbid instance (no signal)."""
    from . import sandbox as sb

    sb.pause(name)
    if as_json:
        emit(True, {"name": name, "state": "paused"})
        return
    click.echo(f"{name}: paused")


@sandbox.command("resume")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable result on stdout.")
def sandbox_resume(name: str, as_json: bool) -> None:
    """Thaw a paused instance NAME: every process goes on where it was."""
    from . import sandbox as sb

    sb.resume(name)
    if as_json:
        emit(True, {"name": name, "state": "running"})
        return
    click.echo(f"{name}: running")


_unwinding = threading.Event()


def _interrupt(signum: int, frame: object) -> None:
    """Ctrl-C or a SIGTERM: every wait in relaunch ends (CANCEL), then the main thread unwinds.
    Only once: a second Ctrl-C must not cut short the cleanup (credentials removed, the exit code
    and its message) that the first one started."""
    processes.CANCEL.set()
    if not _unwinding.is_set():
        _unwinding.set()
        raise KeyboardInterrupt


def wants_json(argv: list[str]) -> bool:
    """Was `--json` given to the command? Read from argv before click parses it, so that a usage
    error can answer in JSON too; a `--json` that is the value of another option does not count."""
    command: click.Command = cli
    takes_value: set[str] = set()
    tokens = iter(argv)
    for token in tokens:
        if token == "--":
            return False
        if token == "--json":
            return True
        if token in takes_value:
            next(tokens, None)
        elif isinstance(command, click.Group) and token in command.commands:
            command = command.commands[token]
            takes_value = {opt for p in command.params if isinstance(p, click.Option) and not p.is_flag
                           and not p.count for opt in p.opts}
    return False


def fail(as_json: bool, message: str, hint: str | None, code: int, refused: bool = False) -> int:
    """The exit code of a failure, and with --json its JSON on stdout (the text already went to stderr);
    `refused`: the other side said no (credentials, no room, a conflicting writer): a retry changes nothing."""
    if as_json:
        _print_document({"error": message, "hint": hint or None, "exit": code, "refused": refused})
    return code


def main(argv: list[str] | None = None) -> int:
    try:
        setup_logging(str(debug_log_file()))
    except OSError:
        pass
    _unwinding.clear()
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return _main(argv)
    finally:
        # the work and its exit code are decided: a Ctrl-C now must not turn them into a kill by signal
        _unwinding.set()


def _main(argv: list[str] | None) -> int:
    args = list(argv if argv is not None else sys.argv[1:])
    command = args[:1]
    as_json = wants_json(args)
    not_verified = "evacuation NOT verified: DO NOT destroy the instance"
    _document.clear()
    try:
        cli.main(args=args, prog_name="relaunch", standalone_mode=False)
        _print_document()
        return 0
    except click.exceptions.Exit as exc:
        _print_document()
        return exc.exit_code
    except click.ClickException as exc:
        exc.show()
        where = exc.ctx.command_path if isinstance(exc, click.UsageError) and exc.ctx else "relaunch"
        return fail(as_json, exc.format_message(), f"`{where} --help` shows the usage", 2)
    except (KeyboardInterrupt, Interrupted, click.exceptions.Abort):  # click turns Ctrl-C into Abort
        message = "interrupted: nothing half-written is trusted; rerun to continue"
        if command == ["watch"]:
            message = "watch stopped (Ctrl-C); the training was not touched and goes on"
        click.echo(message, err=True)
        if command == ["evacuate"]:
            click.echo(not_verified, err=True)
        return fail(as_json, message, not_verified if command == ["evacuate"] else None, Interrupted.exit_code)
    except RelaunchError as exc:
        log.debug("error", exc_info=True)
        if exc.result is not None and not _document:
            _document[:] = [exc.result]
        click.echo(redact(f"Error: {exc.message}"), err=True)
        if exc.hint:
            click.echo(redact(f"hint: {exc.hint}"), err=True)
        return fail(as_json, exc.message, exc.hint, exc.exit_code, exc.refused)
    except Exception as exc:  # a bug: one line here, the trace in the debug log
        log.exception("internal error")
        message = f"internal error: {type(exc).__name__}: {exc}"
        click.echo(redact(f"Error: {message} (full trace in {debug_log_file()})"), err=True)
        if command == ["evacuate"]:
            click.echo(not_verified, err=True)
            return fail(as_json, message, not_verified, EvacuationError.exit_code)
        return fail(as_json, message, f"full trace in {debug_log_file()}", 1)


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
