"""Preflight: what must hold before anything changes, and the few fixes that come first."""

from __future__ import annotations

import shlex

from ..errors import EnvError
from ..host.facts import unseen_run
from ..job import Job
from ..plan import Action
from ..recipe.disks import recipe_disk_warnings, too_small
from ..ui import human
from .env import provides_python, uv_makes_venv, venv_works

GiB = 1024**3
# where a recipe puts these by default: the home folder, which any login user can write
HOME_DEFAULTS = {"checkpoint.dir": "~/ckpt", "env.venv": "~/venvs/{name}"}


def missing_packages(job: Job) -> list[str]:
    facts = job.facts.host
    missing = [tool for tool in ("tmux", "rsync") if not facts.tools.get(tool)]
    missing += [p for p in facts.missing_apt if p not in missing]
    if facts.python and not facts.venv_module and not uv_makes_venv(job):
        # only where pip makes the venv (`python -m venv`): uv needs no venv module
        missing.append(f"python{job.recipe.env.python}-venv")
    return missing


def apt_command(packages: list[str], root: bool) -> str:
    sudo = "" if root else "sudo -n "
    names = " ".join(shlex.quote(p) for p in packages)
    return (f"{sudo}env DEBIAN_FRONTEND=noninteractive apt-get update -qq && "
            f"{sudo}env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq {names}")


def newest_bytes(job: Job) -> int:
    """The size of the newest complete checkpoint, on the instance or in the store (0: none yet)."""
    from .checkpoint import instance_checkpoints

    sizes = [sum(e.size for e in cp.files) for cp in instance_checkpoints(job)[-1:]]
    store = job.facts.store
    record = store.manifest.newest() if store and store.manifest else None
    if record is not None:
        sizes.append(sum(f.size for f in record.files.values()))
    return max(sizes, default=0)


def disk_warnings(job: Job) -> list[str]:
    """Where checkpoint.dir and env.venv sit, against the provider's disks and this disk's size."""
    paths = job.paths
    warnings, notes = recipe_disk_warnings(job.recipe, job.facts.host.home,
                                           {"checkpoint.dir": paths.ckpt_dir, "env.venv": paths.venv})
    small = too_small(paths.ckpt_dir, job.facts.host.total_ckpt, newest_bytes(job))
    return [f"warning: {w}" for w in [*warnings, *([small] if small else [])]] + [f"note: {n}" for n in notes]


def summary(job: Job) -> list[str]:
    """What the instance has, as facts (printed before anything is planned), and warnings."""
    facts, paths = job.facts.host, job.paths
    if facts.gpus:
        gpus = ", ".join(g.split(",")[0].strip() for g in facts.gpus)
    elif facts.gpu_error:
        gpus = f"unknown ({facts.gpu_error})"
    else:
        gpus = "none (fine for a CPU run)"
    python = facts.python or "-"
    if provides_python(job):
        python = f"{job.recipe.env.python} from uv (the image has none; python3 is {facts.python3_version or '-'})"
    else:
        python += f" ({facts.python3_version})"
    lines = [f"python {python}, {human(facts.free_ckpt)} free for checkpoints, GPUs: {gpus}"]
    if facts.free_venv < GiB:
        lines.append(f"warning: only {human(facts.free_venv)} free where the venv goes ({paths.venv})")
    return lines + disk_warnings(job)


def plan_preflight(job: Job, checkpoint_bytes: int) -> list[Action]:
    """Raise EnvError (exit 4) when the instance cannot work; else plan the missing system packages."""
    recipe, facts, paths = job.recipe, job.facts.host, job.paths
    unseen = unseen_run(facts, recipe.run.session)
    if unseen is not None and unseen.certain:
        # its session is not this login's, but this recipe's training runs on the box: a second one
        # would share its GPUs and checkpoint.dir
        raise EnvError(f"{job.host}: preflight: {unseen.why}; starting it here would train twice",
                       unseen.hint("status", job.target))
    found = f"python3 is {facts.python3_version}" if facts.python3_version else "no python3 at all"
    if not facts.python and not provides_python(job):
        raise EnvError(
            f"{job.host}: preflight: env.python is {recipe.env.python} but the instance has no "
            f"python{recipe.env.python} ({found})",
            f"set env.installer: uv, which provides Python {recipe.env.python} (from env.python_mirror on an "
            "instance without internet access); or choose an image with it, or set env.python to what it has",
        )
    if provides_python(job) and not facts.python3_version and not venv_works(job):
        # uv is put in place by templates/tool.py, which any python3 runs
        raise EnvError(f"{job.host}: preflight: env.python is {recipe.env.python}, which uv would provide, but the "
                       "instance has no python3 at all to put uv in place with",
                       "choose an image with a python3 (any 3.8 or newer)")
    blocked = [(key, path, folder) for key, path, folder in (("checkpoint.dir", paths.ckpt_dir, facts.ckpt_blocked),
                                                              ("env.venv", paths.venv, facts.venv_blocked)) if folder]
    if blocked:
        # else the checkpoint step fails on mkdir (exit 5: "rerunning resumes", which it never would); a
        # recipe made for one provider's disks (RunPod's /workspace) meets an image without them
        where = "; ".join(f"{key} {path}: {facts.user} cannot create it in {folder}" for key, path, folder in blocked)
        sets = " ".join(f"--set '{key}={HOME_DEFAULTS[key].format(name=recipe.name)}'" for key, _, _ in blocked)
        raise EnvError(f"{job.host}: preflight: {where}",
                       f"point it at a folder this user can write, e.g. {sets} (and the same folder in run.command), "
                       "or extend the base recipe of this instance's provider (`relaunch providers`)")
    if checkpoint_bytes and facts.free_ckpt < checkpoint_bytes * 1.05:
        raise EnvError(
            f"{job.host}: preflight: the checkpoint needs {human(checkpoint_bytes)} but only "
            f"{human(facts.free_ckpt)} is free under {paths.ckpt_dir}",
            "rent a bigger disk or point checkpoint.dir at the large volume",
        )
    missing = missing_packages(job)
    if not missing:
        return [Action("preflight", "system packages", skip="tmux, rsync and env.apt already installed")]
    if not facts.tools.get("apt-get"):
        raise EnvError(f"{job.host}: preflight: missing {', '.join(missing)} and there is no apt-get",
                       "install them on the image, or pick an image that has them")
    if not facts.can_root:
        raise EnvError(f"{job.host}: preflight: missing {', '.join(missing)}, and {facts.user} is not root "
                       "and has no passwordless sudo", "install them once as root, or use the provider's "
                       "default user")
    return [Action("preflight", f"install {' '.join(missing)} with apt",
                             command=apt_command(missing, facts.is_root), deadline=900,
                             say=f"installing {' '.join(missing)} with apt")]
