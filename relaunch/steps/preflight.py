"""Preflight: read-only facts first, then the few fixes that must come before anything else."""

from __future__ import annotations

import shlex

from ..errors import EnvError
from ..host.connection import Remote
from ..host.facts import HostFacts, facts_script, parse_facts
from ..plan import Action
from ..recipe import Recipe
from .common import Job, InstancePaths

GiB = 1024**3


def gather_facts(remote: Remote, recipe: Recipe, paths: InstancePaths) -> HostFacts:
    script = facts_script(recipe.env.python, paths.venv, paths.ckpt_dir, recipe.run.session,
                          list(recipe.env.apt), templates=recipe.templates)
    result = remote.check("bash -s", "preflight (reading facts)", EnvError, stdin=script.encode(),
                          display="bash -s < facts.sh")
    return parse_facts(result.text)


def human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return f"{n} B"


def missing_packages(recipe: Recipe, facts: HostFacts) -> list[str]:
    missing = [tool for tool in ("tmux", "rsync") if not facts.tools.get(tool)]
    missing += [p for p in facts.missing_apt if p not in missing]
    if facts.python and not facts.venv_module:
        missing.append(f"python{recipe.env.python}-venv")
    return missing


def apt_command(packages: list[str], root: bool) -> str:
    sudo = "" if root else "sudo -n "
    names = " ".join(shlex.quote(p) for p in packages)
    return (f"{sudo}env DEBIAN_FRONTEND=noninteractive apt-get update -qq && "
            f"{sudo}env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq {names}")


def plan_preflight(job: Job, checkpoint_bytes: int) -> list[Action]:
    """Check what must hold before anything changes; raise EnvError (exit 4) when it does not."""
    recipe, facts, paths = job.recipe, job.facts, job.paths
    if not facts.python:
        found = f"python3 is {facts.python3_version}" if facts.python3_version else "no python3 at all"
        raise EnvError(
            f"{job.host}: preflight: env.python is {recipe.env.python} but the instance has no "
            f"python{recipe.env.python} ({found})",
            f"choose an image with Python {recipe.env.python}, or set env.python to what it has",
        )
    if checkpoint_bytes and facts.free_ckpt < checkpoint_bytes * 1.05:
        raise EnvError(
            f"{job.host}: preflight: the checkpoint needs {human(checkpoint_bytes)} but only "
            f"{human(facts.free_ckpt)} is free under {paths.ckpt_dir}",
            "rent a bigger disk or point checkpoint.dir at the large volume",
        )
    if facts.free_venv < GiB:
        job.ui.warn(f"{job.host}: only {human(facts.free_venv)} free where the venv goes ({paths.venv})")
    gpus = ", ".join(g.split(",")[0].strip() for g in facts.gpus) if facts.gpus else "none (fine for a CPU run)"
    job.say("preflight", f"python {facts.python} ({facts.python3_version}), {human(facts.free_ckpt)} free "
            f"for checkpoints, GPUs: {gpus}")

    missing = missing_packages(recipe, facts)
    if not missing:
        return [Action("preflight", "system packages", skip="tmux, rsync and env.apt already installed")]
    if not facts.tools.get("apt-get"):
        raise EnvError(f"{job.host}: preflight: missing {', '.join(missing)} and there is no apt-get",
                       "install them on the image, or pick an image that has them")
    if not facts.can_root:
        raise EnvError(f"{job.host}: preflight: missing {', '.join(missing)}, and {facts.user} is not root "
                       "and has no passwordless sudo", "install them once as root, or use the provider's "
                       "default user")
    command = apt_command(missing, facts.is_root)

    def run() -> None:
        job.say("preflight", f"installing {' '.join(missing)} with apt")
        job.remote.check(command, "preflight (apt-get install)", EnvError, timeout=900)

    return [Action("preflight", f"install {' '.join(missing)}", command, run)]
