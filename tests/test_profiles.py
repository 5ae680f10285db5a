"""Issue 22's "Done when", on every sandbox image profile: a recipe from `relaunch init --provider P`,
as a user takes it, through the whole cycle on the stock image that provider rents out.

For each profile: `up`, train until a checkpoint, `evacuate --stop` (safe to destroy), destroy, `up`
on a second instance of the same profile, resumed from the store's newest checkpoint (its bytes) and
training on past it. Then across profiles (runpod to lambda: the recipe asks 3.11, lambda has 3.10),
which notice sources `up` says can fire (runpod, ubuntu-22.04), a runpod instance stopped and started
again (the venv and checkpoints on /workspace kept, the home wiped), and a checkpoint.dir on runpod's
container disk warned about.

The recipe is what `init --provider` wrote; the test writes only the training command (with its
ready line, so `up` need not watch it for run.grace) and the checkpoint remote, plus what a sandbox
instance needs because it reaches no internet and no SSH agent: env.index_url (the local index),
env.python_mirror (uv's offline mirror of this machine's CPython 3.11, for the images without 3.11),
the example's env.lock and env.files, and ssh.key. `recipe_from_init` checks that nothing else differs.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e import EXAMPLE, run_cli, wait_for
from relaunch import sandbox as sb
from relaunch.recipe import load_recipe
from relaunch.sandbox.pythons import build_mirror

# profile -> the provider whose `init --provider` recipe runs on it
PROVIDER = {"ubuntu-22.04": "generic", "ubuntu-24.04": "generic", "runpod": "runpod", "vast": "vast",
            "lambda": "lambda", "aws-dlami": "aws"}
SAVE_EVERY = 5
INDEX_URL = f"http://127.0.0.1:{sb.INDEX_PORT}/simple/"
MIRROR_URL = f"http://127.0.0.1:{sb.INDEX_PORT}/python/downloads.json"
# what the test may write into init's recipe (dotted keys): see the module docstring
WRITTEN = {"run.command", "run.ready", "checkpoint.remote", "env.index_url", "env.python_mirror", "env.lock",
           "env.files", "ssh.key"}


@pytest.fixture(scope="session")
def index_and_mirror(package_index: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example's package index (torch CPU, uv, pip), and under python/ uv's offline mirror of this
    machine's CPython 3.11: served inside an instance at http://127.0.0.1:8765/."""
    dest = tmp_path_factory.mktemp("index-and-mirror")
    for part in ("simple", "files"):            # the index itself, shared (the server follows links)
        (dest / part).symlink_to(package_index / part)
    build_mirror(["3.11"], dest / "python", MIRROR_URL.rsplit("/", 1)[0])
    return dest


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict):
        out: dict[str, Any] = {}
        for key, value in data.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out or {prefix.rstrip("."): {}}
    return {prefix.rstrip("."): data}


def recipe_from_init(folder: Path, provider: str, key: Path, store: Path) -> Path:
    """`relaunch init --provider PROVIDER`, then only the keys of WRITTEN set (asserted)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "recipe.yaml"
    made = run_cli("init", str(path), "--provider", provider, home=folder / "state")
    assert made.returncode == 0, made.stderr
    shutil.copy(EXAMPLE / "train.py", folder / "train.py")
    shutil.copy(EXAMPLE / "requirements.lock", folder / "requirements.lock")
    before = yaml.safe_load(path.read_text())
    ckpt_dir = load_recipe(path).checkpoint.dir     # where init's base recipe puts checkpoints
    data = yaml.safe_load(path.read_text())
    data["run"]["command"] = (f"python train.py --out {ckpt_dir} --layout files --steps 100000 "
                              f"--save-every {SAVE_EVERY} --sleep 0.2 --resume \"{{{{ checkpoint }}}}\"")
    data["run"]["ready"] = r"^step \d+ "
    data["checkpoint"]["remote"] = str(store)
    data["env"].update({"index_url": INDEX_URL, "python_mirror": MIRROR_URL, "lock": "requirements.lock",
                        "files": {"train.py": "~/work/train.py"}})
    data["ssh"] = {"key": str(key)}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    old, new = _flat(before), _flat(data)
    changed = {k for k in old.keys() | new.keys() if old.get(k) != new.get(k)}
    assert {".".join(k.split(".")[:2]) for k in changed} <= WRITTEN, changed
    assert new["env.python"] == "3.11" and new["extends"] == [f"providers/{provider}"]
    return path


def host_of(inst: sb.Instance, provider: str) -> str:
    """HOST as a user types it: the generic recipe does not know the image's user (ubuntu@ADDRESS);
    the others' presets do, but a container's port is mapped (ADDRESS:PORT, as the console shows)."""
    return f"{inst.user}@{inst.address}" if provider == "generic" else inst.host


def log_text(ssh, inst: sb.Instance) -> str:
    return ssh(inst, "cat ~/my-run.log 2>/dev/null", check=False).stdout


def newest_step(ssh, inst: sb.Instance, ckpt_dir: str) -> int:
    out = ssh(inst, f"ls -1 {ckpt_dir} 2>/dev/null", check=False).stdout
    return max((int(m[1]) for m in re.finditer(r"^ckpt-(\d+)\.pt$", out, re.M)), default=0)


def trained_past(ssh, inst: sb.Instance, step: int) -> bool:
    return any(int(m[1]) > step for m in re.finditer(r"^step (\d+) ", log_text(ssh, inst), re.M))


def store_newest(store: Path) -> tuple[str, int, str]:
    """(name, step, sha256) of the newest checkpoint the store's manifest holds, the hash of its bytes."""
    manifest = json.loads((store / ".relaunch" / "manifest.json").read_text())
    newest = max(manifest["checkpoints"], key=lambda c: c["step"])
    digest = hashlib.sha256((store / newest["name"]).read_bytes()).hexdigest()
    return newest["name"], newest["step"], digest


def instance_dir(recipe: Path, inst: sb.Instance) -> str:
    """checkpoint.dir as the instance sees it (~ and {{ name }} resolved)."""
    home = "/root" if inst.user == "root" else f"/home/{inst.user}"
    return load_recipe(recipe).checkpoint.dir.replace("{{ name }}", "my-run").replace("~", home, 1)


def evacuated(recipe: Path, host: str, home: Path, store: Path) -> tuple[str, int, str]:
    evac = run_cli("evacuate", str(recipe), host, "--stop", home=home)
    assert evac.returncode == 0, evac.stderr
    assert "safe to destroy" in evac.stderr, evac.stderr
    return store_newest(store)


def assert_resumed(ssh, inst: sb.Instance, up_err: str, newest: tuple[str, int, str], ckpt_dir: str) -> None:
    """The second `up` restored the store's newest checkpoint (those bytes), training said so and goes on."""
    name, step, digest = newest
    assert f"step {step}" in up_err, up_err
    said = wait_for("training's 'resumed from' line", lambda: re.search(
        rf"^resumed from (\S+) at step (\d+)$", log_text(ssh, inst), re.M), timeout=120)
    assert int(said[2]) == step, said[0]
    restored = said[1]
    assert restored == f"{ckpt_dir}/{name}", said[0]
    assert ssh(inst, f"sha256sum {restored}").stdout.split()[0] == digest
    wait_for(f"training past step {step}", lambda: trained_past(ssh, inst, step), timeout=120)


@pytest.mark.parametrize("image", list(PROVIDER))
def test_init_recipe_up_evacuate_and_resume_on_a_second_instance(image, tmp_path, sandbox, ssh, ssh_key,
                                                                  index_and_mirror):
    provider = PROVIDER[image]
    store, home = tmp_path / "store", tmp_path / "state"
    recipe = recipe_from_init(tmp_path / "work", provider, ssh_key, store)
    first = sandbox(image=image, index_dir=index_and_mirror)
    ckpt_dir = instance_dir(recipe, first)

    up = run_cli("up", str(recipe), host_of(first, provider), home=home)
    assert up.returncode == 0, up.stderr
    wait_for("a checkpoint on the first instance", lambda: newest_step(ssh, first, ckpt_dir) >= SAVE_EVERY)
    newest = evacuated(recipe, host_of(first, provider), home, store)
    sb.destroy(first.name)

    second = sandbox(image=image, index_dir=index_and_mirror)
    up2 = run_cli("up", str(recipe), host_of(second, provider), home=home)
    assert up2.returncode == 0, up2.stderr
    assert_resumed(ssh, second, up2.stderr, newest, ckpt_dir)
