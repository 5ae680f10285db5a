"""Plans from facts, no network: given these facts and this recipe, exactly these actions.

Each case in tests/fixtures/plans/*.json names a facts fixture (JSON, as `Facts.as_dict` writes
it) with a patch for the case, the store, and the actions expected: every field the executor
uses (command, argv, call, stdin, deadline, retry, lane, skip; and, where set, the node, `always`
(a cleanup that runs after a failure), `needs`, `produces` and `fails_as`: the exit code it
fails with), in order. Paths that depend on
where the tests run are written `<repo>` and `<state>`.

What each plan must do is written by hand below (plan_invariants, PROMISES): order, needs,
deadlines, quoting, what runs where. The `expect` snapshot only shows a reviewer what changed: on
a mismatch the test prints the diff; to accept it, RELAUNCH_REGEN_PLANS=1 pytest
tests/test_plans.py, then read the diff of the fixtures before committing it. Regenerating never
makes a broken promise pass.
"""

from __future__ import annotations

import copy
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

from relaunch.cycle import plan_up
from relaunch.host.spec import Target
from relaunch.job import Facts, Job, Node
from relaunch.layouts import Checkpoint, Entry
from relaunch.plan import Action, action_dict
from relaunch.recipe import load_recipe
from relaunch.steps.checkpoint import choose
from relaunch.steps.evacuate import plan_copy, plan_meta
from relaunch.steps.stop import plan_stop
from relaunch.transports.base import Store
from relaunch.transports.hf import HfStore
from relaunch.transports.local import LocalPathStore
from relaunch.transports.rclone import RcloneStore
from relaunch.transports.relay import Relay

HERE = Path(__file__).parent
FIX = HERE / "fixtures" / "plans"
REPO = HERE.parent
CASES = sorted(FIX.glob("case-*.json"))
LISTINGS = sorted((HERE / "fixtures" / "listings").glob("*.json"))


def merge(base: Any, patch: Any) -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            out[key] = merge(base.get(key), value)
        return out
    return copy.deepcopy(patch)


def make_store(kind: str, recipe_name: str, state: Path) -> Store:
    if kind == "local":
        return LocalPathStore(FIX / "store" / "planned", recipe_name)
    rclone = RcloneStore("s3", "bucket/runs/a", recipe_name)
    rclone._env = {"RCLONE_CONFIG_S3_TYPE": "s3", "RCLONE_CONFIG_S3_SECRET_ACCESS_KEY": "not-a-real-secret-0123"}
    hf = HfStore("acme/ckpts", "run1", recipe_name, "hf_notarealtoken0123", None)
    hf._revision = "0123456789abcdef0123456789abcdef01234567"
    return {"rclone": rclone, "hf": hf, "relay-rclone": Relay(rclone, state / "cache" / "planned"),
            "relay-hf": Relay(hf, state / "cache" / "planned")}[kind]


def job_for(case: dict[str, Any], state: Path) -> tuple[Job, Store]:
    recipe = load_recipe(FIX / "recipe.yaml", case.get("set", []))
    facts_doc = merge(json.loads((FIX / case["facts"]).read_text()), case.get("patch", {}))
    facts = Facts.from_dict(facts_doc)
    target = Target(address="203.0.113.7", user=recipe.ssh.user, port=22, key="/keys/id_ed25519")
    return Job(recipe, Node(target), facts), make_store(case["store"], recipe.name, state)


def shown(actions: list[Action], state: Path) -> list[dict[str, Any]]:
    text = json.dumps([action_dict(a) for a in actions], indent=1)
    # the bin folder first: a venv inside the checkout is under <repo> too
    text = text.replace(str(Path(sys.executable).parent), "<bin>")
    text = text.replace(str(REPO), "<repo>").replace(str(state), "<state>")
    return json.loads(text)


def planned(case: dict[str, Any], state: Path) -> list[Action]:
    job, store = job_for(case, state)
    what = case["plan"]
    if what == "up":
        return plan_up(job, store, wanted=case.get("checkpoint"))[0].actions
    if what == "stop":
        return plan_stop(job)
    if what == "meta":
        return plan_meta(job)
    if what == "copy":
        checkpoints = {c.name: c for c in _instance_checkpoints(job)}
        unpinned = frozenset([job.host] if case.get("unpinned") else [])
        return plan_copy(job, store, checkpoints[case["checkpoint"]], every_byte=case.get("every_byte", False),
                         unpinned=unpinned)
    raise AssertionError(f"unknown plan {what}")


def _instance_checkpoints(job: Job) -> list[Checkpoint]:
    from relaunch.steps.checkpoint import instance_checkpoints

    return instance_checkpoints(job)


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("RELAUNCH_HOME", str(tmp_path))
    return tmp_path


# -- what each plan must do, written by hand -----------------------------------------------------------
# The snapshot in each case file (its "expect") is regenerated from the code's own output, so it can
# only show what changed. What a plan must do is said here: the rules every plan keeps
# (plan_invariants) and each case's own promise (PROMISES). Regenerating never touches these.
def titles(got: list[dict[str, Any]]) -> list[str]:
    return [a["title"] for a in got]


def one(got: list[dict[str, Any]], start: str) -> dict[str, Any]:
    found = [a for a in got if a["title"].startswith(start)]
    assert len(found) == 1, f"expected one action titled {start!r}, got {titles(got)}"
    return found[0]


def at(got: list[dict[str, Any]], start: str) -> int:
    return got.index(one(got, start))


def ran(got: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [a for a in got if not a["skip"]]


def plan_invariants(case: dict[str, Any], got: list[dict[str, Any]]) -> None:
    produced = {a["produces"] for a in got if a.get("produces")}
    for a in got:
        for need in a.get("needs") or ():
            assert need in produced, f"{a['title']!r} needs {need!r}, which nothing in the plan produces"
        if a["skip"]:
            assert not (a["command"] or a["argv"] or a["call"]), f"a skipped action does something: {a['title']!r}"
            continue
        if a["command"] or a["argv"]:
            assert a["deadline"] and a["deadline"] > 0, f"{a['title']!r} runs without a deadline"
        if a["argv"]:
            assert a["where"] == "local", f"{a['title']!r}: an argv runs here"
        if a["command"]:
            assert a["where"] == "instance", f"{a['title']!r}: a shell command runs on the instance"
            shlex.split(a["command"])  # every quote closed
    secrets = ["not-a-real-secret-0123", "hf_notarealtoken0123", *(case.get("patch", {}).get("secrets") or {}).values()]
    text = json.dumps(got)
    assert not [s for s in secrets if s in text], "a secret is shown in the plan"
    if case["plan"] == "up" and len(got) > 1:
        order = ["preflight", "env", "checkpoint", "launch"]
        assert [a["step"] for a in got] == sorted((a["step"] for a in got), key=order.index), "steps out of order"
        assert got[-1]["title"] == "watch the command start" and got[-1]["produces"] == "launch"
        start = at(got, "start tmux session")
        assert all(i < start for i, a in enumerate(got) if a["step"] != "launch"), "training starts before its env"
        assert one(got, "upload run.sh")["deadline"] and at(got, "upload run.sh") < start
    if case["plan"] == "copy":
        name = case["checkpoint"]
        verify = at(got, f"verify {name}")
        assert at(got, f"hash {name} on the instance") < verify       # the instance's hashes before the verdict
        assert got[verify]["produces"] == f"verified:{name}" and got[verify]["where"] == "local"
        if not case.get("unpinned"):
            assert got[0]["title"].startswith(f"pin {name}") and got[0]["produces"] == f"pin:{name}"
            assert got[-1]["title"].startswith("unpin") and got[-1]["always"]    # also after a failure
            assert all(a["where"] != "instance" or a["title"].startswith(("pin", "unpin")) or a["command"] is None
                       or "/.relaunch/planned/pinned" in a["command"] or a["title"].startswith(("rclone", "hf"))
                       for a in got), "a copy reads the checkpoint elsewhere than its pins"


def _up_restores(got: list[dict[str, Any]], name: str, how: str) -> None:
    """A restore lands in the hidden folder, is verified there against the manifest, then moved into place."""
    ready = at(got, "/root/ckpt/.relaunch-incoming ready for the copy")
    copy = at(got, how)
    over = at(got, f"the copy of {name} is over")
    verify = at(got, f"verify {name} on the instance against the store manifest")
    move = at(got, f"move {name} into place at /root/ckpt/")
    assert ready < copy < over < verify < move < at(got, "start tmux session")
    assert got[ready]["produces"] == f"incoming:{name}" and got[verify]["needs"] == [f"incoming:{name}"]
    assert got[move]["needs"] == [f"verified:{name}"] and got[verify]["lane"] == "checkpoint-verify"
    assert got[verify]["command"].startswith("cd /root/ckpt/.relaunch-incoming && ")
    assert "mv -T -- " in got[move]["command"] and "set-aside" in got[move]["command"]   # never overwritten


def _fresh_env(got: list[dict[str, Any]]) -> None:
    """The env is built from the uploaded lock in the env lane, its freeze compared with the lock."""
    lock = at(got, "upload <repo>/tests/fixtures/plans/plan.lock")
    build = at(got, "create /root/venvs/planned and install 2 pinned packages")
    freeze = at(got, "pip freeze of the venv")
    assert lock < build < freeze < at(got, "compare pip freeze with the lock")
    assert got[build]["command"] == "bash -s" and got[build]["fails_as"] == "env"   # the script on stdin
    assert got[build]["deadline"] >= 600 and got[freeze]["produces"] == "freeze"
    assert {a["lane"] for a in got if a["step"] == "env"} == {"env"}


def _nothing_restored(got: list[dict[str, Any]], why: str) -> None:
    assert [a["skip"] for a in got if a["step"] == "checkpoint"] == [why]


PROMISES: dict[str, Any] = {}


def promise(name: str) -> Any:
    def register(check: Any) -> Any:
        PROMISES[name] = check
        return check
    return register


@promise("case-up-fresh-start")
def _(got: list[dict[str, Any]]) -> None:
    assert got[0]["skip"] == "tmux, rsync and env.apt already installed"
    _fresh_env(got)
    _nothing_restored(got, "the store <repo>/tests/fixtures/plans/store/planned is empty: fresh start")
    guard = at(got, "start the guard in tmux session planned-guard")
    assert at(got, "start tmux session planned") < guard < len(got) - 1
    assert one(got, "upload the guard's config")["command"].startswith("umask 077 && ")


@promise("case-up-already-running")
def _(got: list[dict[str, Any]]) -> None:
    assert len(got) == 1 and got[0]["step"] == "launch" and "already running" in got[0]["skip"]


@promise("case-up-apt-with-sudo")
def _(got: list[dict[str, Any]]) -> None:
    apt = got[0]
    assert apt["step"] == "preflight" and apt["command"].count("sudo -n ") == 2
    assert apt["command"].endswith("apt-get install -y -qq tmux libaio1") and apt["deadline"] >= 600
    assert all(a["command"] is None or "/root" not in a["command"] for a in got)     # the user's home, not root's
    assert one(got, "create /home/ubuntu/venvs/planned")


@promise("case-up-guard-off")
def _(got: list[dict[str, Any]]) -> None:
    assert one(got, "start the guard")["skip"] and not [t for t in titles(got) if t.startswith("upload guard")]


@promise("case-up-guard-sources")
def _(got: list[dict[str, Any]]) -> None:
    config = json.loads(one(got, "upload the guard's config")["stdin"])
    assert config["every"] == 2.0 and "file:/root/RECLAIM" in config["sources"] and "aws" in config["sources"]
    assert at(got, "upload the guard's config") < at(got, "start the guard in tmux session planned-guard")


@promise("case-up-hf-instance")
def _(got: list[dict[str, Any]]) -> None:
    _up_restores(got, "checkpoint-20", "the instance downloads checkpoint-20")
    download = one(got, "the instance downloads checkpoint-20")
    assert "--revision 0123456789abcdef0123456789abcdef01234567" in download["command"]   # the manifest's commit
    assert download["stdin"] == "<secret>" and "read -r -d ''" in download["command"]    # the token on stdin
    assert at(got, "hf in relaunch's tools folder") < at(got, "the instance downloads")
    assert one(got, "remove /root/ckpt/.relaunch-hf-download")["always"]
    # uv makes hf's venv (no venv module needed); pip only in the branch where there is no uv
    tools = one(got, "hf in relaunch's tools folder")["stdin"]
    by_uv, _, by_pip = tools.partition("; else ")
    assert "/root/.relaunch/tools/bin/uv venv --quiet --allow-existing --no-python-downloads" in by_uv
    assert "-m venv" not in by_uv and "-m pip" not in by_uv and "-m venv" in by_pip


@promise("case-up-newer-on-instance")
def _(got: list[dict[str, Any]]) -> None:
    _nothing_restored(got, "the instance already has ckpt-00000030.pt (step 30), newer than the store's")
    assert not [a for a in got if a["argv"] or "ckpt-00000040" in json.dumps(a)]            # the .tmp never counts


@promise("case-up-rclone-instance")
def _(got: list[dict[str, Any]]) -> None:
    _up_restores(got, "ckpt-00000020.pt", "the instance downloads ckpt-00000020.pt")
    download = one(got, "the instance downloads ckpt-00000020.pt")
    assert download["stdin"] == "<secret>" and "/root/.relaunch/tools/bin/rclone " in download["command"]
    assert " copy --files-from0 - s3:bucket/runs/a /root/ckpt/.relaunch-incoming/" in download["command"]


@promise("case-up-relay-rclone")
def _(got: list[dict[str, Any]]) -> None:
    _up_restores(got, "ckpt-00000020.pt", "ckpt-00000020.pt (31.2 KiB) to the instance")
    fetch = at(got, "ckpt-00000020.pt (31.2 KiB) from rclone:s3:bucket/")
    assert got[fetch]["where"] == "local" and fetch < at(got, "ckpt-00000020.pt (31.2 KiB) to the instance")
    clears = [a for a in got if a["title"].startswith("clear <state>/cache/planned/")]
    assert [a.get("always", False) for a in clears] == [False, True]                  # before, and even on failure


@promise("case-up-resumed-accelerate")
def _(got: list[dict[str, Any]]) -> None:
    _up_restores(got, "checkpoints/checkpoint_1", "checkpoints/checkpoint_1 (31.3 KiB) to the instance")
    move = one(got, "move checkpoints/checkpoint_1 into place")["command"]
    assert "mkdir -p -- /root/ckpt/checkpoints && " in move


@promise("case-up-resumed-start")
def _(got: list[dict[str, Any]]) -> None:
    _up_restores(got, "ckpt-00000020.pt", "ckpt-00000020.pt (31.2 KiB) to the instance")
    push = one(got, "ckpt-00000020.pt (31.2 KiB) to the instance")
    assert push["argv"][0] == "rsync"
    assert push["argv"][-1] == "203.0.113.7:/root/ckpt/.relaunch-incoming/ckpt-00000020.pt"
    assert "StrictHostKeyChecking=yes" in " ".join(push["argv"])
    assert "/root/ckpt/ckpt-00000020.pt" in one(got, "upload run.sh")["stdin"]                 # resumes from it


@promise("case-up-same-on-instance")
def _(got: list[dict[str, Any]]) -> None:
    [restore] = [a for a in got if a["step"] == "checkpoint"]
    assert restore["title"].startswith("verify /root/ckpt/ckpt-00000020.pt against the store manifest")
    assert not [a for a in got if a["argv"]]                                                  # nothing copied


@promise("case-up-rollback")
def _(got: list[dict[str, Any]]) -> None:
    # the branch: from the instance's clock (facts), named by what it resumed
    branch = "20251130T102000Z-from-ckpt-00000010.pt"
    aside = one(got, "set aside ckpt-00000020.pt, ckpt-00000030.pt")
    command = aside["command"]
    assert command.startswith("cd -- /root/ckpt && mkdir -p -- .relaunch-aside/" + branch)
    # the lineage file first (whole: a temporary file renamed), then one rename per checkpoint
    assert command.index("mv -f -- .relaunch-aside/lineage.jsonl.tmp .relaunch-aside/lineage.jsonl") < \
        command.index("mv -T --")
    lineage = json.loads(shlex.split(command.split("printf '%s\\n' ", 1)[1].split(";", 1)[0])[0])
    assert (lineage["id"], lineage["resumed"], lineage["step"], lineage["aside"]) == \
        (branch, "ckpt-00000010.pt", 10, ["ckpt-00000020.pt", "ckpt-00000030.pt"])
    assert "for n in ckpt-00000020.pt ckpt-00000030.pt; do" in command
    stored = one(got, "set aside in the store: ckpt-00000020.pt, ckpt-00000030.pt")
    assert stored["call"] == "store.record_branch" and stored["where"] == "local"
    # after the restore, before training starts: no save of the new branch is ever among them
    assert at(got, "verify /root/ckpt/ckpt-00000010.pt") < at(got, "set aside ckpt") < \
        at(got, "set aside in the store") < at(got, "start tmux session planned")


@promise("case-up-secrets")
def _(got: list[dict[str, Any]]) -> None:
    secrets = one(got, "secrets WANDB_API_KEY -> /root/.relaunch/planned/secrets.env")
    assert secrets["stdin"] == "<secret>" and secrets["command"].startswith("umask 077 && ")
    assert "chmod 600 -- " in secrets["command"] and at(got, "secrets WANDB") < at(got, "start tmux session")


@promise("case-up-streams")
def _(got: list[dict[str, Any]]) -> None:
    pushes = [a for a in got if a["title"].startswith("checkpoint-30 (1.2 GiB) to the instance")]
    assert [a["lane"] for a in pushes] == ["checkpoint", "push-2", "push-3"]
    assert all(a["needs"] == ["incoming:checkpoint-30"] for a in pushes[1:])
    over = one(got, "the copy of checkpoint-30 is over")
    assert over["needs"] == ["pushed:checkpoint-30:2", "pushed:checkpoint-30:3"]
    _up_restores(got, "checkpoint-30", "checkpoint-30 (1.2 GiB) to the instance: 2 file(s), 600")


@promise("case-up-two-indexes")
def _(got: list[dict[str, Any]]) -> None:
    script = one(got, "create /root/venvs/planned")["stdin"]
    assert "export PIP_EXTRA_INDEX_URL=http://127.0.0.1:8766/simple/" in script
    assert "UV_INDEX_STRATEGY=unsafe-best-match" in script
    assert not [a for a in got if a["command"] and "8766" in a["command"]]     # an index URL never on a command line


@promise("case-up-uv-provides-python")
def _(got: list[dict[str, Any]]) -> None:
    assert got[0]["skip"]                                                      # no preflight error for the Python
    script = one(got, "create /root/venvs/planned")["stdin"]
    assert "UV_PYTHON_DOWNLOADS_JSON_URL=http://127.0.0.1:8765/python/downloads.json" in script
    assert at(got, "uv in relaunch's tools folder") < at(got, "create /root/venvs/planned")


@promise("case-up-venv-matches")
def _(got: list[dict[str, Any]]) -> None:
    venv = one(got, "venv")
    assert venv["skip"].startswith("venv /root/venvs/planned already matches the lock")
    assert not [t for t in titles(got) if t.startswith(("create ", "upload <repo>/tests/fixtures/plans/plan.lock"))]
    assert one(got, "upload <repo>/tests/fixtures/plans/train.py")


@promise("case-stop")
def _(got: list[dict[str, Any]]) -> None:
    assert titles(got)[0] == "send SIGTERM to the training's process group"
    wait = got[1]
    assert wait["title"].startswith("wait up to 120s") and wait["deadline"] > 120 and wait["produces"] == "stop"
    assert got[2]["command"] == "tmux kill-session -t =planned-guard 2>/dev/null || true"   # exact name, after


@promise("case-stop-not-running")
def _(got: list[dict[str, Any]]) -> None:
    assert len(got) == 1 and got[0]["skip"]


@promise("case-meta")
def _(got: list[dict[str, Any]]) -> None:
    assert got[0]["command"] == "tail -n 200 -- /root/planned.log 2>/dev/null || true"
    assert got[0]["produces"] == "log-tail" and got[-1]["call"] == "store.flush"          # the manifest last
    assert [a["call"] for a in got[1:-1]] == ["store.write_meta"] * 3


def _local_copy(got: list[dict[str, Any]], source: str) -> None:
    rsync = one(got, "ckpt-00000030.pt (step 30, 1 file(s), 31.2 KiB) from the instance")
    assert rsync["argv"][0] == "rsync" and rsync["argv"][-2] == f"203.0.113.7:{source}"
    assert at(got, "prepare the staging folder") < at(got, "ckpt-00000030.pt (step 30") < at(got, "the copy of")


def _local_store_copy(got: list[dict[str, Any]], source: str) -> None:
    """Into a local store: hashed here as it lands, then the store accepts it."""
    _local_copy(got, source)
    follow = one(got, "sha256 of ckpt-00000030.pt here as it lands")
    assert follow["needs"] == ["staging:ckpt-00000030.pt"] and "--follow" in follow["argv"]
    assert one(got, "verify ckpt-00000030.pt")["call"] == "store.accept"


@promise("case-copy-local")
def _(got: list[dict[str, Any]]) -> None:
    _local_store_copy(got, "/root/.relaunch/planned/pinned/")
    assert "--checksum" not in one(got, "ckpt-00000030.pt (step 30")["argv"]


@promise("case-copy-local-every-byte")
def _(got: list[dict[str, Any]]) -> None:
    _local_store_copy(got, "/root/.relaunch/planned/pinned/")
    assert "--checksum" in one(got, "ckpt-00000030.pt (step 30")["argv"]


@promise("case-copy-local-unpinned")
def _(got: list[dict[str, Any]]) -> None:
    _local_store_copy(got, "/root/ckpt/")
    assert not [t for t in titles(got) if t.startswith(("pin ", "unpin"))]
    still = at(got, "ckpt-00000030.pt is still on the instance")
    assert at(got, "hash ckpt-00000030.pt on the instance") < still < at(got, "verify ckpt-00000030.pt")


@promise("case-copy-local-streams")
def _(got: list[dict[str, Any]]) -> None:
    copies = [a for a in got if a["title"].startswith("checkpoint-30 (step 30")]
    assert [a["lane"] for a in copies] == ["copy", "copy-2", "copy-3"]
    over = one(got, "the copy of checkpoint-30 is over")
    assert over["needs"] == ["pulled:checkpoint-30:2", "pulled:checkpoint-30:3"]


@promise("case-copy-rclone-instance")
def _(got: list[dict[str, Any]]) -> None:
    upload = one(got, "the instance uploads ckpt-00000030.pt")
    assert " copy --immutable --files-from0 - /root/.relaunch/planned/pinned/ s3:bucket/runs/a" in upload["command"]
    assert upload["stdin"] == "<secret>"
    assert one(got, "hash ckpt-00000030.pt on the instance")["title"].endswith("(sha256, md5)")


@promise("case-copy-hf-instance")
def _(got: list[dict[str, Any]]) -> None:
    create = at(got, "create the repo acme/ckpts (private)")
    upload = at(got, "the instance uploads ckpt-00000030.pt")
    assert create < upload < at(got, "verify ckpt-00000030.pt in the repo at the commit")
    assert got[upload]["stdin"] == "<secret>" and ".relaunch/incoming" in got[upload]["command"]


@promise("case-copy-relay-hf")
def _(got: list[dict[str, Any]]) -> None:
    _local_copy(got, "/root/.relaunch/planned/pinned/")
    upload = one(got, "each file of ckpt-00000030.pt from this machine to")
    assert upload["needs"] == ["staging:ckpt-00000030.pt", "hashes:ckpt-00000030.pt"]      # verified here first


def snapshot_diff(expected: list[dict[str, Any]], got: list[dict[str, Any]]) -> str:
    import difflib

    def lines(doc: list[dict[str, Any]]) -> list[str]:
        return json.dumps(doc, indent=1, ensure_ascii=False).splitlines()

    return "\n".join(difflib.unified_diff(lines(expected), lines(got), "the case's expect", "the plan now",
                                          lineterm=""))


def test_every_case_has_its_promises_written_by_hand() -> None:
    assert sorted(PROMISES) == sorted(p.stem for p in CASES)


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_plan_case(path: Path, state: Path) -> None:
    """The hand-written promises first; then the snapshot, as a diff for a reviewer to accept."""
    case = json.loads(path.read_text())
    got = shown(planned(case, state), state)
    plan_invariants(case, got)
    PROMISES[path.stem](got)
    if os.environ.get("RELAUNCH_REGEN_PLANS"):
        case["expect"] = got
        path.write_text(json.dumps(case, indent=1, ensure_ascii=False) + "\n")
    if got != case["expect"]:
        pytest.fail(f"{case['why']}\nThe plan kept every promise above but differs from its snapshot:\n"
                    f"{snapshot_diff(case['expect'], got)}\n"
                    f"If the change is intended: RELAUNCH_REGEN_PLANS=1 python -m pytest "
                    f"{Path(__file__).relative_to(REPO)} -k {path.stem}, "
                    f"then read `git diff {path.relative_to(REPO)}` before committing it.",
                    pytrace=False)


def test_every_plan_function_has_a_case() -> None:
    kinds = {json.loads(p.read_text())["plan"] for p in CASES}
    stores = {json.loads(p.read_text())["store"] for p in CASES}
    assert kinds == {"up", "stop", "meta", "copy"}
    assert stores == {"local", "rclone", "hf", "relay-rclone", "relay-hf"}


@pytest.mark.parametrize("path", LISTINGS, ids=[p.stem for p in LISTINGS])
def test_every_layouts_newest_complete_checkpoint_is_chosen(path: Path, state: Path) -> None:
    """With an empty store, `up` resumes from the newest complete checkpoint the layout finds."""
    spec = json.loads(path.read_text())
    listing = [line.split(" ", 3) for line in spec["listing"]]
    case = {"facts": "facts-root.json", "store": "local",
            "patch": {"listing": [[k, int(s), float(m), p] for k, s, m, p in listing]},
            "set": [f"checkpoint.layout={spec['layout']}", f"checkpoint.pattern={spec.get('pattern', 'ckpt-*.pt')}"]}
    job, store = job_for(case, state)
    plan, resumed = plan_up(job, store)
    expect = spec["expect"]
    restore = [a for a in plan.actions if a.step == "checkpoint"]
    if not expect:
        assert resumed.checkpoint == "" and [a.skip for a in restore] == [f"the store {job.facts.store.label} is "
                                                                          "empty: fresh start"]
        return
    newest = expect[-1]
    assert choose(job).on_instance is not None
    assert (resumed.checkpoint, resumed.step) == (f"/root/ckpt/{newest['name']}", newest["step"])
    assert [a.skip for a in restore] == [f"the instance already has {newest['name']} (step {newest['step']}), "
                                         "newer than the store's"]


def test_env_vars_reach_the_run_script_rendered(state: Path) -> None:
    case = {"facts": "facts-root.json", "store": "local", "set": ["env.vars={OUT: '~/out/{{ name }}-{{ step }}'}"]}
    job, store = job_for(case, state)
    launch = next(a for a in plan_up(job, store)[0].actions if a.title.startswith("upload run.sh"))
    assert isinstance(launch.stdin, bytes)
    assert "export OUT='~/out/planned-0'\n" in launch.stdin.decode()


# -- node groups: shape, what changed, and the group's plan ------------------------------------------
def group_jobs(state: Path, n: int, gpus: int = 0, sets: tuple[str, ...] = ()) -> tuple[list[Job], Store]:
    import dataclasses

    case = {"facts": "facts-root.json", "store": "local", "set": list(sets),
            "patch": {"host": {"gpus": [f"GPU {i}, 80 GiB, 550.0" for i in range(gpus)]}}}
    first, store = job_for(case, state)
    jobs = []
    for rank in range(n):
        target = dataclasses.replace(first.target, address=f"203.0.113.{10 + rank}")
        jobs.append(Job(first.recipe, Node(target, rank, n, "203.0.113.10"), Facts.from_dict(first.facts.as_dict())))
    return jobs, store


def test_group_shape_keeps_the_global_batch_and_names_the_counts_that_would(state: Path) -> None:
    from relaunch.errors import EnvError
    from relaunch.steps.group import shape

    jobs, _ = group_jobs(state, 2, gpus=4, sets=("run.batch={global: 512, micro: 8}",))
    s = shape(jobs)
    assert (s.nproc, s.world_size, s.grad_accum) == (4, 8, 8)
    assert shape(jobs[:1]).grad_accum == 16                       # half the GPUs: twice the accumulation
    three, _ = group_jobs(state, 3, gpus=4, sets=("run.batch={global: 512, micro: 8}",))
    with pytest.raises(EnvError) as info:
        shape(three)                                              # 12 processes do not divide 64 micro-batches
    assert "with 4 per node: 1 node(s) x 4, 2 node(s) x 4, 4 node(s) x 4, 8 node(s) x 4, 16 node(s) x 4" in (
        info.value.hint or "")
    mixed, _ = group_jobs(state, 2, gpus=4)
    mixed[1].facts.host.gpus = mixed[1].facts.host.gpus[:2]
    with pytest.raises(EnvError, match="different GPU counts"):
        shape(mixed)


def test_what_changed_and_a_zero_checkpoint_at_another_world_size(state: Path) -> None:
    from relaunch.errors import CheckpointError
    from relaunch.manifest import CheckpointRecord, FileRecord
    from relaunch.steps.group import check_reshard, shape, what_changed

    jobs, _ = group_jobs(state, 1, gpus=4, sets=("run.batch={global: 512, micro: 8}",))
    saved = {"world_size": 8, "grad_accum": 8, "nnodes": 2, "nproc_per_node": 4}
    record = CheckpointRecord("step-100", 100, {"step-100/.metadata": FileRecord(1, "a" * 64)}, "now", "h",
                              saved_with=saved)
    assert what_changed(record, shape(jobs), jobs[0]) == "world size 8 -> 4: grad_accum 8 -> 16, global batch 512 kept"
    zero = CheckpointRecord("global_step100", 100, {
        "global_step100/zero_pp_rank_0_mp_rank_00_optim_states.pt": FileRecord(1, "b" * 64)}, "now", "h",
        saved_with=saved)
    with pytest.raises(CheckpointError, match="DeepSpeed ZeRO checkpoint saved at world size 8") as info:
        check_reshard(zero, shape(jobs), jobs[0])
    assert "ds_to_universal" in (info.value.hint or "")


def test_a_group_plan_copies_once_then_fans_out(state: Path) -> None:
    from relaunch.cycle import plan_group_up

    jobs, store = group_jobs(state, 3)
    manifest = json.loads((FIX / "case-up-resumed-start.json").read_text())["patch"]["store"]["manifest"]
    for job in jobs:
        job.facts.store = Facts.from_dict({"host": {}, "store": {"label": "s", "empty": False,
                                                                 "manifest": manifest}}).store
    plan, resumed = plan_group_up(jobs, store, "known hosts lines\n")
    actions = plan.actions
    local = [a for a in actions if a.argv and a.argv[0] == "rsync"]
    assert len(local) == 1 and local[0].argv[-1].startswith("203.0.113.10:")        # the slow link once
    fanout = [a for a in actions if a.command.startswith("rsync ")]
    assert [(a.host.split("@")[1], a.command.split()[-1].split(":")[0]) for a in fanout] == [
        ("203.0.113.10", "203.0.113.11"), ("203.0.113.10", "203.0.113.12")]       # rounds: 1 -> 2 -> 3
    assert {a.host for a in actions if a.title.startswith("verify ckpt-00000020.pt on")} == {j.host for j in jobs}
    cleanup = [a for a in actions if a.always]
    assert {a.host for a in cleanup} == {j.host for j in jobs} and all("relaunch-fanout" in a.command for a in cleanup)
    assert all(job.checkpoint.endswith("/ckpt/ckpt-00000020.pt") and job.step == 20 for job in resumed)
    assert [a.host for a in actions if a.title.startswith("start tmux")] == [j.host for j in jobs]


def test_a_groups_rollback_sets_each_nodes_later_parts_aside_there_once_before_the_start(state: Path) -> None:
    """`up --checkpoint` of an older checkpoint on a node group: every node moves its own parts of
    the later checkpoints aside (one branch, the id from node 0's clock), the store sets its later
    records aside once, and both before any node starts training."""
    from relaunch.cycle import plan_group_up

    jobs, store = group_jobs(state, 2)
    case = json.loads((FIX / "case-up-rollback.json").read_text())["patch"]
    for job in jobs:
        job.facts.store = Facts.from_dict({"host": {}, "store": {"label": "s", **case["store"]}}).store
        job.facts.listing = Facts.from_dict({"host": {}, "listing": case["listing"]}).listing
        job.facts.host.now = case["host"]["now"]
    plan, resumed = plan_group_up(jobs, store, "known hosts lines\n", wanted="ckpt-00000010.pt")
    actions = plan.actions
    aside = [a for a in actions if a.title.startswith("set aside ckpt-00000020.pt, ckpt-00000030.pt")]
    assert [a.host for a in aside] == [j.host for j in jobs]
    assert all("/.relaunch-aside/20251130T102000Z-from-ckpt-00000010.pt" in a.title for a in aside)
    [stored] = [a for a in actions if a.call == "store.record_branch"]
    assert stored.args["branch"].aside == ["ckpt-00000020.pt", "ckpt-00000030.pt"]
    starts = [actions.index(a) for a in actions if a.title.startswith("start tmux")]
    assert max(actions.index(a) for a in [*aside, stored]) < min(starts)
    assert all(job.step == 10 for job in resumed)


def test_a_group_copy_pins_each_nodes_part_on_that_node_and_unpins_it_there(state: Path) -> None:
    """Each node pins the files it sends, at the same time as the others; every copy and hash of
    a part reads that node's pins; each node's unpin runs also after a failure; a node that could
    not pin copies from checkpoint.dir (and has no unpin)."""
    import dataclasses

    from relaunch.steps.evacuate import plan_copy

    jobs, store = group_jobs(state, 2)
    cp = Checkpoint("step-40", 40, tuple(Entry(f"step-40/__{r}_0.distcp", "f", 10, 1.0) for r in range(2)))
    parts = [(job, dataclasses.replace(cp, files=(cp.files[r],))) for r, job in enumerate(jobs)]
    actions = plan_copy(jobs[0], store, cp, parts=parts)
    hosts = [job.host for job in jobs]
    pins = [a for a in actions if a.title.startswith("pin ")]
    assert [(a.host, a.lane, a.stdin) for a in pins] == [(h, f"pin@{h}", f"step-40/__{r}_0.distcp\0".encode())
                                                       for r, h in enumerate(hosts)]
    assert actions[:2] == pins                                   # pinned before anything reads the files
    told = actions[2]
    assert told.call == "checks.pinned" and told.args["hosts"] == hosts
    assert [r.name for r in told.args["found"]] == [f"pin:step-40@{h}" for h in hosts]
    rsyncs = [a for a in actions if a.argv[:1] == ("rsync",)]
    assert [a.argv[-2] for a in rsyncs] == [f"{job.target.address}:/root/.relaunch/planned/pinned/" for job in jobs]
    assert all(a.command.startswith("cd /root/.relaunch/planned/pinned && ") for a in actions
               if a.title.startswith("hash "))
    assert not [a for a in actions if a.title == "step-40 is still on the instance"]    # the pins hold it
    unpins = actions[-2:]
    assert [(a.host, a.always) for a in unpins] == [(h, True) for h in hosts]
    assert all(a.command.startswith("rm -rf -- /root/.relaunch/planned/pinned && ") for a in unpins)

    mixed = plan_copy(jobs[0], store, cp, parts=parts, unpinned=frozenset([hosts[1]]))
    assert [a.host for a in mixed if a.title.startswith(("pin ", "unpin"))] == [hosts[0], hosts[0]]
    assert [(a.host, a.command.split(" && ")[0]) for a in mixed if a.title == "step-40 is still on the instance"] \
        == [(hosts[1], "cd /root/ckpt")]
    assert [a.argv[-2] for a in mixed if a.argv[:1] == ("rsync",)] == [
        f"{jobs[0].target.address}:/root/.relaunch/planned/pinned/", f"{jobs[1].target.address}:/root/ckpt/"]


@pytest.mark.parametrize(("mirror", "variable"), [
    ("http://127.0.0.1:8765/python/downloads.json", "UV_PYTHON_DOWNLOADS_JSON_URL"),
    ("https://tok@mirror.example.com/downloads.json?x=1", "UV_PYTHON_DOWNLOADS_JSON_URL"),
    ("https://mirror.example.com/python-build-standalone", "UV_PYTHON_INSTALL_MIRROR"),
    ("file:///srv/pbs", "UV_PYTHON_INSTALL_MIRROR"),
])
def test_where_uv_gets_the_python_it_provides(state: Path, mirror: str, variable: str) -> None:
    """A downloads list of your own builds (.json) or a python-build-standalone mirror; the Python
    goes beside the venv; nothing of this when the image has the Python or pip installs."""
    from relaunch.steps.env import python_env

    case = {"facts": "facts-root.json", "store": "local", "patch": {"host": {"python": ""}},
            "set": ['env.python="3.12"', f"env.python_mirror={mirror}"]}
    job, _ = job_for(case, state)
    assert python_env(job) == {"UV_PYTHON_INSTALL_DIR": "/root/venvs/.relaunch-pythons", variable: mirror}
    has_it, _ = job_for({**case, "patch": {}}, state)
    assert python_env(has_it) == {}
    pip, _ = job_for({**case, "set": [*case["set"], "env.installer=pip"]}, state)
    assert python_env(pip) == {}


def test_a_venv_is_reused_only_while_its_python_runs_and_is_env_python(state: Path) -> None:
    from relaunch.steps.env import plan_env

    freeze = {"venv_freeze": ["numpy==2.3.4", "torch==2.13.0"]}
    titles = {}
    for label, venv_python in (("same", "3.11.2"), ("other", "3.10.12"), ("broken", "")):
        job, _ = job_for({"facts": "facts-root.json", "store": "local",
                          "patch": {"host": {**freeze, "venv_python": venv_python}}}, state)
        titles[label] = [a.skip or a.title for a in plan_env(job) if "venv" in a.title]
    assert titles["same"][0] == "venv /root/venvs/planned already matches the lock (2 lines)"
    assert titles["other"][0] == ("make /root/venvs/planned again (its Python is 3.10.12, env.python is 3.11) "
                                  "and install 2 pinned packages")
    assert titles["broken"][0].startswith("make /root/venvs/planned again (its Python is broken")


def test_an_install_failure_names_the_indexes_searched_and_a_python_uv_could_not_get(state: Path) -> None:
    from relaunch.cycle import StepOutputs
    from relaunch.ui import UI

    extra = "http://127.0.0.1:8766/simple/"
    job, _ = job_for({"facts": "facts-root.json", "store": "local", "set": [f"env.extra_index_urls=[{extra}]"]},
                     state)
    checks = StepOutputs(UI(quiet=True), job.host, job.recipe)
    uv_said = ("relaunch-env-phase lock\n  x No solution found when resolving dependencies:\n  Because there is no "
               "version of rlcufake==1.0+cu999 and you require rlcufake==1.0+cu999, we can conclude that ...\n")
    error = checks.install_failure(1, uv_said)
    assert error is not None and error.message == (f"{job.host}: env: installing the lock failed: there is no version "
                                                   "of rlcufake==1.0+cu999 and you require rlcufake==1.0+cu999")
    assert (error.hint or "").startswith(f"the indexes searched: http://127.0.0.1:8765/simple/ + {extra} "
                                         "(UV_INDEX_STRATEGY=unsafe-best-match: each pin from whichever index has it)")
    providing = "relaunch-env-phase python\nerror: No download found for request: cpython-3.12-linux-x86_64-gnu\n"
    error = checks.install_failure(1, providing)
    assert error is not None and error.message == (f"{job.host}: env: uv could not provide Python 3.11: No download "
                                                   "found for request: cpython-3.12-linux-x86_64-gnu")
    assert "uv's default download source" in (error.hint or "")


# every instance path of the recipe written as a template, as a team's base recipe writes them
TEMPLATED = ["env.venv=~/venvs/{{ name }}", "checkpoint.dir='{{ home }}/ckpt/{{ name }}'",
             "run.workdir='{{ home }}/work-{{ name }}'", "run.log=~/{{ name }}.log",
             f"env.files={{{FIX / 'train.py'}: '{{{{ home }}}}/work-{{{{ name }}}}/train.py'}}"]


def test_nothing_up_or_plan_says_shows_a_template_of_the_recipe(state: Path) -> None:
    """The facts `up` says, the guard's words, every action as `relaunch plan` shows it, and the
    attach line name the rendered paths (the sandbox layer's test_living does the same on a box)."""
    from relaunch.steps.launch import attach_command
    from relaunch.steps.notices import protection
    from relaunch.steps.preflight import summary

    job, store = job_for({"facts": "facts-root.json", "store": "local", "set": TEMPLATED}, state)
    plan, started = plan_up(job, store)
    said = "\n".join([*summary(job), *protection(job, {}).lines(), plan.render(), attach_command(started)])
    assert "{{" not in said and "{%" not in said
    upload = next(a for a in plan.actions if a.title.startswith("upload ") and "train.py" in a.title)
    assert upload.title.endswith("-> /root/work-planned/train.py")
    assert "/root/venvs/planned" in said and "/root/planned.log" in said
