"""The two layers of the suite (tests/layers.py) and the checks the quick layer carries for CI.

The quick layer, `python -m pytest -m "not sandbox"`, must hold no test that needs root, network
namespaces or torch: a test that needs them and lacks the marker fails there, naming the marker.
Proved here on a small suite of its own, run with the real plugin.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SUITE = {
    "pytest.ini": "[pytest]\n",
    "conftest.py": """
        import pytest

        pytest_plugins = ["layers"]


        @pytest.fixture
        def sandbox():
            return "an instance"
        """,
    "test_rooms.py": """
        import subprocess
        import sys
        import types


        def test_plain():
            assert 1 + 1 == 2


        def test_reads_the_network_namespaces_unmarked():
            proc = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
            assert proc.returncode == 0, proc.stderr


        def test_with_the_sandbox_fixture(sandbox):
            assert sandbox


        def test_loads_torch_unmarked():
            sys.modules.setdefault("torch", types.ModuleType("torch"))
        """,
    "test_heavy.py": """
        def test_trains():
            import torch  # noqa: F401
        """,
}


def run_suite(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    for name, text in SUITE.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    env = {k: v for k, v in os.environ.items() if k != "RELAUNCH_QUICK_LAYER_SHIMS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), env.get("PYTHONPATH", "")])
    # the PATH of this machine, not the one of a quick layer this test may itself run in
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if "relaunch-quick-layer-" not in p)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-rA", *args],
                          cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)


def test_the_quick_layer_refuses_what_needs_root_and_leaves_out_what_is_marked(tmp_path: Path) -> None:
    quick = run_suite(tmp_path, "-m", "not sandbox")
    out = quick.stdout
    assert quick.returncode == 1, out
    assert "PASSED test_rooms.py::test_plain" in out
    # needs root and lacks the marker: refused, and told how to mark it
    assert "FAILED test_rooms.py::test_reads_the_network_namespaces_unmarked" in out
    assert "ip: refused in the quick layer (-m 'not sandbox')" in out and "@pytest.mark.sandbox" in out
    assert "FAILED test_rooms.py::test_loads_torch_unmarked" in out
    assert "loaded torch in the quick layer" in out
    # marked by its fixture, and a module importing torch is not even imported
    assert "test_with_the_sandbox_fixture" not in out and "test_heavy" not in out
    assert "2 failed, 1 passed, 1 deselected" in out


def test_the_full_suite_runs_every_test_and_marks_the_heavy_ones(tmp_path: Path) -> None:
    marked = run_suite(tmp_path, "-m", "sandbox", "--collect-only", "-q")
    assert marked.returncode == 0, marked.stdout
    assert sorted(line for line in marked.stdout.splitlines() if "::" in line) == [
        "test_heavy.py::test_trains", "test_rooms.py::test_with_the_sandbox_fixture"]
    full = run_suite(tmp_path, "-k", "not trains")            # (torch itself takes seconds to import)
    assert full.returncode == 0, full.stdout
    assert "4 passed" in full.stdout


def test_ruff_is_clean() -> None:
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "relaunch", "tests"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"ruff check relaunch tests:\n{proc.stdout}{proc.stderr}"


def test_mypy_is_clean() -> None:
    # a cache outside the checkout, so that a test run leaves the tree clean; one per checkout, since
    # mypy's cache names modules, and another checkout's (a branch that moved one) crashes it
    checkout = hashlib.sha256(str(REPO).encode()).hexdigest()[:12]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "relaunch-tests" / "mypy" / checkout
    proc = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(cache), "relaunch"], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"mypy relaunch:\n{proc.stdout}{proc.stderr}"
