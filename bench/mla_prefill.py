"""MLA prefill on the CPU: the absorbed form against the expanded one, per chunk size and cached
context, with llama.cpp's prefill of the same shape in the same run.

    python bench/mla_prefill.py [--preset deepseek-v2-lite-4l] [--chunks 16,32,64,128,256,512]
                                [--contexts 0,512] [--threads 2] [--repeats 3]

One bf16 model (testing/tiny.py PRESETS), compiled twice: `--mla-expanded-from 0` (absorbed in every
step) and `--mla-expanded-from 2` (every prefill step expanded). Each cell times one step of one
sequence bringing `chunk` new tokens after `context` cached ones (CompiledModel.forward, median of
--repeats, the two artifacts alternating), and llama-bench's prompt processing of `chunk` tokens at
depth `context` (-p chunk -d context) on the same checkpoint as a bf16 GGUF. The last column says
which form is faster; the CPU target's mla_expanded_from (targets/cpu.py) comes from this table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from big_model import built_llama_cpp  # noqa: E402
from moe_mla import gguf  # noqa: E402

from kiln.options import CompileOptions


def llama_prefill_rate(llama_cpp: Path, model: Path, chunk: int, context: int, threads: int, repeats: int) -> float:
    proc = subprocess.run([str(llama_cpp / "build" / "bin" / "llama-bench"), "-m", str(model), "-p", str(chunk),
                           "-n", "0", "-d", str(context), "-t", str(threads), "-r", str(repeats), "-o", "json"],
                          capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"llama-bench failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)[0]["avg_ts"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="deepseek-v2-lite-4l")
    ap.add_argument("--chunks", default="16,32,64,128,256,512")
    ap.add_argument("--contexts", default="0,512")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--llama-cpp", default=None, help="default: build/peers/llama_cpp_python-*/vendor/llama.cpp")
    ap.add_argument("--workdir", default="build/bench")
    args = ap.parse_args()
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    llama_cpp = built_llama_cpp(args.llama_cpp)

    import numpy as np
    from kiln.compiler import compile_model
    from kiln.runtime.model import CompiledModel
    from kiln.runtime.step import SeqChunk, step_inputs
    from kiln.testing.tiny import preset_model

    work = Path(args.workdir) / args.preset
    model_dir = preset_model(args.preset, work / "model")
    forms = {"absorbed": 0, "expanded": 2}
    models = {}
    for form, expanded_from in forms.items():
        out = work / f"artifact-bf16-{form}"
        options = CompileOptions(target="cpu", dtype="bfloat16", mla_expanded_from=expanded_from)
        compile_model(model_dir, out, options, show=None, force=True)
        models[form] = CompiledModel(out)
    chunks, contexts = [int(c) for c in args.chunks.split(",")], [int(c) for c in args.contexts.split(",")]
    page_size = models["absorbed"].page_size
    pages = -(-(max(chunks) + max(contexts)) // page_size)
    for model in models.values():
        model.allocate_kv((pages + 1) * model.bytes_per_page)
    ids = np.random.default_rng(0).integers(3, 500, max(chunks)).tolist()
    ggml = gguf(model_dir, work, llama_cpp)

    rows = []
    for context in contexts:
        for chunk in chunks:
            seq = SeqChunk(ids[:chunk], context, list(range(pages)),
                           [(context + i) for i in range(chunk)])          # pages 0.. in order: slot = position
            inputs = step_inputs([seq], page_size)
            assert {m.step_kind(inputs) for m in models.values()} == {"mixed", "prefill"} or chunk < 2
            times = {form: [] for form in models}
            for form, model in models.items():
                model.forward(inputs)                                       # warm
            for _ in range(args.repeats):
                for form, model in models.items():
                    t0 = time.perf_counter()
                    model.forward(inputs)
                    times[form].append(time.perf_counter() - t0)
            rate = {form: chunk / statistics.median(t) for form, t in times.items()}
            llama = llama_prefill_rate(llama_cpp, ggml, chunk, context, args.threads, args.repeats)
            faster = max(rate, key=rate.get)
            rows.append([context, chunk, f"{rate['absorbed']:.1f}", f"{rate['expanded']:.1f}",
                         f"{rate['expanded'] / rate['absorbed']:.2f}x", f"{llama:.1f}",
                         f"{max(rate.values()) / llama:.2f}x", faster])
            print(" | ".join(map(str, rows[-1])), file=sys.stderr)

    print(f"\n{args.preset}, bf16, {args.threads} threads, one sequence, prefill tok/s (median of {args.repeats})")
    print("| cached context | chunk | kiln absorbed | kiln expanded | expanded / absorbed | llama.cpp | "
          "kiln best / llama.cpp | faster form |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(map(str, r)) + " |")


if __name__ == "__main__":
    main()
