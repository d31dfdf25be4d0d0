"""Compile, load and run a big model on this machine, beside llama.cpp on the same weights.

    python bench/big_model.py [--preset llama-3.1-8b] [--modes q4,q8] [--threads N]
                              [--llama-cpp DIR] [--serve q4] [--repeats 3] [--workdir build/bench]

For each mode it measures, each in its own process (peak RSS from wait4, so per process):
- `kiln compile` of the preset's checkpoint (the 8B shape is written in bfloat16 tensor by tensor by
  kiln.testing.tiny, so making it needs no 32 GB either): wall time, peak RSS, artifact bytes;
- `kiln run ART --json`: start-up (load_seconds, from the timings), peak RSS of the whole run, and
  decode tok/s, medians of --repeats. Start-up is measured with the weights in the page cache (the
  second and later runs), which is what a user re-running a model sees;
- with --llama-cpp (a built llama.cpp tree, see ../shared/PEERS.md): the checkpoint converted to a
  bf16 GGUF and quantised to Q4_0/Q8_0 (wall time, peak RSS, file size), then `llama-bench` decode
  (tg) at the same thread count, and llama-bench's wall time for one token (load included);
- with --serve MODE: `kiln serve` on that artifact, seconds until /health is ready and one
  /v1/completions answer (16 tokens).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

KILN = [sys.executable, "-m", "kiln.cli"]
MODES = {"bf16": ("bfloat16", None), "q8": ("float32", "q8"), "q4": ("float32", "q4")}
GGUF_TYPES = {"q8": "Q8_0", "q4": "Q4_0", "bf16": None}
PROMPT = "The history of the printing press begins"


def run_measured(cmd: list[str], env=None) -> tuple[float, float, str, str, int]:
    """Run `cmd` with its output in temporary files; (wall s, peak RSS GiB, stdout, stderr, rc)."""
    import tempfile
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return wall, usage.ru_maxrss / 2**20, out.read(), err.read(), proc.returncode


def check(rc: int, cmd, err: str) -> None:
    if rc != 0:
        raise SystemExit(f"{' '.join(map(str, cmd))} failed ({rc}):\n{err[-3000:]}")


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def kiln_compile(model_dir: Path, out: Path, mode: str, threads: int) -> dict:
    dtype, quant = MODES[mode]
    cmd = [*KILN, "compile", str(model_dir), "-o", str(out), "--dtype", dtype, "--force"]
    if quant:
        cmd += ["--quant", quant]
    wall, rss, _, err, rc = run_measured(cmd, env={**os.environ, "TVM_NUM_THREADS": str(threads)})
    check(rc, cmd, err)
    return {"compile_s": wall, "compile_rss_gib": rss, "artifact_gib": dir_bytes(out) / 2**30}


def kiln_run(artifact: Path, threads: int, repeats: int) -> dict:
    cmd = [*KILN, "run", str(artifact), "--prompt", PROMPT, "--max-tokens", "33", "--json", "--threads", str(threads)]
    runs = []
    for _ in range(repeats + 1):                   # the first warms the page cache
        wall, rss, out, err, rc = run_measured(cmd)
        check(rc, cmd, err)
        runs.append((json.loads(out)["timings"], rss, wall))
    runs = runs[1:]
    manifest = json.loads((artifact / "manifest.json").read_text())
    return {"startup_s": statistics.median(t["load_seconds"] for t, _, _ in runs),
            "run_rss_gib": max(r for _, r, _ in runs),
            "weights_gib": manifest["files"]["weights.safetensors"]["bytes"] / 2**30,
            "decode_tok_s": statistics.median(t["decode_tokens_per_second"] for t, _, _ in runs)}


def sentencepiece_tokenizer(out: Path) -> None:
    """A small SentencePiece model (byte fallback) for llama.cpp's converter, which rejects byte-level
    BPE tokenizers it does not know; speed does not depend on the tokenizer."""
    import sentencepiece as spm
    from kiln.testing.tiny import corpus
    text = out.with_suffix(".txt")
    text.write_text("\n".join(corpus()))
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(out.with_suffix("")), vocab_size=1000,
                                   byte_fallback=True, model_type="bpe", minloglevel=2)
    text.unlink()


def built_llama_cpp(given: str | None) -> Path:
    """The llama.cpp checkout to run: `given`, else the newest build/peers/llama_cpp_python-*; it must
    have been built as ../shared/PEERS.md says."""
    import glob
    found = sorted(glob.glob("build/peers/llama_cpp_python-*/vendor/llama.cpp"))
    llama_cpp = Path(given or (found[-1] if found else ""))
    if not (llama_cpp / "build" / "bin" / "llama-bench").exists():
        raise SystemExit(f"llama.cpp is not built at {llama_cpp} (recipe: ../shared/PEERS.md)")
    return llama_cpp


def gguf_source(model_dir: Path, work: Path) -> Path:
    """The checkpoint (linked) with a SentencePiece tokenizer in place of its own, for the converter."""
    source = work / "hf-with-sentencepiece"
    source.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.suffix in (".safetensors", ".json") and not f.name.startswith("tokenizer") \
                and f.name != "special_tokens_map.json" and not (source / f.name).exists():
            (source / f.name).symlink_to(f.resolve())
    if not (source / "tokenizer.model").exists():
        sentencepiece_tokenizer(source / "tokenizer.model")
    return source


def gguf_files(model_dir: Path, work: Path, llama_cpp: Path, modes: list[str]) -> dict:
    """The checkpoint as GGUF files, made once; per mode the quantise step's measurements."""
    bin_dir = llama_cpp / "build" / "bin"
    results, ggufs = {}, {m: work / f"{GGUF_TYPES[m] or 'bf16'}.gguf" for m in modes}
    if all(p.exists() for p in ggufs.values()):
        return {m: {"gguf": p, "gguf_gib": p.stat().st_size / 2**30} for m, p in ggufs.items()}
    source = gguf_source(model_dir, work)
    bf16 = work / "bf16.gguf"
    if not bf16.exists():
        cmd = [sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(source), "--outtype", "bf16",
               "--outfile", str(bf16)]
        wall, rss, _, err, rc = run_measured(cmd, env={**os.environ, "PYTHONPATH": str(llama_cpp / "gguf-py")})
        check(rc, cmd, err)
        print(f"llama.cpp convert_hf_to_gguf (bf16): {wall:.0f} s, peak RSS {rss:.2f} GiB", flush=True)
    for mode in modes:
        if GGUF_TYPES[mode] is None:
            results[mode] = {"gguf": bf16}
            continue
        cmd = [str(bin_dir / "llama-quantize"), str(bf16), str(ggufs[mode]), GGUF_TYPES[mode], "2"]
        wall, rss, _, err, rc = run_measured(cmd)
        check(rc, cmd, err)
        results[mode] = {"gguf": ggufs[mode], "quantize_s": wall, "quantize_rss_gib": rss}
    if "bf16" not in modes:
        bf16.unlink()                                 # 16 GB at 8B: keep only what is measured
    for r in results.values():
        r["gguf_gib"] = r["gguf"].stat().st_size / 2**30
    return results


def llama_bench(llama_cpp: Path, gguf: Path, threads: int, repeats: int) -> dict:
    bench = str(llama_cpp / "build" / "bin" / "llama-bench")
    cmd = [bench, "-m", str(gguf), "-p", "0", "-n", "32", "-t", str(threads), "-r", str(repeats), "-o", "json"]
    _, rss, out, err, rc = run_measured(cmd)
    check(rc, cmd, err)
    tg = json.loads(out)[0]["avg_ts"]
    one = [bench, "-m", str(gguf), "-p", "0", "-n", "1", "-t", str(threads), "-r", "1", "-o", "json"]
    wall, _, _, err, rc = run_measured(one)
    check(rc, one, err)
    return {"llama_decode_tok_s": tg, "llama_rss_gib": rss, "llama_one_token_wall_s": wall}


def serve_check(artifact: Path, threads: int) -> str:
    port = 8417
    cmd = [*KILN, "serve", str(artifact), "--port", str(port), "--threads", str(threads)]
    t0 = time.perf_counter()
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while True:
            if server.poll() is not None:
                raise SystemExit(f"kiln serve exited: {server.stderr.read()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.5)
        ready = time.perf_counter() - t0
        body = json.dumps({"model": artifact.name, "prompt": PROMPT, "max_tokens": 16, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        t1 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=600) as r:
            answer = json.loads(r.read())
        took = time.perf_counter() - t1
        with open(f"/proc/{server.pid}/status") as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 2**20
        return (f"kiln serve {artifact.name}: ready in {ready:.1f} s; /v1/completions gave "
                f"{answer['usage']['completion_tokens']} tokens in {took:.1f} s; server peak RSS {rss:.2f} GiB")
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--modes", default="q4,q8")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--llama-cpp", type=Path, default=None, help="a llama.cpp tree built as in PEERS.md")
    ap.add_argument("--serve", default=None, help="mode whose artifact `kiln serve` answers one request with")
    ap.add_argument("--recompile", action="store_true", help="compile even where an artifact is there")
    ap.add_argument("--workdir", default="build/bench")
    args = ap.parse_args()
    from kiln.testing.tiny import preset_model
    modes = args.modes.split(",")
    work = Path(args.workdir) / args.preset
    t0 = time.perf_counter()
    model_dir = preset_model(args.preset, work / "model")
    made = time.perf_counter() - t0
    ckpt = sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / 2**30
    print(f"{args.preset}: checkpoint {ckpt:.2f} GiB" + (f" (made in {made:.0f} s)" if made > 1 else ""), flush=True)
    rows = {}
    for mode in modes:
        artifact = work / f"artifact-{mode}"
        row = rows[mode] = {}
        if args.recompile or not (artifact / "manifest.json").exists():
            row.update(kiln_compile(model_dir, artifact, mode, args.threads))
        else:
            row["artifact_gib"] = dir_bytes(artifact) / 2**30
        row.update(kiln_run(artifact, args.threads, args.repeats))
        print(mode, json.dumps({k: round(v, 3) for k, v in row.items()}), flush=True)
    if args.llama_cpp:
        peers = gguf_files(model_dir, work / "gguf", args.llama_cpp, modes)
        for mode in modes:
            rows[mode].update({k: v for k, v in peers[mode].items() if k != "gguf"})
            rows[mode].update(llama_bench(args.llama_cpp, peers[mode]["gguf"], args.threads, args.repeats))
            print(mode, "llama.cpp", json.dumps({k: round(v, 3) for k, v in rows[mode].items()
                                                 if k.startswith(("llama", "gguf", "quantize"))}), flush=True)

    def cell(row, key, fmt="{:.1f}"):
        return fmt.format(row[key]) if key in row else "—"
    print(f"\n{args.preset}, {args.threads} threads (medians of {args.repeats}; RSS = peak resident set of that process)")
    print("| mode | kiln compile s | compile peak RSS GiB | artifact GiB | kiln start-up s | `kiln run` peak RSS GiB "
          "(weights GiB) | kiln decode tok/s | llama.cpp quantize s (peak RSS GiB) | GGUF GiB | llama.cpp decode tok/s "
          "| kiln / llama.cpp decode |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for mode, r in rows.items():
        ratio = f"{r['decode_tok_s'] / r['llama_decode_tok_s']:.2f}×" if "llama_decode_tok_s" in r else "—"
        quantize = f"{r['quantize_s']:.0f} ({r['quantize_rss_gib']:.2f})" if "quantize_s" in r else "—"
        print(f"| {mode} | {cell(r, 'compile_s', '{:.0f}')} | {cell(r, 'compile_rss_gib', '{:.2f}')} | "
              f"{r['artifact_gib']:.2f} | {r['startup_s']:.2f} | {r['run_rss_gib']:.2f} ({r['weights_gib']:.2f}) | "
              f"{r['decode_tok_s']:.2f} | {quantize} | {cell(r, 'gguf_gib', '{:.2f}')} | "
              f"{cell(r, 'llama_decode_tok_s', '{:.2f}')} | {ratio} |")
    if args.serve:
        print(serve_check(work / f"artifact-{args.serve}", args.threads))


if __name__ == "__main__":
    main()
