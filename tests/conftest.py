"""Shared fixtures: the tiny random-weight models and their CPU artifacts, built once per run and
shared by every test file and xdist worker (tests/artifact_cache.py); one Ray cluster per worker, shared by
the tests that run on Ray (tests/ray_cluster.py)."""
from __future__ import annotations

import os

import pytest

import artifact_cache

pytest_plugins = ("ray_cluster",)          # ray_cluster, ray_serve: one Ray cluster per worker


def pytest_configure(config):
    if not hasattr(config, "workerinput"):          # the controller (or a run without xdist)
        artifact_cache.prune()
    if config.getoption("--no-build"):
        refuse_builds()
    threads = artifact_cache.worker_threads()
    if threads is not None:            # each core runs one worker's kernels, not several, and no
        os.environ.setdefault("TVM_NUM_THREADS", str(threads))       # worker is bound to the first
        os.environ.setdefault("TVM_BIND_THREADS", "0")              # core (runtime/threads.py)
    # (NumPy's BLAS keeps its own count: the interpreter's sums, and so the int8 KV levels that
    # test_mla.py holds compiled kernels to, depend on it)


@pytest.fixture(scope="session")
def make_model():
    """make_model(family) -> the directory of a tiny `family` model (kiln.testing.tiny, seed 0)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    return artifact_cache.tiny_model


@pytest.fixture(scope="session")
def llama_cpu(make_model):
    """(artifact dir, HF model) of the tiny GQA Llama compiled for the CPU."""
    transformers = pytest.importorskip("transformers")
    model_dir = make_model("llama")
    artifact = artifact_cache.cpu_artifact(model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    return artifact, hf


@pytest.fixture(scope="session")
def compiled_family(make_model):
    """compiled_family(family, **compile options) -> the artifact of that tiny model compiled for the CPU."""
    return lambda family, **options: artifact_cache.cpu_artifact(make_model(family), **options)


# ---------------------------------------------------------------------------- tiers
# `make test-fast` runs with --no-build: the tests marked `build` (they build with TVM, lower a graph
# to TVM's IR, run what TVM built, or build kiln's CUDA kernels for the CPU emulator) are left out,
# and an unmarked test that builds with TVM fails, naming the mark, so the fast tier stays fast.
BUILD_FIXTURES = {"llama_cpu", "compiled_family", "gpu_bundle", "gpu_family"}


def pytest_addoption(parser):
    parser.addoption("--no-build", action="store_true",
                     help="leave out the tests marked `build` (no TVM build, no lowering): make test-fast")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if BUILD_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.build)
    if config.getoption("--no-build"):
        kept = [item for item in items if item.get_closest_marker("build") is None]
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept


def refuse_builds() -> None:
    """For the rest of this process every TVM build and lowering raises: a test that reaches one
    (or its fixture does) is missing its `build` mark."""
    import tvm
    import tvm.tirx
    import kiln.codegen

    def refuse(*args, **kwargs):
        raise AssertionError("this test or its fixture builds with TVM: mark the test @pytest.mark.build")
    tvm.compile = tvm.tirx.build = kiln.codegen.lower_graph = refuse
