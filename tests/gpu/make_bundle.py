"""Build the tiny model and its CUDA artifacts into one folder, for tests/gpu on a GPU machine.

    python tests/gpu/make_bundle.py OUT [--arch sm_90] [--model DIR] [--variants float32,q8]
                                        [--families qwen3,gemma2]

--families adds OUT/families/<family>/ (model/ and cuda-float32/) for tests/gpu/test_cuda_families.py.
With --families-without-weights their artifacts are compiled with --no-weights and their models left
out (a tenth of the size: what a 64 MiB transfer takes); there, `make_bundle.py OUT --attach-families`
makes each tiny model (kiln.tiny, seed 0) and writes its weights into the artifact (kiln attach-weights).

A GPU machine may have only TVM's runtime (no compiler): build here, copy OUT
there, and run `KILN_GPU_BUNDLE=OUT pytest tests/gpu`.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# artifact folder suffix -> extra `kiln compile` flags
VARIANTS = {"float32": ["--dtype", "float32"], "float16": ["--dtype", "float16"],
            "bfloat16": ["--dtype", "bfloat16"], "q8": ["--dtype", "float16", "--quant", "q8"],
            "q4": ["--dtype", "float16", "--quant", "q4"], "fp8": ["--dtype", "float16", "--quant", "fp8"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--model", default=None, help="an existing tiny model dir (default: make one)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--families", default="", help="tiny families (kiln.tiny) to add under families/")
    ap.add_argument("--families-without-weights", action="store_true")
    ap.add_argument("--attach-families", action="store_true",
                    help="on the GPU machine: make the models of families without weights and attach them")
    args = ap.parse_args()
    if args.attach_families:
        return attach_families(Path(args.out))
    variants = [v for v in args.variants.split(",") if v]
    if variants:
        build(Path(args.out), args.arch, args.model, variants)
    for family in filter(None, args.families.split(",")):
        from kiln.tiny import make_tiny_model
        folder = Path(args.out) / "families" / family
        if args.families_without_weights:
            with tempfile.TemporaryDirectory() as model:
                make_tiny_model(model, family, seed=0)
                compile_variant(Path(model), folder, args.arch, "float32", ["--no-weights"])
            continue
        if not (folder / "model" / "config.json").exists():
            make_tiny_model(folder / "model", family, seed=0)
        build(folder, args.arch, str(folder / "model"), ["float32"])


def attach_families(out: Path) -> None:
    """Each families/<family>/ whose artifact has no weights: its tiny model made here, its weights attached."""
    from kiln.artifact import read_manifest
    from kiln.attach_weights import attach_weights
    from kiln.tiny import make_tiny_model
    for folder in sorted((out / "families").iterdir()):
        artifact = folder / "cuda-float32"
        if read_manifest(artifact, verify=False)["weights_source"] != "absent":
            continue
        if not (folder / "model" / "config.json").exists():
            make_tiny_model(folder / "model", folder.name, seed=0)
        attach_weights(artifact, folder / "model")


def build(out: Path, arch: str, model_dir: str | None, variants: list[str]) -> None:
    """OUT/model (the given model, or the tiny Llama) and OUT/cuda-<variant> for each variant."""
    out.mkdir(parents=True, exist_ok=True)
    model = out / "model"
    if model_dir and Path(model_dir).resolve() != model.resolve():
        if model.exists():
            shutil.rmtree(model)
        shutil.copytree(model_dir, model)
    elif not (model / "config.json").exists():
        from kiln.tiny import make_tiny_model
        make_tiny_model(model, "llama", seed=0)
    for name in variants:
        compile_variant(model, out, arch, name)


def compile_variant(model: Path, out: Path, arch: str, variant: str, flags: list[str] = ()) -> None:
    # each CUDA compile runs in its own process: the CUDA loader must be set up before TVM loads
    subprocess.run([sys.executable, "-m", "kiln.cli", "compile", str(model), "--target", "cuda", "--arch", arch,
                    *VARIANTS[variant], *flags, "-o", str(out / f"cuda-{variant}"), "--force"], check=True)


if __name__ == "__main__":
    main()
