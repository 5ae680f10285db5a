"""What names mean to `relaunch adopt`, and the paths and words it writes: `~` for the home,
absolute paths, a shell word for each argument (quoted, Jinja-safe), secrets kept out of the recipe.
"""

from __future__ import annotations

import posixpath
import re
import shlex

from .facts import MARK

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


def env_value(value: str, home: str) -> str:
    """A variable's value for env.vars: the home as {{ home }}, Jinja's own markers kept literal."""
    if _JINJA.search(value):
        return "{% raw %}" + value + "{% endraw %}"
    if home and home != "/":
        value = re.sub(rf"(^|[:=, ]){re.escape(home.rstrip('/'))}(?=/|$|:)", r"\1{{ home }}", value)
    return value


def local_name(path: str, cwd: str, home: str) -> str:
    """Where a copied file goes beside the recipe: relative to the workdir, else to the home."""
    for base in (cwd, home):
        if base and base != "/" and path.startswith(base.rstrip("/") + "/"):
            return path[len(base.rstrip("/")) + 1:]
    return path.lstrip("/")
