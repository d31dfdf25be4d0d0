"""kiln on a local Ray cluster (kiln.serve.cluster): the issue-36 goals, measured, as markdown tables.

    python bench/cluster.py [--seconds 60] [--stages load,kill,prefix,disagg] [--workdir build/bench/cluster]

load    2 replicas of the tiny Llama, --seconds of 8 clients: 3/4 of requests streamed, 30 % of
        those dropped by the client after 1-4 chunks; outcomes by kind, and each replica's KV
        pages in use once the load ends.
kill    the same load with one replica killed a third of the way in: outcomes, and how long Ray
        Serve took to run two replicas again.
prefix  8 system prompts (~450 tokens) × 12 questions, 4 clients, over 3 replicas whose KV caches
        hold about 3.3 system prompts each, routed by prefix and round-robin: prefix-cache hit rate
        and TTFT (time to the first streamed chunk, at the client). The model is a Llama of hidden
        512 and 8 layers (random weights), where a 450-token prefill costs real time.
disagg  for each KV format (full, sliding window, MLA latent, int8): a prompt prefilled by an engine
        in another Ray process, its KV exported into the object store, fetched and imported by an
        engine here that decodes on; the tokens against one engine's, and the time per prompt
        token of each part against the prefill's. Medians of 5.
Everything runs on this machine: the replicas share its cores with Ray and the load generator.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import ray
from ray import serve

from kiln.options import CompileOptions

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))       # the tiny models' cache (tests/artifact_cache.py)


def artifact(family: str, **overrides) -> str:
    import artifact_cache
    if not overrides:
        return str(artifact_cache.cpu_artifact(artifact_cache.tiny_model(family)))
    from kiln.compiler import compile_model
    from kiln.testing.tiny import make_tiny_model
    compile_options = {k: overrides.pop(k) for k in ("dtype", "kv_dtype") if k in overrides}
    name = family + "-" + "-".join(f"{k}{v}" for k, v in sorted({**overrides, **compile_options}.items()))
    out = ARGS.workdir / name
    if not (out / "artifact" / "manifest.json").exists():
        model = make_tiny_model(out / "model", family, seed=0, **overrides)
        compile_model(model, out / "artifact", CompileOptions(target="cpu", **compile_options), show=None, force=True)
    return str(out / "artifact")


def deploy(art: str, name: str, kv_memory: str = "32MiB", **cluster) -> None:
    from kiln.serve.app import ServerConfig
    from kiln.serve.cluster.app import ClusterConfig
    from kiln.testing import cluster_ops as ops
    ops.deploy(ServerConfig.of(art, kv_memory=kv_memory, threads=1, max_num_seqs=16),
               ClusterConfig(num_cpus=1, app_name=name, **cluster))


def outcome_row(label: str, outcomes) -> str:
    from kiln.testing.cluster_load import Outcomes
    cells = " | ".join(str(outcomes.kinds[k]) for k in Outcomes.KINDS)
    return f"| {label} | {outcomes.total} | {cells} |"


def outcome_table(rows: list[str]) -> None:
    from kiln.testing.cluster_load import Outcomes
    print("| requests | total | " + " | ".join(Outcomes.KINDS) + " |")
    print("|---|---|" + "---|" * len(Outcomes.KINDS))
    print("\n".join(rows))


def kv_in_use(app: str, replicas: int) -> dict:
    """Each replica's KV pages in use, as written after the load (ops.settled_gauges)."""
    from kiln.testing import cluster_ops as ops
    try:
        found = ops.settled_gauges(app, replicas)
    except TimeoutError as e:
        return {"not settled": str(e)}
    return {replica: g.kv_pages_used for replica, (_, g) in found.items()}


def stage_load(url: str) -> None:
    from kiln.testing import cluster_load as load
    deploy(artifact("llama"), "kiln", replicas=2)
    t0 = time.perf_counter()
    streamed, whole = asyncio.run(load.mixed_load(url, ARGS.seconds, clients=8))
    took = time.perf_counter() - t0
    print(f"\n### load: 2 replicas, {ARGS.seconds:.0f} s of 8 clients ({took:.1f} s with the last requests)\n")
    outcome_table([outcome_row("streamed", streamed), outcome_row("non-streamed", whole)])
    print(f"\nKV pages in use per replica after the load: {kv_in_use('kiln', 2)}; "
          f"median TTFT of the streams {1e3 * statistics.median(streamed.ttfts):.0f} ms")


def stage_kill(url: str) -> None:
    from kiln.testing import cluster_load as load
    from kiln.testing import cluster_ops as ops
    deploy(artifact("llama"), "kiln", replicas=2)
    back = {}

    async def kill_then_watch():
        await asyncio.sleep(ARGS.seconds / 3)
        killed = back["killed"] = await asyncio.to_thread(ops.kill_replica, "kiln", "engine")
        t = time.perf_counter()
        # back: the killed actor gone from the replicas, and two replicas running (the new one among them)
        await asyncio.to_thread(ops.wait_for, lambda: killed not in ops.replica_actors("kiln", "engine")
                                and len(ops.replica_actors("kiln", "engine")) == 2
                                and ops.running_replicas("kiln", "engine") == 2, 120)
        back["seconds"] = time.perf_counter() - t

    async def run():
        return (await asyncio.gather(load.mixed_load(url, ARGS.seconds, clients=8, seed=1), kill_then_watch()))[0]
    streamed, whole = asyncio.run(run())
    print(f"\n### kill: 2 replicas, {ARGS.seconds:.0f} s of 8 clients, one replica killed at "
          f"{ARGS.seconds / 3:.0f} s\n")
    outcome_table([outcome_row("streamed", streamed), outcome_row("non-streamed", whole)])
    print(f"\nKilled {back['killed']}; two replicas running again {back['seconds']:.1f} s after the kill; KV pages in use per replica "
          f"after the load: {kv_in_use('kiln', 2)}. Stream errors: {sorted(set(streamed.errors))[:2]}")


def stage_prefix(url: str) -> None:
    from kiln.runtime.model import CompiledModel
    from kiln.runtime.tokenizer import Tokenizer
    from kiln.testing import cluster_load as load
    from kiln.testing import cluster_ops as ops
    art = artifact("llama", hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                   num_key_value_heads=2)
    prompts = load.shared_prefix_prompts(systems=8, questions=12, system_words=120)
    model, tok = CompiledModel(art, verify=False), Tokenizer(art)
    lengths = [len(tok.encode(p)) for p in prompts]
    pages = int(3.3 * (max(lengths) // model.page_size + 1))
    print(f"\n### prefix: 8 system prompts × 12 questions ({min(lengths)}-{max(lengths)} tokens), 4 clients, "
          f"3 replicas of {pages} KV pages ({pages * model.page_size} tokens) each\n")
    print("| routing | prefix-cache hit rate | median TTFT ms | p90 TTFT ms | wall s |")
    print("|---|---|---|---|---|")
    for routing in ("prefix", "round-robin"):
        deploy(art, routing, kv_memory=str(pages * model.bytes_per_page), replicas=3, routing=routing)
        t0 = time.perf_counter()
        outcomes = asyncio.run(load.prefix_load(url, prompts, clients=4))
        wall = time.perf_counter() - t0
        gauges = [g for _, g in ops.settled_gauges(routing, 3).values()]
        rate = sum(g.prefix_hits for g in gauges) / sum(g.prefix_queried for g in gauges)
        ttfts = sorted(outcomes.ttfts)
        assert outcomes.kinds["completed"] == len(prompts), outcomes.errors[:3]
        print(f"| {routing} | {rate:.3f} | {1e3 * statistics.median(ttfts):.0f} | "
              f"{1e3 * ttfts[int(0.9 * len(ttfts))]:.0f} | {wall:.1f} |")


@ray.remote(num_cpus=0)
class Prefiller:
    def __init__(self, art):
        from kiln.runtime.llm import LLM
        self.llm = LLM(art, kv_memory="32MiB", threads=1)

    def prefill(self, prompt, params):
        from kiln.serve.cluster.transport import ObjectStoreTransport
        engine = self.llm.engine
        t0 = time.perf_counter()
        req = engine.add_request(prompt, params, export_kv=True)
        out = engine.run_to_completion()[req.request_id]
        total = time.perf_counter() - t0
        t1 = time.perf_counter()
        ref = ObjectStoreTransport().send(out.kv)
        put = time.perf_counter() - t1
        export = out.kv.timings["export"]
        return [ref], {"prefill": total - export, "export": export, "put": put, "bytes": out.kv.nbytes}


def stage_disagg() -> None:
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampler import SamplingParams
    from kiln.serve.cluster.transport import ObjectStoreTransport
    formats = {"full (Llama, h512 × 8 layers)": ("llama", dict(hidden_size=512, intermediate_size=1408,
                                                                num_hidden_layers=8, num_attention_heads=8,
                                                                num_key_value_heads=2)),
               "sliding window 7 (tiny Mistral)": ("mistral_window", {}),
               "MLA latent (tiny DeepSeek-V2)": ("deepseek_v2", {"dtype": "float32"}),
               "int8 + scales (Llama, h512 × 8 layers)": ("llama", dict(hidden_size=512, intermediate_size=1408,
                                                                         num_hidden_layers=8, num_attention_heads=8,
                                                                         num_key_value_heads=2, kv_dtype="int8"))}
    for other in serve.status().applications:       # nothing else running beside the measurement
        serve.delete(other)
    print("\n### disagg: prefill in another Ray process, KV through the object store, decode here "
          "(512-token prompt, 16 greedy tokens, medians of 5)\n")
    print("| KV format | KV bytes/token | same tokens as one engine | prefill µs/token | export µs/token | "
          "put µs/token | get µs/token | import µs/token | transfer / prefill |")
    print("|---|---|---|---|---|---|---|---|---|")
    prompt = [3 + (i * 37) % 400 for i in range(512)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    async def measure(art: str) -> tuple[bool, dict]:
        """(the tokens were one engine's every time, median seconds and bytes of each part), all in one event
        loop, as a decode replica receives (a fresh loop per fetch would add its start-up to each)."""
        decode = LLM(art, kv_memory="32MiB", threads=1)
        expected = decode.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        prefiller = Prefiller.remote(art)
        runs, same = [], True
        for _ in range(5):
            [ref], times = await prefiller.prefill.remote(prompt, first)
            t0 = time.perf_counter()
            snapshot = await ObjectStoreTransport().receive(ref)
            t1 = time.perf_counter()
            req = decode.engine.import_kv(snapshot, params)
            t2 = time.perf_counter()
            tokens = decode.engine.run_to_completion()[req.request_id].outputs[0].token_ids
            same = same and tokens == expected
            runs.append({**times, "get": t1 - t0, "import": t2 - t1})
        ray.kill(prefiller)
        return same, {k: statistics.median(r[k] for r in runs) for k in runs[0]}

    for label, (family, options) in formats.items():
        art = artifact(family, **options) if options else artifact(family)
        same, med = asyncio.run(measure(art))
        per = {k: 1e6 * med[k] / len(prompt) for k in ("prefill", "export", "put", "get", "import")}
        transfer = per["export"] + per["put"] + per["get"] + per["import"]
        print(f"| {label} | {med['bytes'] / len(prompt):.0f} | {'yes' if same else '**no**'} | {per['prefill']:.1f} | "
              f"{per['export']:.2f} | {per['put']:.2f} | {per['get']:.2f} | {per['import']:.2f} | "
              f"{transfer / per['prefill']:.3f} |")


def main() -> None:
    global ARGS
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--stages", default="load,kill,prefix,disagg")
    ap.add_argument("--workdir", type=Path, default=REPO / "build" / "bench" / "cluster")
    ap.add_argument("--port", type=int, default=8765)
    ARGS = ap.parse_args()
    ARGS.workdir.mkdir(parents=True, exist_ok=True)
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": ARGS.port})
    url = f"http://127.0.0.1:{ARGS.port}"
    try:
        for stage in ARGS.stages.split(","):
            {"load": lambda: stage_load(url), "kill": lambda: stage_kill(url), "prefix": lambda: stage_prefix(url),
             "disagg": stage_disagg}[stage]()
            sys.stdout.flush()
    finally:
        serve.shutdown()
        ray.shutdown()


ARGS = None

if __name__ == "__main__":
    main()
