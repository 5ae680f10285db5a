"""Several writers on one Hugging Face Hub store (`checkpoint.remote: hf:OWNER/REPO/SUB`).

Two evacuations (two instances, or `sync` here and `evacuate` on another machine) write the same
repo; the local lock does not see the other one. Every manifest commit names its parent, the
fake Hub (tests/hubserver.py) refuses a stale one with 412 as the Hub does, and the writer
merges and tries again. These tests run real huggingface_hub clients against the fake Hub's HTTP
API: two processes racing, and exact interleavings made with `hub.before_commit`, where another
writer commits between a writer's read of the head and its commit.

A writer here does what relaunch does for one checkpoint: `via: local` (upload from a verified
staged copy against the head, verify at the upload's commit, record) or `via: instance` (a
commit with no parent, as `hf upload` on the instance makes, then accepted against the
instance's sha256 and git blob ids).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from conftest import host_side_address
from e2e import run_cli
from relaunch.errors import EvacuationError
from relaunch.host.hashing import FileHash
from relaunch.layouts.base import Checkpoint, Entry
from relaunch.manifest import CheckpointRecord, FileRecord, StoreManifest, utc_now
from test_hf_store import assert_no_secret, hf_recipe, hub_env, plant_file

REPO = "acme/ckpts"
SUB = "run1"
MANIFEST = ".relaunch/manifest.json"


def checkpoint_files(step: int, variant: str = "") -> dict[str, bytes]:
    """checkpoint-<step>/: weights big enough to be an LFS file, a small state file kept regular
    (git blob id). The same (step, variant) always gives the same bytes."""
    rng = random.Random(f"{step}-{variant}")
    return {f"checkpoint-{step}/model.safetensors": rng.randbytes(3000),
            f"checkpoint-{step}/trainer_state.json": json.dumps({"global_step": step, "v": variant}).encode()}


class Writer:
    """One relaunch process writing the store; it reads the store when made, as evacuate does."""

    def __init__(self, url: str, token: str, folder: Path, host: str, via: str = "local") -> None:
        from relaunch.transports.hf import HfStore

        self.store = HfStore(REPO, SUB, "writers", token, url)
        self.url, self.token, self.folder, self.host, self.via = url, token, folder, host, via
        self.store.read(writing=True)

    def _stage(self, step: int, variant: str) -> tuple[Checkpoint, CheckpointRecord, Path]:
        files = checkpoint_files(step, variant)
        staged = self.folder / f"staged-{step}-{variant}"
        for path, data in files.items():
            (staged / path).parent.mkdir(parents=True, exist_ok=True)
            (staged / path).write_bytes(data)
        cp = Checkpoint(f"checkpoint-{step}", step, tuple(Entry(p, "f", len(b), 0.0) for p, b in sorted(files.items())))
        record = CheckpointRecord(cp.name, step, {p: FileRecord(len(b), hashlib.sha256(b).hexdigest())
                                                  for p, b in files.items()}, utc_now(), self.host)
        return cp, record, staged

    def upload(self, step: int, variant: str = "") -> CheckpointRecord:
        """via local, up to the record: uploaded against the head and verified at that commit."""
        cp, record, staged = self._stage(step, variant)
        self.store.commit_from(staged, cp, self.host)
        self.store.check_uploaded(record, staged)
        return record

    def evacuate(self, step: int, variant: str = "") -> CheckpointRecord:
        if self.via == "local":
            record = self.upload(step, variant)
            self.store.record(record)
            return record
        from huggingface_hub import CommitOperationAdd, HfApi

        from relaunch.transports.hf.client import git_blob_id

        cp, record, staged = self._stage(step, variant)
        api = HfApi(endpoint=self.url, token=self.token)
        incoming = f"{SUB}/{self.store.incoming(cp)}"       # where `hf upload` on the instance puts it: no parent
        info = api.create_commit(REPO, [CommitOperationAdd(f"{incoming}/{e.path}", str(staged / e.path))
                                        for e in cp.files], commit_message=f"upload {cp.name}")
        hashes = {e.path: FileHash(e.path, e.size, {"sha256": record.files[e.path].sha256,
                                                    "gitblob": git_blob_id(staged / e.path)}) for e in cp.files}
        self.store.accept_upload(cp, hashes, f"{self.url}/{REPO}/commit/{info.oid}", self.host)
        return record


@pytest.fixture
def hub(hf_hub, monkeypatch, tmp_path):
    """A fake Hub on 127.0.0.1 with an empty private repo; this process's huggingface_hub (and the
    writer processes it starts) upload through LFS, which is what the fake Hub speaks."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)
    for name, value in {"HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
                        "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HOME": str(tmp_path / "hfhome"),
                        "RELAUNCH_HOME": str(tmp_path / "state")}.items():
        monkeypatch.setenv(name, value)
    server = hf_hub(lfs_threshold=1000)
    server.create_repo(REPO, private=True)
    return server


def writer(hub: Any, tmp_path: Path, who: str, via: str = "local") -> Writer:
    return Writer(hub.url, hub.token, tmp_path / who, f"root@{who}", via)


def stored(hub: Any, revision: str = "main") -> dict[str, bytes]:
    """The store's files (paths relative to SUB) at a revision."""
    return {p[len(SUB) + 1:]: data for p, data in hub.read_files(REPO, revision).items() if p.startswith(SUB + "/")}


def manifest(hub: Any, revision: str = "main") -> StoreManifest:
    return StoreManifest.from_json(stored(hub, revision)[MANIFEST].decode(), "test")


def names(hub: Any) -> list[str]:
    return [r.name for r in manifest(hub).ordered()]


def refused(hub: Any) -> int:
    """How many commits the hub refused because another writer had moved the head (412)."""
    return sum(1 for method, path, status in hub.log if status == 412 and "/commit/" in path)


def assert_every_record_intact(hub: Any) -> None:
    """Every file every record lists is in the repo at the head, with the recorded bytes."""
    files = stored(hub)
    for record in manifest(hub).checkpoints.values():
        for path, want in record.files.items():
            assert path in files, f"{record.name}: {path} is listed but gone"
            assert hashlib.sha256(files[path]).hexdigest() == want.sha256, f"{record.name}: {path} differs"


def manifest_history(hub: Any) -> list[set[str]]:
    """The record names of the manifest at each commit that holds one, oldest first."""
    out = []
    for commit in hub.commits(REPO):
        entry = commit["files"].get(f"{SUB}/{MANIFEST}")
        if entry is not None:
            text = hub.store.blob_path(entry[1]).read_text()
            out.append({c["name"] for c in json.loads(text)["checkpoints"]})
    return out


# -- two writers at the same time --------------------------------------------------------------
def _race(url: str, token: str, folder: str, who: str, via: str, steps: list[int], barrier: Any) -> None:
    """One writer process: for each step, upload and verify, then record at the same moment as the
    other writer, then write its metadata with the manifest (as evacuate's last step does)."""
    w = Writer(url, token, Path(folder), f"root@{who}", via)
    for step in steps:
        record = w.upload(step) if via == "local" else None
        barrier.wait(timeout=120)
        if record is not None:
            w.store.record(record)
        else:
            w.evacuate(step)
        w.store.write_meta("log-tail.txt", f"{who} step {step}\n")
        barrier.wait(timeout=120)
        w.store.flush()


@pytest.mark.sandbox  # half a minute of racing writers
def test_two_writer_processes_racing_keep_every_record_and_file(hub, tmp_path):
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    plan = {"a": ("local", [10, 30, 50]), "b": ("instance", [20, 40, 60])}
    procs = [ctx.Process(target=_race, args=(hub.url, hub.token, str(tmp_path / who), who, via, steps, barrier))
             for who, (via, steps) in plan.items()]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=300)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    assert [proc.exitcode for proc in procs] == [0, 0]

    assert names(hub) == [f"checkpoint-{s}" for s in (10, 20, 30, 40, 50, 60)]
    assert_every_record_intact(hub)
    files = stored(hub)
    for step in (10, 20, 30, 40, 50, 60):
        assert {p: files.get(p) for p in checkpoint_files(step)} == checkpoint_files(step)
    assert files[".relaunch/log-tail.txt"] in (b"a step 50\n", b"b step 60\n")
    history = manifest_history(hub)           # no commit ever dropped a record another one made
    assert all(before <= after for before, after in zip(history, history[1:], strict=False)), history
    assert refused(hub) >= 1                  # they did collide, and the loser merged and retried


@pytest.mark.parametrize("via", ["local", "instance"])
def test_another_writer_committing_between_read_and_commit_is_merged(hub, tmp_path, via):
    a = writer(hub, tmp_path, "a", via)
    b = writer(hub, tmp_path, "b", "local")
    a.store.write_meta("freeze.txt", "torch==2.13.0\n")
    # B records checkpoint-20 after A read the head for its manifest commit, before that commit lands
    hub.before_commit("relaunch: manifest", lambda: b.evacuate(20))
    a.evacuate(10)

    assert names(hub) == ["checkpoint-10", "checkpoint-20"]
    assert manifest(hub).checkpoints["checkpoint-20"].host == "root@b"
    assert_every_record_intact(hub)
    assert sorted(a.store.manifest.checkpoints) == ["checkpoint-10", "checkpoint-20"]
    # the metadata went in the commit that recorded checkpoint-10, as before
    head = hub.commits(REPO)[-1]
    assert head["message"] == "relaunch: manifest" and f"{SUB}/.relaunch/freeze.txt" in head["files"]
    assert stored(hub)[".relaunch/freeze.txt"] == b"torch==2.13.0\n"
    assert manifest_history(hub)[-2:] == [{"checkpoint-20"}, {"checkpoint-10", "checkpoint-20"}]
    assert refused(hub) == 1


@pytest.mark.parametrize("via", ["local", "instance"])
def test_a_name_recorded_with_other_files_is_refused_never_overwritten(hub, tmp_path, via):
    a = writer(hub, tmp_path, "a", via)
    b = writer(hub, tmp_path, "b", "local")
    hub.before_commit("relaunch: manifest", lambda: b.evacuate(10, variant="other run"))
    with pytest.raises(EvacuationError) as err:
        a.evacuate(10)

    message = str(err.value)
    assert err.value.exit_code == 6 and "\n" not in message
    assert "checkpoint-10 is already recorded in the store with different files" in message
    assert "root@b" in message and "refusing to overwrite" in message
    record = manifest(hub).checkpoints["checkpoint-10"]          # B's record stands, with B's bytes
    assert record.host == "root@b"
    assert {p: f.sha256 for p, f in record.files.items()} == {
        p: hashlib.sha256(data).hexdigest() for p, data in checkpoint_files(10, "other run").items()}
    assert_every_record_intact(hub)
    assert "checkpoint-10" not in (a.store.manifest.checkpoints if a.store.manifest else {})


def test_an_upload_never_replaces_a_checkpoint_another_writer_recorded(hub, tmp_path):
    a = writer(hub, tmp_path, "a", "local")             # reads the store while it is empty
    b = writer(hub, tmp_path, "b", "local")
    b.evacuate(10, variant="other run")
    commits = len(hub.commits(REPO))
    with pytest.raises(EvacuationError) as err:
        a.evacuate(10)                                  # other bytes under the same name
    assert err.value.exit_code == 6 and "checkpoint-10 is already recorded" in str(err.value)
    assert len(hub.commits(REPO)) == commits            # refused before anything was uploaded
    assert {p: stored(hub)[p] for p in checkpoint_files(10)} == checkpoint_files(10, "other run")

    # the same bytes (two instances holding the same checkpoint) are no conflict: B's record stays
    b.evacuate(30)
    a.evacuate(30)
    assert names(hub) == ["checkpoint-10", "checkpoint-30"]
    assert manifest(hub).checkpoints["checkpoint-30"].host == "root@b"
    assert_every_record_intact(hub)


# -- pruning while another writer records ------------------------------------------------------
def test_prune_keeps_a_record_another_writer_made_meanwhile(hub, tmp_path):
    a = writer(hub, tmp_path, "a")
    for step in (10, 20, 30):
        a.evacuate(step)
    b = writer(hub, tmp_path, "b", "instance")
    # B records an older checkpoint while A prunes to keep=2: B's new record is not A's to drop
    hub.before_commit("relaunch: manifest", lambda: b.evacuate(15))
    pruned = a.store.prune(a.store.manifest, 2, frozenset({"checkpoint-30"}))

    assert names(hub) == ["checkpoint-15", "checkpoint-20", "checkpoint-30"]
    assert pruned == ["checkpoint-10"]
    assert_every_record_intact(hub)
    files = stored(hub)
    assert not [p for p in files if p.startswith("checkpoint-10/")]           # the dropped one is deleted
    assert {p: files.get(p) for p in checkpoint_files(15)} == checkpoint_files(15)
    assert refused(hub) == 1


def test_prune_deletes_no_file_another_writer_recorded_before_the_deletion(hub, tmp_path):
    a = writer(hub, tmp_path, "a")
    b = writer(hub, tmp_path, "b")                      # its instance still has checkpoint-10
    for step in (10, 20, 30):
        a.evacuate(step)
    # A's manifest no longer lists checkpoint-10; before A deletes its files, B records it again
    hub.before_commit("relaunch: prune", lambda: b.evacuate(10))
    assert a.store.prune(a.store.manifest, 2, frozenset({"checkpoint-30"})) == ["checkpoint-10"]

    assert names(hub) == ["checkpoint-10", "checkpoint-20", "checkpoint-30"]
    assert manifest(hub).checkpoints["checkpoint-10"].host == "root@b"
    assert_every_record_intact(hub)
    assert refused(hub) == 1                  # A's deletion met B's commit, and looked again


def test_a_record_whose_files_were_pruned_after_its_upload_is_refused(hub, tmp_path):
    a = writer(hub, tmp_path, "a")
    b = writer(hub, tmp_path, "b")
    for step in (10, 20, 30):
        a.evacuate(step)
    uploaded: list[CheckpointRecord] = []
    # B uploads (and verifies) checkpoint-10 again just before A deletes it, and records it after
    hub.before_commit("relaunch: prune", lambda: uploaded.append(b.upload(10)))
    a.store.prune(a.store.manifest, 2, frozenset({"checkpoint-30"}))
    assert uploaded and not [p for p in stored(hub) if p.startswith("checkpoint-10/")]

    with pytest.raises(EvacuationError) as err:
        b.store.record(uploaded[0])
    assert err.value.exit_code == 6 and "\n" not in str(err.value)
    assert "checkpoint-10 not recorded: checkpoint-10/" in str(err.value) and "is gone from" in str(err.value)
    assert names(hub) == ["checkpoint-20", "checkpoint-30"]                  # never listed without its files
    assert_every_record_intact(hub)


def test_retries_are_bounded_and_end_in_one_line(hub, tmp_path, monkeypatch):
    from relaunch.transports.hf import commits

    monkeypatch.setattr(commits, "COMMIT_TRIES", 3)
    a = writer(hub, tmp_path, "a")
    for i in range(3):          # someone commits before each of A's tries
        hub.before_commit("relaunch: manifest", lambda i=i: hub.seed(REPO, {f"{SUB}/notes-{i}.txt": b"busy"}))
    with pytest.raises(EvacuationError) as err:
        a.evacuate(10)
    assert err.value.exit_code == 6 and "\n" not in str(err.value)
    assert "other writers kept committing to acme/ckpts (3 tries)" in str(err.value)
    assert MANIFEST not in stored(hub)
    assert refused(hub) == 3


# -- through the CLI ---------------------------------------------------------------------------
def test_evacuate_merges_another_writers_record_and_refuses_a_conflicting_one(tmp_path, sandbox, ssh, ssh_key,
                                                                                hub):
    """`relaunch evacuate` (via local) while another machine writes the same store."""
    inst = sandbox()
    env, home = hub_env(hub, tmp_path), tmp_path / "state"
    recipe = hf_recipe(tmp_path, "hfwriters", ssh_key, inst, f"hf:{REPO}/{SUB}", layout="files", via="local", keep=2)
    other = writer(hub, tmp_path, "other")
    other_files: dict[str, bytes] = {}

    def other_records(step: int, size: int) -> None:
        """The other writer records ckpt-<step> (bytes of its own) right before our manifest commit."""
        name = f"ckpt-{step:08d}.pt"
        data = random.Random(step).randbytes(size)
        other_files[name] = data
        (other.folder / name).parent.mkdir(parents=True, exist_ok=True)
        (other.folder / name).write_bytes(data)
        cp = Checkpoint(name, step, (Entry(name, "f", size, 0.0),))
        record = CheckpointRecord(name, step, {name: FileRecord(size, hashlib.sha256(data).hexdigest())}, utc_now(),
                                  other.host)
        other.store.commit_from(other.folder, cp, other.host)
        other.store.check_uploaded(record, other.folder)
        other.store.record(record)

    plant_file(ssh, inst, 20)
    hub.before_commit("relaunch: manifest", lambda: other_records(15, 1800))
    merged = run_cli("evacuate", str(recipe), inst.host, home=home, env=env)
    assert merged.returncode == 0, merged.stderr
    assert "safe to destroy" in merged.stderr
    assert names(hub) == ["ckpt-00000015.pt", "ckpt-00000020.pt"]
    assert_every_record_intact(hub)
    assert stored(hub)["ckpt-00000015.pt"] == other_files["ckpt-00000015.pt"]
    assert refused(hub) == 1

    # the other writer records ckpt-30 with its own bytes while this instance's ckpt-30 is evacuated
    plant_file(ssh, inst, 30)
    hub.before_commit("relaunch: manifest", lambda: other_records(30, 2500))
    conflict = run_cli("evacuate", str(recipe), inst.host, home=home, env=env)
    assert conflict.returncode == 6, conflict.stderr
    assert "ckpt-00000030.pt is already recorded in the store with different files" in conflict.stderr
    assert "refusing to overwrite" in conflict.stderr and "DO NOT destroy" in conflict.stderr
    assert "safe to destroy" not in conflict.stderr and "Traceback" not in conflict.stderr
    assert len([ln for ln in conflict.stderr.splitlines() if ln.startswith("Error")]) == 1
    record = manifest(hub).checkpoints["ckpt-00000030.pt"]
    assert record.host == "root@other"
    assert "ckpt-00000020.pt" in names(hub)
    assert_every_record_intact(hub)
    assert_no_secret(home, [merged, conflict], hub.token)


# -- two instances evacuated at once, from two machines ----------------------------------------------
def _evacuate_both(recipe: Path, insts: list, tmp_path: Path, env: dict[str, str],
                   ended: list[threading.Event] | None = None) -> list:
    """`relaunch evacuate RECIPE HOST` for each instance at the same moment, each as from its own
    machine (its own RELAUNCH_HOME: the local lock serialises one machine's writers only);
    `ended[n]` is set once the n-th has exited."""
    def evacuate(n: int) -> Any:
        try:
            return run_cli("evacuate", str(recipe), insts[n].host, home=tmp_path / f"machine-{n}", env=env,
                           timeout=180)
        finally:
            if ended is not None:
                ended[n].set()

    with ThreadPoolExecutor(len(insts)) as pool:
        return list(pool.map(evacuate, range(len(insts))))


@pytest.mark.parametrize("via", ["local", "instance"])
def test_two_instances_evacuated_at_once_both_end_safe_with_both_records(via, tmp_path, sandbox, ssh, ssh_key,
                                                                          package_index, hf_hub):
    """Two instances, each holding its own checkpoint, evacuated into one Hub store by two `relaunch
    evacuate` at once. The first manifest commit is held at the hub until the other one arrives:
    both are in flight on the same head; the other lands, the held one is refused (412: the head
    moved), and its writer merges and commits again. Both say `safe to destroy`; the store lists
    both, every file with its bytes."""
    insts = [sandbox(index_dir=package_index), sandbox(index_dir=package_index)]
    hub = hf_hub(bind=host_side_address(insts[0]), lfs_threshold=1000)    # both instances reach it there
    hub.create_repo(REPO, private=True)
    env = hub_env(hub, tmp_path)
    recipe = hf_recipe(tmp_path, "hfrace", ssh_key, insts[0], f"hf:{REPO}/{SUB}", layout="files", via=via, keep=2)
    held: dict[str, str] = {}                 # each instance's checkpoint: name -> sha256
    for inst, step in zip(insts, (10, 20), strict=True):
        held |= plant_file(ssh, inst, step)
    other_arrived = threading.Event()
    waited: list[bool] = []
    hub.before_commit("relaunch: manifest", lambda: waited.append(other_arrived.wait(timeout=60)))
    hub.before_commit("relaunch: manifest", other_arrived.set)

    results = _evacuate_both(recipe, insts, tmp_path, env)
    for result in results:
        assert result.returncode == 0, result.stderr
        assert "safe to destroy" in result.stderr and "Traceback" not in result.stderr
    assert waited == [True]                   # both manifest commits were in flight at once
    assert names(hub) == ["ckpt-00000010.pt", "ckpt-00000020.pt"]
    assert {p: manifest(hub).checkpoints[p].host for p in held} == {
        "ckpt-00000010.pt": f"root@{insts[0].address}", "ckpt-00000020.pt": f"root@{insts[1].address}"}
    assert_every_record_intact(hub)
    files = stored(hub)
    assert {p: hashlib.sha256(files[p]).hexdigest() for p in held} == held
    history = manifest_history(hub)           # no commit ever dropped a record another one made
    assert all(before <= after for before, after in zip(history, history[1:], strict=False)), history
    assert refused(hub) >= 1                  # the held one was refused (the head moved), merged, committed again
    assert_no_secret(tmp_path / "machine-0", results, hub.token)
    assert_no_secret(tmp_path / "machine-1", results, hub.token)


@pytest.mark.parametrize("via", ["local", "instance"])
def test_two_instances_evacuating_one_name_with_other_bytes_at_once_one_refuses(via, tmp_path, sandbox, ssh, ssh_key,
                                                                                 package_index, hf_hub):
    """Both instances hold ckpt-30, each with bytes of its own (two runs writing one store), and are
    evacuated at once. The first one's record is held at the hub until the second one's upload is
    on its way, and that upload (a slow one) lands only after the first evacuation said `safe to
    destroy`: on a store that records the name with other bytes. The second refuses (exit 6) and
    overwrites nothing: the store records the first one's ckpt-30 and holds its bytes."""
    insts = [sandbox(index_dir=package_index), sandbox(index_dir=package_index)]
    hub = hf_hub(bind=host_side_address(insts[0]), lfs_threshold=1000)
    hub.create_repo(REPO, private=True)
    env = hub_env(hub, tmp_path)
    recipe = hf_recipe(tmp_path, "hfrace", ssh_key, insts[0], f"hf:{REPO}/{SUB}", layout="files", via=via, keep=2)
    name = "ckpt-00000030.pt"
    hashes = [plant_file(ssh, inst, 30)[name] for inst in insts]
    assert hashes[0] != hashes[1]

    def recorded() -> bool:
        return MANIFEST in stored(hub) and name in names(hub)

    uploading, ended = threading.Event(), [threading.Event(), threading.Event()]
    waited: list[bool] = []

    def second_upload() -> None:
        uploading.set()
        waited.append(ended[0].wait(timeout=90) and recorded())

    hub.before_commit("relaunch: manifest", lambda: waited.append(uploading.wait(timeout=60)))
    hub.before_commit(f"(step 30) from root@{insts[1].address}", second_upload)

    first, second = _evacuate_both(recipe, insts, tmp_path, env, ended)
    assert waited == [True, True], [first.stderr, second.stderr]   # the upload was on its way, and met the record
    assert first.returncode == 0, first.stderr
    assert "safe to destroy" in first.stderr
    assert second.returncode == 6, second.stderr
    assert f"{name} is already recorded in the store with different files" in second.stderr
    assert "refusing to overwrite" in second.stderr and "DO NOT destroy" in second.stderr
    assert "safe to destroy" not in second.stderr and "Traceback" not in second.stderr
    assert names(hub) == [name]
    assert manifest(hub).checkpoints[name].host == f"root@{insts[0].address}"
    assert_every_record_intact(hub)           # the record's file holds the first one's bytes
    assert hashlib.sha256(stored(hub)[name]).hexdigest() == hashes[0]

