"""Batch-1 and batch-8 decode tokens/s of a CUDA artifact beside HF transformers on the same GPU.

    python bench/decode_gpu.py ARTIFACT HF_MODEL_DIR [--new-tokens 64] [--repeats 5]

Prints a Markdown table (medians of --repeats runs) for docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("model")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    import numpy as np
    import torch
    import transformers
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampler import SamplingParams

    llm = LLM(args.artifact, kv_memory="1GiB")
    dtype = getattr(torch, llm.model.manifest["dtype"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).cuda().eval()
    rows = []
    for batch in (1, 8):
        prompts = [np.random.default_rng(b).integers(3, 500, args.prompt_len).tolist() for b in range(batch)]
        params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        kiln_rates = []
        for _ in range(args.repeats):
            reqs = llm.generate(prompts, params)
            first = max(r.metrics.first_token_time for r in reqs)
            last = max(r.metrics.finish_time for r in reqs)
            kiln_rates.append(batch * (args.new_tokens - 1) / (last - first))
        ids = torch.tensor(prompts).cuda()
        hf_rates = []
        with torch.no_grad():
            hf.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
            for _ in range(args.repeats):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                hf.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0)
                torch.cuda.synchronize()
                prefill = time.perf_counter() - t0
                t0 = time.perf_counter()
                hf.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                            pad_token_id=0)
                torch.cuda.synchronize()
                hf_rates.append(batch * (args.new_tokens - 1) / (time.perf_counter() - t0 - prefill))
        k, h = statistics.median(kiln_rates), statistics.median(hf_rates)
        rows.append(f"| {batch} | {k:.1f} | {h:.1f} | {k / h:.2f}x |")
    print(f"\n{torch.cuda.get_device_name()}, {llm.model.manifest['dtype']}, prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens, median of {args.repeats}")
    print("| batch | kiln decode tok/s | HF decode tok/s | kiln / HF |\n|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
