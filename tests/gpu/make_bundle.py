"""Build the tiny model and its CUDA artifacts into one folder, for tests/gpu on a GPU machine.

    python tests/gpu/make_bundle.py OUT [--arch sm_90] [--model DIR] [--variants float32,q8]
                                        [--without-weights] [--families qwen3,gemma2]
    python tests/gpu/make_bundle.py OUT --attach

--families adds OUT/families/<family>/ (model/ and cuda-float32/) for tests/gpu/test_cuda_families.py.
--without-weights compiles the variants with --no-weights (model/ stays: it has the weights once);
--families-without-weights likewise the families' artifacts, and leaves their models out (a tenth
of the size: what a 64 MiB transfer takes). There, `make_bundle.py OUT --attach` writes the weights
into every artifact without them (kiln attach-weights): the variants' from model/, each family's from
its tiny model (kiln.testing.tiny, seed 0), made there first.

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
            "q4": ["--dtype", "float16", "--quant", "q4"], "fp8": ["--dtype", "float16", "--quant", "fp8"],
            "lora": ["--dtype", "float16", "--max-loras", "4", "--max-lora-rank", "16"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--model", default=None, help="an existing tiny model dir (default: make one)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--without-weights", action="store_true", help="the variants compiled with --no-weights")
    ap.add_argument("--families", default="", help="tiny families (kiln.testing.tiny) to add under families/")
    ap.add_argument("--families-without-weights", action="store_true")
    ap.add_argument("--attach", "--attach-families", action="store_true",
                    help="on the GPU machine: write the weights of every artifact in OUT without them")
    args = ap.parse_args()
    if args.attach:
        return attach(Path(args.out))
    variants = [v for v in args.variants.split(",") if v]
    if variants:
        build(Path(args.out), args.arch, args.model, variants, ["--no-weights"] if args.without_weights else [])
    for family in filter(None, args.families.split(",")):
        from kiln.testing.tiny import make_tiny_model
        folder = Path(args.out) / "families" / family
        if args.families_without_weights:
            with tempfile.TemporaryDirectory() as model:
                make_tiny_model(model, family, seed=0)
                compile_variant(Path(model), folder, args.arch, "float32", ["--no-weights"])
            continue
        if not (folder / "model" / "config.json").exists():
            make_tiny_model(folder / "model", family, seed=0)
        build(folder, args.arch, str(folder / "model"), ["float32"])


def attach(out: Path) -> None:
    """Each artifact in OUT without weights gets its model's: OUT/cuda-* OUT/model's, and each
    families/<family>/cuda-float32 its tiny model's, made here first."""
    from kiln.artifact import read_manifest
    from kiln.weights.attach import attach_weights
    from kiln.testing.tiny import make_tiny_model
    for artifact in sorted(out.glob("cuda-*")) + sorted(out.glob("families/*/cuda-float32")):
        if read_manifest(artifact, verify=False).weights_source != "absent":
            continue
        model = artifact.parent / "model"
        if not (model / "config.json").exists():        # a family's: OUT/model always travels
            make_tiny_model(model, artifact.parent.name, seed=0)
        attach_weights(artifact, model)
        print(f"attached {model}'s weights to {artifact}", flush=True)


def build(out: Path, arch: str, model_dir: str | None, variants: list[str], flags: list[str] = ()) -> None:
    """OUT/model (the given model, or the tiny Llama) and OUT/cuda-<variant> for each variant."""
    out.mkdir(parents=True, exist_ok=True)
    model = out / "model"
    if model_dir and Path(model_dir).resolve() != model.resolve():
        if model.exists():
            shutil.rmtree(model)
        shutil.copytree(model_dir, model)
    elif not (model / "config.json").exists():
        from kiln.testing.tiny import make_tiny_model
        make_tiny_model(model, "llama", seed=0)
    for name in variants:
        compile_variant(model, out, arch, name, flags)


def compile_variant(model: Path, out: Path, arch: str, variant: str, flags: list[str] = ()) -> None:
    # each CUDA compile runs in its own process: the CUDA loader must be set up before TVM loads
    subprocess.run([sys.executable, "-m", "kiln.cli", "compile", str(model), "--target", "cuda", "--arch", arch,
                    *VARIANTS[variant], *flags, "-o", str(out / f"cuda-{variant}"), "--force"], check=True)


if __name__ == "__main__":
    main()
