"""The typed recipe: every key of CONTRACT.md's Recipe section, with its default.

The models only validate. Reading YAML, `extends`, `--set` and resolving local paths
against the file that wrote them is `loader.py`'s job; by the time a dict reaches
`Recipe.model_validate`, local paths are already absolute. Paths on the instance stay
strings with `~`: only the instance knows its home.

One job, a little over 500 lines: one model per section of the contract's Recipe, each key
with its default and description (recipe-keys.md is generated from them).
"""

from __future__ import annotations

import base64
import binascii
import re
import signal
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator
from pydantic.config import JsonDict

from relaunch.recipe.providers import did_you_mean, load_providers

# tmux expands `#(...)` in session names and the store uses the name as a folder: keep it plain.
NAME_RE = re.compile(r"[A-Za-z0-9_-]+")
ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# what env.python_mirror must be (once its ${NAME}s are expanded: recipe/variables.py)
MIRROR_RE = re.compile(r"(https?://[^/\s]+|file:///?[^/\s])")
# The template variables relaunch provides; `env.vars` may not shadow them.
BUILTIN_VARS = (
    "name", "host", "user", "home", "checkpoint", "step", "gpus",
    "nnodes", "node_rank", "master_addr", "world_size", "nproc_per_node", "grad_accum", "checkpoint_dir",
)
REMOTE_PREFIXES = ("rclone:", "hf:")
# The instance scripts in templates/ a recipe's `templates:` folder may replace, by file name.
SCRIPT_NAMES = ("env.sh.j2", "run.sh.j2", "setup.sh.j2", "prelude.sh.j2", "facts.sh")
_HF_REMOTE_RE = re.compile(r"hf:[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*(/[^/].*)?")

Origin = tuple[str, int | None]  # (file as displayed, or "--set"; line)


def _scalar_text(value: Any) -> str:
    """A YAML scalar as the user wrote it when the loader kept that (`3.10`, not `3.1`)."""
    raw = getattr(value, "raw", None)
    if raw is not None:
        return str(raw)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


def recipe_keys_of(model: type[BaseModel]) -> dict[str, str]:
    """The keys a recipe writes for a model's fields -> the field names (they differ only where
    Python needs another name: `batch.global` is the field `global_`)."""
    return {(field.alias or name): name for name, field in model.model_fields.items()}


def _key(description: str, example: Any, default: Any = ..., shown_default: str | None = None,
         **rules: Any) -> Any:
    """A recipe key. Its description and example are the generated key reference (docs/recipe-keys.md),
    so a key cannot be added without them; `shown_default` is how the reference writes a default that
    is derived from other keys."""
    extra: JsonDict | None = {"shown_default": shown_default} if shown_default is not None else None
    if callable(default) and isinstance(default, type):
        return Field(default_factory=default, description=description, examples=[example],
                     json_schema_extra=extra, **rules)
    return Field(default, description=description, examples=[example], json_schema_extra=extra, **rules)


class SSH(_Section):
    """How to reach the instance."""

    user: str = _key("User to log in as; wins over the provider preset.", "ubuntu", "root",
                     shown_default="root, or the provider preset's user")
    port: int = _key("SSH port; wins over the provider preset.", 22, 22, ge=1, le=65535)
    key: Path | None = _key("Private key file (relative to the recipe file); else ssh-agent and ~/.ssh/config.",
                            "~/.ssh/id_ed25519", None)
    host_key: str | None = _key("Pin of the instance's host key, as the provider console shows it; "
                                "else trust on first use.", "SHA256:uNiVztksCsDhcc0u9e8BujQXVUpKZIDTMczCvj3tD2s",
                                None)
    wait: float = _key("Seconds to keep trying to connect while the instance boots (`up`); other commands wait "
                       "only for what may pass (a timeout, a late banner), and say at once what waiting cannot "
                       "mend (no key, a refused key or port).", 300, 300, ge=0)

    @field_validator("host_key")
    @classmethod
    def _fingerprint(cls, v: str | None) -> str | None:
        if v is None:
            return v
        body = v.removeprefix("SHA256:").rstrip("=")
        try:
            digest = base64.b64decode(body + "=" * (-len(body) % 4), validate=True)
            ok = v.startswith("SHA256:") and len(digest) == 32  # a sha256 is 32 bytes
        except (binascii.Error, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"must look like SHA256:<base64> (as `ssh-keygen -lf` prints it), got {v!r}")
        return v

    @field_validator("key", mode="before")
    @classmethod
    def _expand_key(cls, v: Any) -> Any:
        return Path(v).expanduser() if isinstance(v, str) else v


class Env(_Section):
    """The environment on the instance: Python, venv, packages, files, setup, variables."""

    python: str = _key('Required major.minor Python on the instance, quoted ("3.10" is not 3.1); '
                       "checked before anything else. With installer uv, uv provides it when the image "
                       "lacks it (installed beside the venv, on the same disk).", "3.11")
    python_mirror: str | None = _key("Where uv gets env.python when the image lacks it, for instances without "
                                     "internet access: a URL ending in .json is a downloads list of your own "
                                     "builds (UV_PYTHON_DOWNLOADS_JSON_URL), any other a mirror of "
                                     "python-build-standalone's releases (UV_PYTHON_INSTALL_MIRROR). http, https "
                                     "or file; ${NAME} and a token in it as in index_url.",
                                     "https://mirror.example.com/python-build-standalone", None)
    venv: str = _key("Where the venv lives on the instance.", "~/venvs/llama-ft", "", shown_default="~/venvs/NAME")
    installer: Literal["pip", "uv"] = _key("What makes the venv and installs the lock into it: uv (several times "
                                           "faster, and needs no pythonX.Y-venv package; `python -m venv` and pip "
                                           "take over when the package index has no uv), or pip. With no lock and "
                                           "no index_url, `python -m venv` makes the venv and nothing is fetched.",
                                           "pip", "uv")
    lock: Path | None = _key("A pinned `pip freeze` (relative to the recipe file); `relaunch freeze` writes it.",
                             "requirements.lock", None)
    index_url: str | None = _key("Package index for the lock (`relaunch freeze` writes the one the instance's pip "
                                 "or uv uses). A token in it (https://user:token@host/simple, a token-like path "
                                 "segment, ?token=) is kept out of the recipe file as ${NAME}, a variable of this "
                                 "machine's environment (the whole URL, or only its token); the value reaches pip "
                                 "and uv through their environment, never a command line, and every message shows "
                                 "it as ***.",
                                 "https://download.pytorch.org/whl/cu124", None)
    extra_index_urls: list[str] = _key("More package indexes (e.g. PyPI beside a CUDA index); each pin is found "
                                       "on whichever index has it, with pip and with uv. ${NAME} and tokens as in "
                                       "index_url.",
                                       ["https://pypi.org/simple"], list)
    system_site_packages: bool = _key("Let the venv see the image's preinstalled packages (torch, CUDA).",
                                      True, False)
    apt: list[str] = _key("Debian packages installed (with sudo when not root) only if missing.",
                          ["tmux", "rsync"], list)
    files: dict[Path, str] = _key("Local file (relative to the recipe file) -> instance path, uploaded before setup.",
                                  {"train.py": "~/work/train.py"}, dict)
    setup: list[str] = _key("Shell lines run in the venv after install, in run.workdir, fail-fast like a CI step "
                            "(a failing line stops the setup: exit 4); once per lock, counted only once all succeeded.",
                            ["pip install -e ."], list)
    vars: dict[str, str] = _key("Environment variables for setup and command; also template variables.",
                                {"WANDB_MODE": "offline"}, dict)
    secrets: list[str] = _key("Names of local environment variables handed to the instance in a 0600 file, "
                              "never on a command line or in a log.", ["HF_TOKEN"], list)

    @field_validator("python", mode="before")
    @classmethod
    def _python_version(cls, v: Any) -> Any:
        if isinstance(v, float):
            # YAML reads 3.10 as the number 3.1; the loader kept the text the user wrote.
            raise ValueError(f'write it as a quoted string: "{_scalar_text(v)}"')
        if isinstance(v, str) and not re.fullmatch(r"\d+\.\d+", v):
            raise ValueError(f'must be MAJOR.MINOR such as "3.11", got {v!r}')
        return v

    @field_validator("python_mirror")
    @classmethod
    def _mirror(cls, v: str | None) -> str | None:
        # one that starts with a ${NAME} is checked once expanded (variables.python_mirror)
        if v is not None and not v.startswith("${") and not MIRROR_RE.match(v):
            raise ValueError(f"must be an http://, https:// or file:// URL, got {v!r}")
        return v

    @field_validator("vars", mode="before")
    @classmethod
    def _vars(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        out = {}
        for k, val in v.items():
            if not isinstance(k, str) or not ENV_NAME_RE.fullmatch(k):
                raise ValueError(f"{k!r} is not a usable environment variable name ([A-Za-z_][A-Za-z0-9_]*)")
            if k in BUILTIN_VARS:
                raise ValueError(f"{k!r} would hide relaunch's own template variable of that name")
            # Scalars become the text the user wrote; a list or mapping is left to fail as not a string.
            out[k] = "" if val is None else _scalar_text(val) if isinstance(val, (bool, int, float)) else val
        return out

    @field_validator("secrets")
    @classmethod
    def _secrets(cls, v: list[str]) -> list[str]:
        for name in v:
            if not ENV_NAME_RE.fullmatch(name):
                raise ValueError(f"{name!r} is not an environment variable name ([A-Za-z_][A-Za-z0-9_]*)")
        return v


class Checkpoint(_Section):
    """Where training writes checkpoints, and the store they are copied to."""

    dir: str = _key("Where training writes checkpoints on the instance.", "~/ckpt", "~/ckpt")
    layout: Literal["auto", "files", "hf-trainer", "dcp", "deepspeed", "lightning", "accelerate"] = _key(
        "How checkpoints look, and so which ones are complete.", "hf-trainer", "auto")
    pattern: str = _key("Which files are checkpoints, for layout files.", "ckpt-*.pt", "ckpt-*.pt")
    keep: int = _key("Newest complete checkpoints kept in the store.", 2, 2, ge=1)
    remote: Path | str = _key("The store: a folder on this machine (relative to the recipe file), "
                              "rclone:REMOTE:PATH or hf:OWNER/REPO[/SUBFOLDER].", "./store/llama-ft")
    via: Literal["local", "instance"] = _key("local: bytes pass through this machine, no credentials on the "
                                             "instance; instance: the instance talks to the remote itself.",
                                             "local", "local", shown_default="local (instance for hf:)")
    every: float = _key("Seconds between copies in `relaunch sync`; in `relaunch watch`, the longest time "
                        "between two rounds (a round also starts as each checkpoint is saved).", 600, 600, gt=0)
    streams: int = _key("rsync streams at once (each its own SSH connection) for a checkpoint of several large "
                        "files, so that a link one stream cannot fill (far away: SSH's window / the round trip) "
                        "is filled; a single file is one stream. A via: local evacuation uses one unless this "
                        "is set: each file then goes up while the next arrives.", 8, 4, ge=1, le=32,
                        shown_default="4 (1 for a via: local evacuation)")

    @field_validator("remote", mode="before")
    @classmethod
    def _remote(cls, v: Any) -> Any:
        if isinstance(v, Path):
            return v
        if not isinstance(v, str) or not v:
            raise ValueError("must be a local path, rclone:REMOTE:PATH or hf:OWNER/REPO[/SUBFOLDER]")
        if v.startswith("hf:") and not _HF_REMOTE_RE.fullmatch(v):
            raise ValueError(f"must look like hf:OWNER/REPO[/SUBFOLDER], got {v!r}")
        if v.startswith("rclone:") and ":" not in v[len("rclone:"):]:
            raise ValueError(f"must look like rclone:REMOTE:PATH, got {v!r}")
        return v if v.startswith(REMOTE_PREFIXES) else Path(v)


class Stop(_Section):
    """How `evacuate --stop` asks training to save and exit."""

    signal: str = _key("Signal sent to the command's process group.", "TERM", "TERM")
    timeout: float = _key("Seconds to wait for training to exit after the signal.", 120, 120, ge=0)

    @field_validator("signal")
    @classmethod
    def _signal(cls, v: str) -> str:
        name = v.upper().removeprefix("SIG")
        if name not in {s.name.removeprefix("SIG") for s in signal.Signals}:
            raise ValueError(f"{v!r} is not a signal name (TERM, INT, USR1, ...)")
        return name


class Batch(_Section):
    """The global batch to keep when the number of processes changes."""

    global_: int = _key("Samples per optimizer step, kept whatever the world size.", 512, alias="global", gt=0)
    micro: int = _key("Samples per process per forward/backward pass.", 8, gt=0)

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class Metrics(_Section):
    """Regexes that read a training step's numbers from the log (for `up`'s start and `relaunch drill`)."""

    step: str = _key("Regex whose first group is the step number.", r"step (\d+)", r"step (\d+)")
    loss: str = _key("Regex whose first group is the loss.", r"loss ([\d.]+)", r"loss ([-+\d.eE]+)")
    grad_norm: str | None = _key("Regex whose first group is the gradient norm.", r"grad_norm ([\d.]+)", None)

    @field_validator("step", "loss", "grad_norm")
    @classmethod
    def _regex(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                if re.compile(v).groups < 1:
                    raise ValueError("needs a group ( ) around the number")
            except re.error as exc:
                raise ValueError(f"is not a valid regular expression: {exc}") from None
        return v


class Run(_Section):
    """The training command and where it runs."""

    command: str = _key("The training command, run in tmux in the venv; {{ checkpoint }} is the restored "
                        "checkpoint (empty on a fresh start).", 'python train.py --resume "{{ checkpoint }}"')
    workdir: str = _key("Folder on the instance the command (and env.setup) runs in.", "~/work", "~")
    session: str = _key("tmux session name ([A-Za-z0-9_-]).", "llama-ft", "", shown_default="NAME")
    log: str = _key("Log file on the instance the command's output is appended to.", "~/llama-ft.log", "",
                    shown_default="~/NAME.log")
    stop: Stop = _key("How `evacuate --stop` asks training to save and exit.", {"signal": "TERM", "timeout": 120},
                      Stop)
    ready: str | None = _key("A regex: a line of the command's log that proves training started; `up` returns "
                             "when it appears (or exits 4 when the command dies first).", "^step \\d+ ", None)
    grace: float = _key("Seconds `up` watches the command at most: until a log line matches run.ready, or without "
                        "one until two lines show the step going up (run.metrics.step); if it dies first, `up` exits "
                        "4 with its last lines; alive after them, it counts as started.", 60, 60, ge=0)
    nproc_per_node: int | None = _key("Processes per node ({{ nproc_per_node }}, for torchrun); else the GPUs "
                                      "found on the node, at least 1.", 8, None, gt=0,
                                      shown_default="the GPUs found on the node")
    batch: Batch | None = _key("Global and micro batch: gives {{ grad_accum }} = global / (micro x world size), "
                               "so a resume on fewer GPUs keeps the global batch.", {"global": 512, "micro": 8},
                               None)
    metrics: Metrics = _key("How the log shows a training step: `up` without run.ready returns once the step goes "
                            "up; `relaunch drill` reads step, loss and grad norm.",
                            {"step": r"step (\d+)", "loss": r"loss ([\d.]+)"}, Metrics)

    @field_validator("ready")
    @classmethod
    def _ready(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                re.compile(v)
            except re.error as exc:
                raise ValueError(f"is not a valid regular expression: {exc}") from None
        return v

    @field_validator("session")
    @classmethod
    def _session(cls, v: str) -> str:
        if v and not NAME_RE.fullmatch(v):
            raise ValueError("may use only letters, digits, _ and - (tmux expands #(...) in session names)")
        return v


GUARD_SOURCES = ("aws", "gcp", "azure", "sigterm")
ADVICE_SOURCES = ("aws-rebalance",)     # recommendations, not notices: a copy now, training goes on


class Guard(_Section):
    """The watcher `up` starts beside training: it asks the instance's metadata service (and
    what else is named) for a reclaim notice, and on one asks training to save and exit."""

    enabled: bool = _key("Start the guard beside training on `up` (in its own tmux session NAME-guard).",
                         True, True)
    sources: list[str] = _key("Where a reclaim notice comes from: aws (IMDSv2 spot instance-action), gcp "
                              "(instance/preempted), azure (Scheduled Events Preempt, Terminate), sigterm (the "
                              "guard's own SIGTERM), file:PATH (a file on the instance that appears), url:URL (an "
                              "address that answers 200); and aws-rebalance (the rebalance recommendation: not a "
                              "notice, `watch` copies at once and training goes on). A source that does not "
                              "answer is switched off, said once in `relaunch status`.",
                              ["aws", "sigterm", "file:~/RECLAIM"], list(GUARD_SOURCES))
    every: float = _key("Seconds between the guard's looks at each source, and between `relaunch watch`'s looks "
                        "at the instance (a new complete checkpoint starts a round at the next one).", 5, 5, gt=0)

    @field_validator("sources")
    @classmethod
    def _sources(cls, v: list[str]) -> list[str]:
        for source in v:
            if source in GUARD_SOURCES or source in ADVICE_SOURCES:
                continue
            if source.startswith("file:") and len(source) > len("file:"):
                continue
            if source.startswith("url:") and re.match(r"url:https?://[^/\s]+", source):
                continue
            raise ValueError(f"{source!r} is not a notice source: use " + ", ".join(GUARD_SOURCES + ADVICE_SOURCES)
                             + ", file:PATH or url:http://...")
        return v


class Recover(_Section):
    """What `relaunch watch` does when the instance is lost or reclaimed."""

    command: str | None = _key("A command run on this machine (in the recipe's folder) that rents a replacement "
                               "and prints its HOST on its last line, optionally followed by the host key "
                               "fingerprint to pin; `watch` then runs `up` there. Unset: `watch` waits for the "
                               "instance to come back.", "./rent-replacement.sh", None)
    lost_after: float = _key("Seconds the instance stays unreachable before `watch` counts it as lost.",
                             120, 120, gt=0)
    attempts: int = _key("How many times `watch` tries to recover (the command, then `up`), with backoff.",
                         3, 3, ge=1)
    timeout: float = _key("Seconds recover.command may run before it is ended. It may have rented already, so it "
                          "is not run again: the HOST on the last line it printed is used, else `watch` stops.",
                          900, 900, gt=0)
    alive: str | None = _key("A command run on this machine (in the recipe's folder) before an unreachable instance "
                             "counts as lost: is HOST (also in $RELAUNCH_HOST) still running at the provider? Exit 0 "
                             "= yes (nothing is rented, whatever this machine's network does), 1 = no (lost), "
                             "anything else = cannot tell (asked again later, nothing rented meanwhile). Unset: "
                             "lost after recover.lost_after without an answer.",
                             "./is-it-running.sh", None)
    shrink: bool = _key("Node groups: when a node is lost or reclaimed, resume at once on the nodes that are left "
                        "(gradient accumulation recomputed, the global batch kept) and grow back to full size once "
                        "recover.command brought replacements; false: wait for the replacements and come back at "
                        "full size.", True, False)


class Recipe(_Section):
    """A validated recipe. Build it with `load_recipe`, which also records where each key came from."""

    name: str = _key("Names the tmux session and the store ([A-Za-z0-9_-]).", "llama-ft")
    extends: list[str] = _key("Recipes merged first, in order, this file last: paths ending in .yaml (relative "
                              "to this file) or names from a recipe library (NAME.yaml in this file's folder "
                              "and those above it, then $RELAUNCH_RECIPES, then the shipped recipes).",
                              ["team/base.yaml", "base/pytorch"], list)
    provider: str | None = _key("Preset from `relaunch providers`: the SSH user and port its instances take.",
                                "lambda", None)
    ssh: SSH = _key("How to reach the instance.", {"user": "ubuntu", "port": 22}, SSH)
    env: Env = _key("The environment on the instance.", {"python": "3.11"})
    checkpoint: Checkpoint = _key("Where checkpoints are written and stored.", {"remote": "./store/llama-ft"})
    run: Run = _key("The training command.", {"command": "python train.py"})
    guard: Guard = _key("The on-instance watcher for reclaim notices that `up` starts beside training.",
                        {"sources": ["aws", "sigterm"], "every": 5}, Guard)
    recover: Recover = _key("What `relaunch watch` does when the instance is lost.",
                            {"command": "./rent-replacement.sh", "lost_after": 120}, Recover)
    templates: Path | None = _key("A folder (relative to the recipe file) whose files replace relaunch's instance "
                                  "scripts of the same name: " + ", ".join(SCRIPT_NAMES) + ".",
                                  "./team-templates", None)

    _source: Path = PrivateAttr(default=Path("recipe.yaml"))
    _origins: dict[tuple[str, ...], Origin] = PrivateAttr(default_factory=dict)
    _files: list[str] = PrivateAttr(default_factory=list)
    _guesses: dict[tuple[str, ...], str] = PrivateAttr(default_factory=dict)   # key -> its GUESS comment

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.fullmatch(v):
            raise ValueError(
                f"{v!r}: use only letters, digits, _ and - (it names the tmux session and the store)"
            )
        return v

    @field_validator("extends", mode="before")
    @classmethod
    def _one_extends(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("provider")
    @classmethod
    def _provider(cls, v: str | None) -> str | None:
        presets = load_providers()
        if v is not None and v not in presets:
            raise ValueError(
                f"unknown provider {v!r}{did_you_mean(v, presets)}; `relaunch providers` lists them"
            )
        return v

    @model_validator(mode="before")
    @classmethod
    def _provider_defaults(cls, data: Any) -> Any:
        # The preset supplies ssh.user/port only where the recipe did not write them.
        if not isinstance(data, dict) or not isinstance(data.get("provider"), str):
            return data
        preset = load_providers().get(data["provider"])
        ssh = data.get("ssh") or {}
        if preset is None or not isinstance(ssh, dict):
            return data
        return {**data, "ssh": {**preset.ssh_defaults(), **ssh}}

    @model_validator(mode="after")
    def _name_defaults(self) -> Recipe:
        self.env.venv = self.env.venv or f"~/venvs/{self.name}"
        self.run.session = self.run.session or self.name
        self.run.log = self.run.log or f"~/{self.name}.log"
        return self

    # --- where things came from -------------------------------------------------------------

    @property
    def source(self) -> Path:
        """The top recipe file."""
        return self._source

    def locate(self, key: str) -> Origin:
        """(file, line) of the YAML that set dotted `key`, its nearest parent, or the top file."""
        best: tuple[str, ...] = ()
        for path in self._origins:
            joined = ".".join(path)
            if (key == joined or key.startswith(joined + ".")) and len(path) > len(best):
                best = path
        top = self._origins.get((), (str(self._source), None))
        if ".".join(best) != key:
            # Inside a section the file did not write: the key has its default, not the section's line.
            try:
                if isinstance(self.value(".".join(best)), BaseModel):
                    return top
            except KeyError:
                pass
        return self._origins.get(best, top)

    def ssh_wait_at_most(self, seconds: float) -> Recipe:
        """This recipe with ssh.wait cut to `seconds`: a loop that reconnects (sync, watch) does not
        sit through a whole boot wait on every outage."""
        return self.model_copy(update={"ssh": self.ssh.model_copy(update={"wait": min(self.ssh.wait, seconds)})})

    def wrote(self, key: str) -> bool:
        """Whether a recipe file (or `--set`) wrote dotted `key` itself, rather than a default or
        the provider preset filling it in."""
        return tuple(key.split(".")) in self._origins

    def where(self, key: str) -> str:
        """`file:line` that defined dotted `key`, `--set` for an override, else the recipe file."""
        file, line = self.locate(key)
        return f"{file}:{line}" if line else file

    @property
    def files(self) -> list[str]:
        """Every recipe file merged into this one, in the order applied (the top file last)."""
        return list(self._files)

    def _written_at(self, path: tuple[str, ...]) -> tuple[str, ...] | None:
        """The key whose line wrote the value at `path`: itself, or the list or mapping a file wrote
        as a whole around it; None when no file (nor --set) wrote it."""
        if path in self._origins:
            return path
        # Inside a list or mapping a file wrote as a whole, the value is that file's; inside a
        # section it did not write out, the key kept its default.
        parents = [p for p in self._origins if p and path[: len(p)] == p]
        best = max(parents, key=len, default=None)
        return best if best is not None and not isinstance(self._node(best), BaseModel) else None

    def origin(self, path: tuple[str, ...]) -> str:
        """Where the value at key `path` came from: `file:line`, `--set`, `preset NAME` or `default`."""
        at = self._written_at(path)
        if at is not None:
            file, line = self._origins[at]
            return file if line is None else f"{file}:{line}"
        if self.provider and len(path) == 2 and path[0] == "ssh" and \
                path[1] in load_providers()[self.provider].ssh_defaults():
            return f"preset {self.provider}"
        return "default"

    def guess(self, path: tuple[str, ...]) -> str | None:
        """What the GUESS comment over the value at key `path` says (above its key, or above a
        section around it in the same file), or None: the value is not marked as a guess."""
        at = self._written_at(path)
        if at is None:
            return None
        file = self._origins[at][0]
        for n in range(len(at), 0, -1):
            note = self._guesses.get(at[:n])
            if note is not None and self._origins[at[:n]][0] == file:
                return note
        return None

    def _node(self, path: tuple[str, ...]) -> Any:
        node: Any = self
        for part in path:
            if isinstance(node, BaseModel):
                node = getattr(node, part)
            elif isinstance(node, dict):
                node = next(v for k, v in node.items() if str(k) == part)
            else:
                node = node[int(part)]
        return node

    def value(self, key: str) -> Any:
        """The value at dotted `key` ("run.command", "env.setup.0", "env.vars.WANDB_MODE")."""
        node: Any = self
        parts = key.split(".")
        while parts:
            if isinstance(node, BaseModel) and parts[0] in recipe_keys_of(type(node)):
                node = getattr(node, recipe_keys_of(type(node))[parts.pop(0)])
            elif isinstance(node, dict):
                # Mapping keys may contain dots (file names): prefer the whole rest as one key.
                rest = ".".join(parts)
                match = [k for k in node if str(k) == rest] or [k for k in node if str(k) == parts[0]]
                if not match:
                    raise KeyError(key)
                node = node[match[0]]
                parts = [] if str(match[0]) == rest else parts[1:]
            elif isinstance(node, list) and parts[0].isdigit() and int(parts[0]) < len(node):
                node = node[int(parts.pop(0))]
            else:
                raise KeyError(key)
        return node
