"""The commands that write or read a recipe: adopt, check, init, providers, interval."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from ..errors import UsageError
from ..host.spec import HostSpec
from ..ui import UI, redact
from .common import cli, common, complete_providers, emit, load


@cli.command(short_help="Write a recipe for a run started by hand; read-only there")
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
    from ..adopt import adopt as adopt_run
    from ..adopt import render

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


@cli.command(short_help="Validate a recipe: every value, where it came from, every guess")
@click.argument("recipe")
@click.option("--explain", is_flag=True,
              help="Print the merged recipe with every value, defaults included, and where each came from (file:line, "
                   "preset, default, --set).")
@common
def check(recipe: str, explain: bool, overrides: tuple[str, ...], as_json: bool, verbose: bool, yes: bool) -> None:
    """Validate a recipe (extends resolved, templates rendered) without touching any host, and show the
    values it sets, each with where it came from (file:line, preset, --set), and the guesses its files
    still mark: a comment starting `GUESS:` above a key, as `relaunch adopt` writes them (check the
    value, then delete `GUESS:` to confirm it). --explain shows every value, defaults included."""
    from ..recipe import check_recipe
    from ..recipe.explain import explain as explained
    from ..recipe.explain import explain_text, guesses_text, values_text
    from ..recipe.render import disk_findings

    r = load(recipe, overrides)
    notes = check_recipe(r)
    warnings, disk_notes = disk_findings(r)
    notes += disk_notes
    for warning in warnings:
        click.echo(f"warning: {warning}", err=True)
    for note in notes:
        click.echo(f"note: {note}", err=True)
    report = as_json or explain          # the listing is stdout's: the report goes to stderr
    if explain and not as_json:
        click.echo(redact(explain_text(r)), nl=False)
    click.echo(f"{recipe}: ok (recipe {r.name})", err=report)
    if not report:
        click.echo(redact(values_text(r, recipe)), nl=False)
    click.echo(redact(guesses_text(r)), nl=False, err=report)
    entries = explained(r)
    emit(as_json, {"ok": True, "name": r.name, "notes": notes, "warnings": warnings, "files": r.files,
                   "values": [e.as_dict() for e in entries], "guesses": [e.guess_dict() for e in entries if e.guess]})


@cli.command(short_help="Write a commented starter recipe")
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

    from ..recipe import starter_recipe
    from ..recipe.model import Checkpoint

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


@cli.command(short_help="List the provider presets and their base recipes")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable result on stdout.")
def providers(as_json: bool) -> None:
    """List the provider presets: SSH user and port, whether the disk survives a stop, which disks a
    stop or a reclaim wipes, the reclaim notice the instance gets, one note, and the documentation
    each fact comes from. Each has a base recipe, `extends: [providers/NAME]`."""
    from ..recipe import load_providers

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


@cli.command(short_help="The checkpoint interval that keeps Badput under a budget")
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
    from .. import interval as iv

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
    r = load(recipe, overrides, lock_needed=False) if recipe is not None else None
    gaps, entries = 0, None
    if r is not None and m is None:
        entries = iv.history_of(r)
        m, gaps = iv.measured_mtbi(r, entries)
    assert m is not None
    measured, where = None, ""
    if (t is None or s is None) and r is not None:
        from .. import cycle

        ui = UI(verbose=verbose)
        spec = HostSpec.parse(host) if host else cycle.last_host(r, ui)
        measured, where = iv.measure_instance(r, spec, ui, s)
    elif r is not None:
        click.echo("note: --step-time and --save-time given; nothing to measure on the instance", err=True)
    result = iv.compute(t, s, m, b, every, measured, where, blocking)
    notice = None
    if r is not None and iv.notice_fit(r, result.save_time, c) is not None:
        if c is None:
            from ..history import copy_time as measured_copy

            c = measured_copy(entries if entries is not None else iv.history_of(r))
        notice = iv.notice_fit(r, result.save_time, c)
    result = iv.with_history(result, gaps, notice)
    if as_json:
        emit(True, result.as_dict())
        return
    for line in result.lines():
        click.echo(line)
