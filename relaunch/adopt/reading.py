"""From what was read on the instance to a recipe: every value with its evidence, every guess
marked. Pure: the scan, the chosen candidate, its detail and the checkpoint listings in, an
`Adoption` (recipe data, notes per key, the lock, the files to copy, the report's facts) out.

This module builds the recipe; what it builds from lives beside it: words.py (quoting, paths),
environment.py (venv, Python, lock, indexes), program.py (imports, source flags, layouts),
places.py (the checkpoint folder), provider.py. `read` stays one function of about 300 lines:
it writes the recipe key by key, each with its evidence.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

from ..layouts import Entry
from ..recipe import variables
from ..recipe.model import ENV_NAME_RE, NAME_RE
from ..ui import has_credentials, redact_url
from .candidates import Candidate
from .commandline import NNODES_FLAGS, NPROC_FLAGS, Invocation, flag_value, invocation
from .environment import env_root, index_from, lock_lines, python_version, without_relaunch
from .facts import MARK, Detail, Scan
from .places import Place, choose_place, examine
from .program import layout_in_source, pattern_in_source, program_files, source_flags
from .provider import guess_provider
from .words import (
    CKPT,
    ML_PREFIXES,
    MULTI_GPU,
    NPROC,
    RESUME,
    RESUME_OPTIONS,
    SYSTEM_PREFIXES,
    SYSTEM_VARS,
    WORLD,
    env_value,
    local_name,
    secrets_in,
    shell_word,
    shown,
    tilde,
)


@dataclass
class Fact:
    key: str                   # a recipe key (run.command) or a label (training)
    value: str                 # as shown
    evidence: str              # where it came from
    guess: bool = False


@dataclass
class Adoption:
    name: str
    data: dict[str, Any]                          # the recipe, as nested plain data
    notes: dict[str, tuple[str, bool]]            # dotted key -> (evidence, guess)
    facts: list[Fact]
    lock: list[str]                               # the lock file's lines (comments included)
    files: dict[str, str]                         # path beside the recipe -> text
    warnings: list[str] = field(default_factory=list)
    newest: str = ""                              # the newest complete checkpoint on the instance

    @property
    def guesses(self) -> list[Fact]:
        return [f for f in self.facts if f.guess]


@dataclass
class Context:
    """What adopt knows beyond the instance: how it connected and what the user asked for."""

    host: str
    user: str                       # the login user
    home: str                       # the login's home
    name: str | None = None         # --name
    port: int = 22                  # the port adopt connected on
    set_keys: frozenset[str] = frozenset()   # keys --set gives (adopt does not guess those)


class _Builder:
    def __init__(self) -> None:
        self.data: dict[str, Any] = {}
        self.notes: dict[str, tuple[str, bool]] = {}
        self.facts: list[Fact] = []
        self.warnings: list[str] = []

    def put(self, key: str, value: Any, evidence: str, guess: bool = False, show: str | None = None,
            fact: bool = True) -> None:
        node = self.data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
        self.notes[key] = (evidence, guess)
        if fact:
            self.fact(key, show if show is not None else _show_value(value), evidence, guess)

    def fact(self, key: str, value: str, evidence: str, guess: bool = False) -> None:
        self.facts.append(Fact(key, value, evidence, guess))


def _named_indexes(urls: list[str], b: _Builder) -> list[str]:
    """The index URLs for the recipe, one with a credential (the scan left it as a marker, or this
    side finds one) as `${NAME}`, with a warning naming the variable to set on this machine."""
    out: list[str] = []
    taken: set[str] = set()
    for url in urls:
        hidden = re.sub(f"{MARK}[A-Za-z_][A-Za-z0-9_]*{MARK}", "***", url)
        if hidden == url and not has_credentials(url):
            out.append(url)
            continue
        name = variables.name_for(hidden, taken)
        taken.add(name)
        out.append(f"${{{name}}}")
        b.warnings.append(f"the package index {redact_url(hidden)} holds a credential: the recipe names it as "
                          f"${{{name}}}, never the URL; set {name} to that URL on this machine (export {name}='...') "
                          "before `up`")
    return out


def _show_value(value: Any) -> str:
    if isinstance(value, list):
        return ", ".join(map(str, value))
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items())
    return str(value)


def _resume(call: Invocation, flags: dict[str, tuple[int, str]], script: str) -> tuple[list[str], str, bool, str]:
    """(program args with {{ checkpoint }} in the resume option, evidence, guess, warning)."""
    args = list(call.args)
    for name in RESUME_OPTIONS:
        for at, word in enumerate(args):
            if word == name:
                if at + 1 >= len(args) or args[at + 1].startswith("-"):
                    return args, (f"the command already passes {name} as a switch: the script resumes by itself "
                                  "(from checkpoint.dir, where `up` restores the newest)"), True, ""
                value = args[at + 1]
                if value == "":
                    args[at + 1] = CKPT
                    return args, f"the command passes {name} (empty): {{{{ checkpoint }}}} goes there", False, ""
                args[at:at + 2] = [RESUME + name]
            elif word.startswith(name + "="):
                value = word[len(name) + 1:]
                if value == "":
                    args[at] = f"{name}={CKPT}"
                    return args, f"the command passes {name}= (empty): {{{{ checkpoint }}}} goes there", False, ""
                args[at:at + 1] = [RESUME + name]
            else:
                continue
            return args, (f"the command passes {name} {shown(value)}: replaced by the checkpoint `up` restores "
                          "(left out on a fresh start)"), False, ""
    defined = [f for f in RESUME_OPTIONS if f in flags and not re.search(r"store_true|is_flag", flags[f][1])]
    if defined:
        flag = defined[0]
        return [*args, RESUME + flag], (f"{script}:{flags[flag][0]} defines {flag}; added so that `up` resumes "
                                        "from the checkpoint it restores (left out on a fresh start)"), True, ""
    if "_cli" in flags and "fit" in args:
        return [*args, RESUME + "--ckpt_path"], (
            f"{script} runs LightningCLI, whose fit subcommand takes --ckpt_path: added (left out on a fresh "
            "start)"), True, ""
    if "_hf" in flags:
        return [*args, RESUME + "--resume_from_checkpoint"], (
            f"{script} parses TrainingArguments (HfArgumentParser): --resume_from_checkpoint added (left out on "
            "a fresh start)"), True, ""
    return args, "", True, ("the command takes no resume argument adopt could find: run.command does not use "
                            "{{ checkpoint }}. Edit it so that the training resumes from {{ checkpoint }}, or make "
                            "sure it resumes from the newest checkpoint in checkpoint.dir by itself (`up` restores it "
                            "there)")


def _command(call: Invocation, args: list[str], home: str, launcher_words: list[str]) -> str:
    def word(arg: str) -> str:
        if arg == CKPT:
            return '"{{ checkpoint }}"'
        if arg.endswith(CKPT):
            return shell_word(arg[:-len(CKPT)], home) + '"{{ checkpoint }}"'
        if arg.startswith(RESUME):
            return "{% if checkpoint %}" + arg[len(RESUME):] + ' "{{ checkpoint }}"{% endif %}'
        for mark, variable in ((NPROC, "{{ nproc_per_node }}"), (WORLD, "{{ world_size }}")):
            if arg.startswith(mark):
                return shell_word(arg[len(mark):], home) + variable if arg != mark else variable
        if arg == MULTI_GPU:
            return "{% if world_size > 1 %}--multi_gpu{% endif %}"
        return shell_word(arg, home)

    head: list[str] = []
    if call.console:
        head.append(shlex.quote(os.path.basename(call.console)))
    elif call.interpreter:
        exe = os.path.basename(call.interpreter[0])
        head.append("python" if re.match(r"^python[0-9.]*$", exe) else shlex.quote(exe))
        head += [shell_word(w, home) for w in call.interpreter[1:]]
    head += [word(w) for w in launcher_words]
    if call.kind in ("module", "code"):
        head += ["-m" if call.kind == "module" else "-c", shell_word(call.target, home)]
    elif call.kind == "script":
        head.append(shell_word(call.target, home))
    return " ".join(head + [word(a) for a in args])


def read(scan: Scan, c: Candidate, detail: Detail, listings: dict[str, list[Entry] | None], ctx: Context,
         named: list[Place], scanned: list[Place]) -> Adoption:
    """The adoption of candidate `c`: `named` and `scanned` are the checkpoint places planned by
    `plan_places`, `listings` their folders' listings (None: does not exist)."""
    b = _Builder()
    p = c.root
    home = p.home if p.uid != scan.uid and p.home else ctx.home
    call = invocation(p.argv)
    since = p.start

    # -- which run -------------------------------------------------------------------------------
    how = {"tmux": f"tmux session {c.session}, window {c.pane.window if c.pane else '?'} pane "
                   f"{c.pane.pane if c.pane else '?'}",
           "screen": f"screen session {c.screen.id if c.screen else '?'}",
           "process": "outside any tmux or screen session"}
    wrapper = [w for w in c.started_by if w.argv and w.argv[0] not in ("-bash", "bash", "-sh", "sh", "-zsh", "zsh")
               and not (len(w.argv) > 2 and w.argv[1] == "-c")]
    via = f"; started by `{shown(' '.join(wrapper[-1].argv))}` (pid {wrapper[-1].pid})" if wrapper else ""
    b.fact("training", f"pid {p.pid}: {shown(' '.join(p.argv))}",
           f"{how[c.kind]}{via}; {len(c.tree)} process(es)" + (f", GPUs: {'; '.join(c.gpus)}" if c.gpus else ""))

    # -- the name --------------------------------------------------------------------------------
    stem = re.sub(r"[^A-Za-z0-9_-]+", "-", os.path.splitext(os.path.basename(call.target or call.console))[0]
                  if call.kind in ("script", "none") else call.target.rsplit(".", 1)[-1]).strip("-")
    if ctx.name:
        name, why = ctx.name, "--name"
    elif c.kind in ("tmux", "screen") and NAME_RE.fullmatch(c.session) and not c.session.isdigit():
        name, why = c.session, f"the name of the {c.kind} session"
    elif stem and NAME_RE.fullmatch(stem):
        name, why = stem, f"the program's name ({call.program})"
    else:
        name, why = "adopted", "no usable session or program name"
    b.put("name", name, why, guess=not ctx.name and c.kind == "process")

    # -- ssh -------------------------------------------------------------------------------------
    if p.uid != scan.uid and p.user and p.user != ctx.user:
        b.put("ssh.user", p.user, f"the training runs as {p.user} (uid {p.uid}); you logged in as {ctx.user}",
              guess=True)
        b.warnings.append(f"the training runs as {p.user}, not as {ctx.user} whom you logged in as: `up` runs the "
                          f"command as ssh.user ({p.user})")
    else:
        b.put("ssh.user", ctx.user, f"you logged in as {ctx.user}, and the training runs as {p.user or ctx.user}")
    if ctx.port != 22:
        b.fact("ssh.port", "not written", f"you connected on port {ctx.port}; a new instance's HOST gives its own "
               "(USER@ADDRESS:PORT)")
    provider, evidence = guess_provider(scan, ctx.user)
    if provider:
        b.put("provider", provider, evidence, guess=True)
    else:
        b.fact("provider", "none recognised", evidence, guess=True)

    # -- the program and its files ---------------------------------------------------------------
    cwd = p.cwd or home
    if cwd.endswith(" (deleted)"):
        b.warnings.append(f"the training's working directory {cwd} was deleted")
        cwd = cwd[:-len(" (deleted)")]
    b.put("run.workdir", tilde(cwd, home), f"/proc/{p.pid}/cwd is {cwd}")
    pf = program_files(call, cwd, home, detail)
    b.warnings += pf.warnings
    script_path, script_text, copy = pf.script_path, pf.script_text, pf.copy
    source_text = pf.text(detail)
    files: dict[str, str] = {}
    mapping: dict[str, str] = {}
    for path, why in copy:
        local = local_name(path, cwd, home)
        if local in files:
            continue
        info = detail.sources.get(path) or detail.paths.get(path)
        text = info.text if info is not None else None
        if text is None:
            continue
        files[local] = text
        mapping[local] = tilde(path, home)
        b.notes[f"env.files.{local}"] = (why, False)
    if mapping:
        b.put("env.files", mapping, "the program's own files, copied beside the recipe", show=", ".join(mapping))

    # -- the environment root ----------------------------------------------------------------------
    root = detail.prefix
    version, vwhy = python_version(c, root)
    b.put("env.python", version, vwhy, guess=version == "3")
    if root is not None and root.exists and root.conda:
        b.put("env.venv", f"~/venvs/{name}", f"the training runs in the conda env {tilde(root.path, home)} "
              f"({env_root(c)[1]}); `up` makes a venv instead", guess=True)
        b.warnings.append(f"{root.path} is a conda environment: `up` builds a venv from its pip-visible "
                          "packages; what only conda installed (CUDA libraries, MKL) is not in the lock")
    elif root is not None and root.exists and root.pyvenv is not None:
        b.put("env.venv", tilde(root.path, home), f"the training's sys.prefix: {env_root(c)[1]}")
        if root.pyvenv.get("include-system-site-packages", "").lower() == "true":
            b.put("env.system_site_packages", True, f"{root.path}/pyvenv.cfg: include-system-site-packages = true")
            b.warnings.append("the venv also sees the image's own packages (system site-packages): they are not "
                              "in the lock; a new instance needs the same image")
    else:
        b.warnings.append(f"the training runs on {c.root.exe}, outside any venv ({env_root(c)[1]}): `up` makes a "
                          f"venv (~/venvs/{name}) from the lock")
    sites = ", ".join(tilde(s, home) for s in (root.site if root else [])) or "no site-packages"
    dists, left_out, rwarning = without_relaunch(root.dists if root else [], pf.imports)
    if rwarning:
        b.warnings.append(rwarning)
    lock, callouts = lock_lines(dists, sites)
    where = f"the pip freeze of {sites}"
    pinned = [line for line in lock if line and not line.startswith("#")]
    b.put("env.lock", "requirements.lock", where, show=f"requirements.lock ({len(pinned)} packages)")
    if "relaunch.train" in pf.imports or left_out:
        if left_out:
            came = (f"relaunch {next(d.version for d in root.dists if d.name.lower() == 'relaunch')} in the venv"
                    if root else "relaunch in the venv")
            kept = f"; left out of the lock: {', '.join(left_out)} (nothing else there needs them)"
        elif pf.relaunch_train:
            came, kept = f"{tilde(pf.relaunch_train, home)}, a copy beside the program", "; not copied: a copy " \
                "there would come before up's on the path and stay at the version it was copied from"
        else:
            path = next((v.value for v in detail.env if v.name == "PYTHONPATH" and v.value), "")
            came = (f"its PYTHONPATH ({shown(path).replace(home.rstrip('/') + '/', '~/')})" if path and home
                    else "outside the venv and the program's folder")
            kept = ""
        uses = f"the program imports relaunch.train, today from {came}" if "relaunch.train" in pf.imports else \
            f"the program does not import relaunch; {came}"
        b.fact("relaunch.train", "from `up`", f"{uses}{kept}; `up` puts relaunch/train.py on the training's "
               "PYTHONPATH (~/.relaunch/NAME/python), the one of the relaunch that starts its guard")
    for callout in callouts:
        b.warnings.append(f"lock: {callout}")
    if "env.index_url" not in ctx.set_keys:
        urls, from_where = index_from(detail)
        tagged = [line for line in pinned if "+" in line.partition("==")[2]]
        if urls:
            urls = _named_indexes(urls, b)
            b.put("env.index_url", urls[0], from_where)
            if urls[1:]:
                b.put("env.extra_index_urls", urls[1:], from_where)
        elif from_where:
            b.warnings.append(f"the package index: {from_where}; set env.index_url yourself")
        elif tagged:
            tag = tagged[0].partition("+")[2]
            if re.fullmatch(r"cu\d+|cpu|rocm[\d.]+", tag) and "env.extra_index_urls" not in ctx.set_keys:
                url = f"https://download.pytorch.org/whl/{tag}"
                b.put("env.extra_index_urls", [url], f"{tagged[0]} carries a local version tag, which only "
                      "PyTorch's index serves", guess=True)
            else:
                b.warnings.append(f"{tagged[0]} (and {len(tagged) - 1} more) carry a local version tag: they are only "
                                  "on the index they came from; set env.index_url")

    # -- environment variables -------------------------------------------------------------------
    vars_: dict[str, str] = {}
    secret_names: list[str] = []
    for var in detail.env:
        if var.name in SYSTEM_VARS or var.name.startswith(SYSTEM_PREFIXES) or not ENV_NAME_RE.fullmatch(var.name):
            continue
        if var.secret:
            secret_names.append(var.name)
            continue
        value = var.value or ""
        if MARK in value:
            b.warnings.append(f"{var.name}: its value holds a secret ({shown(value)}); not carried over")
            continue
        matters = not var.in_base or not var.same
        if not matters and not var.name.startswith(ML_PREFIXES):
            continue
        if var.name in ("VIRTUAL_ENV", "PYTHONHOME"):
            continue
        vars_[var.name] = env_value(value, home)
        where = {"tmux": "the tmux session's", "screen": "the screen session's", "parent": "its parent's",
                 "login": "a login's"}.get(detail.base_kind, "its session's")
        b.notes[f"env.vars.{var.name}"] = (
            f"set for the training, not in {where} environment" if matters else "a training variable", False)
    # -- the command -----------------------------------------------------------------------------
    flags = source_flags(script_text or "") if script_text else {}
    if script_text and re.search(r"HfArgumentParser", script_text) and re.search(r"TrainingArguments", script_text):
        flags["_hf"] = (0, "--resume_from_checkpoint")
    if script_text and re.search(r"\bLightningCLI\(", script_text):
        flags["_cli"] = (0, "--ckpt_path")
    launcher_words = list(call.launcher_words)
    nproc, nwhy = 0, ""
    if call.launcher:
        found = flag_value(launcher_words, NPROC_FLAGS[call.launcher])
        nodes = flag_value(launcher_words, NNODES_FLAGS[call.launcher])
        single = nodes is None or nodes[1] in ("1", "1:1")
        if found is not None and found[1].isdigit():
            at, value = found
            written = launcher_words[at] if launcher_words[at] != value else f"{launcher_words[at - 1]} {value}"
            nproc, nwhy = int(value), f"{call.launcher}'s {written}"
            if single:
                word = launcher_words[at]
                # accelerate's --num_processes counts every process of every machine: the world size
                mark = WORLD if call.launcher == "accelerate" else NPROC
                launcher_words[at] = mark + (word[:-len(value)] if word != value else "")
                if call.launcher == "accelerate":
                    nwhy += " (the processes of all machines: run.command says {{ world_size }} there)"
        if call.launcher == "accelerate" and "--multi_gpu" in launcher_words:
            # accelerate refuses --multi_gpu for one process: a resume on one GPU would not start
            launcher_words[launcher_words.index("--multi_gpu")] = MULTI_GPU
        if not single:
            b.warnings.append(f"{call.launcher} runs on several nodes ({nodes[1] if nodes else '?'}): adopt read this "
                              "node only; for a node group, give `up` every node and use {{ nnodes }}, {{ node_rank }} "
                              "and {{ master_addr }} in run.command")
    args, rwhy, rguess, rwarn = _resume(call, flags, os.path.basename(script_path) or call.program)
    command = _command(call, args, home, launcher_words)
    b.put("run.command", command, f"/proc/{p.pid}/cmdline" + (f"; {rwhy}" if rwhy else ""),
          guess=rguess and bool(rwhy), fact=False)
    b.fact("run.command", command, f"/proc/{p.pid}/cmdline")
    if rwhy:
        b.fact("resume", "{{ checkpoint }}" if "checkpoint" in command else "by itself", rwhy, rguess)
    if rwarn:
        b.warnings.append(rwarn)
        b.fact("resume", "not found", rwarn, True)
    for secret in secrets_in(p.argv):
        if secret not in secret_names:
            secret_names.append(secret)
            b.warnings.append(f"the command line held a secret: it now reads \"${secret}\", handed to the instance "
                              f"as env.secrets {secret}; export {secret} on this machine before `up`")
    # no TORCH_ELASTIC_SHUTDOWN_TIMEOUT here: the run script exports it from run.stop.timeout (steps/launch.py),
    # and a value written into env.vars would keep a later, longer run.stop.timeout from reaching torchrun
    if vars_:
        b.put("env.vars", vars_, "the training's environment",
              show=", ".join(f"{k}={shown(v)}" for k, v in vars_.items()))
    if secret_names:
        b.put("env.secrets", sorted(set(secret_names)), "names only: the values never left the instance; "
              "export them on this machine before `up` hands them over", show=", ".join(sorted(set(secret_names))))

    # -- checkpoints -----------------------------------------------------------------------------
    places = [examine(Place(pl.path, pl.why, pl.rank, listings.get(pl.path))) for pl in [*named, *scanned]]
    chosen = choose_place(places, since)
    newest = ""
    layout_guess, lwhy = layout_in_source(source_text)
    if chosen is not None and chosen.found:
        last = chosen.found[-1]
        newest = last.name
        guess = chosen.rank >= 2
        b.put("checkpoint.dir", tilde(chosen.path, home), f"{chosen.why}; {len(chosen.found)} complete checkpoint(s), "
              f"newest {last.name} (step {last.step})", guess=guess)
        b.put("checkpoint.layout", chosen.layout, f"the layouts' detector on the listing of {chosen.path}")
        if chosen.layout == "files":
            b.put("checkpoint.pattern", chosen.pattern,
                  f"the names there ({', '.join(cp.name for cp in chosen.found[-2:])})")
        b.fact("checkpoints", f"{len(chosen.found)} complete, newest {last.name} (step {last.step})",
               f"{chosen.path}, layout {chosen.layout}")
        if re.search(r"/version_\d+/checkpoints$", chosen.path):
            b.warnings.append("checkpoint.dir is a Lightning version_N folder: a resumed run writes into a new "
                              "version_N+1; give ModelCheckpoint(dirpath=...) a fixed folder")
    else:
        if chosen is not None:
            info = detail.paths.get(chosen.path)
            state = ("it does not exist yet" if info is not None and info.kind == "missing" else
                     "it holds nothing yet" if not chosen.listing else "it holds no complete checkpoint yet")
            why = f"{chosen.why}; {state}"
            b.put("checkpoint.dir", tilde(chosen.path, home), why, guess=True)
        else:
            b.put("checkpoint.dir", "~/ckpt", "nothing names a checkpoint folder and none was found on the disk: the "
                  "default", guess=True)
            b.warnings.append("no checkpoint folder found: set checkpoint.dir to where the training saves")
        if layout_guess:
            b.put("checkpoint.layout", layout_guess, f"the program uses `{lwhy}`", guess=True)
        else:
            pattern = pattern_in_source(source_text)
            if pattern:
                b.put("checkpoint.layout", "files", "the program names checkpoint files", guess=True)
                b.put("checkpoint.pattern", pattern, f"a file name in the program's source ({pattern})", guess=True)
            else:
                b.put("checkpoint.layout", "auto", "nothing saved yet: the layout is detected when there is",
                      guess=True)
        b.fact("checkpoints", "none yet", "no complete checkpoint on the instance yet: `evacuate` has nothing to copy "
               "until the training saves one", guess=True)
    b.put("checkpoint.remote", f"./store/{name}", "a folder beside this recipe (the default; "
          "--set checkpoint.remote=rclone:... or hf:... for another store)")

    # -- GPUs ------------------------------------------------------------------------------------
    used = {g.split(" ", 1)[0] for g in c.gpus if not g.startswith("/dev/")} or \
        {g.split(" ", 1)[0] for g in c.gpus}
    if nproc:
        b.put("run.nproc_per_node", nproc, nwhy)
    elif used:
        b.put("run.nproc_per_node", len(used), f"the training uses {len(used)} GPU(s): {', '.join(sorted(used))}")
    elif scan.gpus.listed:
        b.put("run.nproc_per_node", len(scan.gpus.listed), f"nvidia-smi lists {len(scan.gpus.listed)} GPU(s); "
              "none shows this training on it", guess=True)
    else:
        why = scan.gpus.error and f"nvidia-smi failed: {scan.gpus.error}" or \
            ("nvidia-smi lists no GPU" if scan.gpus.smi else "nvidia-smi not found")
        b.fact("run.nproc_per_node", "left unset (the default: the GPUs found on the node, at least 1)",
               f"no GPU ({why})")

    # -- the run's log, session, first output ------------------------------------------------------
    log = p.fd1 if p.fd1.startswith("/") and not p.fd1.startswith(("/dev/", "/proc/")) else ""
    if log.endswith(" (deleted)"):
        log = ""
    if log:
        b.put("run.log", tilde(log, home), f"the training's output (fd 1) goes to {log}")
    else:
        where = "a tmux pane" if p.fd1.startswith("/dev/pts") else (p.fd1 or "nowhere adopt can read")
        b.fact("run.log", f"~/{name}.log after `up`", f"today the output goes to {where}, not a file: evacuate "
               "copies no log tail from this instance", guess=False)
    if c.kind == "tmux" and c.session != name and NAME_RE.fullmatch(c.session):
        b.put("run.session", c.session, "the tmux session it runs in (so `status` and `evacuate` see it alive)")
    elif c.kind != "tmux":
        b.warnings.append(f"the run is not in tmux ({c.label}): `relaunch status` on this instance cannot see it "
                          "alive; after `up`, training runs in tmux session " + name)
    for seen, ready in ((r"step (\d+)", r"step \d+"), (r"\{'loss': ", r"\{'loss': "), (r"Epoch \d+:", r"Epoch \d+")):
        lines = [ln for ln in detail.output if re.search(seen, ln)]
        if lines:
            b.put("run.ready", ready, f"its last output lines ({detail.output_from}) say {shown(lines[-1])[:120]!r}",
                  guess=True)
            break
    if not detail.alive:
        b.warnings.append(f"pid {p.pid} ended while adopt read it")
    return Adoption(name=name, data=b.data, notes=b.notes, facts=sorted(b.facts, key=_fact_order), lock=lock,
                    files=files, warnings=b.warnings, newest=newest)


_SECTIONS = ["training", "name", "provider", "ssh", "run.command", "resume", "run.workdir", "env", "relaunch.train",
             "checkpoint", "checkpoints", "run"]


def _fact_order(fact: Fact) -> int:
    """The report in the recipe's order: what runs, where, in which env, its checkpoints, the rest."""
    ranks = [n for n, s in enumerate(_SECTIONS) if fact.key == s or fact.key.startswith(s + ".")]
    return ranks[0] if ranks else len(_SECTIONS)
