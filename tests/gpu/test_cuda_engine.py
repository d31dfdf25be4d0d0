"""The engine on a CUDA artifact: decode entries (TVM's decode kernel, CUDA graphs at batch buckets),
mixed prefill + decode steps, n > 1 with copy-on-write of device pages, prefix-cache hits and
preemption, each against transformers' greedy tokens or the kernels' own other path."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from paging import make_step_inputs  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from reference import hf_greedy, random_prompt as prompt  # noqa: E402


@pytest.fixture(scope="module")
def hf(gpu_bundle):
    return transformers.AutoModelForCausalLM.from_pretrained(gpu_bundle / "model", attn_implementation="eager",
                                                             dtype=torch.float32).eval()


def greedy(max_tokens, **kw):
    from kiln.runtime.sampler import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def llm_for(bundle, variant="float32", entries=("decode", "decode_graph"), **kw):
    """An LLM on the variant's artifact keeping only the named decode entries (forward always runs)."""
    from kiln.runtime.llm import LLM
    llm = LLM(bundle / f"cuda-{variant}", **{"kv_memory": "64MiB", **kw})
    for name in ("decode", "decode_graph"):
        if name not in entries:
            llm.model.entries.pop(name, None)
    if "decode_graph" not in entries:
        llm.model.graph_batches = ()
    return llm


def test_artifact_has_decode_and_graph_entries(gpu_bundle):
    from kiln.artifact import read_manifest
    from kiln.selection.shapes import MMA_ARCHS      # (no TVM compiler: the device has TVM's runtime)
    m = read_manifest(gpu_bundle / "cuda-float16", verify=False).to_json()
    # sm_80+: the decode steps of decode_mma_from sequences and more run the tensor-core kernels
    wide = {"decode_wide", "decode_wide_graph"} if m["target"]["arch"] in MMA_ARCHS else set()
    assert set(m["entries"]) == {"mixed", "decode", "decode_graph"} | wide
    assert m["launches_per_step"]["entries"]["decode_graph"]["host_launches"] <= 3


@pytest.mark.parametrize("variant", ["float32", "float16"])
def test_decode_kernel_and_graphs_generate_what_the_prefill_kernel_does(gpu_bundle, variant):
    """The same greedy tokens for a ragged batch: every step on the prefill kernel; decode steps on
    the decode kernel; decode steps replayed as CUDA graphs (batches padded to buckets)."""
    prompts = [prompt(n, 40 + n) for n in (9, 26, 17, 40, 3)]
    runs = {}
    for entries in ((), ("decode",), ("decode", "decode_graph")):
        llm = llm_for(gpu_bundle, variant, entries)
        runs[entries] = tokens(llm.generate(prompts, greedy(24), use_tqdm=False))
    assert runs[()] == runs[("decode",)] == runs[("decode", "decode_graph")]


def test_graph_steps_match_the_interpreter(gpu_bundle):
    """Decode steps of 3 sequences (bucket 4, so one padding sequence on the scratch page) through
    the captured graph, then replayed, against the interpreter; then a mixed step."""
    from gpu_reference import float32_artifact_and_reference
    from kiln.ir import interpret
    model, graph, weights, kv = float32_artifact_and_reference(gpu_bundle, 32)
    seqs = [(prompt(n, n), [3 * i, 3 * i + 1, 3 * i + 2]) for i, n in enumerate((20, 7, 31))]
    lens = [len(p) for p, _ in seqs]
    steps = [make_step_inputs([(p, 0, pages) for p, pages in seqs], model.page_size)]
    for t in range(4):
        steps.append(make_step_inputs([([5 + t], lens[i] + t, pages) for i, (_, pages) in enumerate(seqs)],
                                      model.page_size))
    steps.append(make_step_inputs([([9], lens[0] + 4, seqs[0][1]), (prompt(12, 99), 0, [20])], model.page_size))
    kinds = []
    for step in steps:
        kinds.append(model.step_kind(step))
        want = interpret(graph, {**step, **kv}, weights)["logits"]
        got = model.forward(step)
        assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max(), kinds[-1]
    assert kinds == ["mixed"] + ["decode_graph"] * 4 + ["mixed"]


def test_engine_paths_on_the_device_equal_transformers(gpu_bundle, hf):
    """n = 3 greedy samples sharing a partial page (copy-on-write of device pages), a second request
    hitting the prefix cache, and a pool so small the scheduler preempts: transformers' tokens."""
    llm = llm_for(gpu_bundle)
    ids = prompt(21, 12)
    want = hf_greedy(hf, ids, 12)
    [three] = llm.generate([ids], greedy(12, n=3))
    assert [c.token_ids for c in three.outputs] == [want] * 3

    system = prompt(70, 9)
    asks = [system + prompt(6, 10), system + prompt(9, 11)]
    outs = [llm.generate([a], greedy(10))[0] for a in asks]
    assert outs[1].num_cached_tokens == 64
    assert tokens(outs) == [hf_greedy(hf, a, 10) for a in asks]

    page_bytes = llm.model.bytes_per_page
    small = llm_for(gpu_bundle, kv_memory=12 * page_bytes, max_num_seqs=16, max_batched_tokens=64,
                    prefix_caching=False)
    rng = np.random.default_rng(5)
    reqs = [(prompt(int(rng.integers(3, 60)), 100 + i), int(rng.integers(2, 24))) for i in range(12)]
    outs = small.generate([p for p, _ in reqs], [greedy(n) for _, n in reqs], use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    assert tokens(outs) == [hf_greedy(hf, p, n) for p, n in reqs]


def test_device_sampling_matches_the_numpy_sampler_on_the_same_logits(gpu_bundle):
    """Logits of a real step on the GPU, sampled there and (copied) by the NumPy sampler: greedy,
    seeded, filtered and penalised rows pick the same tokens; logprobs agree."""
    from kiln.runtime.model import CompiledModel
    from kiln.runtime.sampler import SamplerState, SamplingParams, sample, top_logprobs
    model = CompiledModel(gpu_bundle / "cuda-float16")
    assert model.sampler is not None
    prompts = [prompt(9 + 4 * i, 200 + i) for i in range(8)]            # 9 to 37 tokens
    pages = -(-len(prompts[-1]) // model.page_size)
    model.allocate_kv(8 * pages * model.bytes_per_page)
    step = make_step_inputs([(p, 0, list(range(pages * i, pages * i + pages))) for i, p in enumerate(prompts)],
                            model.page_size)
    logits = model.run(step)
    host = logits.numpy()
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1),
              SamplingParams(temperature=0.7, top_k=40, seed=2), SamplingParams(temperature=1.0, top_p=0.8, seed=3),
              SamplingParams(temperature=0.9, min_p=0.05, seed=4),
              SamplingParams(temperature=1.0, seed=5, repetition_penalty=1.2, frequency_penalty=0.5,
                             logit_bias={3: 4.0}),
              SamplingParams(temperature=1.2, top_k=5, top_p=0.9, min_p=0.01, seed=6), SamplingParams(temperature=0.0)]
    states = [[SamplerState(p, prompts[i]) for i, p in enumerate(params)] for _ in range(2)]
    for round_ in range(3):                   # each round draws the generators' next uniforms
        got = model.sampler.sample(logits, states[0])
        want = sample(host, states[1])
        assert got.tolist() == want.tolist(), round_
    rows, toks = list(range(8)), want.tolist()
    for g, w in zip(model.sampler.top_logprobs(logits, rows, toks, [5] * 8),
                    [top_logprobs(host[r], t, 5) for r, t in zip(rows, toks)]):
        assert g.keys() == w.keys() and all(abs(g[t] - w[t]) < 1e-4 for t in g)


def test_structured_output_on_the_device(gpu_bundle):
    """JSON-schema requests on a CUDA artifact, masked on the device (apply_token_mask) beside a free
    request: every constrained output validates, and the tokens are the host-masked ones on the
    same logits (the same requests on an LLM whose sampler lacks the mask function)."""
    pytest.importorskip("xgrammar")
    import json
    from kiln.runtime.grammar import GrammarSpec
    from kiln.runtime.sampler import SamplingParams
    schema = {"type": "object", "additionalProperties": False, "required": ["n", "ok"],
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}}}
    spec = GrammarSpec("json_schema", json.dumps(schema))
    params = [SamplingParams(temperature=t, seed=i, max_tokens=60, structured=spec)
              for i, t in enumerate((0.0, 1.0, 0.7))] + [SamplingParams(temperature=1.0, seed=9, max_tokens=8)]
    prompts = [prompt(7 + i, 300 + i) for i in range(4)]
    device = llm_for(gpu_bundle, "float16", overlap=False)
    assert device.model.sampler.masks
    on_device = device.generate(prompts, params, use_tqdm=False)
    host = llm_for(gpu_bundle, "float16", overlap=False)
    del host.model.sampler.fn["mask"]
    on_host = host.generate(prompts, params, use_tqdm=False)
    assert tokens(on_device) == tokens(on_host)
    for out in on_device[:3]:
        answer = json.loads(out.outputs[0].text)
        assert out.outputs[0].finish_reason == "stop" and 0 <= answer["n"] <= 99 and isinstance(answer["ok"], bool)


@pytest.mark.parametrize("variant", ["float16", "q4"])
def test_one_step_ahead_generates_what_the_synchronous_engine_does(gpu_bundle, variant):
    """The one-step-ahead engine on the device (runtime/overlap.py, runtime/launch.py: placeholders
    fed from the sampled ids on the device, ids read back through pinned memory after an event) with
    CUDA graphs: greedy, seeded, penalised and n > 1 requests together, logprobs from a graph step's
    kept logits, give the synchronous engine's tokens."""
    from kiln.runtime.launch import OnDevice
    from kiln.runtime.sampler import SamplingParams
    base = dict(max_tokens=20, ignore_eos=True)
    params = [SamplingParams(temperature=0.0, **base), SamplingParams(temperature=0.8, seed=1, logprobs=2, **base),
              SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=2, n=2, **base),
              SamplingParams(temperature=0.0, repetition_penalty=1.3, **base),
              SamplingParams(temperature=0.0, min_tokens=5, max_tokens=9)]
    prompts = [prompt(7 + 5 * i, 90 + i) for i in range(len(params))]
    llm = llm_for(gpu_bundle, variant, ("decode", "decode_graph"), max_num_seqs=16)
    want = llm.generate(prompts, params, use_tqdm=False)
    llm.set_overlap(True)
    launched = []
    launch = llm.model.launch
    llm.model.launch = lambda *a: launched.append(launch(*a)) or launched[-1]
    got = llm.generate(prompts, params, use_tqdm=False)
    assert launched and all(isinstance(h, OnDevice) and (h.readback is not None or not h.count) for h in launched)
    for g, w in zip(got, want):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
        for gc, wc in zip(g.outputs, w.outputs):
            for gl, wl in zip(gc.logprobs or [], wc.logprobs or []):
                assert gl.keys() == wl.keys() and all(abs(gl[t] - wl[t]) < 1e-4 for t in gl)


@pytest.mark.parametrize("variant", ["float16", "q4"])
def test_speculation_on_the_device_gives_the_plain_greedy_tokens(gpu_bundle, variant):
    """n-gram and draft-model speculation on a CUDA artifact (verify steps run the mixed entry; their
    rows are read back and verified on the host) give plain decoding's greedy tokens, with CUDA
    graphs for the plain steps; sampled requests finish with the lengths asked."""
    from kiln.runtime.sampler import SamplingParams
    from kiln.runtime.speculative import SpeculativeConfig
    head = prompt(9, 700)
    prompts = [head + prompt(5, 701) + head, head * 3, prompt(12, 702)]
    plain = llm_for(gpu_bundle, variant, overlap=False).generate(prompts, greedy(24), use_tqdm=False)
    for speculative in (SpeculativeConfig("ngram", 4), SpeculativeConfig("draft", 3, draft=str(gpu_bundle /
                                                                                             "cuda-float32"))):
        llm = llm_for(gpu_bundle, variant, speculative=speculative)
        assert tokens(llm.generate(prompts, greedy(24), use_tqdm=False)) == tokens(plain)
        assert llm.engine.speculator.stats.draft_tokens > 0
        sampled = llm.generate(prompts, SamplingParams(temperature=0.8, seed=4, max_tokens=16, ignore_eos=True),
                               use_tqdm=False)
        assert [len(t) for t in tokens(sampled)] == [16] * 3
