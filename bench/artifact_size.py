"""Artifact size per quantisation mode, with and without the quantised embedding (CPU target).

    python bench/artifact_size.py [--preset llama-3.2-1b] [--modes q4,q8] [--workdir build/bench]

Compiles each mode once (an artifact already there is measured again, not rebuilt) and prints the
artifact's bytes (every file: weights, library, tokenizer), its weights file, and the stored tensors
made from the embedding table (a tied table is one of them when it is shared with the LM head).
Compiling the 1B shape takes ~1-3 minutes and ~10 GB of memory per mode.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from kiln.options import CompileOptions

# mode -> (dtype, weight quant, quantised embedding)
MODES = {"f32": ("float32", None, False), "q8": ("float32", "q8", True),
         "q8 float-embedding": ("float32", "q8", False), "q4": ("float32", "q4", True),
         "q4 float-embedding": ("float32", "q4", False)}
TABLE = "model.embed_tokens.weight"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-3.2-1b")
    ap.add_argument("--modes", default="q4,q4 float-embedding,q8,q8 float-embedding")
    ap.add_argument("--workdir", default="build/bench")
    args = ap.parse_args()
    from kiln.compiler import compile_model
    from kiln.testing.tiny import preset_model
    work = Path(args.workdir) / args.preset
    model_dir = preset_model(args.preset, work / "model")
    print(f"\n{args.preset}: artifact size per mode (CPU target)")
    print("| mode | embedding | artifact (MiB) | artifact (bytes) | weights file (bytes) | embedding-table tensors |")
    print("|---|---|---|---|---|---|")
    for mode in args.modes.split(","):
        dtype, quant, quant_embedding = MODES[mode]
        path = work / f"size-{mode.replace(' ', '-')}"
        if (path / "manifest.json").exists():
            manifest = json.loads((path / "manifest.json").read_text())
        else:
            options = CompileOptions(target="cpu", dtype=dtype, quant=quant, quant_embedding=quant_embedding)
            manifest = compile_model(model_dir, path, options, show=None).to_json()
        total = sum(f["bytes"] for f in manifest["files"].values())
        q = manifest["quantization"]
        embedding = q["embedding"] + (", shared with the LM head" if q.get("embedding_shared_with_lm_head") else "")
        tables = ", ".join(f"{w['name']} {w['dtype']}{w['shape']}" for w in manifest["weights"]
                           if w["param"].startswith(TABLE))
        print(f"| {mode} | {embedding} | {total / 2**20:.1f} | {total} | {manifest['files']['weights.safetensors']['bytes']} "
              f"| {tables} |")


if __name__ == "__main__":
    main()
