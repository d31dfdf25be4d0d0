"""Decode tokens/s of CUDA artifacts against the HBM roofline and HF transformers, on one GPU.

    python bench/decode_gpu.py ARTIFACT [ARTIFACT ...] [--batches 1 8 64] [--prompt-len 128]
                               [--new-tokens 128] [--repeats 3] [--no-hf] [--no-hf-compiled]

For each artifact (a model shape in one dtype / quantisation) and batch size it prints:
  - kiln's decode tok/s (greedy, fixed prompt and output lengths, medians of --repeats runs),
    with CUDA graphs (the artifact's decode_graph entry) and without;
  - kiln's host time per decode step (step wall time minus nothing: the engine's whole step, with
    and without graphs) and the kernel launches per step from the manifest;
  - the roofline: the measured HBM bandwidth (a device-to-device copy, bytes read + written)
    over the bytes one decode step must read (every stored weight except the embedding table,
    of which only the batch's rows are read, plus each sequence's KV at the mean context);
  - HF transformers on the same device in the same float dtype: eager, and `torch.compile`
    with a static cache where it works. Quantised artifacts are compared with HF in float16.
Artifacts may hold generated weights (`kiln compile --no-weights`, then `kiln fill-weights`): speed
does not depend on the values. HF models are built from the artifact's config with random init.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from kiln.ir.types import numpy_dtype


def hbm_bandwidth(torch, gib: float = 2.0, repeats: int = 10) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read and written (median of `repeats`)."""
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * n / statistics.median(times)


def step_bytes(model, batch: int, context: int) -> int:
    """Bytes one decode step of `batch` sequences at `context` tokens each must read: every stored
    weight, except that of an embedding table not shared with the LM head only the batch's rows
    are read; plus each sequence's KV."""
    m = model.manifest.to_json()
    shared = m["quantization"].get("embedding_shared_with_lm_head")
    total = 0
    for w in m["weights"]:
        nbytes = int(np.prod(w["shape"])) * np.dtype(numpy_dtype(w["dtype"])).itemsize
        gathered = w["param"].startswith("model.embed_tokens") and not shared
        total += batch * nbytes // w["shape"][0] if gathered else nbytes
    return total + batch * context * model.bytes_per_page // model.page_size


def kiln_decode(llm, prompts, new_tokens: int, repeats: int, graphs: bool, overlap: bool = False) -> tuple[float, float]:
    """(decode tok/s, host-side ms per decode step) of greedy generation, medians of `repeats`;
    `overlap`: the one-step-ahead engine (runtime/overlap.py)."""
    from kiln.runtime.sampler import SamplingParams
    model = llm.model
    saved = model.graph_batches
    model.graph_batches = saved if graphs else ()
    llm.set_overlap(overlap)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    rates, step_ms = [], []
    for _ in range(repeats):
        stats = llm.engine.stats
        steps0, seconds0 = stats.steps, stats.seconds
        reqs = llm.generate(prompts, params, use_tqdm=False)
        first = max(r.metrics.first_token_time for r in reqs)
        last = max(r.metrics.finish_time for r in reqs)
        rates.append(len(prompts) * (new_tokens - 1) / (last - first))
        step_ms.append(1e3 * (stats.seconds - seconds0) / max(1, stats.steps - steps0))
    model.graph_batches = saved
    llm.set_overlap(False)
    return statistics.median(rates), statistics.median(step_ms)


def overlap_columns(llm, prompts, args) -> str:
    """The one-step-ahead engine's tok/s and ms per step (graphs on), and whether its greedy and
    seeded tokens equal the synchronous engine's on these prompts."""
    from kiln.runtime.sampler import SamplingParams
    rate, ms = kiln_decode(llm, prompts, args.new_tokens, args.repeats, graphs=True, overlap=True)
    checks = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True, logprobs=2)]
    same = []
    for params in checks:
        outputs = []
        for overlap in (False, True):
            llm.set_overlap(overlap)
            outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        same.append(outputs[0] == outputs[1])
    llm.set_overlap(False)
    return f"{rate:.0f} | {ms:.2f} | {'yes' if all(same) else 'NO'} | "


def hf_config(artifact: Path) -> dict | None:
    """The HF config.json of the model an artifact was built from: beside it as ../model/ (the layout
    bench/gpu_kit.py writes), or where the manifest says it was compiled from."""
    import json
    from kiln.artifact import read_manifest
    for model_dir in (artifact.parent / "model", Path(read_manifest(artifact, verify=False).model.source)):
        if (model_dir / "config.json").exists():
            return json.loads((model_dir / "config.json").read_text())
    return None


def hf_decode(torch, transformers, config: dict, dtype, prompts, new_tokens: int, repeats: int,
              compiled: bool) -> float | None:
    """HF decode tok/s (generate with and without the decode tokens, the difference), or None."""
    try:
        cfg = transformers.AutoConfig.for_model(**config)
        with torch.device("cuda"):          # initialised where it runs: an 8B model on the CPU takes minutes
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
        kwargs = {}
        if compiled:
            model.generation_config.cache_implementation = "static"
            model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        ids = torch.tensor(prompts).cuda()
        run = lambda n: model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,  # noqa: E731
                                       pad_token_id=0, **kwargs)
        rates = []
        with torch.no_grad():
            run(8)
            for _ in range(repeats):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                run(1)
                torch.cuda.synchronize()
                prefill = time.perf_counter() - t0
                t0 = time.perf_counter()
                run(new_tokens)
                torch.cuda.synchronize()
                rates.append(len(prompts) * (new_tokens - 1) / (time.perf_counter() - t0 - prefill))
        return statistics.median(rates)
    except Exception as e:          # torch.compile of a given transformers version may not work
        print(f"  HF {'compiled' if compiled else 'eager'} failed: {type(e).__name__}: {str(e)[:200]}")
        return None
    finally:
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifacts", nargs="+")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--no-hf-compiled", action="store_true", help="HF eager only (torch.compile takes minutes)")
    ap.add_argument("--overlap", action="store_true",
                    help="also the one-step-ahead engine with graphs (its tok/s, and its output checked against the "
                         "synchronous engine's)")
    args = ap.parse_args()

    import torch
    import transformers
    from kiln.runtime.llm import LLM

    bandwidth = hbm_bandwidth(torch)
    print(f"\n{torch.cuda.get_device_name()}: measured HBM bandwidth {bandwidth / 1e12:.2f} TB/s "
          f"(device-to-device copy, read + write)")
    hf_rows = {}
    context = args.prompt_len + args.new_tokens // 2
    # rows print as they are measured, so a run cut short still reports what it finished
    print(f"\nprompt {args.prompt_len}, {args.new_tokens} new tokens, greedy, median of {args.repeats}; roofline at "
          f"mean context {context}")
    ahead = "kiln tok/s (graphs, one step ahead) | ms/step ahead | same tokens | " if args.overlap else ""
    print("| shape | mode | batch | kiln tok/s (graphs) | of roofline | kiln tok/s (no graphs) | ms/step graphs / not "
          f"| {ahead}host launches / kernels per step | roofline tok/s | HF eager | HF compiled+static | kiln / HF eager |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|" + "---|" * (3 if args.overlap else 0), flush=True)
    for path in args.artifacts:
        llm = LLM(path, kv_memory="auto", max_num_seqs=max(args.batches),
                  size_kv_for=max(args.batches) * (args.prompt_len + args.new_tokens))
        m = llm.model.manifest.to_json()
        mode = m["quantization"]["weights"] if m["quantization"]["weights"] != "none" else m["dtype"]
        shape = f"{m['model']['config']['num_layers']}L h{m['model']['config']['hidden_size']}"
        launches = m["launches_per_step"]["entries"]
        for batch in args.batches:
            prompts = [np.random.default_rng(b).integers(3, 1000, args.prompt_len).tolist() for b in range(batch)]
            graph_rate, graph_ms = kiln_decode(llm, prompts, args.new_tokens, args.repeats, graphs=True)
            plain_rate, plain_ms = kiln_decode(llm, prompts, args.new_tokens, args.repeats, graphs=False)
            overlap = overlap_columns(llm, prompts, args) if args.overlap else ""
            ceiling = batch * bandwidth / step_bytes(llm.model, batch, context)
            hf_dtype = torch.bfloat16 if m["dtype"] == "bfloat16" else torch.float16
            key = (shape, str(hf_dtype), batch)
            if not args.no_hf and key not in hf_rows:
                hf_cfg = hf_config(Path(path))
                if hf_cfg:
                    hf_rows[key] = tuple(None if compiled and args.no_hf_compiled else
                                         hf_decode(torch, transformers, hf_cfg, hf_dtype, prompts, args.new_tokens,
                                                   args.repeats, compiled) for compiled in (False, True))
            eager, compiled = hf_rows.get(key, (None, None))
            fmt = lambda r: f"{r:.0f}" if r else "n/a"   # noqa: E731
            host = launches.get("decode_graph", launches["mixed"])["host_launches"]
            kernels = launches.get("decode", launches["mixed"])["kernels"]
            print(f"| {shape} | {mode} | {batch} | {graph_rate:.0f} | {graph_rate / ceiling:.0%} | "
                  f"{plain_rate:.0f} | {graph_ms:.2f} / {plain_ms:.2f} | {overlap}{host} / {kernels} | {ceiling:.0f} | "
                  f"{fmt(eager)} | {fmt(compiled)} | " + (f"{graph_rate / eager:.2f}x |" if eager else "n/a |"),
                  flush=True)
        del llm


if __name__ == "__main__":
    main()
