"""CPU decode: kiln (per quantisation mode, batch 1 and 8) beside HF transformers, and beside the
memory-bandwidth limit; compile time, artifact size and kernel launches per step.

    python bench/decode_cpu.py [--preset tiny|llama-3.2-1b|gemma-2-2b|qwen3-1.7b] [--modes f32,bf16,q8]
                               [--threads N] [--new-tokens 32] [--repeats 3] [--hf-dtype float32]

Everything runs in this process with the same thread count (default: $TVM_NUM_THREADS, else every
core, as `kiln run`); numbers are medians of --repeats.
"Limit" is this machine's streaming bandwidth (np.copyto of 1 GiB, read + write, measured in the
same run) divided by the weight bytes one decode step reads; "of limit" is kiln's share of it.
The KV table gives each artifact's KV bytes per token (every layer, as its KVSpec stores it) and what
one sequence holds at a 4k-token context with and without dropping pages outside every layer's
sliding window (the page pool's own accounting).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from kiln.options import CompileOptions

# mode -> (dtype, weight quant, KV cache dtype)
MODES = {"f32": ("float32", None, None), "bf16": ("bfloat16", None, None), "q8": ("float32", "q8", None),
         "q4": ("float32", "q4", None), "fp8": ("float32", "fp8", None), "q8+kv8": ("float32", "q8", "int8")}


def copy_bandwidth() -> float:
    import numpy as np
    a = np.ones(1 << 28, np.float32)
    b = np.empty_like(a)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(b, a)
        times.append(time.perf_counter() - t0)
    return 2 * a.nbytes / statistics.median(times)


def step_weight_bytes(manifest: dict) -> int:
    """Bytes of weights one decode step streams: all stored weights but a table only the embedding
    gather reads (it reads a few rows). A table shared with the LM head is read whole by the head."""
    item = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "uint8": 1, "float8_e4m3fn": 1}
    return sum(item[w["dtype"]] * _prod(w["shape"]) for w in manifest["weights"]
               if not _gather_only(w, manifest["quantization"]))


def _gather_only(weight: dict, quant: dict) -> bool:
    table = "model.embed_tokens.weight"
    if quant.get("embedding_shared_with_lm_head"):
        return False
    scheme = quant.get("embedding", "none")
    if scheme == "none":
        return weight["name"] == table            # a tied head reads its own copy, "<table>@packedNB"
    return weight["param"] in (f"{table}.{scheme}", f"{table}.{scheme}_scale")


def _prod(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def kv_at_context(mode: str, llm, context: int) -> list:
    """KV bytes per token, and the bytes one sequence of `context` tokens holds without and with the
    pool dropping pages outside every layer's window (computed `max_batched_tokens` at a time)."""
    model, pool = llm.model, llm.engine.pool
    kinds = sorted({f"{s.kind}{f' {s.window}' if s.window else ''}" for s in model.kv_specs})
    page_bytes = model.bytes_per_page
    every = pool.pages_for(context) * page_bytes
    live = pool.live_pages_for(context, llm.engine.scheduler.max_batched_tokens) * page_bytes
    return [mode, f"{len(model.kv_specs)} ({', '.join(kinds)})", model.bytes_per_token,
            f"{every / 2**20:.1f} MiB", f"{live / 2**20:.1f} MiB"]


def decode_rate(generate, batch: int, new_tokens: int, repeats: int) -> float:
    rates = []
    for _ in range(repeats):
        first, last = generate(batch, new_tokens)
        rates.append(batch * (new_tokens - 1) / (last - first))
    return statistics.median(rates)


def main() -> None:
    ap = argparse.ArgumentParser()
    from kiln.testing.tiny import PRESETS
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--hf-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--modes", default="f32,bf16,q8,q4")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--threads", type=int, default=None, help="default: $TVM_NUM_THREADS, else every core")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", default="build/bench")
    args = ap.parse_args()
    from kiln.runtime.threads import resolve_threads
    args.threads = resolve_threads(args.threads)
    os.environ["TVM_NUM_THREADS"] = str(args.threads)

    import numpy as np
    import torch
    import transformers
    torch.set_num_threads(args.threads)
    from kiln.compiler import compile_model
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampler import SamplingParams
    from kiln.testing.tiny import preset_model

    work = Path(args.workdir) / args.preset
    model_dir = preset_model(args.preset, work / "model")
    batches = [int(b) for b in args.batches.split(",")]
    prompts = [np.random.default_rng(i).integers(3, 500, args.prompt_len).tolist() for i in range(max(batches))]
    bandwidth = copy_bandwidth()

    rows, greedy, kv_rows = [], {}, []
    for mode in args.modes.split(","):
        dtype, quant, kv = MODES[mode]
        t0 = time.perf_counter()
        options = CompileOptions(target="cpu", dtype=dtype, quant=quant, kv_dtype=kv)
        manifest = compile_model(model_dir, work / f"artifact-{mode}", options, show=None, force=True).to_json()
        compile_s = time.perf_counter() - t0
        size_mib = sum(f["bytes"] for f in manifest["files"].values()) / 2**20
        llm = LLM(work / f"artifact-{mode}", kv_memory="512MiB", max_num_seqs=max(batches))

        def generate(batch, new_tokens, llm=llm, mode=mode):
            reqs = llm.generate(prompts[:batch], SamplingParams(temperature=0.0, max_tokens=new_tokens,
                                                                ignore_eos=True), use_tqdm=False)
            greedy[mode] = reqs[0].outputs[0].token_ids
            return max(r.metrics.first_token_time for r in reqs), max(r.metrics.finish_time for r in reqs)
        generate(1, 4)                                                                    # warm-up
        kv_rows.append(kv_at_context(mode, llm, 4096))
        limit = bandwidth / step_weight_bytes(manifest)
        for batch in batches:
            rate = decode_rate(generate, batch, args.new_tokens, args.repeats)
            rows.append([mode, batch, f"{compile_s:.1f}", f"{size_mib:.0f}",
                         str(manifest["launches_per_step"]["total"]), f"{rate:.2f}", f"{limit * batch:.2f}",
                         f"{rate / (limit * batch):.0%}"])
        del llm

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.hf_dtype)).eval()
    hf_rates = {}
    with torch.no_grad():
        def hf_generate(batch, new_tokens):
            ids = torch.tensor(prompts[:batch])
            t0 = time.perf_counter()
            hf.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0)
            prefill = time.perf_counter() - t0
            t0 = time.perf_counter()
            out = hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=0)
            greedy["hf"] = out[0, args.prompt_len:].tolist()
            end = time.perf_counter()
            return t0 + prefill, end
        hf_generate(1, 4)
        for batch in batches:
            hf_rates[batch] = decode_rate(hf_generate, batch, args.new_tokens, args.repeats)

    print(f"\n{args.preset}: {args.threads} threads, prompt {args.prompt_len}, {args.new_tokens} new tokens, greedy, "
          f"median of {args.repeats}; copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    print("| mode | batch | compile (s) | artifact (MiB) | launches/step | kiln tok/s | limit tok/s | of limit "
          f"| HF {args.hf_dtype} tok/s | kiln / HF |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        hf_rate = hf_rates[r[1]]
        print("| " + " | ".join(map(str, r)) + f" | {hf_rate:.2f} | {float(r[5]) / hf_rate:.2f}x |")
    print("\n| mode | KV layers | KV bytes/token | one sequence at 4k tokens: all pages | with window freeing |")
    print("|---|---|---|---|---|")
    for r in kv_rows:
        print("| " + " | ".join(map(str, r)) + " |")
    print("greedy tokens equal to HF: " + ", ".join(f"{m}: {'yes' if greedy[m] == greedy['hf'] else 'no'}"
                                                     for m in args.modes.split(",")))


if __name__ == "__main__":
    main()
