"""Lineage, without instances: a resume from an older checkpoint starts a new branch. The records
and the store (what is set aside, what keep may delete, the manifest's format and its merge), the
instance's side in relaunch.train (set_aside, the lineage file) and what relaunch lists and reads
of it (the listing leaves it out, facts.sh's lineage section). The whole cycle on sandbox instances
is in tests/test_rollback.py."""

from __future__ import annotations

import hashlib
import json
import shlex
import subprocess
from pathlib import Path

import pytest

from relaunch import manifest, train
from relaunch.errors import CheckpointError
from relaunch.host.facts import parse_facts
from relaunch.host.spec import Target
from relaunch.job import Facts, Job, Node
from relaunch.layouts import LISTING_COMMAND, complete_checkpoints, detect_layout, parse_listing
from relaunch.manifest import Branch, CheckpointRecord, FileRecord, StoreManifest, utc_now
from relaunch.recipe import load_recipe
from relaunch.steps.lineage import box_branches
from relaunch.transports.folder import StoreFolder
from relaunch.transports.hf.merge import merge_manifests

T0 = 1_764_496_800.0        # the old branch's saves were written from here on, a minute apart


def record(step: int, written_at: float | None = None, name: str = "") -> CheckpointRecord:
    name = name or f"step-{step:08d}"
    data = f"step {step}".encode()
    return CheckpointRecord(name=name, step=step, verified_at=utc_now(), host="root@10.0.0.2:22",
                            written_at=T0 + step * 60 if written_at is None else written_at,
                            files={f"{name}/.metadata": FileRecord(len(data), hashlib.sha256(data).hexdigest())})


def manifest_of(*steps: int) -> StoreManifest:
    m = StoreManifest(recipe="r")
    for step in steps:
        m.add(record(step))
    return m


def branch_at(step: int, at: float, ident: str = "") -> Branch:
    return Branch(id=ident or train.branch_id(f"step-{step:08d}", at), resumed=f"step-{step:08d}", step=step, at=at)


def test_a_branch_sets_aside_the_later_records_written_before_it_and_newest_is_the_new_branchs() -> None:
    m = manifest_of(5, 10, 15)
    branch = branch_at(5, at=T0 + 20 * 60)
    assert m.branch(branch) == ["step-00000010", "step-00000015"]
    assert [r.name for r in m.ordered()] == ["step-00000005"] and m.newest().name == "step-00000005"
    assert [r.aside for r in m.aside_records()] == [branch.id, branch.id]
    # the new branch's saves: current, and newest at once although their steps are lower
    m.add(record(7, written_at=T0 + 30 * 60))
    assert m.newest().name == "step-00000007"
    # the same branch read again (another round, another node's lineage file) changes nothing
    assert m.branch(branch) == [] and len(m.branches) == 1


def test_a_new_save_that_reached_the_store_before_the_branch_did_stays_current() -> None:
    """A copy round that read the instance between the rollback and its lineage file: its save of
    the new branch was written after the branch, so the branch does not take it."""
    m = manifest_of(5, 10, 15)
    m.add(record(7, written_at=T0 + 31 * 60))
    assert m.branch(branch_at(5, at=T0 + 30 * 60)) == ["step-00000010", "step-00000015"]
    assert m.newest().name == "step-00000007"
    # `up` branches before training can save anything: everything later goes
    assert manifest_of(5, 10).branch(branch_at(5, at=T0), everything=True) == ["step-00000010"]


def test_keep_prunes_only_the_current_branchs_older_saves(tmp_path: Path) -> None:
    store = StoreFolder(tmp_path / "store")
    m = StoreManifest(recipe="r")
    for step in (5, 10, 15):
        rec = record(step)
        for path in rec.files:
            (store.root / path).parent.mkdir(parents=True, exist_ok=True)
            (store.root / path).write_bytes(f"step {step}".encode())
        m.add(rec)
    m.branch(branch_at(5, at=T0 + 20 * 60))
    for step in (6, 7):
        rec = record(step, written_at=T0 + (30 + step) * 60)
        (store.root / rec.name).mkdir()
        (store.root / rec.name / ".metadata").write_bytes(f"step {step}".encode())
        m.add(rec)
    assert store.prune(m, 2) == ["step-00000005"]
    assert [r.name for r in m.ordered()] == ["step-00000006", "step-00000007"]
    assert {r.name for r in m.aside_records()} == {"step-00000010", "step-00000015"}
    assert (store.root / "step-00000010" / ".metadata").exists() and (store.root / "step-00000015").exists()
    assert store.prune(m, 1) == ["step-00000006"]             # keep 1: still never the abandoned ones
    assert (store.root / "step-00000015" / ".metadata").exists()


def test_format_1_until_a_branch_then_2_which_reads_back_and_an_older_relaunch_refuses(
        monkeypatch: pytest.MonkeyPatch) -> None:
    m = manifest_of(5, 10)
    assert m.to_dict()["format"] == 1 and "branches" not in m.to_dict()
    branch = branch_at(5, at=T0 + 20 * 60)
    m.branch(branch)
    doc = m.to_dict()
    assert doc["format"] == 2 and doc["branches"][0]["id"] == branch.id
    assert [c.get("aside") for c in doc["checkpoints"]] == [None, branch.id]
    again = StoreManifest.from_json(json.dumps(doc), "x")
    assert again.to_dict() == doc and again.newest().name == "step-00000005"
    # an older relaunch reads format 1 only: it refuses this one (never ranks the abandoned branch)
    monkeypatch.setattr(manifest, "FORMAT_BRANCHES", 1)
    with pytest.raises(CheckpointError, match="unknown format 2"):
        StoreManifest.from_dict(doc, "old")


def test_a_fresh_start_over_older_saves_is_a_branch_from_scratch_that_reads_back() -> None:
    m = manifest_of(10, 20)
    scratch = Branch(id=train.branch_id("", T0 + 30 * 60), resumed="", step=0, at=T0 + 30 * 60, by="x")
    assert scratch.id == "20251130T103000Z-from-scratch"
    assert m.branch(scratch) == ["step-00000010", "step-00000020"] and m.newest() is None
    again = StoreManifest.from_json(m.to_json(), "x")
    assert again.branches == [scratch] and len(again.aside_records()) == 2


@pytest.mark.parametrize("change", ["unknown branch", "branch id with a slash", "hidden branch id"])
def test_a_manifest_whose_branches_do_not_hold_is_corrupt(change: str) -> None:
    m = manifest_of(5, 10)
    m.branch(branch_at(5, at=T0 + 20 * 60, ident="20251130T100000Z-from-step-00000005"))
    doc = m.to_dict()
    if change == "unknown branch":
        doc["checkpoints"][1]["aside"] = "20251130T100000Z-from-elsewhere"
    else:
        bad = "../../etc" if change == "branch id with a slash" else ".relaunch"
        doc["branches"][0]["id"] = doc["checkpoints"][1]["aside"] = bad
    with pytest.raises(CheckpointError, match="corrupt store manifest"):
        StoreManifest.from_dict(doc, "x")


def test_a_displaced_record_goes_and_its_branch_says_where_its_bytes_went() -> None:
    m = manifest_of(5, 10)
    branch = branch_at(5, at=T0 + 20 * 60)
    m.branch(branch)
    m.displace("step-00000010", ".relaunch/aside/x")
    assert "step-00000010" not in m.checkpoints and m.branches[0].moved == {"step-00000010": ".relaunch/aside/x"}
    assert StoreManifest.from_json(m.to_json(), "x").branches[0].moved == {"step-00000010": ".relaunch/aside/x"}


def test_two_hub_writers_merge_aside_marks_and_branches() -> None:
    base = manifest_of(5, 10)
    theirs = manifest_of(5, 10)
    theirs.add(record(6, written_at=T0 + 40 * 60))          # another writer added a save
    ours = manifest_of(5, 10)
    branch = branch_at(5, at=T0 + 30 * 60)
    ours.branch(branch)
    merged = merge_manifests(base, ours, theirs, "hf:a/b")
    assert merged.checkpoints["step-00000010"].aside == branch.id
    assert merged.newest().name == "step-00000006" and [b.id for b in merged.branches] == [branch.id]
    # the other way round: their aside mark stays when we change nothing of that record
    assert merge_manifests(base, manifest_of(5, 10), ours, "hf:a/b").checkpoints["step-00000010"].aside == branch.id


def listed(folder: Path, layout: str) -> list[str]:
    out = subprocess.run(LISTING_COMMAND.format(dir=shlex.quote(str(folder))), shell=True, check=True,
                         capture_output=True).stdout
    return [c.name for c in complete_checkpoints(parse_listing(out), layout)]


@pytest.mark.parametrize("layout, names", [
    ("files", ["ckpt-00000005.pt", "ckpt-00000010.pt"]),
    ("hf-trainer", ["checkpoint-5", "checkpoint-10"]),
    ("dcp", ["step-00000005", "step-00000010"]),
])
def test_what_is_set_aside_is_never_listed_and_the_lineage_file_says_it(tmp_path: Path, layout: str,
                                                                        names: list[str]) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for name in names:
        if layout == "files":
            (folder / name).write_bytes(b"x" * 100)
        else:
            (folder / name).mkdir()
            marker = "trainer_state.json" if layout == "hf-trainer" else ".metadata"
            (folder / name / marker).write_text("{}")
    assert listed(folder, layout) == names
    done = train.set_aside(folder, [names[1], "not-there"], names[0], 5, "a test", at=T0)
    assert done is not None and done["aside"] == [names[1]]
    assert listed(folder, layout) == [names[0]] and listed(folder, "auto") == [names[0]]
    if layout != "files":
        assert detect_layout(parse_listing(subprocess.run(LISTING_COMMAND.format(dir=shlex.quote(str(folder))),
                                                          shell=True, capture_output=True).stdout)) == layout
    kept = folder / train.ASIDE_DIR / done["id"] / names[1]
    assert kept.exists() and done["where"] == str(folder / train.ASIDE_DIR / done["id"])
    [line] = (folder / train.ASIDE_DIR / train.LINEAGE_FILE).read_text().splitlines()
    assert json.loads(line) == done and done["id"] == f"20251130T100000Z-from-{names[0]}"


def test_the_nodes_of_a_group_sharing_a_folder_write_one_line_and_nothing_is_moved_twice(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    (folder / "step-00000010").mkdir(parents=True)
    first = train.set_aside(folder, ["step-00000010"], "step-00000005", 5, "node 0", ident="x-from-5", at=T0)
    assert first is not None
    assert train.set_aside(folder, ["step-00000010"], "step-00000005", 5, "node 1", ident="x-from-5", at=T0) is None
    (folder / "step-00000020").mkdir()
    train.set_aside(folder, ["step-00000020"], "step-00000005", 5, "node 1", ident="x-from-5", at=T0)
    assert len((folder / train.ASIDE_DIR / train.LINEAGE_FILE).read_text().splitlines()) == 1
    assert sorted(p.name for p in (folder / train.ASIDE_DIR / "x-from-5").iterdir()) == ["step-00000010",
                                                                                          "step-00000020"]


def test_facts_read_the_lineage_file_and_skip_a_line_they_cannot_read() -> None:
    good = {"id": "20251130T100000Z-from-step-00000005", "resumed": "step-00000005", "step": 5, "at": T0,
            "aside": ["step-00000010"], "by": "relaunch.train.Checkpointer", "where": "/root/ckpt/.relaunch-aside/x"}
    text = f"home=/root\nuid=0\nnow={int(T0)}\n--- lineage\n{json.dumps(good)}\n{{\"id\": cut short\n\n--- end\n"
    facts = parse_facts(text)
    assert facts.lineage == [good] and facts.now == T0
    recipe = load_recipe(Path(__file__).parent / "fixtures" / "plans" / "recipe.yaml")
    nodes = [Job(recipe, Node(Target(address=f"10.0.0.{n}", user="root", port=22)), Facts(host=facts))
             for n in (2, 3)]
    [branch] = box_branches(nodes)                       # two nodes, one branch
    assert (branch.id, branch.host, branch.step) == (good["id"], "root@10.0.0.2", 5)


def test_the_facts_script_lists_the_lineage_file_of_checkpoint_dir(tmp_path: Path) -> None:
    from relaunch.host.facts import facts_script

    folder = tmp_path / "ckpt"
    (folder / "step-00000010").mkdir(parents=True)
    done = train.set_aside(folder, ["step-00000010"], "step-00000005", 5, "a test", at=T0)
    script = facts_script("3.11", str(tmp_path / "venv"), str(folder), "nosuchsession", [])
    out = subprocess.run(["bash", "-s"], input=script, capture_output=True, text=True, timeout=120).stdout
    assert parse_facts(out).lineage == [done]
