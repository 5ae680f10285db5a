"""From what was read on the instance to a recipe: every value with its evidence, every guess
marked. Pure: the scan, the chosen candidate, its detail and the checkpoint listings in, an
`Adoption` (recipe data, notes per key, the lock, the files to copy, the report's facts) out.
"""

from __future__ import annotations

import ast
import configparser
import os
import posixpath
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

from ..layouts import Entry, complete_checkpoints, detect_layout
from ..recipe.model import ENV_NAME_RE, NAME_RE
from .candidates import Candidate
from .commandline import NNODES_FLAGS, NPROC_FLAGS, Invocation, flag_value, invocation, normal_flag, options
from .facts import MARK, Detail, Dist, EnvRoot, Scan

# -- what names mean --------------------------------------------------------------------------------
# options that name where checkpoints go (their normal names, see commandline.normal_flag)
CKPT_OPTIONS = ("output_dir", "out_dir", "outdir", "out", "output", "ckpt_dir", "ckpt", "ckpts", "checkpoint_dir",
                "checkpoints_dir", "checkpoints", "save_dir", "save_path", "save", "dirpath", "default_root_dir",
                "project_dir", "run_dir", "model_dir", "exp_dir", "experiment_dir", "checkpoint_folder")
# options that take the checkpoint to resume from, best first
RESUME_OPTIONS = ("--resume", "--resume_from_checkpoint", "--resume-from-checkpoint", "--resume_from",
                  "--resume-from", "--resume_path", "--resume-path", "--resume_checkpoint", "--resume-checkpoint",
                  "--ckpt_path", "--ckpt-path", "--load_checkpoint", "--load-checkpoint", "--restore_from",
                  "--restore-from")
# environment variables that are the login's or the shell's, never the training's
SYSTEM_VARS = {"PATH", "HOME", "USER", "LOGNAME", "SHELL", "PWD", "OLDPWD", "SHLVL", "_", "TERM", "TERMCAP",
               "TERM_PROGRAM", "TERM_PROGRAM_VERSION", "COLORTERM", "TMUX", "TMUX_PANE", "STY", "WINDOW", "LANG",
               "LANGUAGE", "MAIL", "MOTD_SHOWN", "DISPLAY", "LS_COLORS", "LESSOPEN", "LESSCLOSE", "HOSTNAME",
               "HOSTTYPE", "MACHTYPE", "OSTYPE", "VIRTUAL_ENV", "VIRTUAL_ENV_PROMPT", "PS1", "PS2", "PS4",
               "_OLD_VIRTUAL_PATH", "_OLD_VIRTUAL_PS1", "_OLD_VIRTUAL_PYTHONHOME", "DBUS_SESSION_BUS_ADDRESS",
               "SUDO_USER", "SUDO_UID", "SUDO_GID", "SUDO_COMMAND", "INVOCATION_ID", "JOURNAL_STREAM",
               "MANAGERPID", "SYSTEMD_EXEC_PID", "NOTIFY_SOCKET", "LINES", "COLUMNS", "EDITOR", "VISUAL", "PAGER",
               "PROMPT_COMMAND", "CONDA_PROMPT_MODIFIER", "CONDA_SHLVL", "CONDA_EXE", "CONDA_PYTHON_EXE",
               "CONDA_DEFAULT_ENV", "CONDA_PREFIX", "_CE_CONDA", "_CE_M", "GPG_TTY", "KRB5CCNAME", "which_declare",
               "MANPATH", "INFOPATH", "XAUTHORITY", "SSH_AUTH_SOCK", "SSH_AGENT_PID", "container", "PIP_CONFIG_FILE"}
SYSTEM_PREFIXES = ("LC_", "SSH_", "XDG_", "BASH_FUNC_", "HIST", "TMUX_", "SCREEN")
# variables that shape a training run: carried over even when the session set them for everything
ML_PREFIXES = ("CUDA_", "NCCL_", "TORCH", "PYTORCH_", "OMP_NUM_THREADS", "MKL_", "HF_", "HUGGINGFACE_",
               "TRANSFORMERS_", "DATASETS_", "TOKENIZERS_PARALLELISM", "WANDB_", "ACCELERATE_", "XLA_", "TF_",
               "JAX_", "PYTHONHASHSEED", "PYTHONUNBUFFERED", "PYTHONPATH", "MLFLOW_", "COMET_", "NEPTUNE_",
               "DEEPSPEED_", "NVIDIA_", "LD_LIBRARY_PATH")
# small text files a command names that are part of the job (not data)
CODE_SUFFIXES = (".py", ".yaml", ".yml", ".json", ".toml", ".cfg", ".ini", ".sh", ".conf", ".jsonnet", ".txt")
TOOLING = {"pip", "setuptools", "wheel", "distribute"}      # what `pip freeze` (and relaunch freeze) leave out
# what an option like --out names when it is a file, not a checkpoint folder
NOT_FOLDERS = (".json", ".jsonl", ".csv", ".txt", ".log", ".yaml", ".yml", ".pt", ".pth", ".ckpt", ".bin",
               ".safetensors", ".pkl", ".npz", ".h5", ".png", ".html")
_JINJA = re.compile(r"\{\{|\{%|\{#|\}\}|%\}|#\}")
# places in the command's words that adopt fills with a template (never text from the instance)
CKPT, RESUME, NPROC, WORLD = "\x01ckpt", "\x01resume:", "\x01nproc:", "\x01world:"
MULTI_GPU = "\x01multi_gpu"


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


# -- paths and words ----------------------------------------------------------------------------------
def tilde(path: str, home: str) -> str:
    """/root/ckpt -> ~/ckpt (a path under the home means the same under another user's home)."""
    if home and home != "/" and (path == home or path.startswith(home.rstrip("/") + "/")):
        return "~" + path[len(home.rstrip("/")):]
    return path


def absolute(path: str, cwd: str, home: str) -> str:
    if path == "~" or path.startswith("~/"):
        path = home + path[1:]
    elif path.startswith("$HOME/") or path.startswith("${HOME}/"):
        path = home + path[path.index("/"):]
    return posixpath.normpath(posixpath.join(cwd or "/", path))


def _literal(text: str) -> str:
    """Text that must reach the shell as it is, also through Jinja."""
    if not text:
        return ""
    quoted = shlex.quote(text)
    return "{% raw %}" + quoted + "{% endraw %}" if _JINJA.search(quoted) else quoted


def shell_word(arg: str, home: str) -> str:
    """One argument as a shell word for run.command: the home as `~/` (at the start) or
    `{{ home }}` (inside), a secret the instance held as `"${NAME}"`, the rest quoted."""
    if arg == "":
        return "''"
    pieces = re.split(f"{MARK}([A-Za-z_][A-Za-z0-9_]*){MARK}", arg)
    out = []
    for n, piece in enumerate(pieces):
        if n % 2:
            out.append(f'"${{{piece}}}"')
            continue
        if not piece:
            continue
        if n == 0 and home and home != "/" and (piece == home or piece.startswith(home.rstrip("/") + "/")):
            out.append("~")
            piece = piece[len(home.rstrip("/")):]
            if not piece:
                continue
        inner = home.rstrip("/") + "/" if home and home != "/" else ""
        while inner and inner in piece:
            before, _, piece = piece.partition(inner)
            out.append(_literal(before) + "{{ home }}/")
        out.append(_literal(piece))
    return "".join(out)


def secrets_in(words: list[str]) -> list[str]:
    found = []
    for word in words:
        for name in re.findall(f"{MARK}([A-Za-z_][A-Za-z0-9_]*){MARK}", word):
            if name not in found:
                found.append(name)
    return found


def shown(text: str) -> str:
    """A value read from the instance, for the screen: a secret by its name only."""
    return re.sub(f"{MARK}([A-Za-z_][A-Za-z0-9_]*){MARK}", r"$\1", text)


# -- the environment root (venv) --------------------------------------------------------------------
def env_root(c: Candidate) -> tuple[str, str]:
    """(the training's sys.prefix when it is a venv or conda env, the evidence), ("", why) else."""
    p = c.root
    if p.argv0_root:
        return p.argv0_root, f"argv[0] of pid {p.pid} is {p.argv0}, with {p.argv0_root}/pyvenv.cfg beside it"
    for root in p.mapped:
        if not root.startswith(("/usr", "/lib", "/opt/conda/pkgs")):
            return root, f"pid {p.pid} has packages of {root}/lib/python*/site-packages loaded"
    for value, what in ((p.virtual_env, "VIRTUAL_ENV"), (p.conda_prefix, "CONDA_PREFIX")):
        if value:
            return value, f"{what}={value} in the environment of pid {p.pid}"
    return "", f"pid {p.pid} runs {p.exe or p.argv[:1]}, which belongs to no venv"


def system_sites(c: Candidate) -> list[str]:
    """Where pip puts packages for a Python outside any venv: /usr/local and the user's site."""
    version = re.search(r"python(\d+\.\d+)", os.path.basename(c.root.exe))
    if not version:
        return []
    v = version.group(1)
    home = c.root.home or ""
    return [f"/usr/local/lib/python{v}/dist-packages", f"/usr/local/lib/python{v}/site-packages",
            *([f"{home}/.local/lib/python{v}/site-packages"] if home else [])]


def python_version(c: Candidate, root: EnvRoot | None) -> tuple[str, str]:
    if root is not None and root.pyvenv:
        for key in ("version_info", "version"):
            m = re.match(r"(\d+\.\d+)", root.pyvenv.get(key, ""))
            if m:
                return m.group(1), f"{tilde(root.path, '')}/pyvenv.cfg: {key} = {root.pyvenv[key]}"
    m = re.search(r"python(\d+\.\d+)", os.path.basename(c.root.exe))
    if m:
        return m.group(1), f"/proc/{c.root.pid}/exe is {c.root.exe}"
    if root is not None:
        for site in root.site:
            m = re.search(r"python(\d+\.\d+)/site-packages", site)
            if m:
                return m.group(1), f"{site}"
    return "3", f"/proc/{c.root.pid}/exe ({c.root.exe}) names no version"


def lock_lines(dists: list[Dist], where: str) -> tuple[list[str], list[str]]:
    """(the lock, what will not install elsewhere): `pip freeze` of the environment root, with
    packages installed from git or a local path called out."""
    lines = [f"# The packages of {where}, read by `relaunch adopt` (a pip freeze); `relaunch freeze` rewrites it."]
    callouts: list[str] = []
    for d in sorted(dists, key=lambda d: d.name.lower()):
        name = d.name
        if re.sub(r"[-_.]+", "-", name).lower() in TOOLING:
            continue
        direct = d.direct or {}
        url = str(direct.get("url", ""))
        if MARK in url:
            lines.append(f"# {name}=={d.version}  # installed from a URL with credentials (not copied): add it "
                         "yourself")
            callouts.append(f"{name}: installed from a URL that holds credentials; not in the lock")
        elif "vcs_info" in direct:
            vcs = direct["vcs_info"]
            commit = vcs.get("commit_id", "")
            lines.append(f"{name} @ {vcs.get('vcs', 'git')}+{url}" + (f"@{commit}" if commit else ""))
            callouts.append(f"{name}: installed from {vcs.get('vcs', 'git')} ({url}" + (f" at {commit[:12]}" if commit
                            else "") + "): it installs elsewhere only where that repository is reachable")
        elif url.startswith("file:"):
            editable = bool((direct.get("dir_info") or {}).get("editable"))
            path = url[len("file://"):] if url.startswith("file://") else url[5:]
            lines.append(f"# {name}=={d.version}  # installed from {path}{' (editable)' if editable else ''}, a local "
                         "path: it will not install elsewhere")
            callouts.append(f"{name}: installed from the local path {path}{' (editable)' if editable else ''}: it "
                            "will not install elsewhere; copy its source with env.files and add "
                            f"`pip install {'-e ' if editable else ''}PATH` to env.setup")
        elif url:
            lines.append(f"{name} @ {url}")
            callouts.append(f"{name}: installed from {url} (not from an index)")
        else:
            lines.append(f"{name}=={d.version}")
    return lines, callouts


def index_from(detail: Detail) -> tuple[list[str], str]:
    """(index URLs, where they were read) from pip's and uv's configuration on the instance."""
    for var in ("PIP_INDEX_URL", "UV_INDEX_URL", "UV_DEFAULT_INDEX"):
        found = next((e for e in detail.env if e.name == var), None)
        if found is not None:
            if found.secret or not found.value:
                return [], f"{var} holds credentials (not read)"
            return [found.value], f"{var} in the training's environment"
    for path, text in detail.pip_config:
        if path.endswith(".toml"):
            m = re.search(r"""^\s*(?:index-url|url)\s*=\s*["']([^"']+)["']""", text, re.M)
            if m:
                return [m.group(1)], path
            continue
        parser = configparser.ConfigParser(interpolation=None)
        try:
            parser.read_string(text)
        except configparser.Error:
            continue
        for section in ("install", "global"):
            if parser.has_option(section, "index-url"):
                extra = parser.get(section, "extra-index-url", fallback="").split()
                return [parser.get(section, "index-url"), *extra], f"{path} [{section}] index-url"
    return [], ""


# -- the program's files ------------------------------------------------------------------------------
def module_files(sources: dict[str, Any], roots: list[str]) -> dict[str, str]:
    """module name -> path, for the .py files under the import roots."""
    found: dict[str, str] = {}
    for path in sources:
        for root in roots:
            if path.startswith(root.rstrip("/") + "/"):
                rel = path[len(root.rstrip("/")) + 1:][:-3]
                parts = rel.split("/")
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                if parts:
                    found.setdefault(".".join(parts), path)
                break
    return found


def imported(text: str, module: str) -> set[str]:
    """Module names a Python file imports (absolute, relative ones resolved against `module`)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return set()
    names: set[str] = set()
    package = module.rsplit(".", 1)[0] if "." in module else ""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".") if package else []
                parts = parts[:len(parts) - node.level + 1] if node.level > 1 else parts
                base = ".".join([*parts, *([node.module] if node.module else [])])
            names.add(base)
            names |= {f"{base}.{a.name}" if base else a.name for a in node.names}
    out = set()
    for name in names:
        parts = name.split(".")
        out |= {".".join(parts[:n]) for n in range(1, len(parts) + 1)}
    return out


def import_closure(start: list[tuple[str, str]], sources: dict[str, Any], roots: list[str]) -> list[str]:
    """The local .py files the program imports, transitively (paths)."""
    modules = module_files(sources, roots)
    by_path = {p: m for m, p in modules.items()}
    seen: list[str] = []
    todo = list(start)
    while todo:
        path, module = todo.pop()
        text = sources[path].text if path in sources else None
        if text is None:
            continue
        for name in sorted(imported(text, module)):
            target = modules.get(name)
            if target and target not in seen and target != path:
                seen.append(target)
                todo.append((target, by_path[target]))
    return seen


def source_flags(text: str) -> dict[str, tuple[int, str]]:
    """Options a program defines (argparse, click): option -> (line, the call's text)."""
    found: dict[str, tuple[int, str]] = {}
    for m in re.finditer(r"(?:add_argument|click\.option|\.option)\(\s*((?:[\"']-[\w-]+[\"']\s*,\s*)*)", text):
        call = text[m.start():text.find(")", m.end()) + 1 if text.find(")", m.end()) > 0 else m.end() + 200]
        for flag in re.findall(r"[\"'](--[\w-]+)[\"']", m.group(0) + call[:200]):
            found.setdefault(flag, (text.count("\n", 0, m.start()) + 1, call))
    return found


def ckpt_names_in_source(text: str) -> list[tuple[str, str, int]]:
    """(key, value, line) of checkpoint folders a program or config spells out: keyword arguments
    (TrainingArguments(output_dir=...), ModelCheckpoint(dirpath=...), Trainer(default_root_dir=...),
    ProjectConfiguration(project_dir=...)), argparse defaults, and config keys."""
    found = []
    keys = "|".join(CKPT_OPTIONS)
    patterns = [
        r"add_argument\(\s*[\"']--(?P<key>[\w-]+)[\"'][^)]*?default\s*=\s*[\"'](?P<value>[^\"'\n]+)[\"']",
        rf"\b(?P<key>{keys})\s*=\s*[\"'](?P<value>[^\"'\n{{}}]+)[\"']",
        rf"^\s*[\"']?(?P<key>{keys})[\"']?\s*:\s*[\"']?(?P<value>[^\"'\s,#{{}}]+)",
    ]
    for pattern in patterns:
        for m in re.finditer(pattern, text, re.M):
            key = normal_flag(m.group("key"))
            if key in CKPT_OPTIONS:
                found.append((key, m.group("value"), text.count("\n", 0, m.start()) + 1))
    return found


def file_pattern(names: list[str]) -> str:
    """The checkpoint.pattern that matches these checkpoint file names (the step as `*`)."""
    counts: dict[str, int] = {}
    for name in names:
        runs = list(re.finditer(r"\d+", name))
        if runs:
            last = runs[-1]
            glob = name[:last.start()] + "*" + name[last.end():]
            counts[glob] = counts.get(glob, 0) + 1
    return max(sorted(counts), key=lambda g: counts[g]) if counts else "ckpt-*.pt"


def pattern_in_source(text: str) -> str:
    m = re.search(r"[\"']([A-Za-z0-9_.=-]*)(?:\{[^}\"']*\}|%0?\d*d)([A-Za-z0-9_.=-]*\.(?:pt|pth|ckpt|bin|safetensors))"
                  r"[\"']", text)
    return f"{m.group(1)}*{m.group(2)}" if m else ""


def layout_in_source(text: str) -> tuple[str, str]:
    """A layout guessed from which trainer the program uses (when nothing is on the disk yet)."""
    rules = [("hf-trainer", r"\bTrainingArguments\b|\bSeq2SeqTrainingArguments\b|from transformers import .*Trainer"),
             ("lightning", r"\bModelCheckpoint\b|import (pytorch_)?lightning|from (pytorch_)?lightning"),
             ("accelerate", r"\.save_state\(|from accelerate import|import accelerate"),
             ("deepspeed", r"\bdeepspeed\.initialize\b|\.save_checkpoint\("),
             ("dcp", r"torch\.distributed\.checkpoint|\bdcp\.save\b")]
    for layout, pattern in rules:
        m = re.search(pattern, text)
        if m:
            return layout, m.group(0)
    return "", ""


# -- checkpoints --------------------------------------------------------------------------------------
@dataclass
class Place:
    """A folder that may be checkpoint.dir, why, and what its listing holds."""

    path: str
    why: str
    rank: int                        # lower is better evidence: 0 named by the command, 1 by its source, 2 the disk
    listing: list[Entry] | None = None
    layout: str = ""
    pattern: str = ""
    found: list[Any] = field(default_factory=list)   # complete checkpoints, oldest first


def examine(place: Place) -> Place:
    if not place.listing:
        return place
    layout = detect_layout(place.listing)
    names = [e.path for e in place.listing if "/" not in e.path and e.kind == "f"]
    pattern = file_pattern([n for n in names if re.search(r"\d", n) and not n.startswith(".")]) \
        if layout == "files" else "ckpt-*.pt"
    place.layout, place.pattern = layout, pattern
    place.found = complete_checkpoints(place.listing, layout, pattern)
    return place


def choose_place(places: list[Place], since: float) -> Place | None:
    """The best checkpoint.dir: one with complete checkpoints (named by the command, then its
    source, then written since the training started, then any), else one named without any."""
    holding = [p for p in places if p.found]
    if holding:
        def score(p: Place) -> tuple[int, int, float]:
            newest = max((e.mtime for e in p.found[-1].files), default=0.0)
            return (p.rank, 0 if newest >= since else 1, -newest)
        return min(holding, key=score)
    named = [p for p in places if p.rank < 2]
    return min(named, key=lambda p: p.rank) if named else None


@dataclass
class ProgramFiles:
    """The program's own files on the instance: the script, what it imports, the configs it names."""

    script_path: str
    script_text: str | None
    roots: list[str]
    copy: list[tuple[str, str]]            # (instance path, why)
    warnings: list[str]
    imports: set[str] = field(default_factory=set)   # every module the program's own files import
    relaunch_train: str = ""               # a copy of relaunch/train.py beside the program: not carried over

    def text(self, detail: Detail) -> str:
        """All of their text, for reading names out of it (checkpoint folders, options)."""
        parts = [self.script_text or ""]
        for path, _ in self.copy:
            info = detail.sources.get(path) or detail.paths.get(path)
            if info is not None and path != self.script_path:
                parts.append(info.text or "")
        return "\n".join(parts)


def program_files(call: Invocation, cwd: str, home: str, detail: Detail) -> ProgramFiles:
    warnings: list[str] = []
    script_path = absolute(call.target, cwd, home) if call.kind == "script" else ""
    script = detail.paths.get(script_path)
    script_text = script.text if script is not None else None
    roots = import_roots(call, cwd, home)
    copy: list[tuple[str, str]] = []
    if call.kind == "script":
        if script is None or script.kind == "missing":
            warnings.append(f"the script {script_path} is not on the instance any more: env.files cannot hold it")
        elif script_text is None:
            warnings.append(f"the script {script_path} is not copied: {script.why}")
        else:
            copy.append((script_path, "the script"))
    start: list[tuple[str, str]] = []
    if call.kind == "script" and script_text is not None:
        start.append((script_path, "__main__"))
    elif call.kind == "module":
        modules = module_files(detail.sources, roots)
        path = modules.get(call.target) or modules.get(call.target + ".__main__")
        if path:
            start.append((path, call.target))
            copy.append((path, f"the module {call.target}"))
            for n in range(1, len(call.target.split("."))):
                init = modules.get(".".join(call.target.split(".")[:n]))
                if init:
                    copy.append((init, "its package"))
            main = modules.get(call.target + ".__main__")
            if main and main != path:
                copy.append((main, f"{call.target}/__main__.py"))
    modules = module_files(detail.sources, roots)
    by_path = {path: module for module, path in modules.items()}
    relaunch_train = ""
    for path in import_closure(start, detail.sources, roots):
        module = by_path.get(path, "")
        if is_relaunch_train(module, detail.sources.get(path)):
            relaunch_train = path
            continue
        if all(path != x for x, _ in copy):
            copy.append((path, "imported by the program"))
    if relaunch_train:        # its package's __init__.py (if any) goes with it: `up` provides the package
        copy = [(path, why) for path, why in copy if by_path.get(path) != "relaunch"]
    imports: set[str] = set()
    for path, module in [*start, *((x, by_path.get(x, "")) for x, _ in copy if x.endswith(".py"))]:
        info = detail.sources.get(path) or detail.paths.get(path)
        if info is not None and info.text:
            imports |= imported(info.text, module)
    resume_values = {o.value for o in options(call.args) if o.written in RESUME_OPTIONS}
    for arg in [*call.args, *call.launcher_words]:
        for value in [arg, arg.split("=", 1)[1] if "=" in arg else ""]:
            if not value or MARK in value or value in resume_values:
                continue
            path = absolute(value, cwd, home)
            info = detail.paths.get(path)
            if info is None or info.kind != "f" or path == script_path or any(path == x for x, _ in copy):
                continue
            if re.search(r"\.(pt|pth|ckpt|bin|safetensors|tar|pkl|npz|h5|msgpack)$", path):
                continue                                       # a checkpoint or weights: not a job file
            if info.text is not None and path.endswith(CODE_SUFFIXES) and not path.startswith(
                    ("/usr/", "/etc/", "/proc/", "/dev/")):
                copy.append((path, f"named by the command ({value})"))
            elif info.text is None:
                warnings.append(f"the command names {value} ({info.why}): not copied; a new instance needs it "
                                "too (env.files or env.setup) if the training reads it")
            else:
                warnings.append(f"the command names {value}, a data file?: not copied; add it to env.files if the "
                                "job needs it on a new instance")
    default = accelerate_default_config(call, home)
    info = detail.paths.get(default) if default else None
    if info is not None and info.kind == "f" and info.text is not None:
        copy.append((default, "accelerate launch reads it (the command gives no --config_file)"))
    if detail.sources_capped:
        warnings.append(f"there are many Python files under {', '.join(roots)}: only some were read for imports")
    return ProgramFiles(script_path, script_text, roots, copy, warnings, imports, relaunch_train)


def is_relaunch_train(module: str, info: Any) -> bool:
    """relaunch's own relaunch/train.py, copied beside the program by hand (it reads the guard's
    notice record, RELAUNCH_NOTICE), as opposed to a package of the user's that is also named so."""
    return module == "relaunch.train" and info is not None and "RELAUNCH_NOTICE" in (info.text or "")


def requirement_name(line: str) -> str:
    """The normal name a Requires-Dist line needs; "" for one that only an extra asks for."""
    name, _, marker = line.partition(";")
    if re.search(r"\bextra\s*==", marker):
        return ""
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", name)
    return re.sub(r"[-_.]+", "-", m.group(1)).lower() if m else ""


def without_relaunch(dists: list[Dist], imports: set[str]) -> tuple[list[Dist], list[str], str]:
    """(the dists for the lock, the names left out, a warning): relaunch itself and the packages
    only it needs (fabric, paramiko, ...), when the program takes nothing from relaunch but
    relaunch.train, which `up` puts on the training's PYTHONPATH. A package the program imports
    itself stays, and so does everything another package needs."""
    def normal(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    by = {normal(d.name): d for d in dists}
    if "relaunch" not in by:
        return dists, [], ""
    more = sorted(m for m in imports if m.startswith("relaunch.") and m != "relaunch.train")
    if more:
        return dists, [], (f"the program imports {', '.join(more)} from relaunch: relaunch stays in the lock (`up` "
                           "provides relaunch.train only)")

    def closure(start: set[str]) -> set[str]:
        seen, todo = set(), list(start)
        while todo:
            name = todo.pop()
            if name in seen or name not in by:
                continue
            seen.add(name)
            todo += [r for r in map(requirement_name, by[name].requires) if r]
        return seen

    reach = closure({"relaunch"})
    others = closure({n for n in by if n not in reach})
    tops = {m.split(".", 1)[0] for m in imports}
    used = {n for n in reach - {"relaunch"} if set(by[n].top or [n.replace("-", "_")]) & tops}
    drop = reach - others - closure(used)
    return [d for d in dists if normal(d.name) not in drop], sorted(by[n].name for n in drop), ""


# -- the whole recipe ---------------------------------------------------------------------------------
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


def env_value(value: str, home: str) -> str:
    """A variable's value for env.vars: the home as {{ home }}, Jinja's own markers kept literal."""
    if _JINJA.search(value):
        return "{% raw %}" + value + "{% endraw %}"
    if home and home != "/":
        value = re.sub(rf"(^|[:=, ]){re.escape(home.rstrip('/'))}(?=/|$|:)", r"\1{{ home }}", value)
    return value


def accelerate_default_config(call: Invocation, home: str) -> str:
    """The config `accelerate launch` reads when the command names none (written by `accelerate config`)."""
    if call.launcher != "accelerate" or flag_value(call.launcher_words, ("--config_file", "--config-file")):
        return ""
    return f"{home.rstrip('/')}/.cache/huggingface/accelerate/default_config.yaml" if home else ""


def import_roots(call: Invocation, cwd: str, home: str) -> list[str]:
    """Where the program's own modules are: the script's folder (sys.path[0]), or the working
    directory for -m and -c; never the whole of / or /usr."""
    if call.kind == "script":
        root = posixpath.dirname(absolute(call.target, cwd, home))
    else:
        root = cwd
    return [root] if root not in ("", "/") and not root.startswith(("/usr", "/proc", "/sys", "/dev")) else []


def local_name(path: str, cwd: str, home: str) -> str:
    """Where a copied file goes beside the recipe: relative to the workdir, else to the home."""
    for base in (cwd, home):
        if base and base != "/" and path.startswith(base.rstrip("/") + "/"):
            return path[len(base.rstrip("/")) + 1:]
    return path.lstrip("/")


def guess_provider(scan: Scan, user: str) -> tuple[str, str]:
    vendor = " ".join(v for v in (scan.dmi.get("sys_vendor", ""), scan.dmi.get("product_name", ""),
                                  scan.dmi.get("bios_vendor", "")) if v)
    rules = [("aws", r"Amazon EC2|^Amazon"), ("gcp", r"Google"), ("azure", r"Microsoft Corporation.*Virtual Machine")]
    for provider, pattern in rules:
        if re.search(pattern, vendor):
            return provider, f"/sys/class/dmi/id says {vendor!r}"
    env = set(scan.login_env)
    for provider, names in (("runpod", ("RUNPOD_POD_ID", "RUNPOD_API_KEY")), ("vast", ("VAST_CONTAINERLABEL",)),
                            ("paperspace", ("PAPERSPACE_FQDN", "PAPERSPACE_METRIC_WORKLOAD_ID"))):
        hit = env & set(names)
        if hit:
            return provider, f"{sorted(hit)[0]} is set in a login's environment"
    if user in ("paperspace", "Ubuntu"):
        return {"paperspace": "paperspace", "Ubuntu": "massedcompute"}[user], f"the login user is {user}"
    seen = f"/sys/class/dmi/id says {vendor!r}" if vendor else "no vendor in /sys/class/dmi/id"
    return "", f"{seen}, no provider's variables in a login's environment"


def plan_places(scan: Scan, c: Candidate, detail_paths: dict[str, Any] | None, source_text: str,
                ctx_home: str) -> list[Place]:
    """The folders named as checkpoint folders: by the command's options, by its source and configs."""
    p = c.root
    home = p.home if p.uid != scan.uid and p.home else ctx_home
    cwd = p.cwd or home
    call = invocation(p.argv)
    places: list[Place] = []
    seen: set[str] = set()
    for option in options(call.args):
        if option.name in CKPT_OPTIONS and option.value and MARK not in option.value \
                and not option.value.lower().endswith(NOT_FOLDERS):
            path = absolute(option.value, cwd, home)
            info = (detail_paths or {}).get(path)
            if info is not None and info.kind == "f":
                continue
            if path not in seen:
                seen.add(path)
                places.append(Place(path, f"the command's {option.written} {option.value}", 0))
    for key, value, line in ckpt_names_in_source(source_text):
        path = absolute(value, cwd, home)
        if path not in seen and not value.startswith(("http", "s3:", "gs:")):
            seen.add(path)
            places.append(Place(path, f"{key} = {value!r} in the program's source or config (line {line})", 1))
    return places


def scanned_places(folders: list[Any], named: list[Place]) -> list[Place]:
    taken = {pl.path for pl in named}
    out = []
    for folder in folders:
        # Lightning without ModelCheckpoint(dirpath=...): a new version_N each run, so the folder to
        # watch is lightning_logs, whose version_N/checkpoints the lightning layout reads
        logs = re.fullmatch(r"(.*/lightning_logs)/version_\d+/checkpoints", folder.dir)
        path = logs.group(1) if logs else folder.dir
        if path in taken:
            continue
        taken.add(path)
        inside = next((pl for pl in named if path.startswith(pl.path.rstrip("/") + "/")), None)
        why = (f"inside {inside.path} ({inside.why})" if inside else "found on the disk")
        what = f"{folder.hits} checkpoint-like entries ({', '.join(folder.sample[:3])})"
        if logs:
            what += f" in {folder.dir[len(path) + 1:]}: Lightning's logger folder, a new version_N each run"
        out.append(Place(path, f"{why}: {what}", 1 if inside else 2))
    return out
