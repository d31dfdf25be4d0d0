"""Multi-LoRA serving speed: the base model's throughput beside the same batch on adapters.

    python bench/lora.py [--preset llama-3.2-1b] [--quant q8] [--batch 8] [--adapters 8] [--rank 16] [--threads N]
    python bench/lora.py --artifacts BASE LORA --model MODEL_DIR [--batch 32] [--adapters 8]   (a GPU kit's)

Two artifacts of the preset's model (random weights), compiled here for the CPU: without adapter slots,
and with --max-loras ADAPTERS --max-lora-rank RANK; or two given (--artifacts, e.g. CUDA ones with
`kiln fill-weights` weights; MODEL_DIR gives the adapters' shapes). Rank-RANK PEFT adapters on
q/k/v/o/gate/up/down (random, written here in PEFT's file format), the sequences spread over them in
turn. BATCH sequences of --prompt-len tokens each generate --new-tokens greedily,
in one kiln.LLM.generate; prefill tok/s counts the prompts' tokens over the time to the last first
token, decode tok/s the tokens after each sequence's first over the time from the last first token to
the last token. Medians of --repeats rounds, each
round running every row once in turn (so that a slower or faster minute of the VM hits them alike).
Rows: the base artifact; the LoRA artifact with no adapter; all sequences on one adapter; spread over
ADAPTERS.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import numpy as np

from kiln.testing.lora import write_random_adapter

def rates(llm, prompts, params, loras) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of one generate: the prompts' tokens over the time from the first
    arrival to the last first token; the tokens after each sequence's first over the time from the last
    first token to the last token."""
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    start = min(o.metrics.arrival_time for o in outs)
    first = max(o.metrics.first_token_time for o in outs)
    last = max(o.metrics.last_token_time for o in outs)
    return (sum(len(p) for p in prompts) / (first - start),
            sum(len(o.outputs[0].token_ids) - 1 for o in outs) / (last - first))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-3.2-1b")
    ap.add_argument("--quant", default="q8")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--adapters", type=int, default=None, help="distinct adapters (default: --batch)")
    ap.add_argument("--artifacts", nargs=2, default=None, metavar=("BASE", "LORA"))
    ap.add_argument("--model", default=None, help="with --artifacts: the model folder (its config.json)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--workdir", default="build/bench/lora")
    args = ap.parse_args()
    if args.threads:
        os.environ["TVM_NUM_THREADS"] = str(args.threads)
    from kiln.runtime.llm import LLM
    from kiln.runtime.lora import LoRARequest
    from kiln.runtime.sampler import SamplingParams
    work = Path(args.workdir) / args.preset
    count = args.adapters or args.batch
    if args.artifacts:
        artifacts, model_dir = dict(zip(("base", "lora"), map(Path, args.artifacts))), Path(args.model)
    else:                            # compiled here (the GPU machine has TVM's runtime alone: --artifacts)
        from kiln.compiler import compile_model
        from kiln.options import CompileOptions
        from kiln.testing.tiny import preset_model
        model_dir = preset_model(args.preset, work / "model")
        artifacts = {}
        for name, slots in (("base", 0), ("lora", count)):
            out = work / (f"{args.quant}-{name}" + (f"{slots}-r{args.rank}" if slots else ""))
            if not (out / "manifest.json").exists():
                compile_model(model_dir, out, CompileOptions(quant=args.quant, max_loras=slots,
                                                             max_lora_rank=args.rank), show=None)
            artifacts[name] = out
    config = json.loads((model_dir / "config.json").read_text())
    adapters = [LoRARequest(f"a{i}", i + 1, str(write_random_adapter(work / f"adapter-r{args.rank}-{i}", config,
                                                                       args.rank, i)))
                for i in range(count)]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, config["vocab_size"], args.prompt_len).tolist() for _ in range(args.batch)]
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    # no prefix cache: every round computes its prompts (the base model's would be found cached)
    base_llm, lora_llm = (LLM(artifacts[name], kv_memory="256MiB", prefix_caching=False) for name in ("base", "lora"))
    runs = {"base artifact (no slots)": (base_llm, None, "-"), "LoRA artifact, no adapter": (lora_llm, None, "0"),
            "all on one adapter": (lora_llm, [adapters[0]] * args.batch, "1"),
            f"spread over {count} adapters": (lora_llm, [adapters[i % count] for i in range(args.batch)], str(count))}
    measured = {label: [] for label in runs}
    for round_ in range(args.repeats + 1):          # rounds interleave the runs; the first warms up
        for label, (llm, loras, _) in runs.items():
            pair = rates(llm, prompts, params, loras)
            if round_:
                measured[label].append(pair)
    rows = [(label, count, *(statistics.median(p[i] for p in measured[label]) for i in (0, 1)))
            for label, (_, _, count) in runs.items()]
    base = rows[0]
    threads = os.environ.get("TVM_NUM_THREADS", "all")
    what = f"{artifacts['lora']}" if args.artifacts else f"{args.preset} {args.quant}"
    print(f"\n{what}, batch {args.batch}, rank {args.rank} on q/k/v/o/gate/up/down, "
          f"{args.prompt_len} in / {args.new_tokens} out, threads {threads}; tok/s, medians of {args.repeats}")
    print("| run | adapters | prefill tok/s | vs base | decode tok/s | vs base |\n|---|---|---|---|---|---|")
    for label, count, prefill, decode in rows:
        print(f"| {label} | {count} | {prefill:.1f} | {prefill / base[2]:.2f}x | {decode:.1f} "
              f"| {decode / base[3]:.2f}x |")


if __name__ == "__main__":
    main()
