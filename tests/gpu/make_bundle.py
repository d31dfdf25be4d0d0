"""Build the tiny model and its CUDA artifacts into one folder, for tests/gpu on a GPU machine.

    python tests/gpu/make_bundle.py OUT [--arch sm_90] [--model DIR]

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
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = out / "model"
    if args.model:
        if model.exists():
            shutil.rmtree(model)
        shutil.copytree(args.model, model)
    elif not (model / "config.json").exists():
        from kiln.tiny import make_tiny_model
        make_tiny_model(model, "llama", seed=0)
    for name, flags in VARIANTS.items():
        # each CUDA compile runs in its own process: the CUDA loader must be set up before TVM loads
        subprocess.run([sys.executable, "-m", "kiln.cli", "compile", str(model), "--target", "cuda",
                        "--arch", args.arch, *flags, "-o", str(out / f"cuda-{name}"), "--force"], check=True)


if __name__ == "__main__":
    main()
