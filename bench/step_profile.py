"""Where one step of a compiled artifact spends its time, kernel by kernel.

    python bench/step_profile.py ARTIFACT [--step prefill|decode] [--tokens 128] [--seqs 1]
                                 [--threads 2] [--repeats 5] [--top 15]

A prefill step brings --tokens new tokens for each of --seqs sequences; a decode step one token each
after --tokens of context. The VM's instrument hook times every call it makes (kernels, and the VM's
own builtins), summed per kernel name over a step; the table shows each kernel's median time per
step, its share of the step and its calls. Times include the hook's Python overhead, a few µs a call.
On a CUDA artifact the hook would time launches, not kernels: there PyTorch's profiler (CUPTI) reads
each kernel's time on the GPU, CUDA graphs off so every kernel of the step is launched and named.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict


def step_inputs_for(model, step: str, tokens: int, seqs: int):
    import numpy as np
    from kiln.runtime.step import SeqChunk, step_inputs
    pages = -(-(tokens + 1) // model.page_size)
    model.allocate_kv((pages * seqs + 1) * model.bytes_per_page)
    rng = np.random.default_rng(0)
    chunks = []
    for s in range(seqs):
        own = list(range(s * pages, (s + 1) * pages))
        if step == "prefill":
            chunks.append(SeqChunk(rng.integers(3, 500, tokens).tolist(), 0, own, list(range(tokens))))
        else:
            chunks.append(SeqChunk([int(rng.integers(3, 500))], tokens, own, [tokens]))
    return step_inputs(chunks, model.page_size)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--step", choices=("prefill", "decode"), default="prefill")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--seqs", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    os.environ["TVM_NUM_THREADS"] = str(args.threads)       # before TVM starts its pool
    import tvm
    from kiln.runtime.model import CompiledModel
    model = CompiledModel(args.artifact)
    model.graph_batches = ()
    inputs = step_inputs_for(model, args.step, args.tokens, args.seqs)
    kind = model.step_kind(inputs)
    model.forward(inputs)
    if model.device.dlpack_device_type() != tvm.cpu(0).dlpack_device_type():
        return gpu_profile(model, inputs, kind, args)

    calls: dict[str, list[float]] = defaultdict(list)
    started: list[float] = []

    def instrument(func, symbol, before, ret, *rest):
        if before:
            started.append(time.perf_counter())
        else:
            calls[symbol].append(time.perf_counter() - started.pop())
        return 0                                              # VMInstrumentReturnKind.NO_OP: go on
    steps, per_kernel = [], defaultdict(list)
    model.vm.set_instrument(instrument)
    for _ in range(args.repeats):
        calls.clear()
        t0 = time.perf_counter()
        model.forward(inputs)
        steps.append(time.perf_counter() - t0)
        for name, times in calls.items():
            per_kernel[name].append((sum(times), len(times)))
    model.vm.set_instrument(None)
    step = statistics.median(steps)
    rows = sorted(((statistics.median(t for t, _ in v), v[0][1], name) for name, v in per_kernel.items()),
                  reverse=True)
    print(f"{args.artifact}: {args.step} step ({kind} entry), {args.tokens} tokens × {args.seqs} sequences, "
          f"{args.threads} threads: {step * 1e3:.2f} ms per step (median of {args.repeats}), "
          f"{sum(n for _, n, _ in rows)} calls")
    print_kernel_table(rows, args.top, step, "share", 2)


def gpu_profile(model, inputs, kind: str, args) -> None:
    """Kernel times on the GPU over --repeats steps (CUPTI sees TVM's launches as well as PyTorch's)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    steps = []
    for _ in range(args.repeats):                            # wall time, without the profiler
        t0 = time.perf_counter()
        model.forward(inputs)                                # logits copied back: the step has ended
        steps.append(time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.repeats):
            model.forward(inputs)
        torch.cuda.synchronize()
    rows = sorted(((e.device_time_total / args.repeats / 1e6, e.count // args.repeats, e.key)
                   for e in prof.key_averages() if e.device_time_total > 0), reverse=True)
    step = statistics.median(steps)
    busy = sum(s for s, _, _ in rows)
    print(f"{args.artifact}: {args.step} step ({kind} entry), {args.tokens} tokens × {args.seqs} sequences on "
          f"{torch.cuda.get_device_name()}: {step * 1e3:.2f} ms per step wall (median of {args.repeats}), "
          f"kernels {busy * 1e3:.2f} ms, {sum(n for _, n, _ in rows)} launches")
    print_kernel_table(rows, args.top, busy, "share of kernel time", 3)
    if args.step == "decode":             # against the copy rate: the bytes the step must read, KV included
        from decode_gpu import hbm_bandwidth, step_bytes
        nbytes, rate = step_bytes(model, args.seqs, args.tokens), hbm_bandwidth(torch)
        kv = args.seqs * args.tokens * model.bytes_per_token
        print(f"reads {nbytes / 1e9:.2f} GB a step ({kv / 1e9:.2f} GB of it KV): {nbytes / busy / 1e12:.2f} TB/s over "
              f"the kernels' time, {nbytes / rate / busy:.0%} of the copy rate ({rate / 1e12:.2f} TB/s, read + write)")


def print_kernel_table(rows, top: int, total: float, share: str, digits: int) -> None:
    """rows: (seconds per step, calls, kernel), slowest first; each kernel's share of `total` seconds."""
    print(f"| kernel | calls | ms per step | {share} |")
    print("|---|---|---|---|")
    for seconds, count, name in rows[:top]:
        print(f"| {name[:90]} | {count} | {seconds * 1e3:.{digits}f} | {seconds / total:.1%} |")
    rest = sum(s for s, _, _ in rows[top:])
    print(f"| (the other {max(len(rows) - top, 0)} kernels) | | {rest * 1e3:.{digits}f} | {rest / total:.1%} |")


if __name__ == "__main__":
    main()
