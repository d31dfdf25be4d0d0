"""The import structure the package promises, read from the source: runtime/ reaches TVM through
runtime/tvm_bridge.py alone, and no product module imports kiln.testing (the tiny models and the
cluster loads are for tests, benchmarks and `make demo`)."""
from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTING = "kiln.testing"


def imported_modules(path: Path, package: str = "") -> set[str]:
    """Every module a file imports, at its top or inside a function: `from M import N` counts as M and
    as M.N (N may be a submodule), a relative import is resolved against `package` (the file's own),
    and `importlib.import_module("M")` with a literal name counts as M."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            module = node.module
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            if module:
                names.add(module)
                names |= {f"{module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Call) and "import_module" in (getattr(node.func, "attr", None),
                                                                 getattr(node.func, "id", None)):
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                names.add(node.args[0].value)
    return names


def product_sources() -> dict[Path, str]:
    """Every source file of the product -> its package, from pyproject's package-dir: every folder
    there but testing/ (a folder added to the product is checked without a change here)."""
    folders = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    sources = {}
    for package, folder in folders.items():
        if package == TESTING:
            continue
        for path in (ROOT / folder).rglob("*.py"):
            subpackages = path.relative_to(ROOT / folder).parts[:-1]
            sources[path] = ".".join((package, *subpackages))
    return sources


def test_the_runtime_reaches_tvm_through_one_module():
    files = sorted((ROOT / "runtime").glob("*.py"))
    touching = {f.name for f in files if any(m == "tvm" or m.startswith("tvm.") for m in imported_modules(f))}
    assert len(files) > 10 and touching == {"tvm_bridge.py"}


def test_no_product_module_imports_the_testing_package():
    sources = product_sources()
    importing = sorted(str(path.relative_to(ROOT)) for path, package in sources.items()
                       if any(m == TESTING or m.startswith(TESTING + ".") for m in imported_modules(path, package)))
    assert len(sources) > 100 and {"kiln", "kiln.serve.cluster", "kiln.runtime"} <= set(sources.values())
    assert importing == []


def test_the_import_reader_sees_each_way_of_importing_the_testing_package(tmp_path):
    """So that the test above can fail: absolute, relative, `from kiln import testing`, inside a
    function, and by name through importlib."""
    ways = {"import kiln.testing.tiny": "kiln.testing.tiny",
            "from kiln import testing": "kiln.testing",
            "def f():\n    from ..testing.cluster_ops import deploy": "kiln.testing.cluster_ops",
            "from .. import testing": "kiln.testing",
            "import importlib\nimportlib.import_module('kiln.testing.cluster_load')": "kiln.testing.cluster_load"}
    for source, module in ways.items():
        path = tmp_path / "m.py"
        path.write_text(source + "\n")
        assert module in imported_modules(path, package="kiln.serve"), source
    path.write_text("from .testing_helpers import x\nimport kiln.serve.testing_free\n")
    assert not any(m == TESTING or m.startswith(TESTING + ".") for m in imported_modules(path, "kiln.serve"))
