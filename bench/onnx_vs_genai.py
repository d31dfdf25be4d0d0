"""Decode speed of kiln on an ONNX Runtime GenAI model beside onnxruntime-genai on the same file, and beside kiln
compiled from the Hugging Face directory the file was built from and from torch.onnx.export's file of it (fp32):
the same kernels should give the same speed.

    python bench/onnx_vs_genai.py [--model build/smollm2-135m-instruct-hf] [--precisions fp32,int4]
                                  [--batches 1,8] [--prompt-len 32] [--new-tokens 64] [--repeats 5] [--threads N]

ONNX Runtime GenAI's builder writes an fp32 and an int4 file from MODEL (cached under --workdir). kiln compiles
each file for the CPU with its defaults (float32; the int4 file's blocks as q4 with its float32 scales and int8
activations, as MatMulNBits' accuracy level 4 computes; and with --group-scales float16, the scales rounded to
float16 as kiln's q4 from MODEL has them) and MODEL likewise (float32; for the int4 rows q4 on every linear and the
LM head, the embedding table float, as the file has them). BATCH
sequences of --prompt-len random tokens generate --new-tokens greedily: decode tok/s counts the tokens after each
sequence's first over the time from the last first token to the last (onnxruntime-genai: its generator's steps
after the first). Medians of --repeats rounds; each round runs every row once, in turn, after a warm-up round.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def build_onnx(model: Path, precision: str, out: Path) -> Path:
    if not (out / "model.onnx").exists():
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(model), "-o", str(out),
                        "-p", precision, "-e", "cpu", "-c", str(out.parent / "cache")], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


def torch_exported(model: Path, out: Path) -> Path:
    if not (out / "model.onnx").exists():
        subprocess.run([sys.executable, "-m", "kiln.testing.onnx_export", str(model), str(out)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


def compiled(source: Path, out: Path, **options) -> Path:
    if not (out / "manifest.json").exists():
        from kiln.compiler import compile_model
        from kiln.options import CompileOptions
        compile_model(source, out, CompileOptions(target="cpu", **options), show=None)
    return out


def kiln_decode(llm, prompts, new_tokens: int) -> float:
    from kiln.runtime.sampler import SamplingParams
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True),
                        use_tqdm=False)
    first = max(o.metrics.first_token_time for o in outs)
    last = max(o.metrics.last_token_time for o in outs)
    return sum(len(o.outputs[0].token_ids) - 1 for o in outs) / (last - first)


def genai_decode(model, prompts, new_tokens: int) -> float:
    import onnxruntime_genai as og
    params = og.GeneratorParams(model)
    length = len(prompts[0]) + new_tokens
    params.set_search_options(max_length=length, min_length=length, do_sample=False, batch_size=len(prompts))
    generator = og.Generator(model, params)
    generator.append_tokens(np.asarray(prompts, np.int32))
    generator.generate_next_token()
    start = time.perf_counter()
    steps = 0
    while steps < new_tokens - 1 and not generator.is_done():
        generator.generate_next_token()
        steps += 1
    return len(prompts) * steps / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="build/smollm2-135m-instruct-hf")
    ap.add_argument("--precisions", default="fp32,int4")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--workdir", default="build/bench/onnx")
    args = ap.parse_args()
    if args.threads:
        os.environ["TVM_NUM_THREADS"] = str(args.threads)
    import onnxruntime_genai as og

    from kiln.runtime.llm import LLM
    model, work = Path(args.model), Path(args.workdir)
    batches = [int(b) for b in args.batches.split(",")]
    vocab = int(__import__("json").loads((model / "config.json").read_text())["vocab_size"])
    rng = np.random.default_rng(0)
    runs = {}
    for precision in args.precisions.split(","):
        onnx_dir = build_onnx(model, precision, work / f"{model.name}-{precision}")
        # the file's choices: every linear and the LM head 4-bit, the embedding table float
        quant = ({"quant": "q4", "lm_head_quant": "q4", "more_bits": False, "quant_embedding": False}
                 if precision == "int4" else {})
        from_onnx = compiled(onnx_dir, work / f"kiln-onnx-{precision}")
        from_hf = compiled(model, work / f"kiln-hf-{precision}", **quant)
        from_torch = compiled(torch_exported(model, work / f"{model.name}-torch"), work / "kiln-torch-fp32") \
            if precision == "fp32" else None
        rounded = compiled(onnx_dir, work / "kiln-onnx-int4-f16scales", scale_dtype="float16") \
            if precision == "int4" else None
        for batch in batches:
            prompts = [rng.integers(3, vocab, args.prompt_len).tolist() for _ in range(batch)]
            runs[precision, batch, "onnxruntime-genai"] = (genai_decode, og.Model(str(onnx_dir)), prompts)
            runs[precision, batch, "kiln (from the ONNX file)"] = (kiln_decode, LLM(from_onnx, kv_memory="256MiB",
                                                                                   prefix_caching=False), prompts)
            runs[precision, batch, "kiln (from the HF directory)"] = (kiln_decode, LLM(from_hf, kv_memory="256MiB",
                                                                                      prefix_caching=False), prompts)
            if from_torch is not None:
                runs[precision, batch, "kiln (from torch.onnx.export's file)"] = (
                    kiln_decode, LLM(from_torch, kv_memory="256MiB", prefix_caching=False), prompts)
            if rounded is not None:
                runs[precision, batch, "kiln (from the ONNX file, --group-scales float16)"] = (
                    kiln_decode, LLM(rounded, kv_memory="256MiB", prefix_caching=False), prompts)
    measured = {key: [] for key in runs}
    for round_ in range(args.repeats + 1):
        for key, (run, engine, prompts) in runs.items():
            rate = run(engine, prompts, args.new_tokens)
            if round_:
                measured[key].append(rate)
    threads = os.environ.get("TVM_NUM_THREADS", "all")
    print(f"\n{model.name}, {args.prompt_len} in / {args.new_tokens} out, threads {threads}; decode tok/s, medians of "
          f"{args.repeats}")
    print("| file | batch | who | decode tok/s | vs onnxruntime-genai |\n|---|---|---|---|---|")
    for (precision, batch, who), rates in measured.items():
        peer = statistics.median(measured[precision, batch, "onnxruntime-genai"])
        rate = statistics.median(rates)
        print(f"| {precision} | {batch} | {who} | {rate:.1f} | {rate / peer:.2f}x |")


if __name__ == "__main__":
    main()
