"""The guard and `relaunch watch` on a reclaim notice, end to end: sandbox instances with a metadata
service that speaks AWS's, GCP's and Azure's documented APIs at 169.254.169.254 inside the
instance's own network namespace (tests/metadata_server.py), the example trainer, a real store.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from e2e import cli_env, example_recipe, plain_recipe, run_cli, wait_for, watched_and_refused, whole
from relaunch.sandbox import Instance
from relaunch.sandbox.network import netns

HERE = Path(__file__).parent
METADATA = "169.254.169.254"
MANIFEST = Path(".relaunch") / "manifest.json"
HISTORY = Path(".relaunch") / "history.jsonl"


class MetadataService:
    """tests/metadata_server.py running in an instance's network namespace at 169.254.169.254:80."""

    def __init__(self, folder: Path, provider: str) -> None:
        self.provider = provider
        self.control = folder / f"metadata-{provider}.json"
        self.log = folder / f"metadata-{provider}.log"
        self.control.write_text("")
        self.log.write_text("")

    def raise_notice(self, seconds: float) -> float:
        """The provider's reclaim notice, `seconds` ahead; returns when it was raised."""
        now = time.time()
        self._set({"deadline": now + seconds})
        return now

    def recommend_rebalance(self) -> float:
        """AWS's rebalance recommendation (no notice); returns when it was raised."""
        now = time.time()
        self._set({"rebalance": now})
        return now

    def _set(self, data: dict) -> None:
        """The control file, by a rename: the stand-in reads it on every request, never half written."""
        tmp = self.control.with_name(self.control.name + ".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(self.control)

    def requests(self) -> list[dict]:
        return [json.loads(line) for line in whole(self.log.read_text()).splitlines() if line.strip()]


@contextmanager
def metadata_service(inst: Instance, provider: str, folder: Path) -> Iterator[MetadataService]:
    ns = netns(inst.name)
    service = MetadataService(folder, provider)
    subprocess.run(["ip", "netns", "exec", ns, "ip", "addr", "add", f"{METADATA}/32", "dev", "lo"], check=True)
    out = folder / f"metadata-{provider}.out"
    with out.open("w") as handle:
        proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, str(HERE / "metadata_server.py"),
                                 "--provider", provider, "--control", str(service.control), "--log", str(service.log),
                                 "--bind", METADATA, "--port", "80"], stdout=handle, stderr=subprocess.STDOUT)
    try:
        wait_for("the metadata service", lambda: "listening" in out.read_text() or proc.poll() is not None,
                 timeout=30, every=0.1)
        assert proc.poll() is None, out.read_text()
        yield service
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        subprocess.run(["ip", "netns", "exec", ns, "ip", "addr", "del", f"{METADATA}/32", "dev", "lo"],
                       capture_output=True)


def set_keys(recipe: Path, **sections: dict) -> Path:
    data = yaml.safe_load(recipe.read_text())
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    return recipe


def guard_file(ssh, inst: Instance, name: str, recipe_name: str) -> dict | None:
    out = ssh(inst, f"cat ~/.relaunch/{recipe_name}/guard/{name} 2>/dev/null", check=False).stdout
    return json.loads(out) if out.strip() else None


@contextmanager
def watching(recipe: Path, home: Path, folder: Path, *args: str, env: dict[str, str] | None = None,
             script: str | None = None) -> Iterator[subprocess.Popen]:
    """`relaunch watch RECIPE --json` in the background, its output in folder/watch.out and .err;
    `script` as in e2e.run_cli."""
    program = ["-c", script] if script is not None else ["-m", "relaunch.cli"]
    with (folder / "watch.out").open("w") as out, (folder / "watch.err").open("w") as err:
        proc = subprocess.Popen([sys.executable, *program, "watch", str(recipe), *args, "--json"],
                                env=cli_env(home, env),
                                stdout=out, stderr=err, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def events(folder: Path) -> list[dict]:
    """The watch's events so far: JSON lines on its stderr (--json); stdout gets one document at the end."""
    return [json.loads(line) for line in whole((folder / "watch.err").read_text()).splitlines()
            if line.startswith('{"event"')]


def watch_document(folder: Path) -> dict:
    """The one document `watch --json` printed on stdout when it ended: its end, or its error, and every event."""
    doc = json.loads((folder / "watch.out").read_text())
    assert doc["events"] == events(folder), "the document's events are the ones said on stderr"
    return doc


def step_lines(log: str) -> list[int]:
    return [int(line.split()[1]) for line in whole(log).splitlines() if line.startswith("step ")]


def notice_recipe(tmp_path: Path, name: str, key: Path, index_url: str | None) -> Path:
    # a checkpoint only when training is asked to stop: the one the notice makes it save
    recipe = example_recipe(tmp_path / "work", name=name, layout="files", key=key, index_url=index_url,
                            steps=100000, save_every=100000, sleep=0.05)
    return set_keys(recipe, guard={"every": 1})


def assert_saved_after_notice_and_verified(ssh, inst: Instance, recipe_name: str, store: Path, raised: float,
                                           source: str) -> dict:
    """The training saved after the notice, that checkpoint is verified in the store, no step after it lost."""
    log = ssh(inst, f"cat ~/{recipe_name}.log").stdout
    assert "stopped at step " in log, log[-2000:]
    stopped = int(log.split("stopped at step ")[1].split()[0])
    name = f"ckpt-{stopped:08d}.pt"
    assert max(step_lines(log)) == stopped                       # nothing trained after the save
    saved_at = float(ssh(inst, f"stat -c %Y ~/ckpt/{name}").stdout)
    assert saved_at >= int(raised)                               # the save came after the notice
    manifest = json.loads((store / MANIFEST).read_text())
    newest = manifest["checkpoints"][-1]
    assert (newest["name"], newest["step"]) == (name, stopped)   # verified in the store
    instance_sha = ssh(inst, f"sha256sum ~/ckpt/{name}").stdout.split()[0]
    assert newest["files"][name]["sha256"] == instance_sha
    assert ssh(inst, f"tmux has-session -t ={recipe_name}", check=False).returncode != 0
    notice = guard_file(ssh, inst, "notice.json", recipe_name)
    assert notice is not None and notice["source"] == source
    assert notice["save"]["state"] == "saved" and notice["save"]["exit"] == "0"
    assert notice["copy"]["verified"] is True and notice["copy"]["checkpoint"] == name
    history = [json.loads(line) for line in (store / HISTORY).read_text().splitlines()]
    assert len(history) == 1
    entry = history[0]
    assert entry["cause"] == "notice" and entry["detail"].startswith(f"{source}: ")
    assert entry["newest_seen_step"] == entry["newest_verified_step"] == stopped and entry["steps_lost"] == 0
    assert entry["made_deadline"] is True and entry["copy_seconds"] is not None     # a 2 min window, a tiny save
    return notice


@pytest.mark.parametrize("provider", ["aws", "gcp", "azure"])
def test_a_providers_notice_ends_in_a_save_verified_in_the_store(provider, tmp_path, sandbox, ssh, ssh_key,
                                                                 package_index):
    home, inst = tmp_path / "state", sandbox(index_dir=package_index)
    name = f"notice-{provider}"
    recipe = notice_recipe(tmp_path, name, ssh_key, inst.index_url)
    store = tmp_path / "work" / "store"
    with metadata_service(inst, provider, tmp_path) as metadata:
        up = run_cli("up", str(recipe), inst.host, home=home)
        assert up.returncode == 0, up.stderr
        # it watches the provider's source, and none that the probe's lines above said cannot reach the run
        watched, refused = watched_and_refused(up.stderr)
        assert provider in watched and {"aws", "gcp", "azure"} - {provider} <= refused and not watched & refused
        # the provider's source answers; the other clouds' sources do not, and are switched off
        others = {"aws", "gcp", "azure"} - {provider}

        def settled() -> bool:
            state = guard_file(ssh, inst, "state.json", name) or {}
            sources = state.get("sources", {})
            return sources.get(provider, {}).get("state") == "on" and \
                all(sources.get(o, {}).get("state") == "off" for o in others)
        wait_for("the guard to settle on its sources", settled, timeout=120)
        status = run_cli("status", str(recipe), home=home)
        assert status.returncode == 0, status.stderr
        assert f"guard: running (tmux session {name}-guard): " in status.stdout
        assert f"{provider} on" in status.stdout and all(f"{o} off" in status.stdout for o in others)

        with watching(recipe, home, tmp_path) as watch:
            wait_for("training to run", lambda: max(step_lines(ssh(inst, f"cat ~/{name}.log").stdout) or [0]) >= 20,
                     timeout=120)
            raised = metadata.raise_notice(120)
            watch.wait(timeout=300)
        err = (tmp_path / "watch.err").read_text()
        assert watch.returncode == 0, err
        requests = metadata.requests()
    assert f"reclaim notice from {provider}" in err and "evacuated after the notice" in err and "deadline" in err
    notice = assert_saved_after_notice_and_verified(ssh, inst, name, store, raised, provider)
    assert notice["deadline_from"] == ("the gcp window of 30s" if provider == "gcp" else "the notice")
    kinds = [e["event"] for e in events(tmp_path)]
    assert kinds.index("notice") < kinds.index("evacuated") < kinds.index("interruption")
    # stdout: one document, how the watch ended with every event
    assert watch_document(tmp_path)["reason"] == "notice handled"
    # the guard spoke each API as documented: the IMDSv2 token first, the headers every time
    if provider == "aws":
        mine = [r for r in requests if r["path"].startswith("/latest/")]
        assert mine[0]["method"] == "PUT" and mine[0]["path"] == "/latest/api/token" and mine[0]["status"] == 200
        assert mine[0]["headers"]["X-aws-ec2-metadata-token-ttl-seconds"] == "21600"
        gets = [r for r in mine if r["method"] == "GET"]
        assert gets and all(r["headers"].get("X-aws-ec2-metadata-token") == "known" and r["status"] in (200, 404)
                            for r in gets)
        assert any(r["path"] == "/latest/meta-data/spot/instance-action" and r["status"] == 200 for r in gets)
    elif provider == "gcp":
        mine = [r for r in requests if r["path"].startswith("/computeMetadata/")]
        assert mine and all(r["headers"].get("Metadata-Flavor") == "Google" and r["status"] == 200 for r in mine)
    else:
        mine = [r for r in requests if r["path"].startswith("/metadata/scheduledevents")]
        assert mine and all(r["headers"].get("Metadata") == "true" and r["status"] == 200 for r in mine)
        assert all("api-version=2020-07-01" in r["path"] for r in mine)


def test_a_sigterm_to_the_guard_is_a_notice(tmp_path, sandbox, ssh, ssh_key, package_index):
    """A container or system shutdown: the guard's own SIGTERM. No metadata service here: the
    cloud sources find no route and are switched off."""
    home, inst = tmp_path / "state", sandbox(index_dir=package_index)
    name = "notice-term"
    recipe = notice_recipe(tmp_path, name, ssh_key, inst.index_url)
    store = tmp_path / "work" / "store"
    assert run_cli("up", str(recipe), inst.host, home=home).returncode == 0
    state = wait_for("the cloud sources to be switched off", lambda: (lambda s: s if s and all(
        s["sources"][c]["state"] == "off" for c in ("aws", "gcp", "azure")) else None)(
        guard_file(ssh, inst, "state.json", name)), timeout=120)
    with watching(recipe, home, tmp_path) as watch:
        wait_for("training to run", lambda: max(step_lines(ssh(inst, f"cat ~/{name}.log").stdout) or [0]) >= 20,
                 timeout=120)
        raised = time.time()
        ssh(inst, f"kill -TERM {state['pid']}")
        watch.wait(timeout=300)
    assert watch.returncode == 0, (tmp_path / "watch.err").read_text()
    notice = assert_saved_after_notice_and_verified(ssh, inst, name, store, raised, "sigterm")
    assert notice["deadline_from"] == "the sigterm window of 120s"      # run.stop.timeout: sandbox has no window


def test_a_source_that_never_answers_changes_nothing(tmp_path, sandbox, ssh, ssh_key):
    """A metadata address that accepts and never answers: `up` is not held up, training runs on,
    the source is switched off (said once in status), and the other sources still work."""
    home, inst = tmp_path / "state", sandbox()
    name = "silent"
    counter = "trap 'echo stopped; exit 0' TERM; i=0; while true; do i=$((i+1)); echo \"step $i\"; sleep 0.2; done"
    recipe = plain_recipe(tmp_path, name=name, key=ssh_key, command=counter,
                          guard={"sources": ["aws", "file:~/RECLAIM"], "every": 1})
    with metadata_service(inst, "silent", tmp_path) as metadata:
        up = run_cli("up", str(recipe), inst.host, home=home)
        assert up.returncode == 0, up.stderr
        state = wait_for("aws to be switched off", lambda: (lambda s: s if s and s["sources"]["aws"]["state"] == "off"
                                                            else None)(guard_file(ssh, inst, "state.json", name)),
                         timeout=120)
        assert metadata.requests() == []                      # it never answered anything
    assert "no answer" in state["sources"]["aws"]["why"] and state["sources"]["file:/root/RECLAIM"]["state"] == "on"
    assert guard_file(ssh, inst, "notice.json", name) is None
    before = max(step_lines(ssh(inst, f"cat ~/{name}.log").stdout))
    wait_for("training to go on", lambda: max(step_lines(ssh(inst, f"cat ~/{name}.log").stdout)) > before + 5,
             timeout=60)
    status = run_cli("status", str(recipe), home=home)
    assert status.returncode == 0, status.stderr
    assert "aws off (no answer (timed out)" in status.stdout and "file:/root/RECLAIM on" in status.stdout
    assert ssh(inst, f"tmux has-session -t ={name}-guard", check=False).returncode == 0
    # the other source still works: a file that appears is a notice, and training is asked to stop
    ssh(inst, "touch ~/RECLAIM")
    notice = wait_for("the file notice", lambda: (lambda n: n if n and n["save"]["state"] != "asking" else None)(
        guard_file(ssh, inst, "notice.json", name)), timeout=60)
    # the counter exits 0 and saves nothing: an exit status is not a save
    assert notice["source"] == "file:/root/RECLAIM" and notice["save"]["state"] == "no save"
    assert ssh(inst, f"tmux has-session -t ={name}", check=False).returncode != 0
    shown = run_cli("status", str(recipe), home=home)
    assert "reclaim notice from file:/root/RECLAIM" in shown.stdout and "copy: not verified yet" in shown.stdout


def test_a_second_up_keeps_one_guard_and_evacuate_stop_ends_it(tmp_path, sandbox, ssh, ssh_key):
    home, inst = tmp_path / "state", sandbox()
    name = "twice"
    recipe = plain_recipe(tmp_path, name=name, key=ssh_key, command="sleep 600", guard={"every": 1})
    plan = run_cli("plan", str(recipe), inst.host, home=home)
    assert plan.returncode == 0 and f"start the guard in tmux session {name}-guard" in plan.stdout

    def guards() -> list[str]:
        sessions = ssh(inst, "tmux ls -F '#{session_name}'", check=False).stdout.split()
        return [ln for ln in sessions if ln.endswith("-guard")]
    assert run_cli("up", str(recipe), inst.host, home=home).returncode == 0
    assert guards() == [f"{name}-guard"]
    ssh(inst, f"tmux kill-session -t ={name}")                  # training died: the next up starts both again
    wait_for("the guard to see training end", lambda: guards() == [], timeout=30)
    assert run_cli("up", str(recipe), inst.host, home=home).returncode == 0
    again = run_cli("up", str(recipe), inst.host, home=home)
    assert again.returncode == 0 and "already running" in again.stderr
    assert guards() == [f"{name}-guard"]
    # one guard process in this instance (sandbox instances share the PID namespace: count by netns)
    own = ssh(inst, f"for p in $(pgrep -f '[g]uard.py /root/.relaunch/{name}/guard.json'); do "
                    "[ \"$(readlink /proc/$p/ns/net)\" = \"$(readlink /proc/self/ns/net)\" ] && echo $p; done; true")
    assert len(own.stdout.split()) == 1
    off = run_cli("evacuate", str(recipe), "--stop", "--allow-empty", home=home)   # sleep saves nothing
    assert off.returncode == 0, off.stderr
    assert guards() == []


@pytest.mark.parametrize("provider", ["aws", "gcp", "azure"])
def test_the_metadata_stand_in_answers_like_the_cloud(provider, tmp_path):
    """What the tests above rely on: a request without the provider's header is refused the way
    the real service refuses it, and the notice appears in the provider's own format."""
    import http.client

    service = MetadataService(tmp_path, provider)
    out = tmp_path / "server.out"
    with out.open("w") as handle:
        proc = subprocess.Popen([sys.executable, str(HERE / "metadata_server.py"), "--provider", provider, "--control",
                                 str(service.control), "--log", str(service.log), "--bind", "127.0.0.1", "--port", "0"],
                                stdout=handle, stderr=subprocess.STDOUT)
    try:
        port = int(wait_for("the server", lambda: re.search(r"^listening on \S+:(\d+)$", whole(out.read_text()), re.M),
                            timeout=30, every=0.1)[1])

        def ask(method: str, path: str, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            try:
                conn.request(method, path, headers=headers)
                response = conn.getresponse()
                return response.status, dict(response.getheaders()), response.read()
            finally:
                conn.close()

        if provider == "aws":
            action = "/latest/meta-data/spot/instance-action"
            assert ask("GET", action, {})[0] == 401                                  # IMDSv2 required
            assert ask("PUT", "/latest/api/token", {})[0] == 400                     # the TTL header is required
            status, _, token = ask("PUT", "/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "21600"})
            assert status == 200 and token
            with_token = {"X-aws-ec2-metadata-token": token.decode()}
            assert ask("GET", action, {"X-aws-ec2-metadata-token": "forged"})[0] == 401
            assert ask("GET", action, with_token)[0] == 404                          # no notice yet
            service.raise_notice(120)
            status, _, body = ask("GET", action, with_token)
            notice = json.loads(body)
            assert status == 200 and notice["action"] == "terminate" and notice["time"].endswith("Z")
        elif provider == "gcp":
            path = "/computeMetadata/v1/instance/preempted"
            assert ask("GET", path, {})[0] == 403
            status, headers, body = ask("GET", path, {"Metadata-Flavor": "Google"})
            assert (status, headers["Metadata-Flavor"], body) == (200, "Google", b"FALSE")
            service.raise_notice(30)
            assert ask("GET", path, {"Metadata-Flavor": "Google"})[2] == b"TRUE"
        else:
            path = "/metadata/scheduledevents?api-version=2020-07-01"
            assert ask("GET", path, {})[0] == 400
            assert ask("GET", "/metadata/scheduledevents", {"Metadata": "true"})[0] == 400
            status, _, body = ask("GET", path, {"Metadata": "true"})
            assert status == 200 and json.loads(body)["Events"] == []
            service.raise_notice(60)
            event = json.loads(ask("GET", path, {"Metadata": "true"})[2])["Events"][0]
            assert event["EventType"] == "Preempt" and event["NotBefore"].endswith(" GMT")
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_notice_file_being_written_is_read_once_it_is_written(tmp_path):
    """templates/guard.py as `up` runs it, with a `file:` source whose file appears empty, its writer
    still holding it open: `echo '{"seconds": 300}' > P` between emptying the file and writing it.
    The guard waits for the writer, and its record's deadline is the file's, not the window's."""
    folder, source = tmp_path / "guard", tmp_path / "reclaim"
    config = {"name": "t", "host": "root@test", "folder": str(folder), "session": f"no-such-session-{os.getpid()}",
              "pgid_file": str(tmp_path / "pgid"), "status_file": str(tmp_path / "status"),
              "sources": [f"file:{source}"], "every": 0.2, "signal": "TERM", "stop_timeout": 5, "windows": {},
              "writing_wait": 300}
    (tmp_path / "guard.json").write_text(json.dumps(config))
    with open(source, "w") as writer:                      # emptied, nothing written yet
        guard = subprocess.Popen([sys.executable, str(HERE.parent / "templates" / "guard.py"),
                                  str(tmp_path / "guard.json")], env={**os.environ, "TMUX_TMPDIR": str(tmp_path)},
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            wait_for("the guard to find the file being written (or to end)", lambda: guard.poll() is not None or
                     "being written" in ((folder / "guard.log").read_text() if (folder / "guard.log").exists() else ""),
                     timeout=60, every=0.05)
            writer.write('{"seconds": 300}')
        except BaseException:
            guard.kill()
            raise
    out, err = guard.communicate(timeout=60)
    assert guard.returncode == 0, err
    record = json.loads((folder / "notice.json").read_text())
    assert record["source"] == f"file:{source}" and record["deadline_from"] == "the notice", record
    assert 290 < record["deadline"] - record["seen_at"] <= 300, record
