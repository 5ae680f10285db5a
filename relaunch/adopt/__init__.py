"""`relaunch adopt HOST`: turn a run that was started by hand into a recipe, read-only on the instance.

Connect; read every process, session and GPU (facts.py: templates/adopt.py on the instance);
find the training (candidates.py: asking when several); read it in detail (its environment, venv,
files, checkpoint folders); list the checkpoint folders as `evacuate` will; turn all of it into a
recipe with the evidence for every value (reading.py, recipe_text.py); then write the recipe, the
lock and the program's files here, and check the recipe as `relaunch check` does. Nothing on the
instance is written, signalled or started: every command it ran is in `Result.reads`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..cycle import open_host
from ..errors import RelaunchError, UsageError
from ..gather import listing_command, read_listing
from ..host.connection import HOME_COMMAND
from ..host.remote import Remote
from ..host.spec import HostSpec
from ..layouts import Entry
from ..recipe import check_recipe, load_recipe
from ..recipe.loader import load_data, overrides_data
from ..recipe.model import NAME_RE
from ..ui import UI
from .candidates import Candidate, candidates, matching, nothing_found, on_gpus
from .commandline import invocation
from .environment import env_root, system_sites
from .facts import DETAIL_DEADLINE, SCAN_DEADLINE, Detail, Scan, run_script, script_command
from .places import Place, plan_places, scanned_places
from .program import accelerate_default_config, import_roots, program_files
from .reading import Adoption, Context, read
from .recipe_text import dotted_keys, merge, recipe_text
from .words import absolute, shown

__all__ = ["Result", "adopt", "render"]

# what adopt connects with before it knows anything: the ssh section is all that is used
SKELETON: dict[str, Any] = {"name": "adopt", "env": {"python": "3.11"}, "checkpoint": {"remote": "./store"},
                            "run": {"command": "true"}}
LISTINGS = 12            # checkpoint folders listed at most


@dataclass
class Result:
    host: str
    training: str                         # the candidate's one line
    adoption: Adoption
    recipe: Path
    wrote: list[Path] = field(default_factory=list)
    kept: list[Path] = field(default_factory=list)       # files already here with the same bytes
    reads: list[str] = field(default_factory=list)       # every command run on the instance
    notes: list[str] = field(default_factory=list)       # what `relaunch check` said
    set_keys: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"host": self.host, "training": shown(self.training), "recipe": str(self.recipe),
                "name": self.adoption.name, "wrote": [str(p) for p in self.wrote], "kept": [str(p) for p in self.kept],
                "facts": [{"key": f.key, "value": shown(f.value), "evidence": shown(f.evidence), "guess": f.guess}
                          for f in self.adoption.facts],
                "warnings": [shown(w) for w in self.adoption.warnings], "newest": self.adoption.newest,
                "reads": self.reads, "check": self.notes}


Chooser = Callable[[list[str]], int]


def adopt(spec: HostSpec, ui: UI, *, output: Path, name: str | None = None, session: str | None = None,
          overrides: tuple[str, ...] = (), choose: Chooser | None = None, accept_new_host_key: bool = False) -> Result:
    """Read the run on HOST and write its recipe at `output` (with the lock and the program's files
    beside it). `choose` asks which training when there are several (None: fail listing them).
    `--set` values go into the recipe, except ssh.host_key: a pin belongs to this instance only."""
    extra = overrides_data(overrides)
    if name is None and isinstance(extra.get("name"), str):
        name = extra["name"]                       # `--set name=X` is --name X
    if name is not None and not NAME_RE.fullmatch(name):
        raise UsageError(f"--name {name!r}: use only letters, digits, _ and - (it names the tmux session and the "
                         "store)")
    if output.exists() or output.is_symlink():
        raise UsageError(f"{output} exists; not overwriting it", "give another path with -o, or remove the file")
    above = next((p for p in output.absolute().parents if p.exists()), None)
    if above is None or not above.is_dir():
        raise UsageError(f"{output.parent} is not a folder", "give -o a path in a folder")
    skeleton = load_data(dict(SKELETON), overrides, display="adopt")
    node, remote = open_host(skeleton, spec, ui, accept_new_host_key=accept_new_host_key)
    if "host_key" in extra.get("ssh", {}):
        del extra["ssh"]["host_key"]
        if not extra["ssh"]:
            del extra["ssh"]
    reads = [HOME_COMMAND]
    with remote:
        raw = run_script(remote, "scan", None, SCAN_DEADLINE)
        reads.append(script_command("scan"))
        scan = Scan.from_dict(raw)
        chosen = pick(node.label, scan, session, choose, remote.home)
        ui.step(node.label, "adopt", f"the training: {shown(chosen.line(remote.home))}")
        detail, places, listings = read_chosen(remote, scan, chosen, reads)
    ctx = Context(host=node.label, user=scan.user or node.target.user, home=remote.home or scan.home, name=name,
                  port=node.target.port, set_keys=frozenset(dotted_keys(extra)))
    named, scanned = places
    adoption = read(scan, chosen, detail, listings, ctx, named, scanned)
    result = Result(node.label, chosen.line(ctx.home), adoption, output, reads=reads, set_keys=sorted(ctx.set_keys))
    write(result, extra)
    return result


def pick(host: str, scan: Scan, session: str | None, choose: Chooser | None, home: str) -> Candidate:
    found, skipped = candidates(scan)
    if not found:
        raise nothing_found(host, scan, skipped)
    if session is not None:
        hits = matching(found, session)
        if len(hits) == 1:
            return hits[0]
        listed = "\n".join(f"  {shown(c.line(home))}" for c in found)
        if not hits:
            raise UsageError(f"--session {session}: no training in a session or process of that name on {host}; "
                             f"found:\n{listed}", "give one of the session names above, or a pid")
        raise UsageError(f"--session {session}: {len(hits)} trainings there:\n" +
                         "\n".join(f"  {shown(c.line(home))}" for c in hits), "give the pid instead: --session PID")
    pool, _ = on_gpus(found)
    if len(pool) == 1:
        return pool[0]
    lines = [shown(c.line(home)) for c in pool]
    if choose is not None:
        return pool[choose(lines)]
    listed = "\n".join(f"  {line}" for line in lines)
    hint = pool[0].session if pool[0].kind != "process" and pool[0].session else str(pool[0].root.pid)
    raise UsageError(f"{len(pool)} runs on {host} could be the training:\n{listed}",
                     f"say which with --session (a session name or a pid), e.g. --session {hint}")


def read_chosen(remote: Remote, scan: Scan, c: Candidate,
                reads: list[str]) -> tuple[Detail, tuple[list[Place], list[Place]], dict[str, list[Entry] | None]]:
    """The detail of the chosen run, the checkpoint places and their listings (each read recorded)."""
    p = c.root
    home = p.home if p.uid != scan.uid and p.home else remote.home
    cwd = (p.cwd or home).removesuffix(" (deleted)")
    call = invocation(p.argv)
    prefix, _ = env_root(c)
    words = [call.target, *call.args, *call.launcher_words]
    paths = sorted({absolute(v, cwd, home) for w in words for v in (w, w.split("=", 1)[1] if "=" in w else "")
                    if v and "\0" not in v and len(v) < 4096})[:400]
    if accelerate_default_config(call, home):
        paths.append(accelerate_default_config(call, home))
    named_first = [pl.path for pl in plan_places(scan, c, None, "", home)]
    if c.kind == "tmux" and c.pane is not None:
        base: dict[str, Any] = {"kind": "tmux", "socket": c.pane.socket, "session": c.session}
    elif c.kind == "screen" and c.screen is not None:
        base = {"kind": "screen", "pid": c.screen.pid}
    else:
        parent = scan.procs.get(p.ppid)
        base = {"kind": "parent", "pid": parent.pid} if parent is not None and parent.pid > 1 else {"kind": "login"}
    log = p.fd1 if p.fd1.startswith("/") and not p.fd1.startswith(("/dev/", "/proc/")) else ""
    params = {"pid": p.pid, "related": [q.pid for q in c.started_by], "base": base, "prefix": prefix,
              "sites": [] if prefix else system_sites(c), "home": home, "paths": paths,
              "import_roots": import_roots(call, cwd, home), "named_dirs": named_first,
              "scan_roots": [[cwd, 4]] + ([[home, 2]] if home and home != cwd else []),
              "pane": {"socket": c.pane.socket, "id": c.pane.id} if c.kind == "tmux" and c.pane else None,
              "log": log or None}
    detail = Detail.from_dict(run_script(remote, "detail", params, DETAIL_DEADLINE))
    reads.append(script_command("detail", params))
    source = program_files(call, cwd, home, detail).text(detail)
    named = plan_places(scan, c, detail.paths, source, home)
    scanned = scanned_places(detail.folders, named)
    listings: dict[str, list[Entry] | None] = {}
    for place in [*named, *scanned][:LISTINGS]:
        listings[place.path] = read_listing(remote, place.path)
        reads.append(listing_command(place.path))
    return detail, (named, scanned), listings


# -- writing -----------------------------------------------------------------------------------------
def write(result: Result, extra: dict[str, Any]) -> None:
    """The lock, the program's files and the recipe, beside each other; nothing is overwritten
    (a file already here with the same bytes is kept); the recipe is checked before it is named."""
    adoption, output = result.adoption, result.recipe
    folder = output.parent
    data = merge(adoption.data, extra)
    notes = dict(adoption.notes)
    for key in dotted_keys(extra):
        notes[key] = ("from --set", False)
    lock_value = str(data["env"].get("lock", "requirements.lock"))
    lock = Path(lock_value) if os.path.isabs(lock_value) else folder / lock_value
    if "env.lock" in extra.get("env", {}):
        data["env"]["lock"] = str(lock)
    planned: dict[Path, str] = {lock: "\n".join(adoption.lock) + "\n"}
    for local, text in adoption.files.items():
        planned[folder / local] = text
    clashes = [path for path, text in planned.items() if path.exists() and _read(path) != text]
    if clashes:
        raise UsageError("these files exist here with other contents; not overwriting them: " +
                         ", ".join(str(p) for p in clashes),
                         "give -o a path in another (or a new, empty) folder")
    header = (f"Adopted by `relaunch adopt` from {result.host} on {time.strftime('%Y-%m-%d %H:%M %Z')}: "
              f"{shown(result.training)}. Each value says where it came from; GUESS marks what adopt could not "
              f"read for sure: check those before the first `relaunch up`, then delete `GUESS:` from each "
              f"comment you checked. `relaunch check {output.name}` validates this file and lists the guesses left.")
    text = recipe_text(data, notes, header)
    created: list[Path] = []
    made = [p for p in [folder, *folder.parents] if not p.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.adopt-{os.getpid()}")
    try:
        for path, content in planned.items():
            if path.exists():
                result.kept.append(path)
                continue
            made += [p for p in [path.parent, *path.parent.parents] if not p.exists() and p not in made]
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("x", encoding="utf-8") as f:
                f.write(content)
            created.append(path)
        tmp.write_text(text, encoding="utf-8")
        recipe = load_recipe(tmp)
        result.notes = [n.replace(str(tmp), str(output)) for n in check_recipe(recipe)]
        os.link(tmp, output)               # never over a file that appeared meanwhile
        created.append(output)
    except FileExistsError:
        _remove(created, made)
        raise UsageError(f"{output} (or a file beside it) appeared while adopt ran; nothing written") from None
    except RelaunchError as exc:
        _remove(created, made)
        raise RelaunchError(f"the recipe adopt wrote does not pass `relaunch check` (a bug in adopt): {exc.message}",
                            "nothing was written; please report it with the debug log") from exc
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    result.wrote = created


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def _remove(paths: list[Path], folders: list[Path]) -> None:
    """Undo a write that failed: the files it created, then the folders it made (innermost first)."""
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    for path in sorted(folders, key=lambda p: -len(p.parts)):
        with contextlib.suppress(OSError):
            path.rmdir()


# -- the report ---------------------------------------------------------------------------------------
def render(result: Result) -> str:
    """Every fact with its evidence, every guess marked; what was written; what to check; what next."""
    a = result.adoption
    width = max((len(f.key) for f in a.facts), default=10)
    lines = [f"adopted {shown(result.training)} on {result.host}", ""]
    for f in a.facts:
        value = shown(f.value)
        overridden = f.key in result.set_keys
        lines.append(f"  {f.key:<{width}}  {value}" + ("   (--set gives another value)" if overridden else ""))
        lines.append(f"  {'':<{width}}    {'GUESS: ' if f.guess else 'from: '}{shown(f.evidence)}")
    if a.warnings:
        lines += ["", "check these:"] + [f"  - {shown(w)}" for w in a.warnings]
    guesses = [key for key, (_, guess) in a.notes.items() if guess and key not in result.set_keys]
    if guesses:
        lines += ["", f"{len(guesses)} guess(es), marked GUESS in {result.recipe.name}: {', '.join(guesses)}",
                  f"  check each, then delete `GUESS:` from its comment; `relaunch check {result.recipe}` lists "
                  "those left"]
    wrote = ", ".join(str(p) for p in result.wrote)
    lines += ["", f"wrote {wrote}" + (f" (kept, same bytes: {', '.join(str(p) for p in result.kept)})"
                                      if result.kept else "")]
    for note in result.notes:
        lines.append(f"note: {note}")
    host = result.host
    lines += [f"next: relaunch evacuate {result.recipe} {host}   (copies its checkpoints off; changes nothing there)",
              f"      relaunch up {result.recipe} NEW_HOST        (resumes it on another instance)"]
    return "\n".join(lines)
