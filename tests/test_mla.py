"""Multi-head Latent Attention: specialize_mla's rewrite, the absorbed form against the literal one
(itself checked against transformers in tests/test_frontend_parity.py), kiln's compiled latent
kernels against the interpreter (float, int8 and fp8 latent caches), the latent size reported,
and the engine's batching, preemption and prefix caching on an MLA model."""
from __future__ import annotations

import numpy as np
import pytest

from paging import kv_pages_for, make_step_inputs
from reference import random_prompt

pytest.importorskip("transformers")

PAGE = 16
# a ragged step with chunked prefill, then one with decodes beside the next chunk: pages shuffled
A, B = random_prompt(37, 1), random_prompt(21, 2)
PAGES_A, PAGES_B = [5, 2, 7], [3, 0]
STEPS = [
    [(A[:20], 0, PAGES_A), (B[:19], 0, PAGES_B)],
    [(A[20:], 20, PAGES_A), (B[19:20], 19, PAGES_B)],
    [(B[20:], 20, PAGES_B), ([11], 37, PAGES_A)],
]


def run_steps(forward, kv) -> list[np.ndarray]:
    return [forward({**make_step_inputs(step, PAGE), **kv}) for step in STEPS]


@pytest.fixture(scope="module")
def deepseek(make_model):
    from kiln.frontend import load_hf_model
    model = load_hf_model(make_model("deepseek_v2"))
    return model, model.build_graph("float32", PAGE)


def interpreted(graph, model):
    from kiln.ir import interpret, weight_loader
    weights = weight_loader(graph, lambda name: model.weight(name, "float32"))
    kv = kv_pages_for(graph.kv_specs, 8, fill=np.nan)          # NaN: an unwritten slot read shows
    return run_steps(lambda inputs: interpret(graph, inputs, weights)["logits"], kv)


def test_specialize_mla_absorbs_kv_b_proj_in_every_layer(deepseek):
    from kiln.passes.specialize_mla import specialize_mla
    model, literal = deepseek
    absorbed = specialize_mla(literal)
    ops = [n.op for n in absorbed.nodes]
    layers = model.config.num_layers
    assert "mla_attend" not in ops and ops.count("latent_attend") == layers and ops.count("head_linear") == 2 * layers
    kv_b = "model.layers.0.self_attn.kv_b_proj.weight"
    H, N, R, V = 8, 16, 32, 16                                  # kiln/tiny.py's DeepSeek shape
    assert absorbed.params[f"{kv_b}.absorb_k"].type.shape == (H, N, R)
    assert absorbed.params[f"{kv_b}.absorb_v"].type.shape == (H, R, V)
    assert not any(kv_b in n.inputs for n in absorbed.nodes)
    assert [n.op for n in literal.nodes].count("mla_attend") == layers       # the input graph is kept


def test_absorbed_attention_equals_the_literal_form(deepseek):
    """Ragged batch, chunked prefill, decode beside a chunk, shuffled pages: same logits."""
    from kiln.passes.specialize_mla import specialize_mla
    model, literal = deepseek
    for want, got in zip(interpreted(literal, model), interpreted(specialize_mla(literal), model)):
        assert np.abs(got - want).max() / np.abs(want).max() < 1e-4


def test_mla_attend_without_a_weight_to_split_is_left_alone():
    """Near miss: kv_b computed in the graph (no param to split at compile time) stays literal."""
    from kiln.ir import GraphBuilder, Graph, print_graph, verify
    from kiln.ir.kv_spec import KVSpec
    from kiln.passes.specialize_mla import specialize_mla
    b = GraphBuilder("near_miss")
    q_nope = b.input("q_nope", ("tokens", 2, 4), "float32")
    q_rope = b.input("q_rope", ("tokens", 2, 2), "float32")
    c_kv = b.input("c_kv", ("tokens", 6), "float32")
    k_pe = b.input("k_pe", ("tokens", 2), "float32")
    kv_b = b.op("mul", b.input("kv_b_a", (16, 6), "float32"), b.input("kv_b_b", (16, 6), "float32"))
    idx = [b.input(n, (d,), "int32") for n, d in (("q_indptr", "seqs1"), ("page_indptr", "seqs1"),
                                                 ("page_values", "nnz_pages"), ("last_page_len", "seqs"))]
    pages, _ = b.kv_cache(0, KVSpec("latent", 1, 8, 6, "float32", PAGE))
    written = b.op("latent_append", c_kv, k_pe, pages, b.input("slot_mapping", ("tokens",), "int32"), layer=0)
    graph: Graph = verify(b.output(b.op("mla_attend", q_nope, q_rope, written, kv_b, *idx, layer=0, scale=0.5)))
    assert print_graph(specialize_mla(graph)) == print_graph(graph)


def test_latent_cache_read_by_a_plain_attention_op_is_refused():
    """Its one latent row per token is no K and V pair: the attention op's type rule says so."""
    from kiln.ir import IRError
    from kiln.ir.kv_spec import KVSpec
    from test_kv_spec import attention_graph
    with pytest.raises(IRError, match=r"kv_pages must be \[pages, 2, 1, page_size, 8\], got f32\[pages, 1, 1"):
        attention_graph(KVSpec("latent", 1, 8, 6, "float32", PAGE))


def test_unknown_deepseek_v2_routing_is_refused_at_compile_time():
    from kiln.errors import KilnError
    from kiln.frontend.families import parse_config
    from kiln.tiny import FAMILIES
    config = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 64,
              "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 64,
              **FAMILIES["deepseek_v2"][2], "topk_method": "noaux_tc"}
    with pytest.raises(KilnError, match="topk_method 'noaux_tc' is not supported"):
        parse_config(config)


@pytest.fixture(scope="module")
def compiled(compiled_family):
    return lambda **options: compiled_family("deepseek_v2", dtype="float32", **options)


@pytest.mark.parametrize("kv_dtype", [None, "int8", "fp8"])
def test_compiled_latent_kernels_match_the_interpreter(deepseek, compiled, kv_dtype):
    """The latent append and attention kernels (and head_linear) on float, int8 and fp8 latent
    caches, against the interpreter on the same pipeline's graph."""
    from kiln.passes import run_pipeline
    from kiln.runtime.model import CompiledModel
    model, literal = deepseek
    graph, _ = run_pipeline(literal, "cpu", kv_dtype=kv_dtype)
    artifact = CompiledModel(compiled(**({"kv_dtype": kv_dtype} if kv_dtype else {})))
    artifact.allocate_kv(8 * artifact.bytes_per_page)
    assert [s.dtype for s in artifact.kv_specs] == [s.dtype for s in graph.kv_specs.values()]
    got = run_steps(artifact.forward, {})
    for g, w in zip(got, interpreted(graph, model)):
        assert np.abs(g - w).max() / np.abs(w).max() < 1e-4


def test_kv_bytes_per_token_are_the_latent_rows(deepseek, compiled):
    """inspect and the runtime report R + P values per token and layer (40 × 4 bytes here), not
    the expanded heads × (qk + v) dims (8 × (24 + 16) values)."""
    from kiln.inspect import summary
    from kiln.runtime.model import CompiledModel
    model, _ = deepseek
    layers, latent = model.config.num_layers, 32 + 8
    artifact = compiled()
    text = summary(artifact)
    assert f"kv cache   {layers * latent * 4} bytes per token" in text
    assert "kernel variant mla; mixed steps: kiln_latent; decode steps: kiln_latent" in text
    assert CompiledModel(artifact).bytes_per_token == layers * latent * 4
    quantised = CompiledModel(compiled(kv_dtype="int8"))
    assert quantised.bytes_per_token == layers * (latent + 4)          # a byte per value, a scale per row


def greedy(max_tokens):
    from kiln.runtime.sampler import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_engine_batches_preempts_and_caches_prefixes_on_an_mla_model(compiled):
    """Twelve requests batched equal each alone, also with a pool so small that sequences are
    preempted; a shared prefix hits the prefix cache and keeps the tokens."""
    from kiln.runtime.llm import LLM
    artifact = compiled()
    rng = np.random.default_rng(3)
    system = random_prompt(40, seed=50)
    reqs = [((system if i % 3 == 0 else []) + random_prompt(int(rng.integers(3, 40)), seed=60 + i),
             int(rng.integers(2, 16))) for i in range(12)]

    def tokens(llm):
        outs = llm.generate([p for p, _ in reqs], [greedy(n) for _, n in reqs], use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]
    alone_llm = LLM(artifact, kv_memory="4MiB", max_num_seqs=1, prefix_caching=False)
    alone = [alone_llm.generate([p], greedy(n), use_tqdm=False)[0].outputs[0].token_ids for p, n in reqs]
    batched = LLM(artifact, kv_memory="4MiB", max_num_seqs=12, max_batched_tokens=64)
    assert tokens(batched) == alone
    assert batched.engine.pool.stats.hit_tokens >= 32                 # the shared 40-token prefix's 2 pages
    tight = LLM(artifact, kv_memory=10 * batched.model.bytes_per_page, max_num_seqs=12, max_batched_tokens=64,
                prefix_caching=False)
    assert tokens(tight) == alone
    assert tight.engine.scheduler.num_preemptions > 0
