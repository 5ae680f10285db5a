"""Checkpoints on an rclone remote: a real S3 server (`rclone serve s3`) on this machine's side of
the sandbox links, the real rclone client here and on the instances, both `via` modes."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from conftest import host_side_address
from e2e import example_recipe, local_final_hash, plain_recipe, run_cli, start_cli, wait_for
from relaunch import sandbox as sb


def plant(ssh, inst, name: str, size: int = 3000) -> None:
    ssh(inst, f"mkdir -p ~/ckpt && head -c {size} /dev/urandom > ~/ckpt/{name}.tmp && "
              f"mv ~/ckpt/{name}.tmp ~/ckpt/{name}")


def remote_manifest(s3, path: str) -> list[str]:
    manifest = s3.bucket_dir / path / ".relaunch" / "manifest.json"
    return [c["name"] for c in json.loads(manifest.read_text())["checkpoints"]] if manifest.exists() else []


@pytest.mark.parametrize("via", ["local", "instance"])
def test_evacuate_to_s3_and_up_elsewhere(via, tmp_path, sandbox, ssh, ssh_key, s3_remote, package_index):
    first = sandbox(index_dir=package_index)
    second = sandbox(user="ubuntu", index_dir=package_index)
    # on this machine's side of the instance that outlives the test: every instance routes there
    s3 = s3_remote(bind=host_side_address(second))
    home = tmp_path / "state"
    env = s3.env
    recipe = plain_recipe(tmp_path, name=f"s3-{via}", key=ssh_key, command="echo resumed {{ checkpoint }}; sleep 600",
                          env={"index_url": first.index_url, "secrets": sorted(env)},
                          checkpoint={"remote": f"rclone:{s3.name}:{s3.bucket}/runs/a", "via": via})
    for step in (5, 10, 15):
        plant(ssh, first, f"ckpt-{step:08d}.pt")
    evac = run_cli("evacuate", str(recipe), first.host, home=home, env=env)
    assert evac.returncode == 0, evac.stderr
    assert "safe to destroy" in evac.stderr
    assert remote_manifest(s3, "runs/a") == ["ckpt-00000010.pt", "ckpt-00000015.pt"]
    on_instance = ssh(first, "sha256sum ~/ckpt/ckpt-00000015.pt").stdout.split()[0]
    assert hashlib.sha256((s3.bucket_dir / "runs/a/ckpt-00000015.pt").read_bytes()).hexdigest() == on_instance
    if via == "instance":
        assert ssh(first, "ls ~/.relaunch/tools/bin/rclone").returncode == 0
        # straight from its wheel: no venv (and no pip) was needed for it
        assert ssh(first, "test -e ~/.relaunch/tools/bin/python", check=False).returncode == 1
        assert ssh(first, "ls ~/.relaunch/s3-instance/store.env 2>/dev/null || true").stdout == ""

    # a second evacuation moves nothing new and still verifies
    again = run_cli("evacuate", str(recipe), first.host, home=home, env=env)
    assert again.returncode == 0 and "copied 0" in again.stderr

    sb.destroy(first.name)
    up = run_cli("up", str(recipe), second.host, home=home, env=env)
    assert up.returncode == 0, up.stderr
    assert "restored ckpt-00000015.pt" in up.stderr
    line = wait_for("the command", lambda: ssh(second, "cat ~/s3-*.log 2>/dev/null", check=False).stdout)
    assert f"resumed {second.home}/ckpt/ckpt-00000015.pt" in line


def test_rclone_errors_are_one_line_with_the_right_exit_code(tmp_path, sandbox, ssh, ssh_key, s3_remote):
    inst = sandbox()
    s3 = s3_remote(bind=host_side_address(inst))
    home = tmp_path / "state"
    secret = s3.env[f"RCLONE_CONFIG_{s3.name.upper()}_SECRET_ACCESS_KEY"]
    plant(ssh, inst, "ckpt-00000005.pt")

    def recipe(remote: str, **env):
        return plain_recipe(tmp_path / remote.replace(":", "_").replace("/", "_"), name="errs", key=ssh_key,
                            env={"secrets": sorted(s3.env)}, checkpoint={"remote": remote, **env})

    outputs = []
    unknown = run_cli("up", str(recipe("rclone:nosuchremote:bucket/x")), inst.host, home=home, env=s3.env)
    outputs.append(unknown)
    assert unknown.returncode == 2 and "rclone remote 'nosuchremote' is not defined" in unknown.stderr

    wrong = {**s3.env, f"RCLONE_CONFIG_{s3.name.upper()}_SECRET_ACCESS_KEY": "x" * 40}
    denied = run_cli("up", str(recipe(f"rclone:{s3.name}:{s3.bucket}/x")), inst.host, home=home, env=wrong)
    outputs.append(denied)
    assert denied.returncode == 3, denied.stderr
    denied_evac = run_cli("evacuate", str(recipe(f"rclone:{s3.name}:{s3.bucket}/x")), inst.host, home=home, env=wrong)
    outputs.append(denied_evac)
    assert denied_evac.returncode == 6 and "DO NOT destroy" in denied_evac.stderr

    missing = run_cli("up", str(recipe(f"rclone:{s3.name}:nosuchbucket/x")), inst.host, home=home, env=s3.env)
    outputs.append(missing)
    assert missing.returncode == 5, missing.stderr
    assert "does not exist" in missing.stderr

    for out in outputs:
        assert "Traceback" not in out.stderr
        assert secret not in out.stdout + out.stderr
        assert len([ln for ln in out.stderr.splitlines() if ln.startswith("Error:")]) == 1
    assert secret not in (home / "debug.log").read_text()
    assert not any(secret in p.read_text(errors="ignore") for p in home.rglob("*") if p.is_file())
    assert os.environ.get("RCLONE_CONFIG_TESTSTORE_TYPE") is None


def test_full_cycle_through_s3_is_bit_identical(tmp_path, sandbox, ssh, ssh_key, s3_remote, package_index):
    steps, every = 30, 5
    expected = local_final_hash(tmp_path, "files", steps, every)
    first = sandbox(index_dir=package_index)
    second = sandbox(user="ubuntu", index_dir=package_index)
    s3 = s3_remote(bind=host_side_address(second))
    home = tmp_path / "state"
    recipe = example_recipe(tmp_path / "work", name="s3cycle", layout="files", key=ssh_key, index_url=first.index_url,
                            steps=steps, save_every=every, sleep=0.4)
    text = recipe.read_text().replace(f"remote: {tmp_path / 'work' / 'store'}",
                                      f"remote: rclone:{s3.name}:{s3.bucket}/cycle\n  via: instance")
    text = text.replace("  installer: uv", f"  installer: uv\n  secrets: {json.dumps(sorted(s3.env))}")
    recipe.write_text(text)
    assert run_cli("up", str(recipe), first.host, home=home, env=s3.env).returncode == 0
    wait_for("a checkpoint", lambda: "ckpt-00000010.pt" in ssh(first, "ls ~/ckpt 2>/dev/null", check=False).stdout)
    # --stop: on a loaded machine a checkpoint every 2 s can outrun each round's upload and check
    # through the instance (the core then says so, exit 6: tests/test_evacuate_rounds.py)
    evac = run_cli("evacuate", str(recipe), first.host, "--stop", home=home, env=s3.env)
    assert evac.returncode == 0, evac.stderr
    assert "safe to destroy" in evac.stderr
    sb.destroy(first.name)
    up = run_cli("up", str(recipe), second.host, home=home, env=s3.env)
    assert up.returncode == 0, up.stderr
    final = wait_for("the end", lambda: ssh(second, "cat ~/final.sha256 2>/dev/null", check=False).stdout.strip(),
                     timeout=300)
    assert final == expected


def test_via_local_uploads_each_file_while_the_next_ones_still_arrive(tmp_path, sandbox, ssh, ssh_key, s3_remote):
    """The relay does not wait for the whole checkpoint: a shard goes up as soon as it is here and
    verified, while later shards are still crossing the instance's link."""
    inst = sandbox(rate="8mbit")                  # ~1 MB/s: each 1.5 MB shard takes over a second
    s3 = s3_remote(bind=host_side_address(inst))
    home = tmp_path / "state"
    recipe = plain_recipe(tmp_path, name="relay", key=ssh_key,
                          checkpoint={"remote": f"rclone:{s3.name}:{s3.bucket}/p", "via": "local",
                                      "layout": "hf-trainer"})
    shards = [f"shard-{i:05d}.bin" for i in range(6)]
    ssh(inst, "mkdir -p ~/ckpt/checkpoint-20 && cd ~/ckpt/checkpoint-20 && "
              + " && ".join(f"head -c 1500000 /dev/urandom > {s}" for s in shards)
              + " && echo '{\"global_step\": 20}' > trainer_state.json")
    proc = start_cli("evacuate", str(recipe), inst.host, home=home, env=s3.env, err=tmp_path / "err")
    try:
        remote = s3.bucket_dir / "p" / "checkpoint-20"
        wait_for("the first shard on the remote", lambda: (remote / shards[0]).is_file(), timeout=120, every=0.05)
        # rsync copies in name order: the last shard has not reached this machine yet
        assert not list((home / "cache").rglob(shards[-1]))
        assert proc.wait(timeout=300) == 0, (tmp_path / "err").read_text()
    finally:
        proc.kill()
    err = (tmp_path / "err").read_text()
    assert "safe to destroy" in err
    held = ssh(inst, "cd ~/ckpt && sha256sum checkpoint-20/*").stdout
    for line in held.splitlines():
        digest, path = line.split()
        assert hashlib.sha256((s3.bucket_dir / "p" / path).read_bytes()).hexdigest() == digest
    assert remote_manifest(s3, "p") == ["checkpoint-20"]
