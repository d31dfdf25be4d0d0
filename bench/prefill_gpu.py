"""Time to first token of one prompt on a CUDA artifact, beside HF transformers eager (SDPA).

    python bench/prefill_gpu.py ARTIFACT [--lengths 512 2048 8192] [--repeats 3] [--no-hf]

kiln: `LLM.generate` of one prompt with max_tokens=1 (the scheduler's chunked prefill as a user gets
it), TTFT from the request's metrics. HF: one forward of the prompt in the artifact's float dtype
with attn_implementation="sdpa", from the artifact's config with random weights (speed does not
depend on the values). Medians of --repeats after a warm-up; prefill tokens/s and TFLOP/s of the
linears (2 x parameters x tokens) beside.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def kiln_ttft(llm, length: int, repeats: int) -> float:
    from kiln.runtime.sampler import SamplingParams
    rng = np.random.default_rng(length)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for i in range(repeats + 1):
        prompt = rng.integers(10, llm.model.vocab_size - 10, size=length).tolist()    # no prefix-cache hits
        t0 = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def hf_model(torch, transformers, config: dict, dtype):
    """HF's model of the artifact's config, random weights, SDPA attention, built on the GPU."""
    try:
        cfg = transformers.AutoConfig.for_model(**config, attn_implementation="sdpa")
        with torch.device("cuda"):
            return transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    except Exception as e:
        print(f"  HF failed: {type(e).__name__}: {str(e)[:200]}")
        return None


def hf_ttft(torch, model, length: int, repeats: int) -> float | None:
    try:
        ids = torch.randint(10, model.config.vocab_size - 10, (1, length), device="cuda")
        times = []
        with torch.no_grad():
            for i in range(repeats + 1):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                model(ids, logits_to_keep=1)
                torch.cuda.synchronize()
                if i:
                    times.append(time.perf_counter() - t0)
        return statistics.median(times)
    except Exception as e:
        print(f"  HF failed at {length}: {type(e).__name__}: {str(e)[:200]}")
        return None



def speed_ratio(ratio: float) -> str:
    """kiln's speed over HF's, with two decimals, or two significant digits below 0.01 (not 0.00)."""
    return f"{ratio:.2f}×" if ratio >= 0.01 else f"{ratio:.1e}×"

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--chunk", type=int, default=2048, help="the engine's token budget per step (max_batched_tokens)")
    args = ap.parse_args()
    import torch
    from decode_gpu import hf_config
    from kiln import LLM
    from kiln.artifact import read_manifest
    manifest = read_manifest(args.artifact, verify=False).to_json()
    lengths = [n for n in args.lengths if n < manifest["max_context"]]
    if lengths != args.lengths:
        print(f"(prompts of {manifest['max_context']} tokens or more skipped: the artifact's context)")
    llm = LLM(str(args.artifact), size_kv_for=max(lengths) + 16, max_batched_tokens=args.chunk)
    # every weight but the embedding is read once per token: the linears' FLOPs (not for a mixture,
    # whose tokens each use k of its experts)
    moe = any("experts" in w["param"] for w in manifest["weights"])
    params = 0 if moe else sum(int(np.prod(w["shape"])) for w in manifest["weights"]
                               if not w["param"].startswith("model.embed_tokens"))
    config = None if args.no_hf else hf_config(args.artifact)
    dtype = getattr(torch, manifest["dtype"])
    print(f"# {args.artifact}: {torch.cuda.get_device_name()}, {manifest['dtype']}, "
          f"weights {manifest['quantization']['weights']}, prefill chunks of {args.chunk} tokens\n")
    kiln_times = {}
    for length in lengths:                 # said as measured: a stage cut short keeps what it has
        kiln_times[length] = kiln_ttft(llm, length, args.repeats)
        print(f"kiln TTFT at {length} tokens: {kiln_times[length] * 1e3:.1f} ms", flush=True)
    del llm                    # its KV pages and weights leave room for HF's model
    hf_times = {}
    if config is not None:
        import transformers
        model = hf_model(torch, transformers, config, dtype)
        hf_times = {n: hf_ttft(torch, model, n, args.repeats) for n in lengths} if model is not None else {}
    print("\n| prompt | kiln TTFT ms | kiln tok/s | kiln linear TFLOP/s | HF eager (SDPA) ms | kiln / HF speed |")
    print("|---|---|---|---|---|---|")
    for length in lengths:
        kiln, hf = kiln_times[length], hf_times.get(length)
        flops = f"{2 * params * length / kiln / 1e12:.1f}" if params else ""
        print(f"| {length} | {kiln * 1e3:.1f} | {length / kiln:.0f} | {flops} | "
              f"{'' if hf is None else f'{hf * 1e3:.1f}'} | {'' if hf is None else speed_ratio(hf / kiln)} |",
              flush=True)


if __name__ == "__main__":
    main()
