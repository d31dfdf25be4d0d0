"""Shared fixtures: the tiny random-weight models, built once per test session."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def make_model(tmp_path_factory):
    """make_model(family) -> the directory of a tiny `family` model (kiln.tiny), built on first use."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from kiln.tiny import make_tiny_model

    built: dict[str, Path] = {}

    def make(family: str = "llama") -> Path:
        if family not in built:
            built[family] = make_tiny_model(tmp_path_factory.mktemp(f"tiny-{family}"), family, seed=0)
        return built[family]
    return make


@pytest.fixture(scope="session")
def llama_cpu(make_model, tmp_path_factory):
    """(artifact dir, HF model) of the tiny GQA Llama compiled for the CPU, built once."""
    transformers = pytest.importorskip("transformers")
    from kiln.compiler import compile_model
    model_dir = make_model("llama")
    artifact = tmp_path_factory.mktemp("cpu") / "artifact"
    compile_model(model_dir, artifact, target="cpu", show=None)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    return artifact, hf


@pytest.fixture(scope="session")
def compiled_family(make_model, tmp_path_factory):
    """compiled_family(family, **compile options) -> the artifact of that tiny model compiled for the
    CPU, built once per family and options."""
    from kiln.compiler import compile_model
    built: dict[tuple, Path] = {}

    def get(family: str, **options) -> Path:
        key = (family, tuple(sorted(options.items())))
        if key not in built:
            out = tmp_path_factory.mktemp(f"{family}-cpu") / "artifact"
            compile_model(make_model(family), out, target="cpu", show=None, **options)
            built[key] = out
        return built[key]
    return get
