"""The package's dependencies run one way: host <- transports <- steps <- cycle <- cli.

Read from the source (every `import` and `from ... import`, also inside functions), so a lazy
import cannot hide a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "relaunch"
# lower layers first: a module may import from its own layer or any layer before it
LAYERS = [
    {"__init__", "errors", "paths", "resources", "processes", "retry", "ui", "scripts", "plan", "layouts", "manifest",
     "verdicts", "recipe", "versions", "train", "savecosts"},
    {"host"},
    {"job"},
    {"transports"},
    {"steps"},
    {"executor", "gather"},
    {"cycle"},
    {"sync", "status", "freeze", "interval", "history", "watch", "adopt", "injob"},
    {"sandbox"},
    {"demo", "drill"},
    {"cli", "cli_reference", "__main__"},
]


def unit(module: str) -> str:
    """relaunch.host.connection -> host; relaunch.cycle -> cycle; relaunch.__version__ -> __init__."""
    parts = module.split(".")
    if len(parts) < 2:
        return "__init__"
    exists = (PACKAGE / parts[1]).is_dir() or (PACKAGE / f"{parts[1]}.py").is_file()
    return parts[1] if exists else "__init__"


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1] if len(parts) > 2 else [*parts[:-1], "__init__"]
    return ".".join(parts)


def imports(path: Path) -> set[str]:
    """The relaunch modules a file imports (relative imports resolved)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" and not name.endswith("__init__") else name.rsplit(".", 1)[0]
    if name.endswith(".__init__"):
        package = name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("relaunch")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                if node.module is None:
                    found |= {f"{target}.{a.name}" for a in node.names}
                    continue
            else:
                target = node.module or ""
                if target == "relaunch":            # `from relaunch import scripts`: the submodules
                    found |= {f"relaunch.{a.name}" for a in node.names}
                    continue
            if target.startswith("relaunch"):
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        src = unit(module_name(path))
        for target in imports(path):
            dst = unit(target)
            if dst != src:
                edges.setdefault(src, set()).add(dst)
    return edges


def test_every_unit_has_a_layer() -> None:
    known = set().union(*LAYERS)
    units = {unit(module_name(p)) for p in PACKAGE.rglob("*.py")}
    assert units <= known, f"place these in LAYERS: {sorted(units - known)}"


def test_imports_only_go_down_the_layers() -> None:
    layer = {name: n for n, names in enumerate(LAYERS) for name in names}
    upward = sorted(f"{src} imports {dst}" for src, dsts in graph().items() for dst in dsts
                    if layer[dst] > layer[src])
    assert upward == []


def test_no_cycle_between_packages() -> None:
    edges = graph()
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)


def test_the_checker_sees_relative_and_lazy_imports() -> None:
    """The graph must contain edges that only exist as relative or in-function imports."""
    edges = graph()
    assert "host" in edges["transports"] and "job" in edges["steps"]
    assert "transports" in edges["cycle"] and "cycle" in edges["cli"]


def test_the_training_side_module_imports_nothing_of_relaunch() -> None:
    """relaunch/train.py goes to the instance alone (on the training's PYTHONPATH): it may import
    no other relaunch module, lazily or not."""
    assert imports(PACKAGE / "train.py") == set()


def test_every_package_of_the_source_is_in_the_wheel() -> None:
    """pyproject lists the packages by name: one left out is there in an editable install and
    missing from `pip install relaunch` (relaunch.watch was, once)."""
    import tomllib

    listed = set(tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(path.parent.relative_to(PACKAGE.parent).parts) for path in PACKAGE.rglob("__init__.py")}
    assert found <= listed, f"add to pyproject's packages: {sorted(found - listed)}"


def test_a_command_start_loads_no_more_of_the_sandbox_than_its_image_names() -> None:
    """Every `relaunch` command builds `sandbox create --image`'s choices; the sandbox's other rooms
    (namespaces, locks, boot scripts) load when a name of the package is first used, and every name
    it exports resolves then."""
    import subprocess
    import sys

    probe = ("import sys, relaunch.cli\n"
             "print(sorted(m for m in sys.modules if m.startswith('relaunch.sandbox.')))\n"
             "from relaunch import sandbox as sb\n"
             "resolved = all(getattr(sb, name) is not None for name in sb.__all__)\n"
             "print(resolved, 'relaunch.sandbox.instance' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    loaded, resolved = out.stdout.splitlines()
    assert loaded == "['relaunch.sandbox.images']", out.stdout
    assert resolved == "True True", out.stdout


def test_the_sandbox_loads_each_name_from_the_room_mypy_reads_it_from() -> None:
    """relaunch/sandbox/__init__.py names each export twice: imported under TYPE_CHECKING (what mypy
    checks callers against) and in _FROM (where the first use loads it from). They must agree."""
    import importlib

    sandbox = importlib.import_module("relaunch.sandbox")
    tree = ast.parse((PACKAGE / "sandbox" / "__init__.py").read_text())
    typed = {alias.name: node.module for block in tree.body if isinstance(block, ast.If)
             for node in block.body if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert typed == sandbox._FROM
    assert sorted(typed) == sorted(sandbox.__all__)
