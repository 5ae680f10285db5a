"""Which notice sources can fire, said by `up` and `status` from the guard's own look at each source
on the instance (templates/guard.py's probe mode), and the loss bound where none can.

End to end on sandbox instances: the cloud metadata stand-in (tests/metadata_server.py) answers at
169.254.169.254 inside the instance's namespace as AWS's IMDSv2 does; without it, nothing answers.
"""

from __future__ import annotations

import json
from pathlib import Path

from e2e import plain_recipe, run_cli
from relaunch.steps.notices import Protection
from test_guard import metadata_service


def test_the_words_for_each_finding() -> None:
    protected = Protection({"aws": "answers as its service does"},
                           {"sigterm": "PID 1 is start.sh, not an init: ..."}, {}, 600, "ckpt-20.pt, step 20")
    assert protected.protected and protected.lines() == [
        "aws can fire: answers as its service does",
        "sigterm cannot reach this run: PID 1 is start.sh, not an init: ...",
        "protected by aws: a notice becomes a save (copied off by `relaunch watch`)"]
    assert protected.as_dict()["loss_bound"] is None
    alone = Protection({}, {"sigterm": "PID 1 is start.sh"}, {"file:/x": "fires when /x appears"}, 600, "none yet")
    assert not alone.protected
    assert alone.lines()[-1] == (
        "no notice can protect this run unless file:/x is written: a loss costs what was saved after the store's "
        "newest verified checkpoint (none yet); keep `relaunch watch` running and that is at most one save "
        "interval plus a copy (it copies each checkpoint as it is saved), with `relaunch sync` alone "
        "checkpoint.every = 600s of copies plus one save interval")
    assert alone.as_dict()["sources"]["file:/x"]["fires"] is None
    assert alone.as_dict()["loss_bound"]["every"] == 600


def pid1() -> str:
    # the default image shares this machine's PID namespace: its PID 1 is this machine's
    return Path("/proc/1/comm").read_text().strip()


def test_up_and_status_say_which_sources_protect_the_run(tmp_path, sandbox, ssh_key):
    home, inst = tmp_path / "state", sandbox()
    recipe = plain_recipe(tmp_path / "work", name="notices", key=ssh_key,
                          guard={"sources": ["aws", "gcp", "sigterm", "file:~/RECLAIM"], "every": 1})
    with metadata_service(inst, "aws", tmp_path) as metadata:
        plan = run_cli("plan", str(recipe), inst.host, home=home)
        assert plan.returncode == 0, plan.stderr
        assert not [r for r in metadata.requests() if r["method"] == "GET" and "instance-action" in r["path"]
                    and r["status"] not in (200, 404)]
        up = run_cli("up", str(recipe), inst.host, home=home)
        assert up.returncode == 0, up.stderr
        said = up.stderr
        assert "guard: aws can fire: answers as its service does" in said
        assert "guard: gcp cannot reach this run: " in said
        assert f"PID 1 is {pid1()}" in said
        assert "guard: file:/root/RECLAIM: fires when /root/RECLAIM appears: whatever writes it decides" in said
        assert "guard: protected by aws: a notice becomes a save" in said
        # the probe spoke IMDSv2 as the guard does: a token first, then the token on every GET
        probe = [r for r in metadata.requests() if r["path"].startswith("/latest/")]
        assert probe[0]["method"] == "PUT" and probe[0]["path"] == "/latest/api/token"
        assert all(r["headers"].get("X-aws-ec2-metadata-token") == "known" for r in probe if r["method"] == "GET")
        status = run_cli("status", str(recipe), "--json", home=home)
        assert status.returncode == 0, status.stderr
        notices = json.loads(status.stdout)["notices"]
        assert notices["protected_by"] == ["aws"] and notices["protected"] is True
        assert notices["sources"]["gcp"]["fires"] is False and notices["sources"]["file:/root/RECLAIM"]["fires"] is None
        evacuate = run_cli("evacuate", str(recipe), "--stop", "--allow-empty", home=home)
        assert evacuate.returncode == 0, evacuate.stderr

    # the metadata service gone: only the file source is left, and the copy-off interval is the bound
    up = run_cli("up", str(recipe), inst.host, "--set", "checkpoint.every=300", home=home)
    assert up.returncode == 0, up.stderr
    assert "guard: aws cannot reach this run: no answer" in up.stderr
    assert ("no notice can protect this run unless file:/root/RECLAIM is written: a loss costs what was saved after "
            "the store's newest verified checkpoint (none yet); keep `relaunch watch` running and that is at most one "
            "save interval plus a copy (it copies each checkpoint as it is saved), with `relaunch sync` alone "
            "checkpoint.every = 300s of copies plus one save interval") in up.stderr
    status = run_cli("status", str(recipe), "--json", "--set", "checkpoint.every=300", home=home)
    notices = json.loads(status.stdout)["notices"]
    assert notices["protected"] is False and notices["loss_bound"]["every"] == 300
    text = run_cli("status", str(recipe), home=home)
    assert "  notices that can reach this run:" in text.stdout and "no notice can protect this run" in text.stdout
