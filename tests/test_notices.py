"""Which notice sources can fire, said by `up` and `status` from the guard's own look at each source
on the instance (templates/guard.py's probe mode), and the loss bound where none can.

End to end on sandbox instances: the cloud metadata stand-in (tests/metadata_server.py) answers at
169.254.169.254 inside the instance's namespace as AWS's IMDSv2 does; without it, nothing answers.
"""

from __future__ import annotations

import json
from pathlib import Path

from e2e import plain_recipe, run_cli, wait_for, watched_and_refused
from relaunch.steps.notices import Protection, protection
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


def test_ups_guard_line_watches_only_what_the_probe_said_can_reach_the_run(tmp_path, monkeypatch) -> None:
    """`up` says which sources can fire (the probe), then that the guard runs: the two agree."""
    from relaunch.steps.guard import started_line
    from test_plans import job_for

    monkeypatch.setenv("RELAUNCH_HOME", str(tmp_path))
    job, _ = job_for({"facts": "facts-root.json", "store": "local",
                      "set": ["guard.sources=[aws, gcp, 'file:/x', sigterm]", "guard.every=2"]}, tmp_path)
    job.facts.notices = {"aws": {"fires": True, "why": "answers as its service does"},
                         "gcp": {"fires": False, "why": "no answer"}, "file:/x": {"fires": None, "why": "..."},
                         "sigterm": {"fires": False, "why": "PID 1 is start.sh"}}
    said = protection(job, job.facts.notices).lines()
    assert started_line(job, ["aws", "gcp", "file:/x", "sigterm"], "r-guard") == (
        "guard: watching aws, file:/x every 2s (tmux session r-guard); gcp, sigterm cannot reach this run")
    assert "gcp cannot reach this run: no answer" in said and "aws can fire: answers as its service does" in said
    # the box: nothing can fire; the guard runs, and says it protects nothing, as the lines above do
    job.facts.notices = {**{n: {"fires": False, "why": "no answer"} for n in ("aws", "gcp", "sigterm")},
                         "file:/x": {"fires": None, "why": "..."}}
    assert started_line(job, ["aws", "gcp", "file:/x", "sigterm"], "r-guard") == (
        "guard: watching file:/x every 2s (tmux session r-guard); aws, gcp, sigterm cannot reach this run")
    assert started_line(job, ["aws", "gcp", "sigterm"], "r-guard") == (
        "guard: started (tmux session r-guard), but none of aws, gcp, sigterm can reach this run: no notice "
        "protects it (see above)")


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
        watched, refused = watched_and_refused(said)
        assert "aws" in watched and "gcp" in refused and not watched & refused
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
    watched, refused = watched_and_refused(up.stderr)
    assert "file:/root/RECLAIM" in watched and {"aws", "gcp"} <= refused and not watched & refused
    assert ("no notice can protect this run unless file:/root/RECLAIM is written: a loss costs what was saved after "
            "the store's newest verified checkpoint (none yet); keep `relaunch watch` running and that is at most one "
            "save interval plus a copy (it copies each checkpoint as it is saved), with `relaunch sync` alone "
            "checkpoint.every = 300s of copies plus one save interval") in up.stderr
    status = run_cli("status", str(recipe), "--json", "--set", "checkpoint.every=300", home=home)
    notices = json.loads(status.stdout)["notices"]
    assert notices["protected"] is False and notices["loss_bound"]["every"] == 300
    text = run_cli("status", str(recipe), home=home)
    assert "  notices that can reach this run:" in text.stdout and "no notice can protect this run" in text.stdout


def test_on_a_box_no_notice_reaches_up_and_status_never_say_the_guard_protects_it(tmp_path, sandbox, ssh_key):
    """The issue's RunPod box: no metadata service, PID 1 a start script. `up` said "no notice can
    protect this run", then "guard: watching aws, gcp, azure, sigterm"; status "sigterm on"."""
    home, inst = tmp_path / "state", sandbox(image="runpod")
    recipe = plain_recipe(tmp_path / "work", name="unprotected", key=ssh_key, guard={"every": 1})
    up = run_cli("up", str(recipe), inst.host, home=home)
    assert up.returncode == 0, up.stderr
    assert "guard: no notice can protect this run" in up.stderr
    assert ("launch: guard: started (tmux session unprotected-guard), but none of aws, gcp, azure, sigterm can "
            "reach this run: no notice protects it (see above)") in up.stderr
    assert "guard: watching" not in up.stderr

    def guard_line() -> str:
        out = run_cli("status", str(recipe), home=home)
        assert out.returncode == 0, out.stderr
        line = next(ln for ln in out.stdout.splitlines() if ln.startswith("  guard: "))
        return "" if line.endswith("starting") else line         # the guard has not written its state yet

    line = wait_for("status to show the guard's sources", guard_line, timeout=120, every=1)
    assert line.startswith("  guard: running (tmux session unprotected-guard): ") and \
        line.endswith("; sigterm on (but it cannot reach this run)"), line
