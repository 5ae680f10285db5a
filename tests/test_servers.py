"""The real local servers that checkpoint-remote tests use, driven by the real clients.

- tests/hubserver.py (fake Hugging Face Hub) against the real `hf` CLI and huggingface_hub.
  Uploads take the LFS batch path because `hf_hub.env()` sets HF_HUB_DISABLE_XET=1 (the server
  speaks no Xet); one test covers the inline ("regular") path with Xet left on.
- `rclone serve s3` (fixture `s3_remote`) against the real rclone, remote defined by environment.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import urllib.request
from pathlib import Path

import pytest

from conftest import HubFactory, S3Remote, S3RemoteFactory, host_side_address, tool_path
from e2e import wait_for
from hubserver import start_hub

REPO = "acme/run1"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tree(folder: Path) -> dict[str, bytes]:
    """Every file under folder with its bytes, minus huggingface_hub's local-dir bookkeeping."""
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and ".cache" not in p.relative_to(folder).parts
    }


def run(argv: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout)


def hf(hub_env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return run([tool_path("hf"), *args], hub_env)


def checkpoint_dir(root: Path, big: int = 5 * 1024 * 1024) -> Path:
    """A checkpoint-like folder: one 5 MB binary and small files, one of them nested."""
    root.mkdir(parents=True)
    (root / "model.pt").write_bytes(os.urandom(big))
    (root / "trainer_state.json").write_text(json.dumps({"global_step": 500}))
    (root / "rng_state_0.pth").write_bytes(os.urandom(300))
    (root / "sub").mkdir()
    (root / "sub" / "optimizer.bin").write_bytes(os.urandom(4096))
    return root


# ---------------------------------------------------------------------------------------------
# fake Hub


def test_hf_download_include_gets_exactly_the_seeded_bytes(hf_hub: HubFactory, tmp_path: Path) -> None:
    hub = hf_hub()
    files = {
        "checkpoint-500/model.pt": os.urandom(300_000),
        "checkpoint-500/trainer_state.json": b'{"global_step": 500}',
        "checkpoint-1000/model.pt": os.urandom(1000),
        "README.md": b"# run\n",
    }
    sha = hub.seed(REPO, files)
    out = tmp_path / "dl"
    proc = hf(hub.env(tmp_path / "hfhome"), "download", REPO, "--include", "checkpoint-500/*", "--local-dir", str(out))
    assert proc.returncode == 0, proc.stderr
    assert tree(out) == {k: v for k, v in files.items() if k.startswith("checkpoint-500/")}
    # the bytes came through the resolve route of the seeded commit
    assert ("GET", f"/{REPO}/resolve/{sha}/checkpoint-500/model.pt", 200) in hub.log


def test_hf_upload_folder_lands_through_lfs(hf_hub: HubFactory, tmp_path: Path) -> None:
    from huggingface_hub import HfApi

    hub = hf_hub()
    local = checkpoint_dir(tmp_path / "checkpoint-500")
    env = hub.env(tmp_path / "hfhome")
    proc = hf(env, "upload", REPO, str(local), "checkpoint-500")
    assert proc.returncode == 0, proc.stderr

    stored = hub.read_files(REPO)
    expected = {f"checkpoint-500/{k}": v for k, v in tree(local).items()}
    assert {k: sha256(v) for k, v in stored.items() if k != ".gitattributes"} == {
        k: sha256(v) for k, v in expected.items()
    }
    # every non-empty file went through the LFS batch API and the signed PUT, then one commit
    puts = [path for method, path, status in hub.log if method == "PUT" and status == 200]
    assert sorted(p.rsplit("/", 1)[1] for p in puts) == sorted(sha256(v) for v in expected.values())
    assert ("POST", f"/api/models/{REPO}/commit/main", 200) in hub.log

    # the tree API (read by the real client) shows them as LFS files with their sha256
    listing = list(HfApi(endpoint=hub.url, token=hub.token).list_repo_tree(REPO, recursive=True))
    files = {f.path: f for f in listing if f.__class__.__name__ == "RepoFile"}
    for path, data in expected.items():
        assert files[path].size == len(data)
        assert files[path].lfs is not None and files[path].lfs.sha256 == sha256(data)
    assert "checkpoint-500/sub" in {f.path for f in listing if f.__class__.__name__ == "RepoFolder"}

    # uploading the same folder again sends no bytes: preupload reports the stored oids
    before = len(puts)
    proc = hf(env, "upload", REPO, str(local), "checkpoint-500")
    assert proc.returncode == 0, proc.stderr
    assert len([1 for method, _, status in hub.log if method == "PUT" and status == 200]) == before


def test_upload_then_download_roundtrip_and_deletion(hf_hub: HubFactory, tmp_path: Path) -> None:
    from huggingface_hub import CommitOperationDelete, HfApi

    hub = hf_hub()
    local = checkpoint_dir(tmp_path / "ck", big=100_000)
    env = hub.env(tmp_path / "hfhome")
    assert hf(env, "upload", REPO, str(local), "checkpoint-500").returncode == 0
    api = HfApi(endpoint=hub.url, token=hub.token)
    api.create_commit(REPO, [CommitOperationDelete("checkpoint-500/sub/")], commit_message="drop sub")
    proc = hf(env, "download", REPO, "--local-dir", str(tmp_path / "back"))
    assert proc.returncode == 0, proc.stderr
    back = tree(tmp_path / "back")
    assert ".gitattributes" in back  # the Hub's first commit, as on the real one
    assert {k: v for k, v in back.items() if k.startswith("checkpoint-500/")} == {
        f"checkpoint-500/{k}": v for k, v in tree(local).items() if not k.startswith("sub/")
    }
    assert [c["message"] for c in hub.commits(REPO)] == ["initial commit", "Upload folder using huggingface_hub",
                                                         "drop sub"]  # fmt: skip


def test_tree_pagination_is_followed(hf_hub: HubFactory) -> None:
    from huggingface_hub import HfApi

    hub = hf_hub(tree_page_size=2)
    hub.seed(REPO, {f"checkpoint-{i}/model.pt": bytes([i]) * 10 for i in range(1, 6)})
    paths = {f.path for f in HfApi(endpoint=hub.url, token=hub.token).list_repo_tree(REPO, recursive=True)}
    assert {f"checkpoint-{i}/model.pt" for i in range(1, 6)} <= paths
    assert len([1 for method, path, _ in hub.log if method == "GET" and "/tree/" in path]) >= 5


def test_wrong_token_is_an_auth_error(hf_hub: HubFactory, tmp_path: Path) -> None:
    hub = hf_hub()
    hub.seed(REPO, {"checkpoint-500/model.pt": b"weights"})
    env = hub.env(tmp_path / "hfhome", token="hf_notTheRightToken000000000000000")
    down = hf(env, "download", REPO, "--local-dir", str(tmp_path / "dl"))
    assert down.returncode != 0
    assert "401" in down.stderr and "Invalid credentials" in down.stderr, down.stderr
    local = checkpoint_dir(tmp_path / "ck", big=10)
    up = hf(env, "upload", REPO, str(local), "checkpoint-600")
    assert up.returncode != 0
    assert "401" in up.stderr and "Invalid credentials" in up.stderr, up.stderr
    assert set(hub.listing(REPO)) == {".gitattributes", "checkpoint-500/model.pt"}


def test_missing_repo_and_file_are_not_found(hf_hub: HubFactory, tmp_path: Path) -> None:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RemoteEntryNotFoundError, RepositoryNotFoundError

    hub = hf_hub()
    proc = hf(hub.env(tmp_path / "hfhome"), "download", "acme/nothing", "--local-dir", str(tmp_path / "dl"))
    assert proc.returncode != 0
    assert "Model 'acme/nothing' not found" in proc.stderr, proc.stderr
    api = HfApi(endpoint=hub.url, token=hub.token)
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("acme/nothing")
    hub.seed(REPO, {"a.txt": b"a"})
    with pytest.raises(RemoteEntryNotFoundError):
        api.hf_hub_download(REPO, "b.txt", local_dir=tmp_path / "one")


def test_private_repo_hidden_without_token(hf_hub: HubFactory) -> None:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    hub = hf_hub()
    HfApi(endpoint=hub.url, token=hub.token).create_repo("acme/secret", private=True)
    assert HfApi(endpoint=hub.url, token=hub.token).model_info("acme/secret").private is True
    with pytest.raises(RepositoryNotFoundError):
        HfApi(endpoint=hub.url, token=False).model_info("acme/secret")


def test_resolve_headers_and_range(hf_hub: HubFactory) -> None:
    hub = hf_hub()
    data = os.urandom(1000)
    sha = hub.seed(REPO, {"w.bin": data})
    url = f"{hub.url}/{REPO}/resolve/main/w.bin"
    req = urllib.request.Request(url, method="HEAD", headers={"Authorization": f"Bearer {hub.token}"})
    with urllib.request.urlopen(req) as r:
        assert r.headers["X-Repo-Commit"] == sha
        assert r.headers["X-Linked-Etag"] == f'"{sha256(data)}"'
        assert r.headers["X-Linked-Size"] == "1000" and r.headers["Content-Length"] == "1000"
    req = urllib.request.Request(url, headers={"Range": "bytes=990-"})
    with urllib.request.urlopen(req) as r:
        assert r.status == 206 and r.headers["Content-Range"] == "bytes 990-999/1000"
        assert r.read() == data[990:]


def test_regular_uploads_work_with_xet_left_on(hf_hub: HubFactory, tmp_path: Path) -> None:
    # every file announced "regular": sent base64 inside the commit, so hf_xet is never asked
    hub = hf_hub(lfs_threshold=10**12)
    env = {k: v for k, v in hub.env(tmp_path / "hfhome").items() if k != "HF_HUB_DISABLE_XET"}
    local = checkpoint_dir(tmp_path / "ck", big=200_000)
    proc = hf(env, "upload", REPO, str(local), "ck")
    assert proc.returncode == 0, proc.stderr
    entries = hub.listing(REPO)
    assert {k: e.sha256 for k, e in entries.items() if k.startswith("ck/")} == {
        f"ck/{k}": sha256(v) for k, v in tree(local).items()
    }
    assert not any(e.lfs for e in entries.values())


def test_servers_refuse_to_listen_everywhere(tmp_path: Path, s3_remote: S3RemoteFactory) -> None:
    with pytest.raises(ValueError):
        start_hub(tmp_path / "hub", host="0.0.0.0")
    with pytest.raises(ValueError):
        s3_remote(bind="0.0.0.0")


# ---------------------------------------------------------------------------------------------
# rclone serve s3


def rclone(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return run([tool_path("rclone"), "--config", "/dev/null", *args], env)



def check_until(s3: S3Remote, local: Path, what: str, said: str) -> subprocess.CompletedProcess[str]:
    """`rclone check` of `local` against s3 `x` until its output says `said`."""
    def check() -> subprocess.CompletedProcess[str] | None:
        proc = rclone(s3.env, "check", str(local), s3.remote("x"))
        return proc if said in proc.stderr else None

    return wait_for(what, check, timeout=30, every=0.1)

def test_rclone_copy_to_the_bucket_and_back(s3_remote: S3RemoteFactory, tmp_path: Path) -> None:
    s3 = s3_remote()
    local = checkpoint_dir(tmp_path / "checkpoint-500")
    proc = rclone(s3.env, "copy", str(local), s3.remote("x"))
    assert proc.returncode == 0, proc.stderr
    assert tree(s3.bucket_dir / "x") == tree(local)  # objects are plain files in the served folder
    proc = rclone(s3.env, "copy", s3.remote("x"), str(tmp_path / "back"))
    assert proc.returncode == 0, proc.stderr
    assert tree(tmp_path / "back") == tree(local)


def test_rclone_s3_exposes_md5_only(s3_remote: S3RemoteFactory, tmp_path: Path) -> None:
    s3 = s3_remote()
    local = checkpoint_dir(tmp_path / "ck", big=100_000)
    assert rclone(s3.env, "copy", str(local), s3.remote("x")).returncode == 0
    proc = rclone(s3.env, "lsjson", "--hash", "-R", "--files-only", s3.remote("x"))
    assert proc.returncode == 0, proc.stderr
    listing = {e["Path"]: e for e in json.loads(proc.stdout)}
    files = tree(local)
    assert set(listing) == set(files)
    for path, data in files.items():
        assert listing[path]["Size"] == len(data)
        assert listing[path]["Hashes"] == {"md5": hashlib.md5(data).hexdigest()}
    # sha256 is not a hash the s3 remote has: only by downloading the bytes
    assert rclone(s3.env, "hashsum", "sha256", s3.remote("x")).returncode != 0
    proc = rclone(s3.env, "hashsum", "sha256", "--download", s3.remote("x"))
    assert proc.returncode == 0, proc.stderr
    assert dict(reversed(line.split("  ", 1)) for line in proc.stdout.splitlines()) == {
        p: sha256(d) for p, d in files.items()
    }


def test_rclone_check_finds_damage_and_missing_files(s3_remote: S3RemoteFactory, tmp_path: Path) -> None:
    s3 = s3_remote()
    local = checkpoint_dir(tmp_path / "ck", big=100_000)
    assert rclone(s3.env, "copy", str(local), s3.remote("x")).returncode == 0
    same = rclone(s3.env, "check", str(local), s3.remote("x"))
    assert same.returncode == 0, same.stderr
    assert "0 differences found" in same.stderr

    # one flipped byte, same size: the md5 comparison sees it
    target = s3.bucket_dir / "x" / "model.pt"
    data = bytearray(target.read_bytes())
    data[100] ^= 0xFF
    target.write_bytes(bytes(data))
    # the server lists the folder from a 100 ms cache (see the s3_remote fixture): until it sees the new bytes
    damaged = check_until(s3, local, "the server to serve the flipped byte", "differences found")
    assert damaged.returncode == 1
    assert "model.pt: md5 differ" in damaged.stderr, damaged.stderr
    assert rclone(s3.env, "check", "--download", str(local), s3.remote("x")).returncode == 1

    (s3.bucket_dir / "x" / "trainer_state.json").unlink()
    missing = check_until(s3, local, "the server to list the file gone", "file not in S3 bucket")
    assert missing.returncode == 1
    assert "trainer_state.json: file not in S3 bucket" in missing.stderr, missing.stderr
    assert "1 files missing" in missing.stderr


def test_rclone_wrong_keys_are_refused(s3_remote: S3RemoteFactory) -> None:
    s3 = s3_remote()
    env = {**s3.env, f"RCLONE_CONFIG_{s3.name.upper()}_SECRET_ACCESS_KEY": "wrongSecretKey0123456789abcdef"}
    proc = rclone(env, "lsjson", s3.remote())
    assert proc.returncode != 0
    assert "403" in proc.stderr and "SignatureDoesNotMatch" in proc.stderr, proc.stderr


def test_s3_server_stops_at_teardown(s3_remote: S3RemoteFactory) -> None:
    s3 = s3_remote()
    assert s3.proc.poll() is None
    s3.stop()
    assert s3.proc.poll() is not None
    assert rclone(s3.env, "lsjson", "--retries", "1", "--low-level-retries", "1", s3.remote()).returncode != 0


# ---------------------------------------------------------------------------------------------
# from inside a sandbox instance (the `via: instance` mode): servers bound to its host-side address


def test_instance_reaches_servers_on_its_host_side_address(sandbox, ssh, hf_hub: HubFactory,
                                                          s3_remote: S3RemoteFactory) -> None:  # fmt: skip
    inst = sandbox()
    bind = host_side_address(inst)
    hub = hf_hub(bind=bind)
    hub.seed(REPO, {"checkpoint-500/model.pt": b"weights"})
    s3 = s3_remote(bind=bind)
    assert hub.url.startswith(f"http://{bind}:") and s3.endpoint.startswith(f"http://{bind}:")
    fetch = (
        "python3 -c 'import sys, urllib.request, urllib.error\n"
        "try: r = urllib.request.urlopen(sys.argv[1]); print(r.status, r.read().decode())\n"
        "except urllib.error.HTTPError as e: print(e.code)' "
    )
    got = ssh(inst, fetch + f"{hub.url}/{REPO}/resolve/main/checkpoint-500/model.pt").stdout
    assert got.strip() == "200 weights"
    # the real rclone inside the instance (its home is an empty disk: bring the binary in over ssh)
    with open(tool_path("rclone"), "rb") as binary:
        put = subprocess.run(ssh.argv(inst, "cat > ~/rclone && chmod +x ~/rclone"), stdin=binary,
                             capture_output=True, timeout=300)  # fmt: skip
    assert put.returncode == 0, put.stderr
    ssh(inst, "mkdir -p ~/ck/sub && echo weights > ~/ck/model.pt && echo 1 > ~/ck/sub/state.json")
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in s3.env.items())
    ssh(inst, f"env {env} ~/rclone --config /dev/null copy ~/ck {s3.remote('from-instance')}")
    assert tree(s3.bucket_dir / "from-instance") == {"model.pt": b"weights\n", "sub/state.json": b"1\n"}
