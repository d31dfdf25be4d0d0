"""Tiny models and compiled artifacts, built once and shared by every test file and xdist worker.

An entry is keyed by what decides its bytes: a model by its family and seed; an artifact by its
model's files and its compile options; both by kiln's source and the versions of the libraries and
tools that build them (`environment_digest`). The first process that asks builds the entry beside
its place under a file lock and renames it in; the others wait on the lock and read it, and no one
sees half an entry. Entries live in build/test-cache/<environment digest>/; `prune` removes the
folders of other digests, whose entries no test can ask for again.

A test must not change what it is given: it copies an artifact before it corrupts or rewrites it.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Callable

from filelock import FileLock

from kiln.options import CompileOptions

REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / "build" / "test-cache"
# every folder of the package (pyproject's package-dir): a new one is keyed without a change here
SOURCES = tuple(sorted(set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
                           .values())))
LIBRARIES = ("apache-tvm", "apache-tvm-ffi", "torch", "transformers", "tokenizers", "numpy", "ml_dtypes",
             "safetensors")


@functools.cache
def environment_digest() -> str:
    """kiln's source, the libraries' versions, Python, this CPU's instruction sets (artifacts are built
    for the host) and nvcc's version: everything besides a test's own inputs that an entry depends on."""
    h = hashlib.sha256()
    for path in sorted(p for folder in SOURCES for p in (REPO / folder).rglob("*")
                       if p.suffix in (".py", ".c", ".cc", ".h", ".json") and "__pycache__" not in p.parts):
        h.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    h.update((REPO / "pyproject.toml").read_bytes())
    for name in LIBRARIES:
        try:
            h.update(f"{name}=={version(name)}".encode())
        except PackageNotFoundError:
            h.update(f"{name} absent".encode())
    h.update(f"{sys.version} {platform.machine()} {_cpu_flags()}".encode())
    if shutil.which("nvcc"):
        h.update(subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.encode())
    return h.hexdigest()[:16]


def _cpu_flags() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()


def root() -> Path:
    return ROOT / environment_digest()


def prune() -> None:
    """Remove the entries of other environments: no test of this checkout can ask for them again."""
    if ROOT.is_dir():
        for folder in ROOT.iterdir():
            if folder.name != environment_digest() and folder.is_dir():
                shutil.rmtree(folder, ignore_errors=True)


def entry(kind: str, key: str, build: Callable[[Path], None]) -> Path:
    """The folder of entry kind/key, made by build(empty folder) if no process has made it yet."""
    final = root() / kind / key
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{final}.lock"):
        if not final.is_dir():
            partial = final.with_name(f"{key}.partial")
            shutil.rmtree(partial, ignore_errors=True)       # left by a process that was killed
            partial.mkdir()
            build(partial)
            partial.rename(final)
    return final


def tiny_model(family: str = "llama", seed: int = 0) -> Path:
    """The directory of a tiny `family` model (kiln.testing.tiny, float32)."""
    def build(folder: Path) -> None:
        from kiln.testing.tiny import make_tiny_model
        make_tiny_model(folder / "model", family, seed=seed)
    return entry("models", f"{family}-seed{seed}", build) / "model"


def _label(model_dir: Path) -> str:
    """A readable prefix for a model's entries: its folder's name, or its family's for a tiny model."""
    model_dir = Path(model_dir)
    return model_dir.parent.name if model_dir.name == "model" else model_dir.name


def files_digest(folder: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        h.update(str(path.relative_to(folder)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _canonical(value) -> str:
    """A stable text for compile options: sets sorted, targets and other objects by their repr."""
    def default(o):
        return sorted(o) if isinstance(o, (set, frozenset)) else repr(o)
    return json.dumps(value, sort_keys=True, default=default)


def cpu_artifact(model_dir: Path, **options) -> Path:
    """`model_dir` compiled in this process with kiln.compiler.compile_model(**options) (target cpu
    unless options name another that builds here)."""
    options = {"target": "cpu", **options}
    key = hashlib.sha256((files_digest(model_dir) + _canonical(options)).encode()).hexdigest()[:20]

    def build(folder: Path) -> None:
        from kiln.compiler import compile_model
        compile_model(model_dir, folder / "artifact", CompileOptions(**options), show=None)
    return entry("artifacts", f"{_label(model_dir)}-{key}", build) / "artifact"


def cli_artifact(model_dir: Path, *flags: str) -> Path:
    """`kiln compile MODEL_DIR *flags -o OUT` run in this process (a target that builds here); a
    non-zero exit raises with the command's output."""
    key = hashlib.sha256((files_digest(model_dir) + _canonical(flags)).encode()).hexdigest()[:20]

    def build(folder: Path) -> None:
        from click.testing import CliRunner
        from kiln.cli import main
        result = CliRunner().invoke(main, ["compile", str(model_dir), *flags, "-o", str(folder / "artifact")])
        if result.exit_code != 0:
            raise RuntimeError(f"kiln compile {' '.join(flags)} exited {result.exit_code}:\n{result.output}")
    return entry("cli", f"{_label(model_dir)}-{key}", build) / "artifact"


# Every CUDA artifact the CPU-side tests read: name -> (tiny family, `kiln compile` flags). They are
# built together in one process, since each CUDA process first spends ~40 s importing TVM's
# tensor intrinsics (TVMScript parsed frame by frame) before its first kernel.
CUDA_BUILDS = {
    "llama-sm_80": ("llama", ["--arch", "sm_80"]),
    "llama-fp8-sm_90": ("llama", ["--arch", "sm_90", "--quant", "fp8"]),
    # sm_90's Hopper GEMMs: q4 in groups of 128 for the layers, the (tied) LM head in float16: both variants
    "gemma2-fp8kv-sm_90": ("gemma2", ["--arch", "sm_90", "--kv-dtype", "fp8", "--quant", "q4", "--group-size", "128",
                                      "--no-quant-lm-head", "--no-quant-embedding"]),
    **{f"{family}-sm_80": (family, ["--arch", "sm_80"])
       for family in ("gemma3", "qwen2_moe", "deepseek_v3")},
    "qwen3-sm_80": ("qwen3", ["--arch", "sm_80", "--max-loras", "2", "--max-lora-rank", "8"]),
    # GGUF's Q4_K format (q4k): the tensor-core GEMM and the GEMV with group minimums
    "olmo2-sm_80": ("olmo2", ["--arch", "sm_80", "--quant", "q4k"]),
}


def cuda_artifact(name: str) -> Path:
    """CUDA_BUILDS[name] compiled with nvcc; the first call builds them all, in one fresh process
    (tests/build_cuda.py). A build that failed raises its error here, for the tests that read it."""
    jobs = {n: {"model": str(tiny_model(family)), "flags": flags} for n, (family, flags) in CUDA_BUILDS.items()}
    key = hashlib.sha256(_canonical(jobs).encode()).hexdigest()[:20]

    def build(folder: Path) -> None:
        (folder / "jobs.json").write_text(json.dumps(jobs))
        proc = subprocess.run([sys.executable, str(Path(__file__).with_name("build_cuda.py")), str(folder)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"tests/build_cuda.py failed:\n{proc.stderr[-5000:]}")
    folder = entry("cuda", key, build)
    errors = json.loads((folder / "errors.json").read_text())
    if name in errors:
        raise RuntimeError(f"kiln compile {' '.join(CUDA_BUILDS[name][1])} failed:\n{errors[name]}")
    return folder / name


def worker_threads() -> int | None:
    """CPU threads per xdist worker, so that the workers together use each core once (None: no xdist)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1:
        return None
    from kiln.runtime.threads import available_cores
    return max(1, available_cores() // workers)
