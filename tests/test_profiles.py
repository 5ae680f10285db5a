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

from e2e import EXAMPLE, run_cli, wait_for, whole
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
    """The training log's whole lines (a `$` in a pattern also matches where a line being written stops)."""
    return whole(ssh(inst, "cat ~/my-run.log 2>/dev/null", check=False).stdout)


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


def assert_resumed(ssh, inst: sb.Instance, up_err: str, newest: tuple[str, int, str], ckpt_dir: str,
                   chosen: str = "newest verified in the store: {name} (step {step})") -> None:
    """`up` chose the newest checkpoint (`chosen` says which), the command resumed from those bytes and
    said so, and training goes on past it."""
    name, step, digest = newest
    assert "checkpoint: " + chosen.format(name=name, step=step) in up_err, up_err
    said = wait_for("training's 'resumed from' line", lambda: re.search(
        r"^resumed from (\S+) at step (\d+)$", log_text(ssh, inst), re.M), timeout=120)
    assert int(said[2]) == step, said[0]
    restored = said[1]
    assert restored == f"{ckpt_dir}/{name}", said[0]
    assert ssh(inst, f"sha256sum {restored}").stdout.split()[0] == digest
    wait_for(f"training past step {step}", lambda: trained_past(ssh, inst, step), timeout=120)


# What `up` and `status --json` say about the notice sources of init's recipe on each image (the base
# recipe's guard.sources): sigterm reaches the run where PID 1 is an init (a VM), never in a container
# whose PID 1 is a start script (runpod); no metadata service answers on a sandbox instance.
NOTICES: dict[str, dict[str, bool]] = {
    "ubuntu-22.04": {"sigterm": True}, "ubuntu-24.04": {"sigterm": True}, "runpod": {"sigterm": False},
    "vast": {}, "lambda": {}, "aws-dlami": {"aws": False, "aws-rebalance": False, "sigterm": True},
}


def assert_notices(image: str, up_err: str, status: dict[str, Any]) -> None:
    want = NOTICES[image]
    notices = status["notices"]
    assert {name: s["fires"] for name, s in notices["sources"].items()} == want, notices
    assert notices["protected"] == any(want.values())
    if want.get("sigterm"):
        assert "guard: sigterm can fire: " in up_err, up_err
        assert "guard: protected by sigterm: a notice becomes a save" in up_err, up_err
        assert notices["loss_bound"] is None
    else:
        if "sigterm" in want:
            said = next(ln for ln in up_err.splitlines() if "guard: sigterm cannot reach this run: " in ln)
            assert "PID 1 is start.sh" in said, said
        # the loss bound, named: the copy-off interval of init's recipe (the default, 600 s)
        assert ("no notice can protect this run: a loss costs what was saved after the store's newest verified "
                "checkpoint (none yet); keep `relaunch watch` running and that is at most one save interval plus a "
                "copy (it copies each checkpoint as it is saved), with `relaunch sync` alone checkpoint.every = 600s "
                "of copies plus one save interval") in up_err, up_err
        assert notices["loss_bound"]["every"] == 600


@pytest.mark.parametrize("image", list(PROVIDER))
def test_init_recipe_up_evacuate_and_resume_on_a_second_instance(image, tmp_path, sandbox, ssh, ssh_key,
                                                                  index_and_mirror):
    provider = PROVIDER[image]
    store, home = tmp_path / "store", tmp_path / "state"
    recipe = recipe_from_init(tmp_path / "work", provider, ssh_key, store)
    first = sandbox(image=image, index_dir=index_and_mirror)
    ckpt_dir = instance_dir(recipe, first)
    host = host_of(first, provider)

    up = run_cli("up", str(recipe), host, home=home)
    assert up.returncode == 0, up.stderr
    image_python = sb.PROFILES[image].python
    if image_python not in (None, "3.11"):     # the image's Python is not the recipe's: uv provides it
        assert f"python 3.11 from uv (the image has none; python3 is {image_python}." in up.stderr, up.stderr
    status = run_cli("status", str(recipe), host, "--json", home=home)
    assert status.returncode == 0, status.stderr
    assert_notices(image, up.stderr, json.loads(status.stdout))
    wait_for("a checkpoint on the first instance", lambda: newest_step(ssh, first, ckpt_dir) >= SAVE_EVERY)
    newest = evacuated(recipe, host, home, store)
    sb.destroy(first.name)

    second = sandbox(image=image, index_dir=index_and_mirror)
    up2 = run_cli("up", str(recipe), host_of(second, provider), home=home)
    assert up2.returncode == 0, up2.stderr
    assert_resumed(ssh, second, up2.stderr, newest, ckpt_dir)


def test_a_recipe_frozen_on_runpod_resumes_on_lambda_with_the_python_uv_provides(tmp_path, sandbox, ssh, ssh_key,
                                                                                 index_and_mirror):
    """The recipe asks 3.11 and puts its checkpoints and venv on RunPod's /workspace. Lambda's image has
    3.10 and no /workspace, which its user cannot make: the first `up` says so at preflight (exit 4,
    nothing changed); with the two folders (and the command's) pointed at the home, it resumes there
    on the Python uv provides from the offline mirror."""
    store, home = tmp_path / "store", tmp_path / "state"
    recipe = recipe_from_init(tmp_path / "work", "runpod", ssh_key, store)
    first = sandbox(image="runpod", index_dir=index_and_mirror)
    up = run_cli("up", str(recipe), first.host, home=home)
    assert up.returncode == 0, up.stderr
    assert "python 3.11 from uv" not in up.stderr          # runpod's image has it
    ckpt_dir = instance_dir(recipe, first)
    wait_for("a checkpoint on runpod", lambda: newest_step(ssh, first, ckpt_dir) >= SAVE_EVERY)
    newest = evacuated(recipe, first.host, home, store)
    sb.destroy(first.name)

    second = sandbox(image="lambda", index_dir=index_and_mirror)
    assert ssh(second, "command -v python3.11; python3 --version").stdout.startswith("Python 3.10.")
    refused = run_cli("up", str(recipe), second.host, home=home)
    assert refused.returncode == 4, refused.stderr
    error = next(ln for ln in refused.stderr.splitlines() if ln.startswith("Error:"))
    # the folder it cannot write in is / (a Lambda image has no /workspace), or /workspace: the sandbox
    # makes that mount point on this machine while any instance needs it (a runpod one of another test)
    assert re.fullmatch(rf"Error: ubuntu@{re.escape(second.address)}: preflight: checkpoint\.dir "
                        r"/workspace/ckpt/my-run: ubuntu cannot create it in (/|/workspace); "
                        r"env\.venv /workspace/venvs/my-run: ubuntu cannot create it in \1", error), error
    assert "--set 'checkpoint.dir=~/ckpt' --set 'env.venv=~/venvs/my-run'" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr
    assert ssh(second, "ls -A ~").stdout.strip() == ""      # nothing was changed

    frozen = load_recipe(recipe)
    command = frozen.run.command.replace(frozen.checkpoint.dir, "~/ckpt")
    assert command != frozen.run.command
    moved = ["--set", "provider=lambda", "--set", "checkpoint.dir=~/ckpt", "--set", "env.venv=~/venvs/my-run",
             "--set", f"run.command={command}"]
    up2 = run_cli("up", str(recipe), second.host, *moved, home=home)
    assert up2.returncode == 0, up2.stderr
    assert "python 3.11 from uv (the image has none; python3 is 3.10." in up2.stderr, up2.stderr
    assert "warning" not in up2.stderr, up2.stderr
    version = "~/venvs/my-run/bin/python -c 'import sys; print(\"%d.%d\" % sys.version_info[:2])'"
    assert ssh(second, version).stdout.strip() == "3.11"
    assert_resumed(ssh, second, up2.stderr, newest, "/home/ubuntu/ckpt")


def test_runpod_stopped_and_started_reuses_the_venv_and_resumes_from_workspace(tmp_path, sandbox, ssh, ssh_key,
                                                                              index_and_mirror):
    home = tmp_path / "state"
    recipe = recipe_from_init(tmp_path / "work", "runpod", ssh_key, tmp_path / "store")
    inst = sandbox(image="runpod", index_dir=index_and_mirror)
    ckpt_dir = instance_dir(recipe, inst)
    venv = load_recipe(recipe).env.venv.replace("{{ name }}", "my-run")
    assert ckpt_dir.startswith("/workspace/") and venv.startswith("/workspace/")
    up = run_cli("up", str(recipe), inst.host, home=home)
    assert up.returncode == 0, up.stderr
    wait_for("a checkpoint on /workspace", lambda: newest_step(ssh, inst, ckpt_dir) >= SAVE_EVERY)

    sb.stop(inst.name)                       # SIGTERM to PID 1 only (dropped), SIGKILL to all 5 s later
    sb.start(inst.name)
    assert ssh(inst, "ls -A ~").stdout.strip() == "", "runpod's home (the container disk) survived a stop"
    step = newest_step(ssh, inst, ckpt_dir)  # what the stop left: the newest complete checkpoint
    name = f"ckpt-{step:08d}.pt"
    digest = ssh(inst, f"sha256sum {ckpt_dir}/{name}").stdout.split()[0]

    again = run_cli("up", str(recipe), inst.host, home=home)
    assert again.returncode == 0, again.stderr
    assert f"venv {venv} already matches the lock" in again.stderr, again.stderr
    # nothing was evacuated: the newest checkpoint is the one the stop left on /workspace
    assert_resumed(ssh, inst, again.stderr, (name, step, digest), ckpt_dir,
                   chosen="the instance already has {name} (step {step}), newer than the store's")


def test_up_on_runpod_warns_that_a_stop_wipes_a_checkpoint_dir_in_home(tmp_path, sandbox, ssh, ssh_key):
    """A recipe that names the provider but does not extend its base: checkpoint.dir is the default ~/ckpt,
    on the container disk. (No lock: nothing to install, the command only has to stay up.)"""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "name": "wiped", "provider": "runpod", "ssh": {"key": str(ssh_key)}, "env": {"python": "3.11"},
        "checkpoint": {"remote": str(tmp_path / "store")}, "run": {"command": "sleep 600", "grace": 3}}))
    inst = sandbox(image="runpod")
    up = run_cli("up", str(recipe), inst.host, home=tmp_path / "state")
    assert up.returncode == 0, up.stderr
    assert (f"warning: {recipe}: checkpoint.dir /root/ckpt is on runpod's container disk (/), which a stop wipes: "
            "a stopped instance comes back without its checkpoints; its volume disk (/workspace) is kept through a "
            "stop (`extends: [providers/runpod]` puts it there)") in up.stderr, up.stderr
    # and so it is
    ssh(inst, "mkdir -p ~/ckpt && echo x > ~/ckpt/ckpt-00000005.pt")
    sb.stop(inst.name)
    sb.start(inst.name)
    assert ssh(inst, "test -e ~/ckpt || echo gone").stdout.strip() == "gone"
