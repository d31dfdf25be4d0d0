"""Compile time, artifact size and batch-1 decode tokens/s on the CPU: kiln beside HF transformers.

    python bench/decode_cpu.py [--preset tiny|llama-3.2-1b] [--threads 2] [--new-tokens 64] [--repeats 3]

Both run in this process with the same thread count; each number is the median
of --repeats runs. Prints a Markdown table for docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny", choices=["tiny", "llama-3.2-1b"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", default="build/bench")
    args = ap.parse_args()
    os.environ["TVM_NUM_THREADS"] = str(args.threads)

    import numpy as np
    import torch
    import transformers
    torch.set_num_threads(args.threads)
    from kiln.compiler import compile_model
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampler import SamplingParams
    from kiln.tiny import PRESETS, make_tiny_model

    work = Path(args.workdir) / args.preset
    family, overrides = PRESETS[args.preset]
    model_dir = work / "model"
    if not (model_dir / "config.json").exists():
        make_tiny_model(model_dir, family or "llama", seed=0, **overrides)
    t0 = time.perf_counter()
    manifest = compile_model(model_dir, work / "artifact", target="cpu", show=None)
    compile_s = time.perf_counter() - t0
    size_mib = sum(f["bytes"] for f in manifest["files"].values()) / 2**20

    prompt = np.random.default_rng(0).integers(3, 500, args.prompt_len).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    llm = LLM(work / "artifact", kv_memory="256MiB", max_num_seqs=1)
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))   # warm-up
    kiln_rates = []
    for _ in range(args.repeats):
        [req] = llm.generate([prompt], params)
        kiln_rates.append((len(req.output_ids) - 1) / (req.finish_time - req.first_token_time))
    kiln_tokens = req.output_ids
    del llm

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    hf_rates = []
    with torch.no_grad():
        hf.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)                   # warm-up
        for _ in range(args.repeats):
            t_first = time.perf_counter()
            hf.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0)
            prefill = time.perf_counter() - t_first
            t0 = time.perf_counter()
            out = hf.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                              do_sample=False, pad_token_id=0)
            total = time.perf_counter() - t0
            hf_rates.append((args.new_tokens - 1) / (total - prefill))
    same = out[0, len(prompt):].tolist() == kiln_tokens

    kiln_med, hf_med = statistics.median(kiln_rates), statistics.median(hf_rates)
    print(f"\n{args.preset}: {platform.processor() or platform.machine()}, {args.threads} threads, "
          f"prompt {args.prompt_len}, {args.new_tokens} new tokens, median of {args.repeats}")
    print("| model | kiln compile (s) | artifact (MiB) | kiln decode tok/s | HF decode tok/s | kiln / HF | same greedy tokens |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {args.preset} | {compile_s:.1f} | {size_mib:.1f} | {kiln_med:.2f} | {hf_med:.2f} | "
          f"{kiln_med / hf_med:.2f}x | {'yes' if same else 'no'} |")
    print("compile phases (s):", manifest["compile_seconds"], file=sys.stderr)


if __name__ == "__main__":
    main()
