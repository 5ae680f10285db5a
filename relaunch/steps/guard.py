"""The guard: a small watcher `up` starts beside training that turns a reclaim notice into a save.

`templates/guard.py` runs on the instance with the instance's own Python, in a tmux session of
its own (`SESSION-guard`): no root, no daemon manager, and it outlives the SSH connection. `up`
(re)starts it after training starts; stopping training (`evacuate --stop`) stops it, and it ends
by itself when training ends. It asks each source in `guard.sources` every `guard.every`
seconds (see the script for the exact requests), and on the first notice it sends
`run.stop.signal` to the training's process group, waits for the save until the notice's
deadline, and writes a notice record (`~/.relaunch/NAME/guard/notice.json`: source, deadline,
save, copy, verdict, times) that `status` and `watch` read.

Why the guard does not copy the checkpoint off itself, even for `via: instance` stores: it would
need the store's credentials on the instance for the whole run (a notice can come at any
moment), while relaunch hands them over only for the one copy that runs (see
transports/tools.py); and what makes a copy trustworthy (the layouts that say which checkpoint
is complete, the hashes on both ends, the manifest written last, the store lock) is relaunch's
code on this machine. So the copy is `relaunch watch`'s: it looks at the guard every
`guard.every` seconds and, on a notice, runs the same evacuation as `relaunch evacuate`; for a
`via: instance` store that is still the instance uploading directly, with the credentials on
that copy's stdin only. Without a watch running, the notice still ends
in a finished save on the instance's disk (kept on a stop or hibernation; AWS, and Azure's
Deallocate) and a notice record that `relaunch status` shows.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

from ..host.remote import upload_command
from ..job import Job
from ..layouts import LISTING_COMMAND, Entry, parse_listing
from ..plan import Action
from ..recipe import Recipe, load_providers, render_at
from ..resources import templates_dir
from ..scripts import whole_lines

SCRIPT = "guard.py"
# the documented notice windows (recipes/providers.yaml), for notices that carry no time
DOCUMENTED = ("aws", "gcp", "azure")
LOOK_DEADLINE = 20.0
LOG_LINES = 20          # of the training log, for the newest step it shows
MARK = b"\n--listing\n"


def guard_session(recipe: Recipe) -> str:
    return f"{recipe.run.session}-guard"


@dataclass(frozen=True)
class GuardPaths:
    folder: str        # state.json, notice.json, guard.log
    script: str
    config: str

    @property
    def state(self) -> str:
        return f"{self.folder}/state.json"

    @property
    def notice(self) -> str:
        return f"{self.folder}/notice.json"

    @property
    def rebalance(self) -> str:
        return f"{self.folder}/rebalance.json"


def guard_paths(job: Job) -> GuardPaths:
    state = job.paths.state
    return GuardPaths(folder=f"{state}/guard", script=f"{state}/{SCRIPT}", config=f"{state}/guard.json")


def windows(recipe: Recipe) -> dict[str, float]:
    """Seconds from a notice to the end when the notice itself carries no time: the documented
    window of each metadata source; for sigterm, file: and url: the recipe's provider's window,
    else run.stop.timeout."""
    presets = load_providers()
    out = {name: presets[name].notice_window or recipe.run.stop.timeout for name in DOCUMENTED}
    provider = presets.get(recipe.provider) if recipe.provider else None
    other = provider.notice_window if provider and provider.notice_window else recipe.run.stop.timeout
    out.update({"sigterm": other, "file": other, "url": other})
    return out


def sources(job: Job) -> list[str]:
    """guard.sources rendered, with `~` in a file: path expanded against the instance's home."""
    context = job.context()
    out = []
    for n, _ in enumerate(job.recipe.guard.sources):
        source = render_at(job.recipe, f"guard.sources.{n}", context)
        if source.startswith("file:"):
            source = "file:" + job.expand(source[len("file:"):])
        out.append(source)
    return out


def classify(names: list[str], probed: dict[str, dict[str, Any]]) -> tuple[list[str], list[str], list[str]]:
    """(the sources that can fire here, those that depend on the user (file:), those that cannot), as
    the guard's probe found them (steps/notices.py): what `up` and `status` say, in one place. A
    source the probe did not answer for cannot."""
    fire: list[str] = []
    depends: list[str] = []
    cannot: list[str] = []
    for name in names:
        fires = (probed.get(name) or {"fires": False}).get("fires")
        (fire if fires is True else depends if fires is None else cannot).append(name)
    return fire, depends, cannot


def started_line(job: Job, names: list[str], session: str) -> str:
    """What `up` says once the guard runs: the sources it watches that can reach this run, and never
    one that the probe's lines above said cannot as if it protected the run."""
    fire, depends, cannot = classify(names, job.facts.notices)
    listening = [n for n in names if n in fire or n in depends]
    if not listening:
        return (f"guard: started (tmux session {session}), but none of {', '.join(cannot)} can reach this "
                "run: no notice protects it (see above)")
    said = f"guard: watching {', '.join(listening)} every {job.recipe.guard.every:g}s (tmux session {session})"
    return said + (f"; {', '.join(cannot)} cannot reach this run" if cannot else "")


def guard_config(job: Job) -> dict[str, Any]:
    recipe, paths = job.recipe, job.paths
    return {"name": recipe.name, "host": job.host, "folder": guard_paths(job).folder, "session": recipe.run.session,
            "pgid_file": paths.pgid_file, "status_file": paths.status_file, "sources": sources(job),
            "ckpt_dir": paths.ckpt_dir,
            "every": recipe.guard.every, "signal": recipe.run.stop.signal, "stop_timeout": recipe.run.stop.timeout,
            "windows": windows(recipe)}


def plan_guard(job: Job) -> list[Action]:
    """Upload the guard and its config, then (re)start it: one guard per recipe on the instance."""
    guard = job.recipe.guard
    title = "start the guard"
    if not guard.enabled:
        return [Action("launch", title, skip="guard.enabled is false")]
    if not guard.sources:
        return [Action("launch", title, skip="guard.sources is empty")]
    where, session = guard_paths(job), guard_session(job.recipe)
    config = guard_config(job)
    python = job.facts.host.python or "python3"
    q = shlex.quote
    exact = q("=" + session)
    # the old guard (an earlier `up`'s config) goes; new-session is an atomic create, so two
    # `up`s at once still leave one guard
    start = (f"tmux kill-session -t {exact} 2>/dev/null; "
             f"tmux new-session -d -s {q(session)} {q(shlex.join([python, where.script, where.config]))} || "
             f"{{ tmux has-session -t {exact} && echo 'the guard appeared meanwhile (another up?); left alone'; }}")
    return [
        Action("launch", f"upload {SCRIPT} -> {where.script} (mode 0600)", command=upload_command(where.script, 0o600),
               stdin=templates_dir() / SCRIPT),
        Action("launch", f"upload the guard's config -> {where.config} (mode 0600)",
               command=upload_command(where.config, 0o600),
               stdin=(json.dumps(config, indent=2, sort_keys=True) + "\n").encode()),
        Action("launch", f"start the guard in tmux session {session}", command=start,
               done=started_line(job, config["sources"], session)),
    ]


def stop_guard(job: Job) -> Action:
    session = guard_session(job.recipe)
    return Action("stop", f"stop the guard (tmux session {session})",
                  command=f"tmux kill-session -t {shlex.quote('=' + session)} 2>/dev/null || true", fails_as="evacuate")


# -- looking at the guard from this machine -----------------------------------------------------
@dataclass
class Look:
    """One look at the instance: is training running, is the guard, what it says."""

    training: bool
    guard: bool
    exit: str = ""                                  # training's exit status once it ended
    clock: float | None = None                      # the instance's time when it looked (its clock)
    state: dict[str, Any] | None = None             # the guard's state.json
    notice: dict[str, Any] | None = None            # the guard's notice.json
    rebalance: dict[str, Any] | None = None         # the guard's rebalance.json (a recommendation)
    listing: list[Entry] | None = None              # checkpoint.dir, when asked for
    log_tail: list[str] = field(default_factory=list)   # the training log's last lines

    def as_dict(self) -> dict[str, Any]:
        return {"training": self.training, "guard": self.guard, "exit": self.exit, "state": self.state,
                "notice": self.notice, "rebalance": self.rebalance}


def look_command(job: Job, listing: bool = False) -> str:
    """Read-only: the sessions, training's exit status, the guard's files and (optionally) checkpoint.dir."""
    q, where, paths = shlex.quote, guard_paths(job), job.paths
    parts = [
        f"if tmux has-session -t {q('=' + job.recipe.run.session)} 2>/dev/null; then echo 'training 1'; "
        "else echo 'training 0'; fi",
        f"if tmux has-session -t {q('=' + guard_session(job.recipe))} 2>/dev/null; then echo 'guard 1'; "
        "else echo 'guard 0'; fi",
        f"echo \"exit $(head -c 20 -- {q(paths.status_file)} 2>/dev/null | tr -cd 0-9)\"",
        "echo \"clock $(date +%s.%N)\"",
        f"echo '--state'; cat -- {q(where.state)} 2>/dev/null; echo",
        f"echo '--notice'; cat -- {q(where.notice)} 2>/dev/null; echo",
        f"echo '--rebalance'; cat -- {q(where.rebalance)} 2>/dev/null; echo",
        f"echo '--log'; tail -n {LOG_LINES} -- {q(paths.log)} 2>/dev/null; echo",
    ]
    if listing:
        folder = q(paths.ckpt_dir)
        parts += ["echo '--listing'", f"if [ -d {folder} ]; then {LISTING_COMMAND.format(dir=folder)}; fi"]
    return "; ".join(parts)


def _json(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _seconds(text: str) -> float | None:
    """`date +%s.%N` as a float; a date without %N (busybox) gives its whole seconds."""
    whole, _, fraction = text.strip().partition(".")
    if not whole.isdigit():
        return None
    return float(whole) + (float("0." + fraction) if fraction.isdigit() else 0.0)


def parse_look(stdout: bytes) -> Look:
    head, marked, tail = stdout.partition(MARK)
    text, _, log_text = head.decode(errors="replace").partition("\n--log\n")
    lines = text.split("\n")
    words = dict(line.split(" ", 1) for line in lines[:4] if " " in line)
    texts = {"--state": "", "--notice": "", "--rebalance": ""}
    section = ""
    for line in lines[4:]:
        if line in texts:
            section = line
        elif section in texts:
            texts[section] += line
    # the log's tail, then the newline the look adds (MARK's first one when a listing follows):
    # a last line without a newline of its own is still being written
    log = [line for line in whole_lines(log_text if marked else log_text.removesuffix("\n")) if line]
    state, notice, rebalance = (_json(texts[k]) if texts[k].strip() else None
                                for k in ("--state", "--notice", "--rebalance"))
    return Look(training=words.get("training") == "1", guard=words.get("guard") == "1",
                exit=words.get("exit", "").strip(), clock=_seconds(words.get("clock", "")), state=state,
                notice=notice, rebalance=rebalance, listing=parse_listing(tail) if marked else None, log_tail=log)


def newest_logged_step(lines: list[str], pattern: str) -> int | None:
    """The last step number the log shows, read with run.metrics.step."""
    regex = re.compile(pattern)
    for line in reversed(lines):
        found = regex.search(line)
        if found:
            try:
                return int(found.group(1))
            except (IndexError, ValueError):
                continue
    return None


def record_command(job: Job) -> str:
    """Replace the notice record on the instance (what `watch` adds: the copy and the verdict)."""
    return upload_command(guard_paths(job).notice, 0o600)


def source_lines(state: dict[str, Any] | None, cannot: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The guard's sources, in words (`status`): on, off and why, or still being asked; `cannot`: the
    sources the probe found cannot reach this run (a guard listening to one protects nothing)."""
    if not state:
        return []
    out = []
    for name, info in (state.get("sources") or {}).items():
        if not isinstance(info, dict):
            continue
        what = info.get("state", "?")
        if what == "off":
            out.append(f"{name} off ({info.get('why') or 'no answer'}, since {info.get('at', '?')})")
        elif what == "checking":
            out.append(f"{name} not answered yet")
        else:
            out.append(f"{name} {what}" + (" (but it cannot reach this run)" if name in cannot else ""))
    return out
