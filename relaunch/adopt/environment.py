"""The run's environment, as `relaunch adopt` reads it: the venv (or conda env) root, its
Python, its lock and package indexes, and relaunch itself left out of the lock.
"""

from __future__ import annotations

import os
import re
from typing import Any

from ..host import indexes
from .candidates import Candidate
from .facts import MARK, Detail, Dist, EnvRoot
from .words import TOOLING, tilde


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
    """(index URLs, where the first was read): pip's and uv's configuration on the instance and the
    training's variables, resolved as `relaunch freeze` resolves them (host/indexes.py), uv's view
    first (the recipe's default installer)."""
    env: dict[str, str] = {}
    for var in detail.env:
        if var.name in indexes.VARIABLES:
            if var.secret or not var.value:
                return [], f"{var.name} holds credentials (not read)"
            env[var.name] = var.value
    files = list(reversed(detail.pip_config))      # the scan lists the file that wins first
    found = indexes.combined({"env": env, "env_from": "the training's environment",
                              "pip_files": [[p, t] for p, t in files if not p.endswith(".toml")],
                              "uv_files": [[p, t] for p, t in files if p.endswith(".toml")]}, "uv")
    if not found.urls:
        return [], ""
    # extras only: they are searched besides the default index, which the recipe must then name
    urls = found.urls if found.index_url else [indexes.DEFAULT_INDEX, *found.urls]
    return urls, found.where.get(urls[0], "uv's default index")


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
