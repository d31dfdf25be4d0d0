"""Build the tiny model and its CUDA artifacts into one folder, for tests/gpu on a GPU machine.

    python tests/gpu/make_bundle.py OUT [--arch sm_90] [--model DIR] [--variants float32,q8]
                                        [--families qwen3,gemma2]

--families adds OUT/families/<family>/ (model/ and cuda-float32/) for tests/gpu/test_cuda_families.py.

A GPU machine may have only TVM's runtime (no compiler): build here, copy OUT
there, and run `KILN_GPU_BUNDLE=OUT pytest tests/gpu`.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
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
    args = ap.parse_args()
    build(Path(args.out), args.arch, args.model, args.variants.split(","))
    for family in filter(None, args.families.split(",")):
        from kiln.tiny import make_tiny_model
        folder = Path(args.out) / "families" / family
        if not (folder / "model" / "config.json").exists():
            make_tiny_model(folder / "model", family, seed=0)
        build(folder, args.arch, str(folder / "model"), ["float32"])


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
        # each CUDA compile runs in its own process: the CUDA loader must be set up before TVM loads
        subprocess.run([sys.executable, "-m", "kiln.cli", "compile", str(model), "--target", "cuda",
                        "--arch", arch, *VARIANTS[name], "-o", str(out / f"cuda-{name}"), "--force"], check=True)


if __name__ == "__main__":
    main()
