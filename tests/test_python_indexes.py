"""The Python and the package indexes of stock images, on sandbox instances with real uv and pip.

- A recipe's Python that the image lacks (a default instance has only this machine's 3.11; the
  recipe asks for 3.12) is provided by uv from an offline mirror served inside the instance, beside
  the venv; the venv is reused while its interpreter works and made again once it is gone. With
  pip, the same recipe stops at preflight and the hint names uv.
- A lock whose `+cu999` pin lives only on env.index_url while an extra index has a plain build of
  the same name installs with uv and with pip (uv's default index strategy takes every version of
  a name from the first index that has it, and so found no `1.0+cu999`).
"""

from __future__ import annotations

import base64
import hashlib
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from e2e import plain_recipe, run_cli, wait_for
from relaunch.sandbox import network
from relaunch.sandbox.index import _write_simple_index
from relaunch.sandbox.pythons import build_mirror

EXTRA_PORT = 8766      # the second index, on the instance's own loopback beside the first (8765)
PROVIDED = "3.12"      # not on a default instance (only this machine's /usr/bin/python3.11)
MIRROR_URL = "http://127.0.0.1:8765/python/downloads.json"


def make_wheel(folder: Path, name: str, version: str) -> Path:
    """A pure-Python wheel `name==version` whose module says which build it is."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f"BUILD = {version!r}\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: relaunch-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{dist}/RECORD"] = "\n".join([*record, f"{dist}/RECORD,,"]) + "\n"
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    return wheel


def small_index(dest: Path, package_index: Path, wheels: list[Path], tools: bool) -> Path:
    """A PEP 503 index at dest holding `wheels`, plus pip and uv from the package index when `tools`."""
    (dest / "files").mkdir(parents=True)
    for wheel in wheels:
        shutil.copy(wheel, dest / "files")
    if tools:
        for pattern in ("uv-*.whl", "pip-*.whl"):
            for found in (package_index / "files").glob(pattern):
                shutil.copy(found, dest / "files")
    _write_simple_index(dest)
    return dest


@contextmanager
def served_in(inst_name: str, folder: Path, port: int) -> Iterator[str]:
    """`folder` served on the instance's own loopback at `port` (its namespace), stopped after."""
    argv = ["ip", "netns", "exec", network.netns(inst_name), sys.executable, "-m", "http.server", str(port),
            "--bind", "127.0.0.1", "--directory", str(folder)]
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}/simple/"
        probe = ["ip", "netns", "exec", network.netns(inst_name), sys.executable, "-c",
                 f"import urllib.request; urllib.request.urlopen({url!r}, timeout=2)"]
        wait_for(f"the second index answering at {url}",
                 lambda: server.poll() is None and subprocess.run(probe, capture_output=True).returncode == 0,
                 timeout=30)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)


@pytest.mark.parametrize("installer", ["uv", "pip"])
def test_a_local_version_pin_found_on_the_first_index_while_the_extra_one_has_a_plain_build(
        tmp_path, sandbox, ssh, ssh_key, package_index, installer):
    wheels = tmp_path / "wheels"
    cuda = small_index(tmp_path / "index-cu", package_index, [make_wheel(wheels / "cu", "rlcufake", "1.0+cu999")],
                       tools=True)
    plain = small_index(tmp_path / "index-plain", package_index, [make_wheel(wheels / "plain", "rlcufake", "1.0")],
                        tools=False)
    inst = sandbox(index_dir=cuda)
    lock = tmp_path / "requirements.lock"
    lock.write_text("rlcufake==1.0+cu999\n")
    with served_in(inst.name, plain, EXTRA_PORT) as extra:
        recipe = plain_recipe(tmp_path, name="twoindexes", key=ssh_key,
                              env={"lock": str(lock), "index_url": inst.index_url, "extra_index_urls": [extra],
                                   "installer": installer})
        up = run_cli("up", str(recipe), inst.host, "-v", home=tmp_path / "state")
    assert up.returncode == 0, up.stderr
    # the venv's own metadata: the local-version build, from the first index
    read = "~/venvs/plain/bin/python -c 'import importlib.metadata as m, rlcufake; print(m.version(\"rlcufake\"), " \
           "rlcufake.BUILD)'"
    assert ssh(inst, read).stdout.split() == ["1.0+cu999", "1.0+cu999"]
    assert "pip freeze matches the lock" in up.stderr
    # the step's line names both indexes and how each pin is looked for
    assert f"from {inst.index_url} + {extra}" in up.stderr
    if installer == "uv":
        assert "UV_INDEX_STRATEGY=unsafe-best-match" in up.stderr


@pytest.fixture(scope="module")
def index_with_python(package_index: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """pip, uv and mpmath, and under python/ uv's offline mirror of CPython 3.12 (made from this
    machine's build): served inside an instance at http://127.0.0.1:8765/."""
    dest = tmp_path_factory.mktemp("index-python")
    small_index(dest, package_index, sorted((package_index / "files").glob("mpmath-*.whl")), tools=True)
    build_mirror([PROVIDED], dest / "python", "http://127.0.0.1:8765/python")
    return dest


def python_recipe(folder: Path, key: Path, installer: str) -> Path:
    lock = folder / "requirements.lock"
    lock.write_text("mpmath==1.3.0\n")
    return plain_recipe(folder, name="pyuv", key=key, command="python -c 'import sys; print(\"running on python\", "
                        "sys.version.split()[0], flush=True)'",
                        env={"python": PROVIDED, "installer": installer, "lock": str(lock),
                             "index_url": "http://127.0.0.1:8765/simple/", "python_mirror": MIRROR_URL},
                        run={"ready": "running on python"})


def test_uv_provides_the_recipes_python_beside_the_venv_and_makes_the_venv_again_once_it_is_gone(
        tmp_path, sandbox, ssh, ssh_key, index_with_python):
    inst = sandbox(index_dir=index_with_python)
    assert ssh(inst, f"command -v python{PROVIDED} || echo none").stdout.strip() == "none"
    recipe = python_recipe(tmp_path, ssh_key, "uv")
    home = tmp_path / "state"

    def ran(n: int) -> str:
        """The n-th start's line in the training log (each start appends one)."""
        lines = wait_for(f"start {n}'s 'running on python' line in ~/pyuv.log", lambda: [
            ln for ln in ssh(inst, "cat ~/pyuv.log 2>/dev/null", check=False).stdout.splitlines()
            if ln.startswith("running on python")][n - 1:], timeout=60)
        return lines[0]

    first = run_cli("up", str(recipe), inst.host, "-v", home=home)
    assert first.returncode == 0, first.stderr
    assert f"python {PROVIDED} from uv (the image has none" in first.stderr
    assert ran(1).startswith(f"running on python {PROVIDED}.")
    venv_python = "~/venvs/plain/bin/python -c 'import sys; print(\"%d.%d\" % sys.version_info[:2])'"
    assert ssh(inst, venv_python).stdout.strip() == PROVIDED
    # installed beside the venv (the same disk), not in the home's ~/.local/share/uv
    installed = ssh(inst, "ls ~/venvs/.relaunch-pythons").stdout.split()
    assert any(name.startswith(f"cpython-{PROVIDED}.") for name in installed), installed
    assert "/root/venvs/.relaunch-pythons/" in ssh(inst, "grep '^home' ~/venvs/plain/pyvenv.cfg").stdout
    assert ssh(inst, "ls -A ~/.local/share/uv/python ~/.local/bin 2>/dev/null; true").stdout.strip() == ""

    second = run_cli("up", str(recipe), inst.host, home=home)
    assert second.returncode == 0, second.stderr
    assert "venv /root/venvs/plain already matches the lock" in second.stderr
    assert ran(2).startswith(f"running on python {PROVIDED}.")

    # a stop wiped the provided Python: the venv's interpreter is gone
    ssh(inst, "rm -rf ~/venvs/.relaunch-pythons")
    third = run_cli("up", str(recipe), inst.host, "-v", home=home)
    assert third.returncode == 0, third.stderr
    assert "already matches the lock" not in third.stderr
    assert "is not a working Python 3.12 venv; making it again" in third.stderr
    assert ran(3).startswith(f"running on python {PROVIDED}.")
    assert ssh(inst, venv_python).stdout.strip() == PROVIDED


def test_with_pip_a_python_the_image_lacks_stops_at_preflight_and_the_hint_names_uv(
        tmp_path, sandbox, ssh, ssh_key, index_with_python):
    inst = sandbox(index_dir=index_with_python)
    recipe = python_recipe(tmp_path, ssh_key, "pip")
    up = run_cli("up", str(recipe), inst.host, home=tmp_path / "state")
    assert up.returncode == 4, up.stderr
    error = next(ln for ln in up.stderr.splitlines() if ln.startswith("Error:"))
    assert f"env.python is {PROVIDED} but the instance has no python{PROVIDED} (python3 is 3.11." in error
    hint = next(ln for ln in up.stderr.splitlines() if ln.startswith("hint:"))
    assert "env.installer: uv" in hint and "env.python_mirror" in hint
    assert "Traceback" not in up.stderr
    assert ssh(inst, "test -e ~/venvs || echo absent").stdout.strip() == "absent"      # nothing changed


def test_a_python_uv_cannot_get_is_named_with_where_it_looked(tmp_path, sandbox, ssh_key, index_with_python):
    inst = sandbox(index_dir=index_with_python)
    recipe = python_recipe(tmp_path, ssh_key, "uv")
    gone = "http://127.0.0.1:8765/python/nothing-here.json"
    up = run_cli("up", str(recipe), inst.host, "--set", f"env.python_mirror={gone}", home=tmp_path / "state")
    assert up.returncode == 4, up.stderr
    error = next(ln for ln in up.stderr.splitlines() if ln.startswith("Error:"))
    assert f"env: uv could not provide Python {PROVIDED}:" in error
    hint = next(ln for ln in up.stderr.splitlines() if ln.startswith("hint:"))
    assert f"env.python_mirror {gone}" in hint
