"""A training's command line, read: which Python program it runs (a script or a module), behind
which launcher (torchrun, accelerate launch, deepspeed), with which arguments. Pure.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

# python's options that take the next word as their value; -c and -m end the options
_PY_VALUE = {"-W", "-X", "--check-hash-based-pycs"}
_PY_FLAGS = set("bBdEhiIOPqsSuvVx")
LAUNCHER_SCRIPTS = {"torchrun": "torchrun", "accelerate": "accelerate", "deepspeed": "deepspeed"}
LAUNCHER_MODULES = {"torch.distributed.run": "torchrun", "torch.distributed.launch": "torchrun",
                    "accelerate.commands.launch": "accelerate", "accelerate.commands.accelerate_cli": "accelerate",
                    "deepspeed.launcher.runner": "deepspeed"}
# processes per node, and nodes, as each launcher spells them
NPROC_FLAGS = {"torchrun": ("--nproc_per_node", "--nproc-per-node"),
               "accelerate": ("--num_processes", "--num-processes"),
               "deepspeed": ("--num_gpus", "--num-gpus")}
NNODES_FLAGS = {"torchrun": ("--nnodes",), "accelerate": ("--num_machines", "--num-machines"),
                "deepspeed": ("--num_nodes", "--num-nodes")}


@dataclass
class Invocation:
    """argv split into: the interpreter's words, the launcher's words, the program and its args."""

    interpreter: list[str]              # [python, -u, ...]: empty when a console script starts it
    console: str = ""                   # a console script's path (argv[1] of its interpreter), if one
    launcher: str = ""                  # torchrun | accelerate | deepspeed | ""
    launcher_words: list[str] = field(default_factory=list)   # its options, as given
    kind: str = "none"                  # script | module | code | none
    target: str = ""                    # the script path or the module name as given
    args: list[str] = field(default_factory=list)

    @property
    def program(self) -> str:
        """How to name it to a person: `train.py`, `-m pkg.train`, `accelerate launch`."""
        if self.kind == "script":
            return self.target
        if self.kind == "module":
            return f"-m {self.target}"
        return self.launcher or os.path.basename(self.console) or "python"


def _python_split(argv: list[str]) -> tuple[list[str], str, str, list[str]]:
    """(interpreter words, kind, target, rest) of a python command line."""
    words, i = argv[:1], 1
    while i < len(argv):
        arg = argv[i]
        if arg in ("-m", "-c"):
            kind = "module" if arg == "-m" else "code"
            return words, kind, argv[i + 1] if i + 1 < len(argv) else "", argv[i + 2:]
        if arg.startswith("-m") and len(arg) > 2 and not arg.startswith("--"):
            return words, "module", arg[2:], argv[i + 1:]
        if arg in _PY_VALUE:
            words += argv[i:i + 2]
            i += 2
            continue
        if arg.startswith("-") and not arg.startswith("--") and len(arg) > 2 and arg[-1] in "mc" \
                and set(arg[1:-1]) <= _PY_FLAGS:
            words.append(arg[:-1])                 # `-um pkg`: -u, then -m
            kind = "module" if arg[-1] == "m" else "code"
            return words, kind, argv[i + 1] if i + 1 < len(argv) else "", argv[i + 2:]
        if arg.startswith("-") and arg != "-":
            words.append(arg)
            i += 1
            continue
        return words, "script", arg, argv[i + 1:]
    return words, "none", "", []


def _launched(launcher: str, rest: list[str]) -> tuple[list[str], str, str, list[str]]:
    """(launcher words, kind, target, program args): the program is the first `*.py` word, or
    the word after -m/--module."""
    start = 1 if launcher == "accelerate" and rest[:1] == ["launch"] else 0
    module = False
    for i in range(start, len(rest)):
        arg = rest[i]
        if arg in ("-m", "--module"):
            module = True
            continue
        if module and not arg.startswith("-"):
            return rest[:i], "module", arg, rest[i + 1:]
        if arg.endswith(".py") and not arg.startswith("-"):
            return rest[:i], "script", arg, rest[i + 1:]
    return rest, "none", "", []


def is_console_script(path: str) -> bool:
    """`/root/venv/bin/torchrun`: a console script its interpreter runs (argv[1] after the shebang)."""
    return "/bin/" in path and not path.endswith(".py")


def invocation(argv: list[str]) -> Invocation:
    words, kind, target, rest = _python_split(argv)
    if kind == "script" and is_console_script(target):
        name = os.path.basename(target)
        launcher = LAUNCHER_SCRIPTS.get(name, "")
        if launcher:
            lw, k, t, a = _launched(launcher, rest)
            return Invocation([], target, launcher, lw, k, t, a)
        return Invocation([], target, "", [], "none", "", rest)
    if kind == "module" and target in LAUNCHER_MODULES:
        launcher = LAUNCHER_MODULES[target]
        lw, k, t, a = _launched(launcher, rest)
        return Invocation([*words, "-m", target], "", launcher, lw, k, t, a)
    return Invocation(words, "", "", [], kind, target, rest)


def flag_value(words: list[str], names: tuple[str, ...]) -> tuple[int, str] | None:
    """(index of the value, value) of `--flag V` or `--flag=V` (index of the word itself then)."""
    for i, word in enumerate(words):
        for name in names:
            if word == name and i + 1 < len(words):
                return i + 1, words[i + 1]
            if word.startswith(name + "="):
                return i, word[len(name) + 1:]
    return None


_NORMAL = re.compile(r"[^a-z0-9_.]")


def normal_flag(word: str) -> str:
    """`--Output-Dir` -> output_dir; `--trainer.default_root_dir` -> default_root_dir."""
    return _NORMAL.sub("_", word.lstrip("-").lower().replace("-", "_")).rsplit(".", 1)[-1]


@dataclass(frozen=True)
class Option:
    at: int              # index of the word holding the value
    name: str            # normal name (normal_flag)
    value: str
    written: str         # the option as written: `--out`, `trainer.default_root_dir`


def options(args: list[str]) -> list[Option]:
    """Every `--name value`, `--name=value` and `name=value` (Hydra, LightningCLI) among a
    program's arguments."""
    found = []
    for i, word in enumerate(args):
        if word.startswith("-") and "=" in word:
            name, _, value = word.partition("=")
            found.append(Option(i, normal_flag(name), value, name))
        elif word.startswith("--") and i + 1 < len(args) and not args[i + 1].startswith("-"):
            found.append(Option(i + 1, normal_flag(word), args[i + 1], word))
        elif re.match(r"^[A-Za-z_][A-Za-z0-9_.]*=", word):
            name, _, value = word.partition("=")
            found.append(Option(i, normal_flag(name), value, name))
    return found
