"""The import structure the package promises, read from the source: each layer imports only the layers
below it in the pipeline, directly or through other modules; the layers that plan and describe
(ir, frontend, selection, passes) import no TVM; the runtime reaches TVM through
runtime/tvm_bridge.py alone; nothing of the product imports the testing helpers."""
from __future__ import annotations

import ast
import tomllib
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# modules of the `kiln` folder every layer may import: the contracts and helpers at the bottom
LEAVES = ("kiln.errors", "kiln.dtypes", "kiln.interface", "kiln.options", "kiln.artifact", "kiln.safetensors_io",
          "kiln.cpu_features", "kiln.cpu_tiles", "kiln.host_cpu")
# layer -> the layers it may import (besides itself and LEAVES); the `kiln` folder's other modules
# (the CLI, the compile driver, inspect, weights) sit on top and may import any layer
BELOW = {
    "kiln.ir": (),
    "kiln.frontend": ("kiln.ir",),
    "kiln.selection": ("kiln.ir",),
    "kiln.targets": ("kiln.ir", "kiln.selection"),
    "kiln.passes": ("kiln.ir", "kiln.selection", "kiln.targets"),
    "kiln.codegen": ("kiln.ir", "kiln.selection", "kiln.targets"),
    "kiln.runtime": (),
    "kiln.serve": ("kiln.runtime",),
}
TVM_FREE = ("kiln.ir", "kiln.frontend", "kiln.selection", "kiln.passes", "kiln.runtime", "kiln.serve",
            *(leaf for leaf in LEAVES if leaf != "kiln.host_cpu"))
BRIDGE = "kiln.runtime.tvm_bridge"
TESTING = "kiln.testing"


def layer_of(module: str) -> str:
    """The layer a module belongs to: its package in BELOW, a leaf, the testing helpers, or the top."""
    for name in (*BELOW, *LEAVES, TESTING):
        if module == name or module.startswith(name + "."):
            return name
    return "kiln"


@cache
def modules() -> dict[str, set[str]]:
    """Every kiln module (by pyproject's package-dir) -> the modules it imports, at its top or inside a
    function, relative imports resolved."""
    folders = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    found = {}
    for package, folder in folders.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if package == "kiln" and parts[0] in {p.split(".")[1] for p in folders if p != "kiln"}:
                continue                                  # a subpackage folder of its own
            name = ".".join([package, *parts]).removesuffix(".__init__")
            found[name] = _imports(path, name)
    return found


def _imports(path: Path, name: str) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    return imported_modules(path, package)


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


def reached(module: str, stop_at: str | None = None) -> set[str]:
    """Every kiln module importing `module` runs (a.b.c runs a, a.b and a.b.c), and every other
    module it imports; `stop_at` is not entered."""
    found, todo = modules(), [module]
    seen: set[str] = set()
    while todo:
        for dep in found.get(todo.pop(), ()):
            for m in found:
                if (dep == m or dep.startswith(m + ".")) and m not in seen and m != stop_at:
                    seen.add(m)
                    todo.append(m)
    return seen


def imports_tvm(module: str) -> bool:
    return any(d == "tvm" or d.startswith(("tvm.", "tvm_ffi")) for d in modules()[module])


def test_the_map_covers_every_layer():
    layers = {layer_of(m) for m in modules()}
    assert set(BELOW) <= layers and "kiln" in layers and len(modules()) > 150


def test_each_layer_imports_only_the_layers_below_it():
    against = []
    for module in modules():
        layer = layer_of(module)
        if layer == "kiln" or layer == TESTING:
            continue
        allowed = {layer, *LEAVES, *BELOW.get(layer, ())}
        for other in reached(module):
            if layer_of(other) not in allowed and other != "kiln":
                against.append(f"{module} reaches {other}")
    assert against == []


def test_the_leaves_import_only_leaves():
    against = [f"{m} reaches {o}" for m in modules() if layer_of(m) in LEAVES
               for o in reached(m) if layer_of(o) not in LEAVES and o != "kiln"]
    assert against == []


def test_planning_layers_and_the_runtime_import_no_tvm():
    against = []
    for module in modules():
        if layer_of(module) not in TVM_FREE or module == BRIDGE:
            continue
        for other in {module} | reached(module, stop_at=BRIDGE):
            if imports_tvm(other):
                against.append(f"{module} reaches TVM through {other}")
    assert against == []


def test_the_runtime_reaches_tvm_through_one_module():
    touching = {m for m in modules() if layer_of(m) == "kiln.runtime" and imports_tvm(m)}
    assert touching == {BRIDGE}


def test_the_product_never_imports_the_testing_helpers():
    """kiln.testing (the tiny models, the cluster loads) is for tests, benchmarks and `make demo`."""
    against = [f"{m} reaches {o}" for m in modules() if layer_of(m) != TESTING
               for o in reached(m) if layer_of(o) == TESTING]
    assert {layer_of(m) for m in modules()} >= {TESTING, "kiln.serve"} and against == []


def test_the_import_reader_sees_each_way_of_importing(tmp_path):
    """So that the tests above can fail: absolute, relative, `from kiln import testing`, inside a
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


def test_the_root_package_imports_nothing_when_imported():
    # `import kiln.ir` runs kiln/__init__.py first: it must load nothing of the other layers
    assert {m for m in modules()["kiln"] if m.startswith("kiln")} == set()
