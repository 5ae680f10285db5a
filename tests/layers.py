"""The two layers of the suite, as a pytest plugin (tests/conftest.py loads it).

`python -m pytest` runs everything; `python -m pytest -m "not sandbox"` is the quick layer: no
root, no network namespaces, no torch. Nobody has to remember the marker: a test is marked
`sandbox` when it uses a fixture that makes or reaches sandbox instances (ROOT_FIXTURES) or sits in
a module that imports a heavy library (HEAVY). A test that needs root and escaped the marker
anyway fails in the quick layer instead of passing there by luck: the commands that need root
(REFUSED) are replaced on PATH by ones that refuse with a message naming the marker, and a test
that loads a heavy library fails, naming it.
"""

from __future__ import annotations

import ast
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

MARKER = "sandbox"
MARKER_HELP = (f"{MARKER}: needs root, network namespaces, torch or minutes; "
               f"left out of the quick layer (-m 'not {MARKER}')")
# fixtures that make sandbox instances, or exist only to reach them
ROOT_FIXTURES = frozenset({"sandbox", "package_index", "ssh", "slurm_cluster"})
HEAVY = ("torch", "transformers", "lightning", "accelerate")
# the commands behind sandbox instances (relaunch.sandbox.network.TOOLS, users.py) that need root
REFUSED = ("ip", "tc", "unshare", "nsenter", "mount", "umount", "useradd", "usermod", "userdel", "chpasswd")
SHIMS_ENV = "RELAUNCH_QUICK_LAYER_SHIMS"
REFUSAL = (f"refused in the quick layer (-m 'not {MARKER}'): this test needs root or network namespaces; "
           f"mark it @pytest.mark.{MARKER} or give it the sandbox fixture")


def quick_layer(config: pytest.Config) -> bool:
    """Whether this run leaves the sandbox tests out (`-m "not sandbox"`, or any expression that does)."""
    expr = config.option.markexpr
    if not expr:
        return False
    from _pytest.mark.expression import Expression

    return not Expression.compile(expr).evaluate(lambda name, **kw: name == MARKER)


@cache
def heavy_imports(path: Path) -> tuple[str, ...]:
    """The heavy libraries a test module imports anywhere in its code (strings holding code don't count)."""
    try:
        tree = ast.parse(path.read_text(), str(path))
    except (OSError, SyntaxError):
        return ()
    found = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "importorskip" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names = [node.args[0].value]
        found.update(name.split(".")[0] for name in names if name.split(".")[0] in HEAVY)
    return tuple(sorted(found))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER_HELP)
    if not quick_layer(config) or os.environ.get(SHIMS_ENV):
        return  # (an xdist worker inherits its controller's shims with its environment)
    shims = Path(tempfile.mkdtemp(prefix="relaunch-quick-layer-"))
    for command in REFUSED:
        shim = shims / command
        shim.write_text(f"#!/bin/sh\necho \"{command}: {REFUSAL}\" >&2\nexit 126\n")
        shim.chmod(0o755)
    config.stash[_shims_key] = shims
    os.environ[SHIMS_ENV] = str(shims)
    os.environ["PATH"] = f"{shims}{os.pathsep}{os.environ.get('PATH', '')}"


_shims_key = pytest.StashKey[Path]()


def pytest_unconfigure(config: pytest.Config) -> None:
    shims = config.stash.get(_shims_key, None)
    if shims is not None:
        shutil.rmtree(shims, ignore_errors=True)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """The quick layer does not even import a module that imports torch (its import alone takes seconds)."""
    if collection_path.suffix == ".py" and collection_path.name.startswith("test_") and quick_layer(config):
        return True if heavy_imports(collection_path) else None
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker(MARKER):
            continue
        module = getattr(item, "module", None)
        if ROOT_FIXTURES.intersection(getattr(item, "fixturenames", ())) or (
            module is not None and heavy_imports(Path(module.__file__))
        ):
            item.add_marker(MARKER)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    loaded = [name for name in HEAVY if name in sys.modules]
    result = yield
    if quick_layer(item.config):
        new = [name for name in HEAVY if name in sys.modules and name not in loaded]
        if new:
            pytest.fail(f"{item.nodeid} loaded {', '.join(new)} in the quick layer (-m 'not {MARKER}'): "
                        f"mark it @pytest.mark.{MARKER}", pytrace=False)
    return result
