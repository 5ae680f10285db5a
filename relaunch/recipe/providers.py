"""Provider presets (recipes/providers.yaml) and the starter recipe for `relaunch init`.

This module sits below the rest of `relaunch.recipe`: it imports nothing from it, so the
model can validate `provider:` against the presets without an import cycle.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import yaml

from relaunch.errors import UsageError
from relaunch.resources import recipes_dir

# The reclaim notices the on-instance guard knows how to watch; "none": documented to give none.
RECLAIM_NOTICES = ("aws", "gcp", "azure", "sigterm", "none")
FATES = ("kept", "wiped")


@dataclass(frozen=True)
class Disk:
    """A disk of a provider's instances whose fate is documented: `path` on the instance (`~` is the
    login user's home), what a stop does to it and what taking the instance back does ("" when no
    source says)."""

    path: str
    stop: str = ""
    reclaim: str = ""
    name: str = ""                # "container disk"
    what: str = ""                # the rest of what the sources say

    def holds(self, path: str) -> bool:
        """Whether the absolute `path` is on this disk (both with `~` expanded)."""
        return path == self.path or path.startswith(self.path.rstrip("/") + "/")

    def as_dict(self) -> dict[str, str | None]:
        return {"path": self.path, "name": self.name, "stop": self.stop or None, "reclaim": self.reclaim or None,
                "what": self.what}


@dataclass(frozen=True)
class Provider:
    """One entry of recipes/providers.yaml. Empty strings and None mean "not known from a source"."""

    name: str
    user: str
    port: int | None
    notes: str
    disk_survives_stop: bool | None = None
    reclaim_notice: str = ""
    notice_window: float | None = None     # seconds between the notice and the end, where documented
    sources: tuple[str, ...] = ()
    disks: tuple[Disk, ...] = ()
    checkpoint_dir: str = ""               # the base recipe's checkpoint.dir ("": the recipe default)
    venv: str = ""                         # the base recipe's env.venv ("": the recipe default)
    guard_sources: tuple[str, ...] | None = None   # the base recipe's guard.sources (None: the default)
    index_url: str = ""                    # the package index its instances reach (the sandbox's own)

    def disk_of(self, path: str, home: str) -> Disk | None:
        """The documented disk that holds `path` on an instance whose login home is `home` (the
        disk with the longest path that holds it), if any."""
        def expanded(p: str) -> str:
            return home.rstrip("/") + p[1:] if p == "~" or p.startswith("~/") else p

        target = expanded(path)
        found = [d for d in self.disks if Disk(expanded(d.path)).holds(target)]
        return max(found, key=lambda d: len(expanded(d.path)), default=None)

    def ssh_defaults(self) -> dict[str, Any]:
        """The ssh values this preset supplies to a recipe (only the known ones)."""
        values: dict[str, Any] = {"user": self.user, "port": self.port}
        return {k: v for k, v in values.items() if v not in ("", None)}

    def as_dict(self) -> dict[str, Any]:
        return {"user": self.user or None, "port": self.port, "disk_survives_stop": self.disk_survives_stop,
                "reclaim_notice": self.reclaim_notice or None, "notice_window": self.notice_window,
                "disks": [d.as_dict() for d in self.disks], "checkpoint_dir": self.checkpoint_dir or None,
                "venv": self.venv or None,
                "guard_sources": None if self.guard_sources is None else list(self.guard_sources),
                "sources": list(self.sources),
                "notes": self.notes}


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """` (did you mean X?)` for the closest choice, or an empty string."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


@lru_cache(maxsize=1)
def _presets() -> tuple[Provider, ...]:
    path = recipes_dir() / "providers.yaml"
    # A broken preset file is our bug, not the user's: let it raise with its own trace.
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    presets = []
    for name, p in raw.items():
        notice = p.get("reclaim_notice") or ""
        if notice not in ("", *RECLAIM_NOTICES):
            raise ValueError(f"providers.yaml: {name}: reclaim_notice {notice!r} is not one of {RECLAIM_NOTICES}")
        disks = tuple(Disk(str(d["path"]), d.get("stop") or "", d.get("reclaim") or "", str(d.get("name") or ""),
                           " ".join(str(d.get("what") or "").split())) for d in p.get("disks") or ())
        for disk in disks:
            if disk.stop not in ("", *FATES) or disk.reclaim not in ("", *FATES):
                raise ValueError(f"providers.yaml: {name}: disk {disk.path}: stop/reclaim must be one of {FATES}")
        guard = p.get("guard_sources")
        presets.append(Provider(
            name=str(name), user=str(p.get("user") or ""), port=int(p["port"]) if p.get("port") else None,
            notes=" ".join(str(p["notes"]).split()), disk_survives_stop=p.get("disk_survives_stop"),
            reclaim_notice=notice, sources=tuple(p.get("sources") or ()),
            notice_window=float(p["notice_window"]) if p.get("notice_window") else None,
            disks=disks, checkpoint_dir=str(p.get("checkpoint_dir") or ""), venv=str(p.get("venv") or ""),
            guard_sources=None if guard is None else tuple(guard), index_url=str(p.get("index_url") or ""),
        ))
    return tuple(presets)


def load_providers() -> dict[str, Provider]:
    """The presets by name, in the file's order (a fresh dict: callers may change it)."""
    return {p.name: p for p in _presets()}


_STARTER = """\
# A relaunch recipe. `relaunch check {path}` validates it without touching any host;
# `relaunch check {path} --explain` shows every value and where it came from;
# `relaunch plan {path} HOST` shows what `up` would do. The commented keys show their defaults;
# every key is described in relaunch's docs/recipe-keys.md.
name: my-run                    # letters, digits, _ and -: names the tmux session and the store
{provider_line}
#                               # extends: merged first, this file wins: paths (relative to this file) or
#                               # names from a recipe library, e.g. team/base ($RELAUNCH_RECIPES)

ssh:
  # user: {user}{user_note}
  # port: {port}
  # key: ~/.ssh/id_ed25519      # else ssh-agent and ~/.ssh/config
  # host_key: SHA256:...        # pin the key the provider console shows; else trust on first use
  # wait: 300                   # seconds to keep trying while the instance boots

env:
  python: "3.11"                # quoted: YAML reads 3.10 as the number 3.1
  {venv_line}
  {installer_line}
  # lock: requirements.lock     # a pinned `pip freeze`; `relaunch freeze recipe.yaml HOST` writes it
  # index_url: https://download.pytorch.org/whl/cu124
  # system_site_packages: false # true: reuse the image's preinstalled torch/CUDA
  # apt: [tmux, rsync]          # installed only if missing
  # files:                      # uploaded before setup: local path (relative to this file) -> instance path
  #   train.py: ~/work/train.py
  # setup: []                   # shell lines run in the venv after install, in run.workdir
  # vars: {{WANDB_MODE: offline}}  # exported for setup and command
  # secrets: [HF_TOKEN]         # local environment variables handed to the instance, never logged

checkpoint:
  {dir_line}
  {layout_line}
  # pattern: "ckpt-*.pt"        # for layout files
  # keep: 2                     # newest complete checkpoints kept off the machine
  remote: {remote}{remote_note}
  # via: local                  # local: bytes pass through this machine | instance: it uploads itself
  # every: 600                  # seconds between copies in `relaunch sync`

run:
  # {{{{ checkpoint }}}} is the restored checkpoint's path on the instance, empty on a fresh start;
  # {{{{ checkpoint_dir }}}} is checkpoint.dir there: give it to your script's output flag, and the
  # command works on every provider's disks.
  command: python train.py --resume "{{{{ checkpoint }}}}"
  workdir: ~/work
  # session: my-run             # tmux session; default: name
  # log: ~/my-run.log
  # stop: {{signal: TERM, timeout: 120}}   # how `evacuate --stop` asks training to save and exit
  # `up` returns once training runs: when a log line matches ready; without ready, when two lines
  # show the step going up (metrics.step: `step 10 ...`, then `step 20 ...`); else after grace.
  # A command that dies before that: exit 4, with its last lines.
  # ready: '^step \\d+ '         # a regex: a log line that proves training started
  # grace: 60                   # seconds `up` watches the command at most
  # metrics: {{step: 'step (\\d+)', loss: 'loss ([-+\\d.eE]+)'}}   # how a step's line reads (up, drill)

# guard:                        # the watcher `up` starts beside training for reclaim notices
#   enabled: true
#   sources: [aws, gcp, azure, sigterm]   # plus aws-rebalance, file:PATH or url:URL
#   every: 5                    # seconds between looks

# recover:                      # what `relaunch watch` does when the instance is lost
#   command: ./rent-replacement.sh   # rents a replacement, prints its HOST on the last line
#   lost_after: 120             # seconds without an answer before it counts as lost
#   attempts: 3
#   timeout: 900                # seconds the command may take
#   alive: ./is-it-running.sh   # asked first: exit 0 = the provider still runs HOST (nothing rented)
#   shrink: false               # node groups: resume on the nodes left, grow back with replacements

# templates: ./team-templates   # a folder whose files replace relaunch's instance scripts by name
"""

LAYOUTS = ("auto", "files", "hf-trainer", "dcp", "deepspeed", "lightning", "accelerate")


def _pad(text: str, width: int = 32) -> str:
    return text.ljust(width) if len(text) < width else text + " "


def starter_recipe(provider: str | None, layout: str | None = None, remote: str | None = None,
                   path: str = "recipe.yaml") -> str:
    """The commented YAML `relaunch init` writes; it loads and passes `check` as it is."""
    presets = load_providers()
    if provider is not None and provider not in presets:
        raise UsageError(f"unknown provider {provider!r}{did_you_mean(provider, presets)}",
                         hint="`relaunch providers` lists them")
    if layout is not None and layout not in LAYOUTS:
        raise UsageError(f"unknown layout {layout!r}{did_you_mean(layout, LAYOUTS)}",
                         hint="one of " + ", ".join(LAYOUTS))
    venv_line = "# venv: ~/venvs/my-run"
    installer_line = _pad("installer: uv", 30) + "# uv | pip (uv installs faster, and provides env.python)"
    dir_line = _pad("dir: ~/ckpt", 30) + "# where training writes checkpoints on the instance"
    if provider is None:
        user, port, note = "root", 22, "the default without a provider"
        provider_line = _pad("# extends: [providers/lambda]") + "# a provider's base recipe: `relaunch providers`"
    else:
        preset = presets[provider]
        user, port = preset.user or "root", preset.port or 22
        note = (f"from the {provider} preset; set it to override" if preset.user else
                f"the {provider} preset knows no user: set it (`relaunch providers`)")
        base = f"providers/{provider}"
        provider_line = _pad(f"extends: [{base}]") + f"# {provider}'s user, port, disks, notices: recipes/{base}.yaml"
        installer_line = _pad("# installer: uv", 30) + f"# from {base}; uv | pip"
        if preset.venv:
            venv_line = _pad(f"# venv: {preset.venv}", 30) + f"# from {base}: on a disk a stop keeps"
        if preset.checkpoint_dir:
            dir_line = _pad(f"# dir: {preset.checkpoint_dir}", 30) + f"# from {base}: on a disk a stop keeps"
    layout_line = (_pad(f"layout: {layout}", 30) if layout else _pad("# layout: auto", 30)) + \
        "# auto | files | hf-trainer | dcp | deepspeed | lightning | accelerate"
    remote_text = json.dumps(remote) if remote else "./store/my-run"
    return _STARTER.format(
        path=path, provider_line=provider_line, venv_line=venv_line, installer_line=installer_line,
        dir_line=dir_line, user=_pad(str(user), 22), user_note=f"# {note}", port=port,
        layout_line=layout_line, remote=_pad(remote_text, 22),
        remote_note="# a local path (relative to this file), rclone:REMOTE:PATH or hf:OWNER/REPO[/SUBFOLDER]",
    )
