"""kiln on Ray Serve (kiln.serve.cluster), on this worker's local Ray cluster (tests/ray_cluster.py):
replicas under a streaming load with disconnects, a replica killed under load, prefix-aware routing
against round-robin, prefill/decode disaggregation, KV pages through Ray's object store for each KV
format, and `kiln serve --replicas` (on a Ray cluster of its own, and attached to this one). Loads are
short (seconds) and bounded in count; the benchmark (bench/cluster.py) runs the same loads longer."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import pytest
import ray
from ray import serve

from kiln.errors import KilnError
from kiln.runtime.sampler import SamplingParams
from kiln.serve.app import ServerConfig
from kiln.testing import cluster_load as load, cluster_ops as ops
from kiln.serve.cluster.app import ClusterConfig, app_builder, build_app
from kiln.serve.cluster.router import PrefixIndex, rank

from serving import free_port, running_server

pytestmark = pytest.mark.build


# -- the router's choice, without Ray -------------------------------------------------------------------
def test_the_router_prefers_the_replica_that_holds_the_prefix_unless_its_queue_is_much_longer():
    index = PrefixIndex(page_size=4)
    system, other = list(range(100, 124)), list(range(200, 224))       # 6 pages each
    index.record("a", index.digests(system + [1, 2, 3]))
    index.record("b", index.digests(other))
    asked = index.digests(system + [9, 9, 9, 9, 9])
    assert index.match("a", asked) == 6 and index.match("b", asked) == 0
    assert rank(index, {"a": 3, "b": 0}, asked, imbalance=4)[0] == "a"        # within the imbalance allowed
    assert rank(index, {"a": 6, "b": 0}, asked, imbalance=4)[0] == "b"        # too far behind: the shorter queue
    # a prompt nobody has seen goes to the shortest queue, then to the replica sent the least
    assert rank(index, {"a": 1, "b": 0}, index.digests(list(range(300, 340))), imbalance=4)[0] == "b"
    index.record("c", [])
    assert rank(index, {"a": 0, "b": 0, "c": 0}, index.digests(list(range(300, 340))), imbalance=4)[0] == "c"
    # a chain: a page whose parent differs does not match, nor anything after it
    assert index.match("a", index.digests([0] + system[1:])) == 0
    small = PrefixIndex(page_size=4, capacity=3)
    small.record("a", small.digests(system))
    assert small.size("a") == 3 and small.match("a", small.digests(system)) == 0   # the oldest pages went first


def test_the_application_asks_ray_for_what_each_replica_needs(artifact):
    """The deployments build_app makes: CPUs or a GPU per replica, the router, autoscaling bounds."""
    def engines(app):
        return app._bound_deployment.init_args[1]._bound_deployment     # (ingress's first argument)
    scaled = engines(build_app(ServerConfig.of(artifact, threads=3), ClusterConfig(replicas=2, max_replicas=5)))
    assert scaled.ray_actor_options["num_cpus"] == 3 and scaled.ray_actor_options["num_gpus"] == 0
    autoscaling = scaled._deployment_config.autoscaling_config
    assert (autoscaling.min_replicas, autoscaling.max_replicas, autoscaling.target_ongoing_requests) == (2, 5, 8.0)
    router = scaled._deployment_config.request_router_config
    assert router.request_router_class.endswith("PrefixAwareRouter") and router.request_router_kwargs == {"page_size": 16}
    fixed = engines(build_app(ServerConfig.of(artifact), ClusterConfig(replicas=3, routing="round-robin", num_gpus=1)))
    assert fixed.num_replicas == 3 and fixed.ray_actor_options["num_gpus"] == 1
    assert fixed._deployment_config.request_router_config.request_router_class.endswith("RoundRobinRouter")
    ingress = build_app(ServerConfig.of(artifact, max_num_seqs=8, max_waiting=100),
                        ClusterConfig(replicas=2, max_replicas=5))._bound_deployment
    assert ingress.max_ongoing_requests == 5 * 2 * 8 + 100          # every request the engines may hold
    split = build_app(ServerConfig.of(artifact), ClusterConfig(replicas=2, prefill_replicas=1))._bound_deployment
    assert [a._bound_deployment.name for a in split.init_args[1:]] == ["decode", "prefill"]
    with pytest.raises(KilnError, match="unknown routing"):
        build_app(ServerConfig.of(artifact), ClusterConfig(routing="random"))
    # a Ray Serve config file's import_path: the same application from its args
    from_file = app_builder({"artifact": artifact, "kv_memory": "0.5", "replicas": 3, "routing": "round-robin"})
    assert engines(from_file).num_replicas == 3
    assert engines(from_file).init_args[0] == ServerConfig.of(artifact, kv_memory="0.5")
    with pytest.raises(KilnError, match="unknown kiln application arguments: replica"):
        app_builder({"artifact": artifact, "replica": 2})


# -- the worker's cluster ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def artifact(llama_cpu):
    return str(llama_cpu[0])


def configs(artifact, kv_memory="16MiB", name="kiln", **cluster) -> tuple[ServerConfig, ClusterConfig]:
    return (ServerConfig.of(artifact, kv_memory=kv_memory, threads=1, max_num_seqs=8),
            ClusterConfig(num_cpus=1, app_name=name, **cluster))


def deploy(artifact, kv_memory="16MiB", name="kiln", **cluster) -> None:
    ops.deploy(*configs(artifact, kv_memory, name, **cluster))


@pytest.fixture
def two_replicas(ray_serve, artifact):
    """Application "kiln", two replicas, shared by the tests that ask in a row: deployed again only
    where it no longer runs as deployed (another test's application took its place, or a replica
    killed has not come back)."""
    wanted = configs(artifact, replicas=2)
    if SHARED.get("kiln") != wanted or ops.running_replicas("kiln", "engine") != 2:
        ops.deploy(*wanted)
        SHARED["kiln"] = wanted
    return ray_serve


SHARED: dict[str, tuple] = {}          # application -> the configs two_replicas deployed it with


def test_two_replicas_serve_streams_with_disconnects_without_a_5xx_or_a_lost_request(two_replicas):
    streamed, whole = asyncio.run(load.mixed_load(two_replicas, seconds=8, clients=6))
    assert streamed.kinds["completed"] > 10 and streamed.kinds["disconnected"] > 3 and whole.kinds["completed"] > 3
    for outcomes in (streamed, whole):
        assert set(outcomes.kinds) <= {"completed", "disconnected"}, outcomes.errors[:5]
    # every replica's KV back to 0, as each wrote it after the load (settled_gauges raises otherwise);
    # /metrics sums both pools
    gauges = [g for _, g in ops.settled_gauges("kiln", replicas=2).values()]
    assert len(gauges) == 2 and all(g.prefix_queried for g in gauges)          # both served the load
    text = httpx.get(f"{two_replicas}/metrics").text
    assert load.metric(text, "kiln_kv_pages_total") == sum(g.kv_pages_total for g in gauges) > gauges[0].kv_pages_total
    assert load.metric(text, "kiln_kv_pages_used") == 0
    assert load.metric(text, "vllm:prefix_cache_queries_total") == sum(g.prefix_queried for g in gauges) > 0
    assert load.metric(text, "kiln_requests_finished_total") >= streamed.kinds["completed"] + whole.total
    assert httpx.get(f"{two_replicas}/health").json() == {"status": "ok"}


def test_a_killed_replica_ends_only_its_own_streams_and_comes_back(two_replicas):
    async def kill_after(seconds):
        await asyncio.sleep(seconds)
        return await asyncio.to_thread(ops.kill_replica, "kiln", "engine")

    async def load_and_kill():
        return await asyncio.gather(load.mixed_load(two_replicas, seconds=8, clients=6, seed=1), kill_after(3))
    (streamed, whole), killed = asyncio.run(load_and_kill())
    assert whole.kinds["completed"] == whole.total > 3, whole.errors[:5]          # retried on the other replica
    assert set(streamed.kinds) <= {"completed", "disconnected", "stream_error"}, streamed.errors[:5]
    # a stream that ended with an error was on the killed replica, and says so; the rest completed
    assert streamed.kinds["stream_error"] <= 2 * 6
    assert all("replica serving this request stopped" in e for e in streamed.errors), streamed.errors
    assert streamed.kinds["completed"] > 10
    assert ops.wait_for(lambda: ops.running_replicas("kiln", "engine") == 2, 60)
    assert killed not in ops.replica_actors("kiln", "engine")
    ops.settled_gauges("kiln", replicas=2)           # the survivor and the new one: no KV page held
    r = httpx.post(f"{two_replicas}/v1/completions", json={"prompt": "after", "max_tokens": 3}, timeout=60)
    assert r.status_code == 200


def test_a_bad_request_gets_a_4xx_from_the_ingress_and_the_cluster_goes_on(two_replicas):
    r = httpx.post(f"{two_replicas}/v1/completions", json={"prompt": "x", "max_tokens": 10 ** 6})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(f"{two_replicas}/v1/completions", json={"prompt": [10 ** 6], "max_tokens": 2})
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]
    assert httpx.post(f"{two_replicas}/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


# -- prefix-aware routing ------------------------------------------------------------------------------
def test_prefix_routing_hits_the_prefix_cache_at_least_twice_as_often_as_round_robin(ray_serve, artifact):
    """8 system prompts × 8 questions over 3 replicas whose caches hold about 3 system prompts
    each: routed by prefix, each replica keeps its own few; in turn, each sees all 8 and evicts.
    Which replica a system prompt first lands on depends on the queues of the moment (on a loaded
    machine one replica may get four and evict): where a round falls short, a second round's counts
    are pooled with it (prefix routing that did nothing would fall short in both)."""
    from kiln.runtime.model import CompiledModel
    from kiln.runtime.tokenizer import Tokenizer
    prompts = load.shared_prefix_prompts(systems=8, questions=8, system_words=120)
    model, tok = CompiledModel(artifact, verify=False), Tokenizer(artifact)
    pages = int(3.3 * (max(len(tok.encode(p)) for p in prompts) // model.page_size + 1))
    counts = {"prefix": [0, 0], "round-robin": [0, 0]}          # hits, queried
    for _ in range(2):
        for routing, count in counts.items():
            deploy(artifact, kv_memory=str(pages * model.bytes_per_page), name=routing, replicas=3, routing=routing)
            outcomes = asyncio.run(load.prefix_load(ray_serve, prompts, clients=4))
            assert outcomes.kinds["completed"] == len(prompts), outcomes.errors[:3]
            gauges = [g for _, g in ops.settled_gauges(routing, replicas=3).values()]
            count[0] += sum(g.prefix_hits for g in gauges)
            count[1] += sum(g.prefix_queried for g in gauges)
            serve.delete(routing)
        rates = {routing: hits / queried for routing, (hits, queried) in counts.items()}
        if rates["prefix"] >= 2 * rates["round-robin"]:
            break
    assert rates["prefix"] >= 2 * rates["round-robin"], rates


# -- prefill/decode disaggregation ---------------------------------------------------------------------
def test_disaggregated_prefill_and_decode_give_one_engines_tokens(ray_serve, artifact):
    from kiln.runtime.llm import LLM
    deploy(artifact, name="split", replicas=1, prefill_replicas=1)
    prompts = ["The quick brown fox " * k for k in (1, 5, 12)]
    alone = LLM(artifact, kv_memory="16MiB", threads=1).generate(
        prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    with httpx.Client(base_url=ray_serve, timeout=60) as http:
        for prompt, expected in zip(prompts, alone):
            body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 1}
            got = http.post("/v1/completions", json=body).json()
            assert "choices" in got, got
            whole = got["choices"][0]
            assert whole["text"] == expected.outputs[0].text and len(whole["logprobs"]["tokens"]) == 12
            with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                chunks = [json.loads(line[6:]) for line in r.iter_lines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
            assert "".join(c["choices"][0]["text"] for c in chunks) == expected.outputs[0].text
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        # what does not split (n > 1, one token) runs whole on the decode replicas
        two = http.post("/v1/completions", json={"prompt": prompts[0], "max_tokens": 3, "n": 2}).json()
        assert len(two["choices"]) == 2
        assert http.post("/v1/completions", json={"prompt": prompts[0], "max_tokens": 1}).status_code == 200
    assert {role for role, _ in ops.settled_gauges("split", replicas=2).values()} == {"prefill", "decode"}
    serve.delete("split")


@ray.remote(num_cpus=0)
class Prefiller:
    """Prefill engines in another process, one per artifact: each exports a prompt's KV into the object store."""

    def __init__(self):
        self.llms = {}

    def prefill(self, artifact, prompt, params):
        from kiln.runtime.llm import LLM
        from kiln.serve.cluster.transport import ObjectStoreTransport
        if artifact not in self.llms:
            self.llms[artifact] = LLM(artifact, kv_memory="8MiB", threads=1)
        engine = self.llms[artifact].engine
        req = engine.add_request(prompt, params, export_kv=True)
        out = engine.run_to_completion()[req.request_id]
        return [ObjectStoreTransport().send(out.kv)]          # (in a list: the ref itself, not its value)


@pytest.fixture(scope="module")
def prefiller(ray_cluster):
    """One Prefiller process for the KV formats' tests (a process each would import kiln four times)."""
    actor = Prefiller.remote()
    yield actor
    ray.kill(actor)


@pytest.mark.parametrize("family, options", [("llama", {}), ("mistral_window", {}), ("deepseek_v2", {"dtype": "float32"}),
                                             ("llama", {"kv_dtype": "int8"})],
                         ids=["full", "sliding", "latent-mla", "int8"])
def test_kv_pages_cross_processes_through_the_object_store(prefiller, compiled_family, family, options):
    from kiln.runtime.llm import LLM
    from kiln.serve.cluster.transport import ObjectStoreTransport
    from reference import random_prompt
    artifact = str(compiled_family(family, **options))
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompt = random_prompt(41, seed=7)
    decode = LLM(artifact, kv_memory="8MiB", threads=1)
    expected = decode.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    prefill = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    [ref] = ray.get(prefiller.prefill.remote(artifact, prompt, prefill))
    snapshot = asyncio.run(ObjectStoreTransport().receive(ref))
    req = decode.engine.import_kv(snapshot, params)
    assert decode.engine.run_to_completion()[req.request_id].outputs[0].token_ids == expected


# -- the command ---------------------------------------------------------------------------------------
def test_kiln_serve_with_replicas_runs_a_local_ray_cluster_and_stops_on_sigterm(artifact, tmp_path):
    log = tmp_path / "serve.log"
    with running_server(artifact, log, "--replicas", "2", "--threads", "1", "--kv-memory", "8MiB") as (url, proc):
        # (the ingress answers as soon as one replica has started; the command says so when all have)
        assert ops.wait_for(lambda: "2 replicas, prefix routing" in log.read_text(), 120)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 4},
                       headers={"Authorization": "Bearer sk-kiln-test"}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        proc.terminate()
        assert proc.wait(timeout=60) == 0


def test_kiln_serve_with_replicas_stops_cleanly_on_sigterm_while_it_starts(ray_cluster, ray_serve, artifact,
                                                                          tmp_path):
    """Attached to this worker's cluster (--ray-address): SIGTERM while its replicas start ends the
    command with 0; its application is gone and the cluster's Serve goes on."""
    ops.remove_apps()                     # (its application takes "/")
    log = tmp_path / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "kiln.cli", "serve", artifact, "--replicas", "1", "--threads", "1",
                             "--kv-memory", "8MiB", "--port", str(free_port()), "--ray-address", ray_cluster],
                            stdout=log.open("w"), stderr=subprocess.STDOUT)

    def deploying() -> bool:
        app = serve.status().applications.get("kiln")
        return app is not None and app.status == "DEPLOYING"
    assert ops.wait_for(lambda: deploying() or proc.poll() is not None, 120), log.read_text()[-3000:]
    proc.terminate()
    assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
    assert "kiln" not in serve.status().applications
    assert httpx.get(f"{ray_serve}/-/healthz").status_code == 200


@pytest.mark.parametrize("args, message", [(["--max-replicas", "2"], "--max-replicas needs --replicas"),
                                           (["--replicas", "3", "--max-replicas", "2"], "below --replicas"),
                                           (["--replicas", "2", "--port", "0"], "needs a port")])
def test_kiln_serve_refuses_replica_options_that_do_not_fit(artifact, args, message):
    proc = subprocess.run([sys.executable, "-m", "kiln.cli", "serve", artifact, *args], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
