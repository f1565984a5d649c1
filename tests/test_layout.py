"""The package's shape: imports run one way, from the CLI down to capture and cost, with no cycle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fxworkload"

# Each part may import only parts of a lower level; capture and cost are independent of each other,
# and so are measure and formats.
LEVEL = {"errors": 0, "records": 0.1, "store": 0.2, "names": 0.25, "limits": 0.25, "inputs": 0.25, "progress": 0.25, "fingerprint": 0.25, "memo": 0.25, "figures": 0.25, "dtypes": 0.5, "capture": 1, "cost": 1, "workload": 2, "parallel": 3, "cluster": 3.5,
         "measure": 4, "formats": 4, "pipeline": 5, "plan": 5.5, "cli": 6, "start": 6.5, "__main__": 7, "__init__": 7}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every fxworkload module this file imports, at any depth of its code, as a dotted name."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("fxworkload"):
                found.add(target)
                found.update(f"{target}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("fxworkload"))
    return {name for name in found if _exists(name)}


def _exists(name: str) -> bool:
    relative = Path(*name.split(".")[1:])
    return (PACKAGE / relative).with_suffix(".py").is_file() or (PACKAGE / relative / "__init__.py").is_file()


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _graph() -> dict[str, set[str]]:
    return {_module_name(path): _imports(path) for path in PACKAGE.rglob("*.py")}


def test_every_part_of_the_package_has_a_level():
    assert {_part(m) for m in _graph()} <= set(LEVEL)


def test_imports_only_go_down():
    upward = []
    for module, targets in _graph().items():
        for target in targets:
            mine, theirs = _part(module), _part(target)
            if mine != theirs and LEVEL[theirs] >= LEVEL[mine] and theirs != "__init__":
                upward.append(f"{module} -> {target}")
    assert upward == []


def test_no_import_cycle_between_modules():
    graph = _graph()
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt == node or nxt not in graph or nxt == "fxworkload":
                continue
            if state.get(nxt) == 1:
                return path + [nxt]
            if nxt not in state and (cycle := visit(nxt, path + [nxt])):
                return cycle
        state[node] = 2
        return None

    cycles = [cycle for start in sorted(graph) if start not in state and (cycle := visit(start, [start]))]
    assert cycles == []


def test_every_subpackage_says_what_it_holds_and_may_import():
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "May import" in doc, init


def test_the_cli_module_does_not_import_torch():
    code = "import sys, fxworkload.cli; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_loading_a_device_profile_never_measures():
    """cost.devices reads profiles; only the measure package may run micro-benchmarks."""
    imports = _imports(PACKAGE / "cost" / "devices.py")
    assert not any(_part(name) == "measure" for name in imports)


def test_tests_read_nothing_beside_the_checkout():
    """A user's clone has no ../shared: every file a test reads lives in the repository (tests/fixtures)."""
    root = PACKAGE.parent
    marks = ("parents[3]", '"shared"', "../shared")
    outside = [str(path.relative_to(root)) for path in (root / "tests").rglob("*.py")
               if path != Path(__file__).resolve() and any(mark in path.read_text() for mark in marks)]
    assert outside == []
