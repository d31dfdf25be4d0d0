"""The import structure the package promises, read from the source: runtime/ reaches TVM through
runtime/tvm_bridge.py alone."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at its top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_the_runtime_reaches_tvm_through_one_module():
    files = sorted((ROOT / "runtime").glob("*.py"))
    touching = {f.name for f in files if any(m == "tvm" or m.startswith("tvm.") for m in imported_modules(f))}
    assert len(files) > 10 and touching == {"tvm_bridge.py"}
