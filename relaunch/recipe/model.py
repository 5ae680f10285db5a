"""The typed recipe: every key of CONTRACT.md's Recipe section, with its default.

The models only validate. Reading YAML, `extends`, `--set` and resolving local paths
against the file that wrote them is `loader.py`'s job; by the time a dict reaches
`Recipe.model_validate`, local paths are already absolute. Paths on the instance stay
strings with `~`: only the instance knows its home.
"""

from __future__ import annotations

import base64
import binascii
import re
import signal
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from relaunch.recipe import render as _render
from relaunch.recipe.providers import did_you_mean, load_providers

# tmux expands `#(...)` in session names and the store uses the name as a folder: keep it plain.
NAME_RE = re.compile(r"[A-Za-z0-9_-]+")
ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# The template variables relaunch provides; `env.vars` may not shadow them.
BUILTIN_VARS = (
    "name", "host", "user", "home", "checkpoint", "step", "gpus",
    "nnodes", "node_rank", "master_addr", "world_size",
)
REMOTE_PREFIXES = ("rclone:", "hf:")
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


class SSH(_Section):
    user: str = "root"
    port: int = Field(default=22, ge=1, le=65535)
    key: Path | None = None
    host_key: str | None = None
    wait: float = Field(default=300, ge=0)

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
    python: str
    venv: str = ""  # empty: ~/venvs/{name}
    installer: Literal["pip", "uv"] = "pip"
    lock: Path | None = None
    index_url: str | None = None
    extra_index_urls: list[str] = []
    system_site_packages: bool = False
    apt: list[str] = []
    files: dict[Path, str] = {}
    setup: list[str] = []
    vars: dict[str, str] = {}
    secrets: list[str] = []

    @field_validator("python", mode="before")
    @classmethod
    def _python_version(cls, v: Any) -> Any:
        if isinstance(v, float):
            # YAML reads 3.10 as the number 3.1; the loader kept the text the user wrote.
            raise ValueError(f'write it as a quoted string: "{_scalar_text(v)}"')
        if isinstance(v, str) and not re.fullmatch(r"\d+\.\d+", v):
            raise ValueError(f'must be MAJOR.MINOR such as "3.11", got {v!r}')
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
    dir: str = "~/ckpt"
    layout: Literal["auto", "files", "hf-trainer", "dcp", "deepspeed", "lightning", "accelerate"] = "auto"
    pattern: str = "ckpt-*.pt"
    keep: int = Field(default=2, ge=1)
    remote: Path | str  # Path: on this machine; str: "rclone:..." or "hf:..."
    via: Literal["local", "instance"] = "local"
    every: float = Field(default=600, gt=0)

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
    signal: str = "TERM"
    timeout: float = Field(default=120, ge=0)

    @field_validator("signal")
    @classmethod
    def _signal(cls, v: str) -> str:
        name = v.upper().removeprefix("SIG")
        if name not in {s.name.removeprefix("SIG") for s in signal.Signals}:
            raise ValueError(f"{v!r} is not a signal name (TERM, INT, USR1, ...)")
        return name


class Run(_Section):
    command: str
    workdir: str = "~"
    session: str = ""  # empty: the recipe's name
    log: str = ""  # empty: ~/{name}.log
    stop: Stop = Field(default_factory=Stop)
    ready: str | None = None  # a regex: a log line that proves training started
    grace: float = Field(default=60, ge=0)  # seconds `up` watches the command when no ready line is given

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


class Recipe(_Section):
    """A validated recipe. Build it with `load_recipe`, which also records where each key came from."""

    name: str
    extends: list[str] = []
    provider: str | None = None
    ssh: SSH = Field(default_factory=SSH)
    env: Env
    checkpoint: Checkpoint
    run: Run

    _source: Path = PrivateAttr(default=Path("recipe.yaml"))
    _origins: dict[tuple[str, ...], Origin] = PrivateAttr(default_factory=dict)

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
        ssh = data.get("ssh", {})
        if preset is None or not isinstance(ssh, dict):
            return data
        return {**data, "ssh": {"user": preset.user, "port": preset.port, **ssh}}

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

    def wrote(self, key: str) -> bool:
        """Whether a recipe file (or `--set`) wrote dotted `key` itself, rather than a default or
        the provider preset filling it in."""
        return tuple(key.split(".")) in self._origins

    def where(self, key: str) -> str:
        """`file:line` that defined dotted `key`, `--set` for an override, else the recipe file."""
        file, line = self.locate(key)
        return f"{file}:{line}" if line else file

    def value(self, key: str) -> Any:
        """The value at dotted `key` ("run.command", "env.setup.0", "env.vars.WANDB_MODE")."""
        node: Any = self
        parts = key.split(".")
        while parts:
            if isinstance(node, BaseModel) and parts[0] in type(node).model_fields:
                node = getattr(node, parts.pop(0))
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

    # --- rendering (see render.py) ------------------------------------------------------------

    def render(self, key: str, context: dict[str, Any]) -> str:
        """The string at dotted `key`, rendered with Jinja2 (undefined variables are errors)."""
        return _render.render_text(self, self.value(key), context, key)

    def render_text(self, text: str, context: dict[str, Any], key: str) -> str:
        """Render `text`; errors are located at `key`."""
        return _render.render_text(self, text, context, key)

    def render_shell(self, key: str, context: dict[str, Any]) -> tuple[str, dict[str, str]]:
        """The string at `key` for a shell, variables as `${RELAUNCH_<NAME>}`: see render.render_shell."""
        return _render.render_shell(self, self.value(key), context, key)
