"""The command line: parse, call one library function, print. Errors become exit codes here.

Progress goes to stderr; results for scripts (`--json`) to stdout. A bug shows one line and
leaves the full trace in the debug log.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from . import __version__, processes
from .errors import EvacuationError, Interrupted, RelaunchError, UsageError
from .host.spec import HostSpec
from .paths import debug_log_file
from .ui import UI, redact, setup_logging

log = logging.getLogger("relaunch")


def common(func: Callable[..., Any]) -> Callable[..., Any]:
    func = click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE",
                        help="Override a recipe value (repeatable), e.g. --set checkpoint.keep=3.")(func)
    func = click.option("--json", "as_json", is_flag=True, help="Machine-readable result on stdout.")(func)
    func = click.option("-v", "--verbose", is_flag=True, help="Show the instance's output live.")(func)
    func = click.option("--yes", is_flag=True, help="Do not prompt.")(func)
    return func


def load(recipe_path: str, overrides: tuple[str, ...]) -> Any:
    from .recipe import check_recipe, load_recipe

    recipe = load_recipe(recipe_path, list(overrides))
    check_recipe(recipe)        # templates too: a typo is exit 2 before any host is contacted
    # secret values never reach the screen or the debug log, whatever prints them
    redact.add(os.environ.get(name, "") for name in recipe.env.secrets)
    return recipe


def emit(as_json: bool, data: Any) -> None:
    if as_json:
        click.echo(json.dumps(data, indent=2))


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="relaunch")
def cli() -> None:
    """Make a rented cloud GPU disposable: evacuate before you destroy, `up` on the next one."""


@cli.command()
@click.argument("recipe")
@click.argument("hosts", nargs=-1, required=True)
@click.option("--dry-run", is_flag=True, help="Show what would run, change nothing (same as `relaunch plan`).")
@click.option("--accept-new-host-key", is_flag=True,
              help="The address was reused by a new instance: forget its recorded host key and record the new one.")
@common
def up(recipe: str, hosts: tuple[str, ...], dry_run: bool, accept_new_host_key: bool, overrides: tuple[str, ...],
       as_json: bool, verbose: bool, yes: bool) -> None:
    """Bring fresh instance(s) back to training: connect, rebuild the env, restore the newest
    complete checkpoint, start the command in tmux. HOST is ADDRESS, USER@ADDRESS or USER@ADDRESS:PORT,
    or a Host alias from ~/.ssh/config."""
    from . import cycle

    r = load(recipe, overrides)
    specs = [HostSpec.parse(h) for h in hosts]
    ui = UI(verbose=verbose)
    results = cycle.up(r, specs, ui, dry_run=dry_run, accept_new_host_key=accept_new_host_key)
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
@click.argument("host")
@common
def plan(recipe: str, host: str, overrides: tuple[str, ...], as_json: bool, verbose: bool, yes: bool) -> None:
    """What `up` would do on HOST: the exact commands and rendered scripts, changing nothing."""
    from . import cycle

    r = load(recipe, overrides)
    ui = UI(verbose=verbose)
    show_plans(cycle.up(r, [HostSpec.parse(host)], ui, dry_run=True), as_json)


@cli.command()
@click.argument("recipe")
@click.argument("host", required=False)
@click.option("--stop", is_flag=True, help="First ask training to save and exit (run.stop), then evacuate.")
@common
def evacuate(recipe: str, host: str | None, stop: bool, overrides: tuple[str, ...], as_json: bool, verbose: bool,
             yes: bool) -> None:
    """Before destroying an instance: copy its checkpoints, env lock and log off it, verify every
    byte, then say `safe to destroy` (exit 0). Any failure: exit 6, DO NOT destroy."""
    from . import cycle

    r = load(recipe, overrides)
    ui = UI(verbose=verbose)
    spec = HostSpec.parse(host) if host else cycle.last_host(r, ui)
    report = cycle.evacuate(r, spec, ui, stop=stop)
    newest = f"{report.newest} (step {report.newest_step})" if report.newest else "no checkpoint yet"
    ui.say(f"store {report.store}: copied {len(report.copied)}, already there {len(report.already)}, "
           f"newest on the instance: {newest}")
    emit(as_json, report.as_dict())
    if not report.safe:         # the verdict alone decides; nothing else may say "safe"
        raise EvacuationError(f"the newest checkpoint on the instance, {newest}, is not verified in the store "
                              f"{report.store}\nevacuation NOT verified: DO NOT destroy the instance")
    ui.ok(f"safe to destroy {spec}")


@cli.command()
@click.argument("recipe")
@click.argument("host", required=False)
@click.option("--every", type=float, default=None, help="Seconds between rounds (default checkpoint.every).")
@click.option("--once", is_flag=True, help="One round, then exit (0 verified, 6 not).")
@common
def sync(recipe: str, host: str | None, every: float | None, once: bool, overrides: tuple[str, ...], as_json: bool,
         verbose: bool, yes: bool) -> None:
    """Copy new complete checkpoints off the instance while training runs, verified, round after
    round (the same copy + verify as evacuate). One line per round; Ctrl-C stops cleanly."""
    from . import cycle
    from .sync import sync as sync_loop

    r = load(recipe, overrides)
    ui = UI(verbose=verbose)
    spec = HostSpec.parse(host) if host else cycle.last_host(r, ui)
    sync_loop(r, spec, ui, every if every is not None else r.checkpoint.every, once,
              emit=click.echo if as_json else None)


@cli.command()
@click.argument("recipe")
@click.argument("host", required=False)
@click.option("--lines", default=10, show_default=True, help="Log lines to show.")
@common
def status(recipe: str, host: str | None, lines: int, overrides: tuple[str, ...], as_json: bool, verbose: bool,
           yes: bool) -> None:
    """Is training alive, its last log lines, GPUs, newest checkpoint on the instance vs newest
    verified in the store (the lag), free disk, env drift. Exit 0 alive, 4 not, 3 unreachable."""
    from . import cycle
    from .errors import EnvError
    from .status import render, status as get_status

    r = load(recipe, overrides)
    ui = UI(verbose=verbose)
    spec = HostSpec.parse(host) if host else cycle.last_host(r, ui)
    result = get_status(r, spec, ui, lines)
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
    """Write the instance venv's `pip freeze` into the recipe's lock file, showing the diff first."""
    from . import cycle
    from .freeze import instance_freeze, local_version_warning, lock_diff, lock_path, write_lock

    r = load(recipe, overrides)
    ui = UI(verbose=verbose)
    path = lock_path(r)
    spec = HostSpec.parse(host) if host else cycle.last_host(r, ui)
    new = instance_freeze(r, spec, ui)
    old = path.read_text().splitlines() if path.exists() else []
    diff = lock_diff(old, new, path)
    warning = local_version_warning(r, new)
    if warning:
        ui.warn(warning)
    if not diff:
        ui.say(f"{path} already matches the instance ({len(new)} packages)")
        emit(as_json, {"lock": str(path), "changed": False, "packages": len(new)})
        return
    click.echo("\n".join(diff))
    if not yes:
        if not sys.stdin.isatty():
            raise UsageError(f"not overwriting {path} without a prompt", "rerun with --yes")
        if not click.confirm(f"write {len(new)} packages to {path}?", default=True, err=True):
            raise UsageError(f"{path} left unchanged")
    write_lock(path, new)
    ui.ok(f"wrote {path} ({len(new)} packages)")
    emit(as_json, {"lock": str(path), "changed": True, "packages": len(new)})


@cli.command()
@click.argument("recipe")
@common
def check(recipe: str, overrides: tuple[str, ...], as_json: bool, verbose: bool, yes: bool) -> None:
    """Validate a recipe (extends resolved, templates rendered) without touching any host."""
    from .recipe import check_recipe

    r = load(recipe, overrides)
    notes = check_recipe(r)
    for note in notes:
        click.echo(f"note: {note}", err=True)
    click.echo(f"{recipe}: ok (recipe {r.name})")
    emit(as_json, {"ok": True, "name": r.name, "notes": notes})


@cli.command()
@click.option("--provider", default=None, help="Preset for the SSH user and port (see `relaunch providers`).")
@click.option("--output", "-o", type=click.Path(dir_okay=False), default=None, help="Write here instead of stdout.")
def init(provider: str | None, output: str | None) -> None:
    """Write a commented starter recipe."""
    from .recipe import starter_recipe

    text = starter_recipe(provider)
    if output is None:
        click.echo(text, nl=False)
        return
    path = Path(output)
    if path.exists():
        raise UsageError(f"{path} exists; not overwriting it")
    path.write_text(text)
    click.echo(f"wrote {path}", err=True)


@cli.command()
@click.option("--json", "as_json", is_flag=True)
def providers(as_json: bool) -> None:
    """List the provider presets (SSH user, port, notes)."""
    from .recipe import load_providers

    presets = load_providers()
    if as_json:
        emit(True, {n: {"user": p.user, "port": p.port, "notes": p.notes} for n, p in presets.items()})
        return
    for name, p in presets.items():
        click.echo(f"{name:<14} {p.user:<8} {p.port:<5} {p.notes}")


@cli.command()
@click.argument("recipe", required=False)
@click.argument("host", required=False)
@click.option("--step-time", metavar="T", help="One training step, e.g. 1.2s (else measured on RECIPE HOST).")
@click.option("--save-time", metavar="S", help="Saving one checkpoint, e.g. 90s (else measured on RECIPE HOST).")
@click.option("--mtbi", metavar="M", help="Mean time between interruptions, e.g. 6h (required).")
@click.option("--badput", "budget", metavar="B", default="5%", show_default=True,
              help="Budget: the largest share of the run a failure may cost, e.g. 5% or 0.05.")
@click.option("--every", type=click.IntRange(min=1), metavar="N", default=None,
              help="Instead: the Badput of saving every N steps.")
@common
def interval(recipe: str | None, host: str | None, step_time: str | None, save_time: str | None,
             mtbi: str | None, budget: str, every: int | None, overrides: tuple[str, ...], as_json: bool,
             verbose: bool, yes: bool) -> None:
    """The checkpoint interval (steps and minutes) that keeps Badput = (S + N*T/2)/MTBI under B.
    Durations: 1.2s, 90s, 90, 250ms, 5m, 6h, 2d, 1h30m. With RECIPE [HOST] instead of --step-time
    and --save-time, they are measured from the checkpoint timestamps on the instance."""
    from . import interval as iv

    if mtbi is None:
        raise UsageError("give --mtbi, the mean time between interruptions (e.g. --mtbi 6h)")
    t = iv.parse_duration(step_time, "--step-time") if step_time is not None else None
    s = iv.parse_duration(save_time, "--save-time") if save_time is not None else None
    m = iv.parse_duration(mtbi, "--mtbi")
    b = iv.parse_fraction(budget, "--badput")
    iv.check_inputs(t, s, m)
    measured, where = None, ""
    if (t is None or s is None) and recipe is not None:
        from . import cycle

        r = load(recipe, overrides)
        ui = UI(verbose=verbose)
        spec = HostSpec.parse(host) if host else cycle.last_host(r, ui)
        measured, where = iv.measure_instance(r, spec, ui, s)
    elif recipe is not None:
        click.echo("note: --step-time and --save-time given; nothing to measure on the instance", err=True)
    result = iv.compute(t, s, m, b, every, measured, where)
    if as_json:
        emit(True, result.as_dict())
        return
    for line in result.lines():
        click.echo(line)


@cli.command()
@click.option("--workdir", type=click.Path(file_okay=False), default="relaunch-demo", show_default=True,
              help="Where the recipe, train.py and the store go (an earlier demo's folder is cleared).")
@click.option("--keep", is_flag=True, help="Leave the second instance (demo-b) running at the end.")
def demo(workdir: str, keep: bool) -> None:
    """The whole story on two local sandbox instances (Linux, root): up, evacuate, destroy, up on a
    new instance, resumed. Prints and runs the real commands; about a minute."""
    from .demo import run_demo

    run_demo(Path(workdir), keep=keep)


# -- sandbox -------------------------------------------------------------------------------
@cli.group()
def sandbox() -> None:
    """Throwaway local instances (Linux, root): own address, real sshd, empty private disk."""


@sandbox.command("create")
@click.argument("name")
@click.option("--user", type=click.Choice(["root", "ubuntu"]), default="root", show_default=True)
@click.option("--disk", default="4G", show_default=True, help="Size of the instance's private home (tmpfs).")
@click.option("--rate", default=None, help="Shape the link, e.g. 100mbit (tc tbf).")
@click.option("--key", "key", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Public key to authorize (default: relaunch's sandbox key).")
@click.option("--index", "index", type=click.Path(exists=True, file_okay=False), default=None,
              help="Serve this package index (a folder with simple/) inside the instance on 127.0.0.1:8765.")
@click.option("--json", "as_json", is_flag=True)
def sandbox_create(name: str, user: str, disk: str, rate: str | None, key: str | None, index: str | None,
                   as_json: bool) -> None:
    """Create instance NAME and print how to reach it."""
    from . import sandbox as sb

    inst = sb.create(name, user=user, authorized_key=Path(key) if key else None, disk=disk, rate=rate,
                     index_dir=Path(index) if index else None)
    if as_json:
        emit(True, {**inst.__dict__, "host": inst.host, "key": str(sb.default_key()) if key is None else None})
        return
    click.echo(f"{inst.name}: {inst.host}  host key {inst.host_key_fingerprint}")
    if key is None:
        click.echo(f"  ssh key: {sb.default_key()}  (recipe: --set ssh.key={sb.default_key()})")
    if inst.index_url:
        click.echo(f"  package index inside the instance: {inst.index_url}")


@sandbox.command("destroy")
@click.argument("name")
def sandbox_destroy(name: str) -> None:
    """Destroy instance NAME: its processes, disk, address and namespace."""
    from . import sandbox as sb

    click.echo(f"{name}: {'destroyed' if sb.destroy(name) else 'no such instance'}")


@sandbox.command("list")
@click.option("--json", "as_json", is_flag=True)
def sandbox_list(as_json: bool) -> None:
    """List the sandbox instances."""
    from . import sandbox as sb

    instances = sb.list_instances()
    if as_json:
        emit(True, [{**i.__dict__, "host": i.host} for i in instances])
        return
    for inst in instances:
        click.echo(f"{inst.name:<14} {inst.host:<24} {inst.host_key_fingerprint}")


def _interrupt(signum: int, frame: object) -> None:
    """Ctrl-C or a SIGTERM: every wait in relaunch ends (CANCEL), then the main thread unwinds."""
    processes.CANCEL.set()
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    try:
        setup_logging(str(debug_log_file()))
    except OSError:
        pass
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    command = (argv if argv is not None else sys.argv[1:])[:1]
    try:
        cli.main(args=argv, prog_name="relaunch", standalone_mode=False)
        return 0
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("interrupted", err=True)
        return 130
    except click.ClickException as exc:
        exc.show()
        return 2
    except (KeyboardInterrupt, Interrupted):
        click.echo("interrupted: nothing half-written is trusted; rerun to continue", err=True)
        if command == ["evacuate"]:
            click.echo("evacuation NOT verified: DO NOT destroy the instance", err=True)
        return Interrupted.exit_code
    except RelaunchError as exc:
        log.debug("error", exc_info=True)
        click.echo(redact(f"Error: {exc.message}"), err=True)
        if exc.hint:
            click.echo(redact(f"hint: {exc.hint}"), err=True)
        return exc.exit_code
    except Exception as exc:  # a bug: one line here, the trace in the debug log
        log.exception("internal error")
        click.echo(redact(f"Error: internal error: {type(exc).__name__}: {exc} (full trace in {debug_log_file()})"),
                   err=True)
        if command == ["evacuate"]:
            click.echo("evacuation NOT verified: DO NOT destroy the instance", err=True)
            return EvacuationError.exit_code
        return 1


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
