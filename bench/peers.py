"""kiln beside llama.cpp on the CPU, in one run: prefill, batch-1 decode and batch-8 decode per mode.

    python bench/peers.py [--preset llama-3.2-1b] [--modes bf16,q8,q4] [--threads 2] [--repeats 3]
                          [--llama-cpp build/peers/llama_cpp_python-*/vendor/llama.cpp]

The preset's random checkpoint (testing/tiny.py PRESETS) is compiled by kiln per mode (bf16; q8 and q4
weights in a float32 model) and converted to GGUF (bf16, Q8_0, Q4_0; bench/big_model.py).
- prefill: one step of --prompt-len new tokens for one sequence (CompiledModel.forward, median of
  --repeats) against `llama-bench -p N -n 0`'s pp. kiln is measured twice: as compiled (steps with
  chunks run codegen/kernels/cpu/gemm.py's GEMM; q8/q4 linears take int8 activations, codegen/kernels/cpu/int8_gemm.py) and
  as before those kernels (the GEMM out of the target's kernel order, float activations: every step on
  the GEMV schedule), so their gain is measured in the same run;
- decode, batch 1: `llama-bench -n 64`'s tg against kiln's engine decoding 64 tokens, in --repeats
  rounds that each read the bandwidth, run llama-bench once and kiln once: this VM's bandwidth
  drifts by half within minutes, so each round's kiln / llama.cpp ratio compares one window, and
  the table shows the median ratio beside each program's median rate, and in brackets the ratio of
  each program's best round (each in its best window); every round is printed as it runs;
- decode, batch 8: `llama-batched-bench -npp 16 -ntg 64 -npl 8`'s S_TG against 8 sequences in kiln's
  engine;
- the batch-1 decode roofline: the machine's best streaming-read rate (bench/bandwidth.py, same
  threads; read at the start and in each decode round) over the bytes of weights a decode step
  reads (every weight but an untied embedding table); `kiln / roofline` is kiln's median rate
  against the best read of the mode's rounds, and `(same round)` the median of each round's rate
  against that round's read.
llama.cpp must be built as ../shared/PEERS.md says. Same thread count everywhere.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bandwidth import read_bandwidth  # noqa: E402
from big_model import MODES, built_llama_cpp, gguf_files  # noqa: E402
from decode_cpu import decode_rate  # noqa: E402

from kiln.options import CompileOptions


def llama_bench(llama_cpp: Path, gguf: Path, prompt: int, new_tokens: int, threads: int, repeats: int) -> float:
    """llama-bench's tokens/s for a prompt of `prompt` tokens (pp) or `new_tokens` decoded (tg): one of them 0."""
    proc = subprocess.run([str(llama_cpp / "build" / "bin" / "llama-bench"), "-m", str(gguf), "-p", str(prompt),
                           "-n", str(new_tokens), "-t", str(threads), "-r", str(repeats), "-o", "json"],
                          capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"llama-bench failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)[0]["avg_ts"]


def llama_batched_rate(llama_cpp: Path, gguf: Path, new_tokens: int, threads: int, repeats: int) -> float:
    """Median S_TG (tokens/s over 8 sequences) of llama-batched-bench."""
    eight = []
    for _ in range(repeats):
        proc = subprocess.run([str(llama_cpp / "build" / "bin" / "llama-batched-bench"), "-m", str(gguf), "-c", "2048",
                               "-npp", "16", "-ntg", str(new_tokens), "-npl", "8", "-t", str(threads)],
                              capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"llama-batched-bench failed:\n{proc.stderr[-3000:]}")
        row = next(line for line in proc.stdout.splitlines() if re.match(r"\|\s+16\s+\|", line))
        eight.append(float(row.strip("|").split("|")[7]))          # S_TG t/s
    return statistics.median(eight)


def decode_bytes(artifact: Path) -> int:
    """Bytes of weights one decode step reads: all but an embedding table the LM head does not share."""
    from kiln.artifact import read_manifest
    m = read_manifest(artifact, verify=False).to_json()
    item = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "uint8": 1, "float8_e4m3fn": 1}
    untied_table = not m["quantization"]["embedding_shared_with_lm_head"]
    return sum(item[w["dtype"]] * math.prod(w["shape"]) for w in m["weights"]
               if not (untied_table and "embed_tokens" in w["param"]))


def kiln_prefill_rate(artifact: Path, prompt: int, repeats: int) -> float:
    import numpy as np
    from kiln.runtime.model import CompiledModel
    from kiln.runtime.step import SeqChunk, step_inputs
    model = CompiledModel(artifact)
    pages = -(-prompt // model.page_size)
    model.allocate_kv((pages + 1) * model.bytes_per_page)
    ids = np.random.default_rng(0).integers(3, 500, prompt).tolist()
    inputs = step_inputs([SeqChunk(ids, 0, list(range(pages)), list(range(prompt)))], model.page_size)
    model.forward(inputs)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model.forward(inputs)
        times.append(time.perf_counter() - t0)
    return prompt / statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-3.2-1b")
    ap.add_argument("--modes", default="bf16,q8,q4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--llama-cpp", default=None, help="default: build/peers/llama_cpp_python-*/vendor/llama.cpp")
    ap.add_argument("--workdir", default="build/bench")
    args = ap.parse_args()
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    llama_cpp = built_llama_cpp(args.llama_cpp)

    import numpy as np
    from kiln.compiler import compile_model
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampler import SamplingParams
    from kiln.targets import target_defaults
    from kiln.testing.tiny import preset_model

    work = Path(args.workdir) / args.preset
    model_dir = preset_model(args.preset, work / "model")
    modes = args.modes.split(",")
    ggufs = gguf_files(model_dir, work, llama_cpp, modes)
    prompts = [np.random.default_rng(i).integers(3, 500, 16).tolist() for i in range(8)]
    cpu, rows = target_defaults("cpu"), []
    bandwidth = read_bandwidth(args.threads)
    print(f"streaming read: {bandwidth:.1f} GB/s at {args.threads} threads", file=sys.stderr, flush=True)
    for mode in modes:
        dtype, quant = MODES[mode]
        kiln = {}
        gemv = dataclasses.replace(cpu, kernels=cpu.kernels.without("gemm"))
        for label, target, int8_activations in (("gemv", gemv, False), ("gemm", cpu, None)):
            artifact = work / f"artifact-{mode}-{label}"
            t0 = time.perf_counter()
            options = CompileOptions(target=target, dtype=dtype, quant=quant,
                                     int8_activations=int8_activations if quant else None)
            compile_model(model_dir, artifact, options, show=None, force=True)
            kiln[f"compile_{label}"] = time.perf_counter() - t0
            kiln[f"pp_{label}"] = kiln_prefill_rate(artifact, args.prompt_len, args.repeats)
        llm = LLM(work / f"artifact-{mode}-gemm", kv_memory="512MiB", max_num_seqs=8)

        def generate(batch, new_tokens, llm=llm):
            reqs = llm.generate(prompts[:batch], SamplingParams(temperature=0.0, max_tokens=new_tokens,
                                                                ignore_eos=True), use_tqdm=False)
            return max(r.metrics.first_token_time for r in reqs), max(r.metrics.finish_time for r in reqs)
        generate(1, 4)
        gguf, step_bytes = ggufs[mode]["gguf"], decode_bytes(work / f"artifact-{mode}-gemm")
        # batch-1 decode in rounds, each one window of the VM's drifting bandwidth: a read, llama.cpp, kiln
        rounds = []
        for _ in range(args.repeats):
            read = read_bandwidth(args.threads)
            peer_tg = llama_bench(llama_cpp, gguf, 0, args.new_tokens, args.threads, 1)
            kiln_tg = decode_rate(generate, 1, args.new_tokens, 1)
            rounds.append((read, peer_tg, kiln_tg))
            print(f"{mode} decode round {len(rounds)}: read {read:.1f} GB/s, llama.cpp {peer_tg:.1f}, kiln {kiln_tg:.1f} "
                  f"tok/s ({kiln_tg / peer_tg:.2f}x)", file=sys.stderr, flush=True)
        best_read = max(r[0] for r in rounds)
        bandwidth = max(bandwidth, best_read)
        peer = {"tg": statistics.median(p for _, p, _ in rounds)}
        kiln["tg"] = statistics.median(k for _, _, k in rounds)
        tg_ratio = statistics.median(k / p for _, p, k in rounds)
        best_ratio = max(k for _, _, k in rounds) / max(p for _, p, _ in rounds)   # each in its best window
        roofline = best_read * 1e9 / step_bytes
        same_round = statistics.median(k * step_bytes / (read * 1e9) for read, _, k in rounds)
        kiln["b8"] = decode_rate(generate, 8, args.new_tokens, args.repeats)
        del llm
        peer["pp"] = llama_bench(llama_cpp, gguf, args.prompt_len, 0, args.threads, args.repeats)
        peer["b8"] = llama_batched_rate(llama_cpp, gguf, args.new_tokens, args.threads, args.repeats)
        rows.append([mode, f"{peer['pp']:.1f}", f"{kiln['pp_gemv']:.1f}", f"{kiln['pp_gemm']:.1f}",
                     f"{kiln['pp_gemm'] / kiln['pp_gemv']:.2f}x", f"{kiln['pp_gemm'] / peer['pp']:.2f}x",
                     f"{peer['tg']:.1f}", f"{kiln['tg']:.1f}", f"{tg_ratio:.2f}x ({best_ratio:.2f}x)",
                     f"{roofline:.1f}", f"{kiln['tg'] / roofline:.0%} ({same_round:.0%})",
                     f"{peer['b8']:.1f}", f"{kiln['b8']:.1f}", f"{kiln['b8'] / peer['b8']:.2f}x",
                     f"{kiln['compile_gemm']:.0f}"])
        print(" | ".join(rows[-1]), file=sys.stderr, flush=True)

    print(f"\n{args.preset}, {args.threads} threads, tok/s, medians of {args.repeats}: prefill {args.prompt_len} "
          f"tokens, decode {args.new_tokens} tokens at batch 1 (in rounds, the ratio the median of the rounds'; "
          f"(best rounds): the best round's rates') "
          f"and 8; roofline: the best streaming read of the mode's decode rounds (at most {bandwidth:.1f} GB/s) "
          f"over the bytes a decode step reads; (same round): each round's rate against its own read")
    print("| mode | llama.cpp pp | kiln pp (before: GEMV) | kiln pp | kiln / before | kiln / llama.cpp | llama.cpp tg "
          "| kiln tg | kiln / llama.cpp (best rounds) | tg roofline | kiln / roofline (same round) | llama.cpp b8 | kiln b8 "
          "| kiln / llama.cpp | kiln compile (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
