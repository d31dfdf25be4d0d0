"""Quantisation error of compiled artifacts: last-token logits of each quant mode against the
float32 artifact (which matches transformers to 1e-4) over N prompts.

    python bench/quant_error.py [--preset llama-3.2-1b] [--prompts 32]

Prints cosine similarity (min, mean) and max relative error (|diff| / max |ref|) per mode.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

MODES = {"q8": ("q8", 32), "q4 g32": ("q4", 32), "q4 g128": ("q4", 128)}


def last_logits(artifact: Path, prompts: list[list[int]]) -> np.ndarray:
    from kiln.runtime.model import CompiledModel
    from kiln.runtime.step import SeqChunk, step_inputs
    model = CompiledModel(artifact, verify=False)
    pages_per_seq = -(-max(map(len, prompts)) // model.page_size)
    model.allocate_kv(pages_per_seq * model.bytes_per_page)
    out = []
    for ids in prompts:
        pages = list(range(-(-len(ids) // model.page_size)))
        slots = [pages[t // model.page_size] * model.page_size + t % model.page_size for t in range(len(ids))]
        out.append(model.forward(step_inputs([SeqChunk(ids, 0, pages, slots)], model.page_size))[0])
    return np.stack(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-3.2-1b")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--workdir", default="build/bench")
    args = ap.parse_args()
    from kiln.compiler import compile_model
    from kiln.tiny import PRESETS, make_tiny_model
    work = Path(args.workdir) / args.preset
    family, overrides = PRESETS[args.preset]
    model_dir = work / "model"
    if not (model_dir / "config.json").exists():
        make_tiny_model(model_dir, family or "llama", seed=0, **overrides)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, int(rng.integers(8, 40))).tolist() for _ in range(args.prompts)]
    artifacts = {"f32": (work / "artifact-f32", None, 32), **{m: (work / f"artifact-{m.replace(' ', '-')}", q, g)
                                                              for m, (q, g) in MODES.items()}}
    logits = {}
    for mode, (path, quant, group) in artifacts.items():
        if not (path / "manifest.json").exists():
            compile_model(model_dir, path, target="cpu", quant=quant, group_size=group, show=None)
        logits[mode] = last_logits(path, prompts)
    ref = logits.pop("f32")
    print(f"\n{args.preset}: last-token logits against the float32 artifact, {args.prompts} prompts of 8-39 tokens")
    print("| mode | cosine min | cosine mean | max relative error | top-1 agreement |\n|---|---|---|---|---|")
    for mode, got in logits.items():
        cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
        rel = np.abs(got - ref).max(1) / np.abs(ref).max(1)
        top1 = (got.argmax(1) == ref.argmax(1)).mean()
        print(f"| {mode} | {cos.min():.4f} | {cos.mean():.4f} | {rel.max():.3f} | {top1:.0%} |")


if __name__ == "__main__":
    main()
