"""The provider catalogue's disks, the base recipes made from it, `init --provider` and the disk
warnings of `check` (no host: pure, from the catalogue and the files)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from e2e import REPO, run_cli
from relaunch.recipe import load_providers, load_recipe
from relaunch.recipe.bases import base_recipe
from relaunch.recipe.model import Guard
from relaunch.recipe.render import disk_findings

BASES = REPO / "recipes" / "providers"


def test_every_provider_has_its_generated_base_recipe_and_nothing_else() -> None:
    presets = load_providers()
    assert sorted(p.stem for p in BASES.glob("*.yaml")) == sorted(presets)
    for name, preset in presets.items():
        assert (BASES / f"{name}.yaml").read_text() == base_recipe(preset), (
            f"recipes/providers/{name}.yaml is stale: run `python -m relaunch.recipe.bases`")


def test_the_catalogue_agrees_with_itself() -> None:
    for name, p in load_providers().items():
        home_disk = p.disk_of("~", "/home/u")
        if p.disk_survives_stop is not None and home_disk is not None and home_disk.stop:
            assert p.disk_survives_stop == (home_disk.stop == "kept"), name
        if p.disks and name != "sandbox":
            assert p.sources, f"{name}: disks without a source"
        for path in (p.checkpoint_dir, p.venv):
            if path:
                disk = p.disk_of(path.split("{", 1)[0], "/root")
                assert disk is not None and disk.stop == "kept", f"{name}: {path} is not on a disk a stop keeps"
        if p.guard_sources is not None:
            Guard.model_validate({"sources": list(p.guard_sources)})
        if p.reclaim_notice == "none" and name != "sandbox":     # the sandbox's images differ: see docs/providers.md
            assert p.guard_sources == (), f"{name}: no notice documented, yet the base recipe listens for one"


def test_the_longest_disk_path_decides() -> None:
    runpod, aws = load_providers()["runpod"], load_providers()["aws"]
    assert runpod.disk_of("~/ckpt", "/root").name == "container disk"          # type: ignore[union-attr]
    assert runpod.disk_of("/workspace/ckpt/x", "/root").name == "volume disk"  # type: ignore[union-attr]
    assert runpod.disk_of("/workspace", "/root").name == "volume disk"         # type: ignore[union-attr]
    assert runpod.disk_of("/workspace2/x", "/root").name == "container disk"   # type: ignore[union-attr]
    assert aws.disk_of("/opt/dlami/nvme/ckpt", "/home/ubuntu").stop == "wiped"  # type: ignore[union-attr]
    assert aws.disk_of("~/ckpt", "/home/ubuntu").stop == "kept"                 # type: ignore[union-attr]
    assert load_providers()["generic"].disk_of("~/ckpt", "/root") is None


@pytest.mark.parametrize("provider", sorted(load_providers()))
def test_init_provider_extends_its_base_and_passes_check(provider: str, tmp_path: Path) -> None:
    path = tmp_path / "recipe.yaml"
    out = run_cli("init", str(path), "--provider", provider, home=tmp_path)
    assert out.returncode == 0, out.stderr
    text = path.read_text()
    assert f"extends: [providers/{provider}]" in text
    recipe = load_recipe(path)
    preset = load_providers()[provider]
    assert recipe.provider == provider and recipe.env.installer == "uv"
    assert any(f.endswith(f"providers/{provider}.yaml") for f in recipe.files)
    if preset.checkpoint_dir:
        assert recipe.checkpoint.dir == preset.checkpoint_dir
        assert recipe.origin(("checkpoint", "dir")).startswith(str(BASES / f"{provider}.yaml"))
    if preset.guard_sources is not None:
        assert recipe.guard.sources == list(preset.guard_sources)
    checked = run_cli("check", str(path), "--json", home=tmp_path)
    assert checked.returncode == 0, checked.stderr
    assert json.loads(checked.stdout)["warnings"] == [], "a base recipe must not put checkpoints on a wiped disk"


def write(folder: Path, text: str) -> Path:
    path = folder / "r.yaml"
    path.write_text(text)
    return path


def test_check_warns_about_checkpoints_on_a_disk_a_stop_wipes(tmp_path: Path) -> None:
    path = write(tmp_path, "name: x\nprovider: runpod\nenv: {python: '3.11'}\ncheckpoint:\n  remote: ./s\n"
                           "run: {command: python t.py}\n")
    out = run_cli("check", str(path), home=tmp_path)
    assert out.returncode == 0
    # the key, where it comes from, what a stop does and where it would be kept
    assert (f"warning: {path}: checkpoint.dir ~/ckpt is on runpod's container disk (/), which a stop wipes: a "
            "stopped instance comes back without its checkpoints; its volume disk (/workspace) is kept through a "
            "stop (`extends: [providers/runpod]` puts it there)") in out.stderr
    assert f"note: {path}: env.venv ~/venvs/x is on runpod's container disk (/)" in out.stderr
    warnings, notes = disk_findings(load_recipe(path, overrides=["checkpoint.dir=/workspace/c",
                                                                   "env.venv=/workspace/v"]))
    assert (warnings, notes) == ([], [])


def test_check_warns_where_the_recipe_wrote_the_key(tmp_path: Path) -> None:
    path = write(tmp_path, "name: x\nextends: [providers/aws]\nenv: {python: '3.11'}\ncheckpoint:\n"
                           "  remote: ./s\n  dir: /opt/dlami/nvme/ckpt\nrun: {command: python t.py}\n")
    warnings, _ = disk_findings(load_recipe(path))
    assert warnings == [f"{path}:6: checkpoint.dir /opt/dlami/nvme/ckpt is on aws's instance store "
                        "(/opt/dlami/nvme), which a stop wipes: a stopped instance comes back without its checkpoints; "
                        "its root EBS volume (/) is kept through a stop"]
    # a provider with no documented disks says nothing; a recipe without a provider neither
    for text in ("name: x\nprovider: generic\n", "name: x\n"):
        plain = write(tmp_path, text + "env: {python: '3.11'}\ncheckpoint: {remote: ./s}\nrun: {command: c}\n")
        assert disk_findings(load_recipe(plain)) == ([], [])


def test_providers_json_lists_the_disks(tmp_path: Path) -> None:
    out = run_cli("providers", "--json", home=tmp_path)
    data = json.loads(out.stdout)
    assert data["runpod"]["disks"][1] == {"path": "/workspace", "name": "volume disk", "stop": "kept",
                                          "reclaim": "wiped", "what": data["runpod"]["disks"][1]["what"]}
    assert data["runpod"]["checkpoint_dir"] == "/workspace/ckpt/{{ name }}"
    assert yaml.safe_load((BASES / "runpod.yaml").read_text())["checkpoint"]["dir"] == "/workspace/ckpt/{{ name }}"


def test_up_warns_with_the_instances_home_and_disk_size(tmp_path: Path) -> None:
    """`up` says the same from the facts it read: the real home, and a disk smaller than two of the
    newest checkpoint (the instance holds one of 600 MiB on a 1 GiB disk)."""
    from relaunch.host.facts import HostFacts
    from relaunch.host.spec import Target
    from relaunch.job import Facts, Job, Node
    from relaunch.layouts import Entry
    from relaunch.steps.preflight import summary

    path = write(tmp_path, "name: x\nprovider: runpod\nenv: {python: '3.11'}\ncheckpoint:\n  remote: ./s\n"
                           "  layout: files\nrun: {command: python t.py}\n")
    recipe = load_recipe(path)
    host = HostFacts(home="/root", user="root", uid=0, python="/usr/bin/python3.11", free_ckpt=400 << 20,
                     free_venv=8 << 30, total_ckpt=1 << 30)
    listing = [Entry(path="ckpt-00000020.pt", kind="f", size=600 << 20, mtime=1.0)]
    job = Job(recipe, Node(Target(address="203.0.113.7", user="root", port=22)), Facts(host=host, listing=listing))
    lines = summary(job)
    assert (f"warning: {path}: checkpoint.dir /root/ckpt is on runpod's container disk (/), which a stop wipes: a "
            "stopped instance comes back without its checkpoints; its volume disk (/workspace) is kept through a "
            "stop (`extends: [providers/runpod]` puts it there)") in lines
    assert ("warning: checkpoint.dir /root/ckpt is on a disk of 1.0 GiB, less than twice the newest checkpoint "
            "(600.0 MiB): the next save may not fit beside the last complete one") in lines
    assert any(line.startswith(f"note: {path}: env.venv /root/venvs/x is on") for line in lines)
    roomy = Job(recipe.model_copy(), job.node, Facts(host=HostFacts(**{**host.as_dict(), "total_ckpt": 2 << 30}),
                                                     listing=listing))
    assert not any("less than twice" in line for line in summary(roomy))


def test_up_stops_at_preflight_where_the_user_cannot_make_checkpoint_dir_or_the_venv(tmp_path: Path) -> None:
    """A recipe made for RunPod's /workspace on an image where / is root's (Lambda's ubuntu user): exit 4 at
    preflight, naming both keys and the folder, before anything changes (the checkpoint step's mkdir failed
    with exit 5, "rerunning resumes", which it never would)."""
    from relaunch.errors import EnvError
    from relaunch.host.facts import HostFacts, parse_facts
    from relaunch.host.spec import Target
    from relaunch.job import Facts, Job, Node
    from relaunch.steps.preflight import plan_preflight

    facts = parse_facts("home=/home/ubuntu\nuser=ubuntu\nuid=1000\npython=/usr/bin/python3.11\n"
                        "venv_module=1\nhas_tmux=1\nhas_rsync=1\nckpt_blocked=/\nvenv_blocked=/\n")
    assert (facts.ckpt_blocked, facts.venv_blocked) == ("/", "/")
    path = write(tmp_path, "name: x\nextends: [providers/runpod]\nenv: {python: '3.11'}\ncheckpoint: {remote: ./s}\n"
                           "run: {command: python t.py}\n")
    node = Node(Target(address="203.0.113.7", user="ubuntu", port=22))
    with pytest.raises(EnvError) as raised:
        plan_preflight(Job(load_recipe(path), node, Facts(host=facts)), 0)
    assert str(raised.value) == ("ubuntu@203.0.113.7: preflight: checkpoint.dir /workspace/ckpt/x: ubuntu cannot "
                                 "create it in /; env.venv /workspace/venvs/x: ubuntu cannot create it in /")
    assert "--set 'checkpoint.dir=~/ckpt' --set 'env.venv=~/venvs/x'" in str(raised.value.hint)
    assert raised.value.exit_code == 4
    # a folder it can make (nothing blocked): preflight goes on
    fine = HostFacts(**{**facts.as_dict(), "ckpt_blocked": "", "venv_blocked": ""})
    assert plan_preflight(Job(load_recipe(path), node, Facts(host=fine)), 0)[0].skip
