"""The Python and the package indexes of stock images, on sandbox instances with real uv and pip.

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

EXTRA_PORT = 8766      # the second index, on the instance's own loopback beside the first (8765)


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
