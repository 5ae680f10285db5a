"""The program's files, as `relaunch adopt` reads them: the modules it imports (from its own
folders), the flags and checkpoint names in its source, and the layout its trainer implies.
"""

from __future__ import annotations

import ast
import posixpath
import re
from dataclasses import dataclass, field
from typing import Any

from .commandline import Invocation, flag_value, normal_flag, options
from .environment import is_relaunch_train
from .facts import MARK, Detail
from .words import CKPT_OPTIONS, CODE_SUFFIXES, RESUME_OPTIONS, absolute


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


def import_roots(call: Invocation, cwd: str, home: str) -> list[str]:
    """Where the program's own modules are: the script's folder (sys.path[0]), or the working
    directory for -m and -c; never the whole of / or /usr."""
    if call.kind == "script":
        root = posixpath.dirname(absolute(call.target, cwd, home))
    else:
        root = cwd
    return [root] if root not in ("", "/") and not root.startswith(("/usr", "/proc", "/sys", "/dev")) else []


def accelerate_default_config(call: Invocation, home: str) -> str:
    """The config `accelerate launch` reads when the command names none (written by `accelerate config`)."""
    if call.launcher != "accelerate" or flag_value(call.launcher_words, ("--config_file", "--config-file")):
        return ""
    return f"{home.rstrip('/')}/.cache/huggingface/accelerate/default_config.yaml" if home else ""
