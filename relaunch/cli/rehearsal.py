"""The commands that rehearse: drill, demo."""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import UsageError
from ..host.spec import HostSpec
from ..ui import UI
from .common import cli, common, emit, load


def watch_kinds(ctx: click.Context, param: click.Parameter, value: str | None) -> list[str] | None:
    """`--watch` (a notice, then a silent loss), `--watch=notice` or `--watch=lost`."""
    if value is None:
        return None
    kinds = {"all": ["notice", "lost"], "notice": ["notice"], "lost": ["lost"]}
    if value not in kinds:
        raise click.BadParameter(f"{value!r} is not notice or lost: write --watch, --watch=notice or --watch=lost "
                                 "(after the hosts, --watch alone takes no value)")
    return kinds[value]


@cli.command(short_help="Rehearse an interruption for real and measure what it costs")
@click.argument("recipe")
@click.argument("hosts", nargs=-1)
@click.option("--job", "in_job", is_flag=True,
              help="A job under a scheduler instead (`relaunch run`): measure its goodput from the timeline node 0 "
                   "wrote and the interruptions in the store's history; no HOST, nothing interrupted here.")
@click.option("--timeline", "timelines", multiple=True, type=click.Path(dir_okay=False), metavar="PATH",
              help="--job: the timeline(s) to read (default: run.log's, rendered on this machine, + .timeline).")
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
def drill(recipe: str, hosts: tuple[str, ...], in_job: bool, timelines: tuple[str, ...], resume_on: tuple[str, ...],
          interrupt: str, watch_for: list[str] | None, notice_seconds: float, keep: bool, past: int,
          tolerance: float, deadline: float, overrides: tuple[str, ...], as_json: bool, verbose: bool,
          yes: bool) -> None:
    """Rehearse an interruption for real: train to a checkpoint, interrupt, evacuate, resume
    (optionally on fewer nodes or GPUs), and compare the steps run twice (run.metrics). Prints
    steps lost, time to resume, loss and grad-norm continuity, throughput; exit 5 when the
    resumed steps do not reproduce the lost ones. With --watch, the watch does the recovering:
    see docs/spot.md. With --job, a job under a scheduler (`relaunch run`): its goodput, measured
    from what it recorded (docs/schedulers.md)."""
    from ..errors import CheckpointError

    r = load(recipe, overrides)
    ui = UI(verbose=verbose)
    if in_job:
        if hosts or watch_for is not None:
            raise UsageError("--job measures a job a scheduler ran: no HOST, no --watch")
        from ..drill.in_job import default_timeline, measure_job

        measured = measure_job(r, [Path(t) for t in timelines] or [default_timeline(r)], tolerance)
        click.echo(measured.table(), err=as_json)
        emit(as_json, measured.as_dict())
        if not measured.passed:
            raise CheckpointError(f"drill --job: {measured.failures()[0]}",
                                  "the table above and the store's .relaunch/history.jsonl say more")
        return
    if not hosts:
        raise UsageError("drill needs HOST (node 0 first), or --job for a job under a scheduler")
    if watch_for is not None:
        ctx = click.get_current_context()
        given = [f"--{name.replace('_', '-')}" for name in ("resume_on", "interrupt")
                 if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT]
        if given:
            raise UsageError(f"{' and '.join(given)} {'does' if len(given) == 1 else 'do'} not go with --watch: the "
                             "watch decides where training resumes, and the drill raises a notice and a silent loss")
        from ..drill import run_watched_drill

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
    from ..drill import run_drill

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


@cli.command(short_help="The whole story on two local sandbox instances")
@click.option("--workdir", type=click.Path(file_okay=False), default="relaunch-demo", show_default=True,
              help="Where the recipe, train.py and the store go (an earlier demo's folder is cleared).")
@click.option("--keep", is_flag=True, help="Leave the second instance (demo-b) running at the end.")
@click.option("--json", "as_json", is_flag=True, help="Print {\"ok\": true} on stdout at the end.")
def demo(workdir: str, keep: bool, as_json: bool) -> None:
    """The whole story on two local sandbox instances (Linux, root): up, evacuate, destroy, up on a
    new instance, resumed. Prints and runs the real commands; about a minute."""
    from ..demo import run_demo

    run_demo(Path(workdir), keep=keep)
    emit(as_json, {"ok": True, "workdir": workdir})


# -- sandbox -------------------------------------------------------------------------------
