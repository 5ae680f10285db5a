"""Provider presets (recipes/providers.yaml) and the starter recipe for `relaunch init`.

This module sits below the rest of `relaunch.recipe`: it imports nothing from it, so the
model can validate `provider:` against the presets without an import cycle.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

import yaml

from relaunch.errors import UsageError
from relaunch.resources import recipes_dir


@dataclass(frozen=True)
class Provider:
    name: str
    user: str
    port: int
    notes: str


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """` (did you mean X?)` for the closest choice, or an empty string."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


@lru_cache(maxsize=1)
def _presets() -> tuple[Provider, ...]:
    path = recipes_dir() / "providers.yaml"
    # A broken preset file is our bug, not the user's: let it raise with its own trace.
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    return tuple(
        Provider(name=str(name), user=str(p["user"]), port=int(p["port"]),
                 notes=" ".join(str(p["notes"]).split()))
        for name, p in raw.items()
    )


def load_providers() -> dict[str, Provider]:
    """The presets by name, in the file's order (a fresh dict: callers may change it)."""
    return {p.name: p for p in _presets()}


_STARTER = """\
# A relaunch recipe. `relaunch check recipe.yaml` validates it without touching any host;
# `relaunch plan recipe.yaml HOST` shows what `up` would do. Every key is described in
# relaunch's README; the commented ones show their defaults.
name: my-run                    # letters, digits, _ and -: names the tmux session and the store
{provider_line}
# extends: [team/base.yaml]     # merged first, this file wins (paths relative to this file)

ssh:
  # user: {user}{user_note}
  # port: {port}
  # key: ~/.ssh/id_ed25519      # else ssh-agent and ~/.ssh/config
  # host_key: SHA256:...        # pin the key the provider console shows; else trust on first use
  # wait: 300                   # seconds to keep trying while the instance boots

env:
  python: "3.11"                # quoted: YAML reads 3.10 as the number 3.1
  # venv: ~/venvs/my-run
  # installer: pip              # pip | uv (uv installs several times faster)
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
  dir: ~/ckpt                   # where training writes checkpoints on the instance
  # layout: auto                # auto | files | hf-trainer | dcp | deepspeed | lightning | accelerate
  # pattern: "ckpt-*.pt"        # for layout files
  # keep: 2                     # newest complete checkpoints kept off the machine
  remote: ./store/my-run        # a local path, rclone:REMOTE:PATH or hf:OWNER/REPO[/SUBFOLDER]
  # via: local                  # local: bytes pass through this machine | instance: it uploads itself
  # every: 600                  # seconds between copies in `relaunch sync`

run:
  # {{{{ checkpoint }}}} is the restored checkpoint's path on the instance, empty on a fresh start.
  command: python train.py --resume "{{{{ checkpoint }}}}"
  workdir: ~/work
  # session: my-run             # tmux session; default: name
  # log: ~/my-run.log
  # stop: {{signal: TERM, timeout: 120}}   # how `evacuate --stop` asks training to save and exit
"""


def starter_recipe(provider: str | None) -> str:
    """The commented YAML `relaunch init [--provider P]` writes; it loads as it is."""
    presets = load_providers()
    if provider is None:
        user, port, note = "root", 22, "                  # the default without a provider"
        provider_line = "# provider: lambda            # SSH user and port preset: see `relaunch providers`"
    elif provider in presets:
        preset = presets[provider]
        user, port = preset.user, preset.port
        provider_line = f"provider: {provider}"
        note = f"                # from the {provider} preset; set it to override"
    else:
        raise UsageError(
            f"unknown provider {provider!r}{did_you_mean(provider, presets)}",
            hint="`relaunch providers` lists them",
        )
    return _STARTER.format(provider_line=provider_line, user=user, user_note=note, port=port)
