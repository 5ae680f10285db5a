"""The README's install: `pipx install` and `uv tool install` of relaunch built as a wheel, each in a
fresh environment of its own (not this test run's), offline from a folder of wheels; the installed
command works and finds what the wheel must carry (the provider base recipes, the demo's example,
the instance scripts).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from e2e import REPO

pytestmark = pytest.mark.sandbox  # builds and installs the wheel: minutes


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(relaunch's wheel, a folder with it and every wheel it needs)."""
    house = tmp_path_factory.mktemp("wheelhouse")
    build = tmp_path_factory.mktemp("build")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(build), str(REPO)],
                   check=True, capture_output=True, timeout=600)
    wheel = next(build.glob("relaunch-*.whl"))
    shutil.copy(wheel, house)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "-d", str(house), str(wheel)],
                   check=True, capture_output=True, timeout=900)
    return house / wheel.name, house


def tool(name: str) -> str:
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.is_file() else shutil.which(name)
    assert found, f"{name} is not installed (pip install '.[test]')"
    return found


def installed_works(bin_dir: Path, tmp: Path) -> None:
    relaunch = bin_dir / "relaunch"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp), "RELAUNCH_HOME": str(tmp / "state")}
    version = subprocess.run([str(relaunch), "--version"], capture_output=True, text=True, env=env, timeout=120)
    assert version.returncode == 0 and "relaunch" in version.stdout, version.stderr
    recipe = tmp / "recipe.yaml"
    made = subprocess.run([str(relaunch), "init", str(recipe), "--provider", "runpod"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert made.returncode == 0, made.stderr
    checked = subprocess.run([str(relaunch), "check", str(recipe), "--explain", "--json"], capture_output=True,
                             text=True, env=env, timeout=120)
    assert checked.returncode == 0, checked.stderr
    files = json.loads(checked.stdout)["files"]
    assert any(f.endswith("providers/runpod.yaml") and "site-packages" in f for f in files), files
    plan = subprocess.run([str(relaunch), "plan", str(recipe), "203.0.113.9", "--set", "ssh.wait=0"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert plan.returncode == 3 and "Traceback" not in plan.stderr    # nothing answers there: a clean exit 3
    # `relaunch demo` (needs root and sandboxes) starts by copying its example out of the package
    # and loading it: that part, with the installed package's own Python
    python = Path(os.path.realpath(relaunch)).parent / "python"
    demo = tmp / "demo"
    copied = subprocess.run([str(python), "-c", "import sys; from pathlib import Path; from relaunch.demo import "
                             "prepare_workdir; print(prepare_workdir(Path(sys.argv[1])))", str(demo)],
                            capture_output=True, text=True, env=env, timeout=120, cwd=tmp)  # not this checkout's
    assert copied.returncode == 0, copied.stderr
    assert sorted(p.name for p in demo.iterdir()) == [".relaunch-demo", "recipe.yaml", "requirements.lock", "train.py"]
    checked = subprocess.run([str(relaunch), "check", copied.stdout.strip(), "--explain", "--json"],
                             capture_output=True, text=True, env=env, timeout=120)
    assert checked.returncode == 0, checked.stderr
    files = json.loads(checked.stdout)["files"]
    assert any(f.endswith("relaunch/recipes/providers/sandbox.yaml") and "site-packages" in f for f in files), files


def test_uv_tool_install_of_the_wheel(wheelhouse: tuple[Path, Path], tmp_path: Path) -> None:
    wheel, house = wheelhouse
    env = {**os.environ, "UV_TOOL_DIR": str(tmp_path / "tools"), "UV_TOOL_BIN_DIR": str(tmp_path / "bin"),
           "UV_CACHE_DIR": str(tmp_path / "cache"), "UV_PYTHON_DOWNLOADS": "never"}
    out = subprocess.run([tool("uv"), "tool", "install", "--offline", "--no-index", "--find-links", str(house),
                          "--python", sys.executable, str(wheel)], capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    installed_works(tmp_path / "bin", tmp_path)


def test_pipx_install_of_the_wheel(wheelhouse: tuple[Path, Path], tmp_path: Path) -> None:
    wheel, house = wheelhouse
    env = {**os.environ, "PIPX_HOME": str(tmp_path / "pipx"), "PIPX_BIN_DIR": str(tmp_path / "bin"),
           "PIPX_MAN_DIR": str(tmp_path / "man"), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(house)}
    out = subprocess.run([tool("pipx"), "install", "--python", sys.executable, str(wheel)], capture_output=True,
                         text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    installed_works(tmp_path / "bin", tmp_path)
