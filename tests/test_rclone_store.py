"""Checkpoints on an rclone remote: a real S3 server (`rclone serve s3`) on this machine's side of
the sandbox links, the real rclone client here and on the instances, both `via` modes."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
from conftest import host_side_address
from e2e import example_recipe, local_final_hash, plain_recipe, run_cli, wait_for

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
    evac = run_cli("evacuate", str(recipe), first.host, home=home, env=s3.env)
    assert evac.returncode == 0, evac.stderr
    sb.destroy(first.name)
    up = run_cli("up", str(recipe), second.host, home=home, env=s3.env)
    assert up.returncode == 0, up.stderr
    final = wait_for("the end", lambda: ssh(second, "cat ~/final.sha256 2>/dev/null", check=False).stdout.strip(),
                     timeout=300)
    assert final == expected
