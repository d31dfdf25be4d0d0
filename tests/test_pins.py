"""Every package `make setup` installs is pinned in constraints.txt, and the environment the tests run
in has each at its pin: a release elsewhere cannot change a run until a pin moves (README: "Pinned
versions")."""
from __future__ import annotations

import re
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins() -> dict[str, str]:
    lines = (REPO / "constraints.txt").read_text().splitlines()
    pairs = [line.split("==") for line in lines if line.strip() and not line.startswith("#")]
    return {canonical(name): pin.strip() for name, pin in pairs}


def requirements() -> set[str]:
    """The packages the Makefile's setup installs by name, and pyproject's runtime, import and test lists."""
    setup = (REPO / "Makefile").read_text().split("$(VENV)/.installed:")[1].split("\n\n")[0]
    named = set(re.findall(r'"([A-Za-z0-9_.\-]+)\s*(?:==|>=)', setup))
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    listed = project["dependencies"] + project["optional-dependencies"]["import"] + \
        project["optional-dependencies"]["test"]
    return {canonical(n) for n in named} | {canonical(re.match(r"[A-Za-z0-9_.\-]+", r).group(0)) for r in listed}


def test_every_package_setup_installs_is_pinned():
    assert "-c constraints.txt" in (REPO / "Makefile").read_text()
    missing = sorted(requirements() - set(pins()))
    assert not missing, f"not pinned in constraints.txt: {missing}"


def test_the_tests_run_on_the_pinned_versions():
    wrong = {}
    for name, pin in pins().items():
        try:
            installed = version(name)
        except PackageNotFoundError:
            continue                          # an optional extra this environment left out
        if installed.split("+")[0] != pin:
            wrong[name] = (installed, pin)
    assert not wrong, f"installed (version, pin): {wrong}"
