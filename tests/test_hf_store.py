"""The Hugging Face Hub store (`checkpoint.remote: hf:OWNER/REPO[/SUBFOLDER]`) end to end.

Real parts: sandbox instances with a real sshd, the fake Hub of tests/hubserver.py speaking the
Hub's HTTP API, the real `hf` CLI installed on the instance from the local package index, and
huggingface_hub on this machine. The hub listens on an instance's host-side address so that
both this machine and the instances reach it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shlex
import shutil
import struct
from pathlib import Path

import pytest
import yaml

from conftest import host_side_address
from e2e import example_recipe, local_final_hash, plain_recipe, run_cli, wait_for
from relaunch import sandbox as sb

REPO = "acme/ckpts"
SUB = "run1"
MANIFEST = f"{SUB}/.relaunch/manifest.json"
TOOLS_HF = "~/.relaunch/tools/bin/hf"


def hub_env(hub, tmp: Path, token: str | None = None) -> dict[str, str]:
    """What the user's shell holds: the hub's endpoint, the token, XET off (the fake hub speaks LFS)."""
    return hub.env(tmp / "hfhome-here", token=token)


def hf_recipe(tmp: Path, name: str, key: Path, inst, remote: str, *, layout: str, **checkpoint: object) -> Path:
    return plain_recipe(tmp / "work", name=name, key=key,
                        command='echo "resume={{ checkpoint }} step={{ step }}" > ~/resumed.txt; sleep 600',
                        env={"index_url": inst.index_url, "secrets": ["HF_TOKEN"]},
                        checkpoint={"remote": remote, "layout": layout, "pattern": "ckpt-*.pt", **checkpoint})


def safetensors(size: int) -> bytes:
    """A well-formed safetensors file of random weights (relaunch checks the header against the size)."""
    header = json.dumps({"w": {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}}).encode()
    return struct.pack("<Q", len(header)) + header + os.urandom(size)


def plant_trainer(ssh, inst, step: int) -> dict[str, str]:
    """A complete `checkpoint-<step>/` (trainer_state.json written last); returns path -> sha256."""
    d = f"~/ckpt/checkpoint-{step}"
    state = json.dumps({"global_step": step})
    weights = base64.b64encode(safetensors(3000)).decode()
    ssh(inst, f"mkdir -p {d} && echo {weights} | base64 -d > {d}/model.safetensors && "
              f"head -c 700 /dev/urandom > {d}/optimizer.pt && printf %s {shlex.quote(state)} > {d}/trainer_state.json")
    return instance_hashes(ssh, inst, f"checkpoint-{step}")


def plant_file(ssh, inst, step: int, size: int = 2500) -> dict[str, str]:
    name = f"ckpt-{step:08d}.pt"
    ssh(inst, f"mkdir -p ~/ckpt && head -c {size} /dev/urandom > ~/ckpt/{name}.tmp && "
              f"mv ~/ckpt/{name}.tmp ~/ckpt/{name}")
    return instance_hashes(ssh, inst, name)


def instance_hashes(ssh, inst, name: str, root: str = "~/ckpt") -> dict[str, str]:
    out = ssh(inst, f"cd {root} && find {shlex.quote(name)} -type f -print0 | xargs -0 sha256sum").stdout
    return {line.split("  ", 1)[1]: line.split("  ", 1)[0] for line in out.splitlines() if line.strip()}


def repo_hashes(hub, repo: str, prefix: str) -> dict[str, str]:
    """path (without prefix) -> sha256 of the bytes the hub stores at main."""
    return {p[len(prefix):]: hashlib.sha256(data).hexdigest()
            for p, data in hub.read_files(repo).items() if p.startswith(prefix)}


def manifest_names(hub, repo: str = REPO, path: str = MANIFEST) -> list[str]:
    return [c["name"] for c in json.loads(hub.read_files(repo)[path])["checkpoints"]]


def assert_no_secret(home: Path, outputs: list, *secrets: str) -> None:
    """No token in anything shown, nor in relaunch's debug log."""
    text = "".join(p.stdout + p.stderr for p in outputs)
    log = home / "debug.log"
    text += log.read_text() if log.exists() else ""
    for secret in secrets:
        assert secret not in text


def test_via_instance_evacuate_then_up_elsewhere(tmp_path, sandbox, ssh, ssh_key, package_index, hf_hub):
    first = sandbox(index_dir=package_index)
    second = sandbox(user="ubuntu", index_dir=package_index)
    # bound to the second's host side: both instances route the whole sandbox range to this machine
    hub = hf_hub(bind=host_side_address(second), lfs_threshold=1000)   # small json files stay regular
    env, home = hub_env(hub, tmp_path), tmp_path / "state"
    recipe = hf_recipe(tmp_path, "hfinst", ssh_key, first, f"hf:{REPO}/{SUB}", layout="hf-trainer")
    older = plant_trainer(ssh, first, 5)
    newest = plant_trainer(ssh, first, 10)

    evac = run_cli("evacuate", str(recipe), first.host, home=home, env=env)
    assert evac.returncode == 0, evac.stderr
    assert "safe to destroy" in evac.stderr
    assert "the instance uploads checkpoint-10" in evac.stderr          # via: instance is the default
    stored = repo_hashes(hub, REPO, f"{SUB}/")
    assert {p: stored.get(p) for p in {**older, **newest}} == {**older, **newest}
    assert sorted(manifest_names(hub)) == ["checkpoint-10", "checkpoint-5"]
    assert hub.store.state("model", REPO)["private"] is True           # created by relaunch: private
    assert f"{SUB}/.relaunch/versions.json" in hub.listing(REPO)
    ssh(first, f"test -x {TOOLS_HF}")                                   # hf in relaunch's tools venv
    ssh(first, "test ! -e ~/.relaunch/hfinst/store.env")                # the token file is gone

    # evacuating again re-verifies and uploads nothing new
    commits = len(hub.commits(REPO))
    again = run_cli("evacuate", str(recipe), first.host, home=home, env=env)
    assert again.returncode == 0, again.stderr
    assert "already there 2" in again.stderr
    assert len(hub.commits(REPO)) <= commits + 1                        # at most the manifest/meta commit

    hub.log.clear()
    up = run_cli("up", str(recipe), second.host, home=home, env=env)
    assert up.returncode == 0, up.stderr
    assert "checkpoint-10 (step 10)" in up.stderr
    assert instance_hashes(ssh, second, "checkpoint-10") == newest
    resolved = [path for method, path, status in hub.log if method == "GET" and "/resolve/" in path]
    assert resolved and not [p for p in resolved if "checkpoint-5/" in p]   # only the newest came down
    listing = ssh(second, "ls -A ~/ckpt").stdout.split()
    assert listing == ["checkpoint-10"]                                 # no download debris, no .cache
    ssh(second, "test ! -e ~/.relaunch/hfinst/store.env")
    resumed = ssh(second, "for i in $(seq 50); do [ -s ~/resumed.txt ] && break; sleep 0.2; done; cat ~/resumed.txt")
    assert resumed.stdout.strip() == "resume=/home/ubuntu/ckpt/checkpoint-10 step=10"
    assert_no_secret(home, [evac, again, up], hub.token)


@pytest.mark.parametrize("case", ["no-venv-module", "no-uv-on-the-index"])
def test_hf_reaches_the_tools_folder_on_an_image_without_a_venv_module_and_from_an_index_without_uv(
        tmp_path, sandbox, ssh, ssh_key, package_index, hf_hub, case):
    """hf is a Python package in relaunch's tools venv. uv makes that venv: Ubuntu 24.04's stock
    python3 has no venv module (no python3-venv), so `python3 -m venv` cannot. Where the index has
    no uv, `python -m venv` and pip make it, as they always did."""
    if case == "no-venv-module":
        inst = sandbox(image="ubuntu-24.04", index_dir=package_index)
        assert ssh(inst, "python3 -m venv /tmp/probe", check=False).returncode != 0   # the image as rented
    else:
        index = tmp_path / "index"            # the same index without uv (hard links: torch is 190 MB)
        shutil.copytree(package_index, index, copy_function=os.link,
                        ignore=lambda folder, names: [n for n in names if n == "uv" or n.startswith("uv-")])
        inst = sandbox(index_dir=index)
    hub = hf_hub(bind=host_side_address(inst))
    home = tmp_path / "state"
    recipe = hf_recipe(tmp_path, "hftools", ssh_key, inst, f"hf:{REPO}/{SUB}", layout="files")
    planted = plant_file(ssh, inst, 5)

    evac = run_cli("evacuate", str(recipe), inst.host, home=home, env=hub_env(hub, tmp_path))
    assert evac.returncode == 0, evac.stderr
    assert "safe to destroy" in evac.stderr
    assert {p: h for p, h in repo_hashes(hub, REPO, f"{SUB}/").items() if p in planted} == planted
    ssh(inst, f"test -x {TOOLS_HF}")
    made_by = ssh(inst, "cat ~/.relaunch/tools/pyvenv.cfg").stdout
    assert ("uv = " in made_by) == (case == "no-venv-module"), made_by
    if case == "no-uv-on-the-index":
        assert ssh(inst, "~/.relaunch/tools/bin/python -m pip --version").returncode == 0
        ssh(inst, "test ! -e ~/.relaunch/tools/bin/uv")


def test_via_local_round_trip_with_pruning(tmp_path, sandbox, ssh, ssh_key, package_index, hf_hub):
    first = sandbox(index_dir=package_index)
    second = sandbox(index_dir=package_index)
    hub = hf_hub(bind=host_side_address(second))
    env, home = hub_env(hub, tmp_path), tmp_path / "state"
    recipe = hf_recipe(tmp_path, "hflocal", ssh_key, first, f"hf:{REPO}", layout="files", via="local", keep=2)
    plant_file(ssh, first, 5)
    plant_file(ssh, first, 10)

    evac = run_cli("evacuate", str(recipe), first.host, home=home, env=env)
    assert evac.returncode == 0, evac.stderr
    assert "safe to destroy" in evac.stderr
    assert sorted(manifest_names(hub, path=".relaunch/manifest.json")) == ["ckpt-00000005.pt", "ckpt-00000010.pt"]
    newest = plant_file(ssh, first, 15)
    evac2 = run_cli("evacuate", str(recipe), first.host, home=home, env=env)
    assert evac2.returncode == 0, evac2.stderr
    assert "pruned ckpt-00000005.pt" in evac2.stderr
    files = set(hub.listing(REPO))
    assert "ckpt-00000005.pt" not in files and {"ckpt-00000010.pt", "ckpt-00000015.pt"} <= files
    assert manifest_names(hub, path=".relaunch/manifest.json") == ["ckpt-00000010.pt", "ckpt-00000015.pt"]
    ssh(first, f"test ! -e {TOOLS_HF}")                 # via local: the instance never talks to the hub

    up = run_cli("up", str(recipe), second.host, home=home, env=env)
    assert up.returncode == 0, up.stderr
    assert "ckpt-00000015.pt (step 15)" in up.stderr
    assert instance_hashes(ssh, second, "ckpt-00000015.pt") == newest
    ssh(second, f"test ! -e {TOOLS_HF}")
    assert_no_secret(home, [evac, evac2, up], hub.token)


def test_up_restores_a_trainers_last_checkpoint(tmp_path, sandbox, ssh, ssh_key, package_index, hf_hub):
    inst = sandbox(index_dir=package_index)
    hub = hf_hub(bind=host_side_address(inst), lfs_threshold=1000)
    files = {"last-checkpoint/model.safetensors": os.urandom(5000), "last-checkpoint/optimizer.pt": os.urandom(1500),
             "last-checkpoint/trainer_state.json": json.dumps({"global_step": 42, "epoch": 1.5}).encode(),
             "README.md": b"# a model\n", "config.json": b"{}"}
    hub.seed("acme/trainer", files, private=True)
    env, home = hub_env(hub, tmp_path), tmp_path / "state"
    recipe = hf_recipe(tmp_path, "hflast", ssh_key, inst, "hf:acme/trainer", layout="hf-trainer")

    up = run_cli("up", str(recipe), inst.host, home=home, env=env)
    assert up.returncode == 0, up.stderr
    assert "last-checkpoint (step 42)" in up.stderr
    want = {p: hashlib.sha256(b).hexdigest() for p, b in files.items() if p.startswith("last-checkpoint/")}
    assert instance_hashes(ssh, inst, "last-checkpoint") == want
    resumed = ssh(inst, "for i in $(seq 50); do [ -s ~/resumed.txt ] && break; sleep 0.2; done; cat ~/resumed.txt")
    assert resumed.stdout.strip() == "resume=/root/ckpt/last-checkpoint step=42"
    assert ".relaunch/manifest.json" not in hub.listing("acme/trainer")       # up writes nothing

    # training goes on; evacuating adds relaunch's record beside the Trainer's folder, which it
    # neither adopts into its manifest nor ever prunes
    newer = plant_trainer(ssh, inst, 50)
    evac = run_cli("evacuate", str(recipe), inst.host, home=home, env=env)
    assert evac.returncode == 0, evac.stderr
    assert manifest_names(hub, "acme/trainer", ".relaunch/manifest.json") == ["checkpoint-50"]
    stored = repo_hashes(hub, "acme/trainer", "")
    assert {p: stored.get(p) for p in [*want, *newer]} == {**want, **newer}     # last-checkpoint/ untouched
    assert_no_secret(home, [up, evac], hub.token)


def test_errors_are_one_line_with_the_right_exit_code_and_no_token(tmp_path, sandbox, ssh, ssh_key, package_index,
                                                                   hf_hub):
    inst = sandbox(index_dir=package_index)
    hub = hf_hub(bind=host_side_address(inst))
    hub.seed(REPO, {f"{SUB}/ckpt-00000001.pt": b"x" * 100})
    home = tmp_path / "state"
    wrong = "hf_wrongTokenWrongTokenWrong0123456789"
    plant_file(ssh, inst, 5)
    outputs = []

    recipe = hf_recipe(tmp_path, "hferr", ssh_key, inst, f"hf:{REPO}/{SUB}", layout="files")
    bad = run_cli("up", str(recipe), inst.host, home=home, env=hub_env(hub, tmp_path, token=wrong))
    assert bad.returncode == 3, bad.stderr
    assert f"HF_TOKEN is missing or not allowed for {REPO}" in bad.stderr and "Traceback" not in bad.stderr

    evac = run_cli("evacuate", str(recipe), inst.host, home=home, env=hub_env(hub, tmp_path, token=wrong))
    assert evac.returncode == 6, evac.stderr
    assert f"HF_TOKEN is missing or not allowed for {REPO}" in evac.stderr and "DO NOT destroy" in evac.stderr
    assert "safe to destroy" not in evac.stderr

    missing = hf_recipe(tmp_path, "hfmissing", ssh_key, inst, "hf:acme/nothing-here", layout="files")
    gone = run_cli("up", str(missing), inst.host, home=home, env=hub_env(hub, tmp_path))
    assert gone.returncode == 5, gone.stderr
    assert "the repo acme/nothing-here does not exist" in gone.stderr and "Traceback" not in gone.stderr
    error_lines = [ln for ln in gone.stderr.splitlines() if ln.startswith("Error")]
    assert len(error_lines) == 1

    typo = hf_recipe(tmp_path, "hftypo", ssh_key, inst, "hf:acme", layout="files")
    usage = run_cli("up", str(typo), inst.host, home=home, env=hub_env(hub, tmp_path))
    assert usage.returncode == 2 and "hf:OWNER/REPO" in usage.stderr, usage.stderr

    # without any token a private repo looks missing, and the message says why
    private = hf_recipe(tmp_path, "hfnotoken", ssh_key, inst, "hf:acme/private", layout="files")
    hub.seed("acme/private", {"ckpt-00000001.pt": b"y" * 100}, private=True)
    no_token = {**hub_env(hub, tmp_path), "HF_TOKEN": ""}
    unlisted = run_cli("up", str(private), inst.host, home=home, env=no_token)
    assert unlisted.returncode == 5, unlisted.stderr
    assert "a private repo looks missing without a token: set HF_TOKEN here" in unlisted.stderr
    outputs += [bad, evac, gone, usage, unlisted]
    assert_no_secret(home, outputs, wrong, hub.token)
    assert not [m for m, _, s in hub.log if m == "POST" and s == 200]     # nothing was written to the hub


def test_full_cycle_through_the_hub_resumes_bit_identical(tmp_path, sandbox, ssh, ssh_key, package_index, hf_hub):
    """The example trainer (hf-trainer layout): up -> train -> evacuate to the hub -> destroy ->
    up on another instance -> the same final weights as an uninterrupted run."""
    steps, save_every = 30, 5
    expected = local_final_hash(tmp_path, "hf-trainer", steps, save_every)
    first = sandbox(index_dir=package_index)
    second = sandbox(user="ubuntu", index_dir=package_index)
    hub = hf_hub(bind=host_side_address(second))        # the first instance (and its address) goes away
    env, home = hub_env(hub, tmp_path), tmp_path / "state"
    recipe = example_recipe(tmp_path / "work", name="hfcycle", layout="hf-trainer", key=ssh_key,
                            index_url=first.index_url, steps=steps, save_every=save_every, sleep=0.4)
    data = yaml.safe_load(recipe.read_text())
    data["checkpoint"]["remote"] = f"hf:{REPO}/{SUB}"
    data["env"]["secrets"] = ["HF_TOKEN"]
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    hub.create_repo(REPO, private=True)                 # a missing repo on `up` is an error (a typo?)

    up = run_cli("up", str(recipe), first.host, home=home, env=env)
    assert up.returncode == 0, up.stderr
    assert "is empty: fresh start" in up.stderr
    wait_for("two checkpoints", lambda: "checkpoint-10" in ssh(first, "ls ~/ckpt 2>/dev/null || true").stdout)
    # --stop: a checkpoint every 2 s outruns a fresh `hf` process per upload (the core says so, exit 6)
    evac = run_cli("evacuate", str(recipe), first.host, "--stop", home=home, env=env)
    assert evac.returncode == 0, evac.stderr
    assert "safe to destroy" in evac.stderr
    evacuated = max(json.loads(hub.read_files(REPO)[MANIFEST])["checkpoints"], key=lambda c: c["step"])
    sb.destroy(first.name)

    up2 = run_cli("up", str(recipe), second.host, home=home, env=env)
    assert up2.returncode == 0, up2.stderr
    assert f"{evacuated['name']} (step {evacuated['step']})" in up2.stderr
    wait_for("training to finish", lambda: ssh(second, "cat ~/final.sha256 2>/dev/null || true").stdout.strip(),
             timeout=300)
    assert ssh(second, "cat ~/final.sha256").stdout.strip() == expected
    assert_no_secret(home, [up, evac, up2], hub.token)


def test_verification_reads_one_revision_lfs_sha256_and_git_blob_ids(tmp_path, hf_hub, monkeypatch):
    """The check behind "verified": sizes, LFS sha256 and (regular files) git blob ids at one commit."""
    from relaunch.manifest import FileRecord
    from relaunch.transports.hf import HfStore
    from relaunch.transports.hf.client import git_blob_id

    monkeypatch.setenv("RELAUNCH_HOME", str(tmp_path / "state"))
    hub = hf_hub(lfs_threshold=1000)
    weights, state = os.urandom(4000), b'{"global_step": 7}'
    sha = hub.seed(REPO, {f"{SUB}/checkpoint-7/model.pt": weights, f"{SUB}/checkpoint-7/trainer_state.json": state})
    hub.seed(REPO, {f"{SUB}/checkpoint-7/model.pt": os.urandom(4000)})       # a later commit changes it
    store = HfStore(REPO, SUB, "verify", hub.token, hub.url)
    (tmp_path / "state.json").write_bytes(state)
    blob_ids = lambda paths: {p: git_blob_id(tmp_path / "state.json") for p in paths}  # noqa: E731
    right = {"checkpoint-7/model.pt": FileRecord(4000, hashlib.sha256(weights).hexdigest()),
             "checkpoint-7/trainer_state.json": FileRecord(len(state), hashlib.sha256(state).hexdigest())}
    assert store._compare(store._snapshot(sha), right, blob_ids) == []
    problems = store._compare(store._snapshot(hub.commits(REPO)[-1]["sha"]), right, blob_ids)
    assert len(problems) == 1 and problems[0].startswith("checkpoint-7/model.pt: sha256")
    (tmp_path / "state.json").write_bytes(b'{"global_step": 8}')              # same size, other bytes
    problems = store._compare(store._snapshot(sha), right, blob_ids)
    assert len(problems) == 1 and problems[0].startswith("checkpoint-7/trainer_state.json: git blob id")
    extra = {**right, "checkpoint-7/rng_state.pth": FileRecord(10, "0" * 64)}
    assert any(pr.startswith("checkpoint-7/rng_state.pth: missing")
               for pr in store._compare(store._snapshot(sha), extra, blob_ids))


def test_uploads_left_in_incoming_are_removed_once_nothing_will_move_them(tmp_path, sandbox, ssh, ssh_key,
                                                                         package_index, hf_hub):
    """A relaunch killed between the instance's upload and its move into place leaves the upload in
    `.relaunch/incoming/`. The next evacuation that copies removes those of a checkpoint the store
    records, and those older than the oldest it keeps; a newer one stays (another writer may be about
    to move it)."""
    from huggingface_hub import CommitOperationAdd, HfApi

    inst = sandbox(index_dir=package_index)
    hub = hf_hub(bind=host_side_address(inst), lfs_threshold=1000)
    env, home = hub_env(hub, tmp_path), tmp_path / "state"
    recipe = hf_recipe(tmp_path, "orphans", ssh_key, inst, f"hf:{REPO}/{SUB}", layout="hf-trainer")
    plant_trainer(ssh, inst, 5)
    assert run_cli("evacuate", str(recipe), inst.host, home=home, env=env).returncode == 0
    incoming = f"{SUB}/.relaunch/incoming"
    left = {f"{incoming}/aaaa/checkpoint-5/model.safetensors": "recorded",
            f"{incoming}/bbbb/checkpoint-1/model.safetensors": "older",
            f"{incoming}/cccc/checkpoint-50/model.safetensors": "newer"}
    api = HfApi(endpoint=env["HF_ENDPOINT"], token=hub.token)
    api.create_commit(REPO, [CommitOperationAdd(p, why.encode()) for p, why in left.items()],      # small: no LFS
                      commit_message="an upload whose relaunch was killed")
    plant_trainer(ssh, inst, 10)
    evac = run_cli("evacuate", str(recipe), inst.host, home=home, env=env)
    assert evac.returncode == 0, evac.stderr
    listing = hub.listing(REPO)
    assert [p for p in left if p in listing] == [f"{incoming}/cccc/checkpoint-50/model.safetensors"]
    assert sorted(manifest_names(hub)) == ["checkpoint-10", "checkpoint-5"]
