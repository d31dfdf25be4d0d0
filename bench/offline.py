"""Offline serving throughput on the CPU: kiln's engine against HF transformers' batched
`generate` (left padding), measured in the same run; then a shared 512-token prefix with and
without prefix caching; then the engine's Python overhead per step.

    python bench/offline.py [--preset tiny|llama-3.2-1b] [--prompts 64] [--prefix-prompts N] [--threads N]

Workload: --prompts prompts of --prompt-lens random tokens (16-256), each asking for --new-tokens
(16-128) new tokens (greedy, EOS ignored). HF gets the same prompts in one batch padded to the longest, generating the
longest request's token count (the shorter requests' extra tokens are not counted for it).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from kiln.options import CompileOptions

PROMPT_LENS, NEW_TOKENS = (16, 256), (16, 128)


def workload(n: int, seed: int = 0, prefix: list[int] | None = None):
    import numpy as np
    rng = np.random.default_rng(seed)
    lo, hi = PROMPT_LENS
    prompts = [(prefix or []) + rng.integers(3, 500, int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)]
    return prompts, [int(rng.integers(NEW_TOKENS[0], NEW_TOKENS[1] + 1)) for _ in range(n)]


def run_kiln(llm, prompts, max_tokens) -> dict:
    from kiln.runtime.sampler import SamplingParams
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    stats = llm.engine.stats
    steps0, secs0, fwd0 = stats.steps, stats.seconds, stats.forward_seconds
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = stats.steps - steps0
    return {"wall": wall, "tok_s": out_tokens / wall, "req_s": len(prompts) / wall,
            "ttft": statistics.median(o.metrics.ttft for o in outs),
            "overhead_ms": 1e3 * ((stats.seconds - secs0) - (stats.forward_seconds - fwd0)) / steps,
            "cached": sum(o.num_cached_tokens for o in outs)}


def run_hf(hf, prompts, max_tokens, torch) -> dict:
    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):                   # left padding, as decoder-only generate wants
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    t0 = time.perf_counter()
    with torch.no_grad():
        hf.generate(ids, attention_mask=mask, max_new_tokens=max(max_tokens), min_new_tokens=max(max_tokens),
                    do_sample=False, pad_token_id=0)
    wall = time.perf_counter() - t0
    return {"wall": wall, "tok_s": sum(max_tokens) / wall, "req_s": len(prompts) / wall}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny", choices=["tiny", "llama-3.2-1b"])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="default: $TVM_NUM_THREADS, else every core")
    ap.add_argument("--workdir", default="build/bench")
    ap.add_argument("--prefix-prompts", type=int, default=None, help="prompts in the shared-prefix run "
                    "(default: --prompts)")
    ap.add_argument("--prompt-lens", default="16-256", help="prompt length range (own tokens)")
    ap.add_argument("--new-tokens", default="16-128", help="new tokens range")
    ap.add_argument("--no-hf", action="store_true")
    args = ap.parse_args()
    global PROMPT_LENS, NEW_TOKENS
    PROMPT_LENS = tuple(map(int, args.prompt_lens.split("-")))
    NEW_TOKENS = tuple(map(int, args.new_tokens.split("-")))
    from kiln.runtime.threads import resolve_threads
    args.threads = resolve_threads(args.threads)
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    import numpy as np
    import torch
    import transformers
    torch.set_num_threads(args.threads)
    from kiln.compiler import compile_model
    from kiln.runtime.llm import LLM
    from kiln.testing.tiny import preset_model

    work = Path(args.workdir) / args.preset
    model_dir = preset_model(args.preset, work / "model")
    artifact = work / "artifact-f32"
    if not (artifact / "manifest.json").exists():
        compile_model(model_dir, artifact, CompileOptions(target="cpu"), show=None)
    print(f"\n{args.preset}: {args.threads} threads, f32, {args.prompts} prompts of {args.prompt_lens} tokens, "
          f"{args.new_tokens} new tokens each, greedy")

    prompts, max_tokens = workload(args.prompts)
    kv = "2GiB"
    kiln_llm = LLM(artifact, kv_memory=kv, max_num_seqs=args.prompts, max_batched_tokens=2048)
    run_kiln(kiln_llm, prompts[:4], [4] * 4)                                 # warm-up
    k = run_kiln(kiln_llm, prompts, max_tokens)
    rows = [("kiln", k)]
    if not args.no_hf:
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        run_hf(hf, prompts[:4], [4] * 4, torch)
        rows.append(("HF generate (padded batch)", run_hf(hf, prompts, max_tokens, torch)))
    print("| engine | wall (s) | output tok/s | requests/s |\n|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['wall']:.1f} | {r['tok_s']:.1f} | {r['req_s']:.2f} |")
    if len(rows) == 2:
        print(f"kiln / HF output tok/s: {rows[0][1]['tok_s'] / rows[1][1]['tok_s']:.2f}x")

    # Shared 512-token prefix (a long system prompt): with and without prefix caching.
    prefix = np.random.default_rng(99).integers(3, 500, 512).tolist()
    n_shared = args.prefix_prompts or args.prompts
    shared, shared_max = workload(n_shared, seed=1, prefix=prefix)
    print(f"\nshared 512-token prefix + {args.prompt_lens} own tokens, {n_shared} prompts")
    print("| prefix caching | wall (s) | output tok/s | median TTFT (s) | prompt tokens from cache |\n|---|---|---|---|---|")
    for caching in (False, True):
        llm = LLM(artifact, kv_memory=kv, max_num_seqs=args.prompts, max_batched_tokens=2048, prefix_caching=caching)
        run_kiln(llm, [prefix + [1]], [1])              # the prefix is computed once before (a warm system prompt)
        r = run_kiln(llm, shared, shared_max)
        print(f"| {'on' if caching else 'off'} | {r['wall']:.1f} | {r['tok_s']:.1f} | {r['ttft']:.3f} | {r['cached']} |")

    # Python overhead: time in step() outside the compiled forward.
    print("\nengine overhead per step (time in Engine.step outside the compiled forward)")
    print("| batch | overhead ms/step | forward ms/step |\n|---|---|---|")
    for batch in (1, 32):
        llm = LLM(artifact, kv_memory=kv, max_num_seqs=batch)
        s = llm.engine.stats
        r = run_kiln(llm, prompts[:batch], [64] * batch)
        fwd = 1e3 * s.forward_seconds / s.steps
        print(f"| {batch} | {r['overhead_ms']:.2f} | {fwd:.2f} |")


if __name__ == "__main__":
    main()
