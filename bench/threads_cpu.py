"""How kiln's CPU kernels scale with threads, beside llama.cpp at the same counts: for a machine
with more cores than this one.

    python bench/threads_cpu.py [--preset llama-3.2-1b] [--modes bf16,q8,q4] [--threads 1,2,4,8,16]
                                [--artifacts DIR] [--llama-cpp DIR] [--prompt-len 128] [--new-tokens 32]

Per mode and thread count: prefill of --prompt-len new tokens for one sequence (one step, median of
--repeats), batch-1 decode and batch-8 decode of --new-tokens tokens, against llama-bench's pp and
tg and llama-batched-bench's S_TG when llama.cpp is built (../shared/PEERS.md). The artifacts are
DIR/<mode> (compiled elsewhere with --no-weights, their weights drawn by `kiln fill-weights`) or,
without --artifacts, compiled here from the preset's random checkpoint; llama.cpp's GGUF files are
converted from that checkpoint (bench/big_model.py). Each thread count runs kiln in a fresh process,
as TVM sizes its worker pool once. The decode roofline is the streaming-read rate at that count
(PyTorch summing 1 GiB: bench/bandwidth.py needs TVM's compiler, which a runtime-only TVM lacks) over
the bytes a decode step reads. An artifact with AMX tile kernels (kiln inspect's `tiles` line) is
measured again with KILN_CPU_TILES=off, the same kernels on AVX-512 BF16 dots: `tiles / off`.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from big_model import MODES, gguf_files  # noqa: E402
from decode_cpu import decode_rate  # noqa: E402
from peers import decode_bytes, kiln_prefill_rate, llama_batched_rate, llama_bench  # noqa: E402

from kiln.options import CompileOptions


def torch_read_bandwidth(threads: int, repeats: int = 7) -> float:
    """Best GB/s of PyTorch summing a 1 GiB float32 tensor on `threads` threads."""
    import torch
    torch.set_num_threads(threads)
    data = torch.ones(2**28)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - t0)
    return data.numel() * 4 / best / 1e9


def measure_kiln(artifacts: dict[str, str], threads: int, prompt_len: int, new_tokens: int, repeats: int) -> dict:
    """In this process, at `threads` threads: per mode the prefill, batch-1 and batch-8 decode rates."""
    import numpy as np
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampler import SamplingParams
    from kiln.runtime.threads import set_threads
    set_threads(threads)
    prompts = [np.random.default_rng(i).integers(3, 500, 16).tolist() for i in range(8)]
    out = {}
    for mode, artifact in artifacts.items():
        llm = LLM(artifact, kv_memory="512MiB", max_num_seqs=8, threads=threads)

        def generate(batch, tokens, llm=llm):
            reqs = llm.generate(prompts[:batch], SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True),
                                use_tqdm=False)
            return max(r.metrics.first_token_time for r in reqs), max(r.metrics.finish_time for r in reqs)
        generate(1, 4)
        out[mode] = {"tg": decode_rate(generate, 1, new_tokens, repeats),
                     "b8": decode_rate(generate, 8, new_tokens, repeats)}
        del llm
        out[mode]["pp"] = kiln_prefill_rate(Path(artifact), prompt_len, repeats)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama-3.2-1b")
    ap.add_argument("--modes", default="bf16,q8,q4")
    ap.add_argument("--threads", default="1,2,4,8,16")
    ap.add_argument("--artifacts", default=None, help="DIR/<mode> artifacts (default: compile into --workdir)")
    ap.add_argument("--llama-cpp", default=None, help="a built llama.cpp (default: build/peers/...; none: kiln only)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", default="build/bench")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)     # JSON: one thread count's kiln run
    args = ap.parse_args()
    if args.worker:
        job = json.loads(args.worker)
        print(json.dumps(measure_kiln(job["artifacts"], job["threads"], args.prompt_len, args.new_tokens,
                                      args.repeats)))
        return

    from kiln.testing.tiny import preset_model
    modes, counts = args.modes.split(","), [int(t) for t in args.threads.split(",")]
    work = Path(args.workdir) / args.preset
    model_dir = preset_model(args.preset, work / "model")
    if args.artifacts:
        artifacts = {m: str(Path(args.artifacts) / m) for m in modes}
    else:
        from kiln.compiler import compile_model
        artifacts = {m: str(work / f"artifact-{m}-gemm") for m in modes}
        for mode in modes:
            if not (Path(artifacts[mode]) / "manifest.json").exists():
                dtype, quant = MODES[mode]
                compile_model(model_dir, artifacts[mode], CompileOptions(dtype=dtype, quant=quant), show=None)
    llama_cpp = None
    if args.llama_cpp != "none":
        from big_model import built_llama_cpp
        try:
            llama_cpp = built_llama_cpp(args.llama_cpp)
        except SystemExit as missing:
            print(f"kiln only: {missing}", file=sys.stderr)
    ggufs = gguf_files(model_dir, work, llama_cpp, modes) if llama_cpp else {}

    from kiln.artifact import read_manifest
    tiled = [m for m in modes if read_manifest(artifacts[m], verify=False).target.tiles]
    rows = {m: [] for m in modes}
    for threads in counts:
        read = torch_read_bandwidth(threads)

        def run_kiln(names: list[str], **env) -> dict:
            job = json.dumps({"artifacts": {m: artifacts[m] for m in names}, "threads": threads})
            proc = subprocess.run([sys.executable, __file__, "--worker", job, "--prompt-len", str(args.prompt_len),
                                   "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats)],
                                  capture_output=True, text=True,
                                  env={**os.environ, "TVM_NUM_THREADS": str(threads), **env})
            if proc.returncode:
                raise SystemExit(f"kiln at {threads} threads failed:\n{proc.stderr[-3000:]}")
            return json.loads(proc.stdout.splitlines()[-1])
        kiln = run_kiln(modes)
        untiled = run_kiln(tiled, KILN_CPU_TILES="off") if tiled else {}
        for mode in modes:
            peer = {}
            if llama_cpp:
                gguf = ggufs[mode]["gguf"]
                peer = {"pp": llama_bench(llama_cpp, gguf, args.prompt_len, 0, threads, args.repeats),
                        "tg": llama_bench(llama_cpp, gguf, 0, args.new_tokens, threads, args.repeats),
                        "b8": llama_batched_rate(llama_cpp, gguf, args.new_tokens, threads, 1)}
            roofline = read * 1e9 / decode_bytes(Path(artifacts[mode]))
            rows[mode].append((threads, read, roofline, kiln[mode], peer, untiled.get(mode)))
            print(f"{mode} {threads} threads: read {read:.1f} GB/s, kiln {kiln[mode]}, llama.cpp {peer}"
                  + (f", kiln with KILN_CPU_TILES=off {untiled[mode]}" if mode in untiled else ""),
                  file=sys.stderr, flush=True)

    print(f"\n{args.preset}, tok/s: prefill {args.prompt_len} tokens (median of {args.repeats}), decode "
          f"{args.new_tokens} tokens at batch 1 and 8; roofline: the read rate at that thread count over the bytes a "
          f"decode step reads; (xN): kiln's rate over its own at {min(counts)} thread(s)")
    for mode in modes:
        off = " kiln pp, tiles off | tiles / off | kiln b8, tiles off | tiles / off |" if mode in tiled else ""
        print(f"\n{mode}\n\n| threads | read GB/s | kiln pp (xN) | llama.cpp pp | kiln / llama.cpp | kiln tg (xN) "
              "| llama.cpp tg | kiln / llama.cpp | kiln / roofline | kiln b8 (xN) | llama.cpp b8 | kiln / llama.cpp |"
              + off)
        print("|---" * (12 + 4 * bool(off)) + "|")
        base = min(rows[mode])[3]
        for threads, read, roofline, kiln, peer, untiled in sorted(rows[mode]):
            cells = [str(threads), f"{read:.1f}"]
            for key in ("pp", "tg", "b8"):
                cells += [f"{kiln[key]:.1f} ({kiln[key] / base[key]:.1f})"]
                cells += [f"{peer[key]:.1f}", f"{kiln[key] / peer[key]:.2f}x"] if peer else ["", ""]
                if key == "tg":
                    cells.append(f"{kiln['tg'] / roofline:.0%}")
            for key in ("pp", "b8") if untiled else ():
                cells += [f"{untiled[key]:.1f}", f"{kiln[key] / untiled[key]:.2f}x"]
            print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
