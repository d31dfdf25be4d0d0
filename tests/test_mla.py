"""Multi-head Latent Attention: specialize_mla's rewrite, the absorbed form against the literal one
(itself checked against transformers in tests/test_frontend_parity.py), kiln's compiled latent
kernels against the interpreter (float, int8 and fp8 latent caches), the latent size reported,
and the engine's batching, preemption and prefix caching on an MLA model."""
from __future__ import annotations

import numpy as np
import pytest
from paging import kv_pages_for, make_step_inputs
from reference import random_prompt

from kiln.options import CompileOptions

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


def run_steps(forward, kv, steps=STEPS) -> list[np.ndarray]:
    return [forward({**make_step_inputs(step, PAGE), **kv}) for step in steps]


@pytest.fixture(scope="module")
def deepseek(make_model):
    from kiln.frontend import load_hf_model
    model = load_hf_model(make_model("deepseek_v2"))
    return model, model.build_graph("float32", PAGE)


def interpreted(graph, model, steps=STEPS):
    from kiln.ir import interpret, weight_loader
    weights = weight_loader(graph, lambda name: model.weight(name, "float32"))
    kv = kv_pages_for(graph.kv_specs, 8, fill=np.nan)          # NaN: an unwritten slot read shows
    return run_steps(lambda inputs: interpret(graph, inputs, weights)["logits"], kv, steps)


def test_specialize_mla_absorbs_kv_b_proj_in_every_layer(deepseek):
    from kiln.passes.specialize_mla import SpecializeMLA
    model, literal = deepseek
    absorbed = SpecializeMLA()(literal)
    ops = [n.op for n in absorbed.nodes]
    layers = model.config.num_layers
    assert "mla_attend" not in ops and ops.count("latent_attend") == layers and ops.count("head_linear") == 2 * layers
    kv_b = "model.layers.0.self_attn.kv_b_proj.weight"
    H, N, R, V = 8, 16, 32, 16                                  # testing/tiny.py's DeepSeek shape
    assert absorbed.params[f"{kv_b}.absorb_k"].type.shape == (H, N, R)
    assert absorbed.params[f"{kv_b}.absorb_v"].type.shape == (H, R, V)
    assert not any(kv_b in n.inputs for n in absorbed.nodes)
    assert [n.op for n in literal.nodes].count("mla_attend") == layers       # the input graph is kept


def test_absorbed_attention_equals_the_literal_form(deepseek):
    """Ragged batch, chunked prefill, decode beside a chunk, shuffled pages: same logits."""
    from kiln.passes.specialize_mla import SpecializeMLA
    model, literal = deepseek
    for want, got in zip(interpreted(literal, model), interpreted(SpecializeMLA()(literal), model)):
        assert np.abs(got - want).max() / np.abs(want).max() < 1e-4


def test_expanded_form_is_chosen_for_prefill_steps(deepseek):
    """SpecializeMLA(n): the absorbed chain for every step, the expanded form (gather, linear with
    kv_b, expanded_attend) beside it, a step_choice at n tokens; for_step keeps one form per step."""
    from kiln.ir.step_forms import for_step
    from kiln.passes.specialize_mla import SpecializeMLA
    model, literal = deepseek
    layers = model.config.num_layers
    both = SpecializeMLA(4)(literal)
    ops = [n.op for n in both.nodes]
    assert ops.count("step_choice") == ops.count("expanded_attend") == ops.count("latent_attend") == layers
    assert {n.attrs["min_tokens"] for n in both.nodes if n.op == "step_choice"} == {4}
    kv_b = "model.layers.0.self_attn.kv_b_proj.weight"
    assert any(n.op == "linear" and n.inputs[1] == kv_b for n in both.nodes)
    assert set(both.inputs) - set(literal.inputs) == {"kv_slots", "kv_indptr"}
    prefill = [n.op for n in for_step(both, "prefill")[0]]
    mixed = [n.op for n in for_step(both, "mixed")[0]]
    assert prefill.count("expanded_attend") == layers and "latent_attend" not in prefill
    assert mixed.count("latent_attend") == layers and "expanded_attend" not in mixed and "latent_gather" not in mixed
    assert "step_choice" not in prefill + mixed


# prefill, then a chunk after cached context beside a 2-token chunk, then decodes
PREFILL_STEPS = [
    [(A[:20], 0, PAGES_A), (B[:19], 0, PAGES_B)],
    [(A[20:], 20, PAGES_A), (B[19:], 19, PAGES_B)],
    [([5], 37, PAGES_A), ([7], 21, PAGES_B)],
]


@pytest.mark.parametrize("expanded_from, chosen", [(2, [True, True, False]), (18, [True, False, False])])
def test_expanded_and_absorbed_forms_equal_the_literal_form(deepseek, expanded_from, chosen):
    """Steps take the expanded form exactly when every chunk has expanded_from tokens; either way
    the logits are the literal form's (the expanded form after cached context too)."""
    from kiln.interface import is_prefill_step
    from kiln.passes.specialize_mla import SpecializeMLA
    model, literal = deepseek
    assert [is_prefill_step(make_step_inputs(step, PAGE)["q_indptr"], expanded_from)
            for step in PREFILL_STEPS] == chosen
    for want, got in zip(interpreted(literal, model, PREFILL_STEPS),
                         interpreted(SpecializeMLA(expanded_from)(literal), model, PREFILL_STEPS)):
        assert np.abs(got - want).max() / np.abs(want).max() < 1e-4


def test_expanded_form_refuses_decode_steps():
    """Decode steps keep the default form: a threshold of 1 is refused by the pass and the op."""
    from kiln.errors import KilnError
    from kiln.ir import GraphBuilder, IRError
    from kiln.passes.specialize_mla import SpecializeMLA
    with pytest.raises(KilnError, match="starts at 2 or more new tokens"):
        SpecializeMLA(1)
    b = GraphBuilder("choice")
    x, y = (b.input(n, ("tokens", 4), "float32") for n in "xy")
    with pytest.raises(IRError, match="min_tokens must be an integer of at least 2"):
        b.op("step_choice", x, y, b.input("q_indptr", ("seqs1",), "int32"), min_tokens=1)


@pytest.mark.build
def test_expanded_form_on_a_gpu_target_is_refused_at_compile_time(make_model, tmp_path):
    from kiln.compiler import compile_model
    from kiln.errors import KilnError
    with pytest.raises(KilnError, match="expanded MLA prefill form has no tvm_mla kernels \\(target cuda\\)"):
        options = CompileOptions(target="cuda", mla_expanded_from=8)
        compile_model(make_model("deepseek_v2"), tmp_path / "a", options, show=None)
    assert not (tmp_path / "a").exists()


def test_each_target_chooses_the_latent_kernels_that_read_its_cache():
    """kiln's CPU kernels read int8 rows and have the expanded form; TVM's MLA kernels on GPUs read
    unquantised rows only, so a GPU with a quantised latent cache is refused by name."""
    from types import SimpleNamespace
    from kiln.errors import KilnError
    from kiln.interface import KVSpec
    from kiln.selection.choice import choose
    from kiln.targets import planned_target
    plain, int8 = (KVSpec("latent", 1, 96, 64, dtype, 16, scales=scales)
                   for dtype, scales in (("float16", "none"), ("int8", "row")))
    cpu, cuda = planned_target("cpu", None, 0), planned_target("cuda", "sm_90", 0)

    def chosen(target, spec, op="latent_attend"):
        node, graph = SimpleNamespace(op=op, attrs={"layer": 0}, output="o"), SimpleNamespace(kv_specs=[spec])
        return choose(node, graph, target, {})["mixed"]
    assert [chosen(cpu, spec) for spec in (plain, int8)] == ["kiln_latent", "kiln_latent"]
    assert chosen(cpu, int8, "expanded_attend") == "kiln_expanded"
    assert chosen(cuda, plain) == "tvm_mla"
    with pytest.raises(KilnError, match="the expanded MLA prefill form has no tvm_mla kernels"):
        chosen(cuda, plain, "latent_gather")
    with pytest.raises(KilnError, match="no MLA attention kernel for a latent KV cache of .*int8.*tvm_mla"):
        chosen(cuda, int8)


def test_mla_attend_without_a_weight_to_split_is_left_alone():
    """Near miss: kv_b computed in the graph (no param to split at compile time) stays literal."""
    from kiln.interface import KVSpec
    from kiln.ir import Graph, GraphBuilder, print_graph, verify
    from kiln.passes.specialize_mla import SpecializeMLA
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
    assert print_graph(SpecializeMLA()(graph)) == print_graph(graph)


def test_latent_cache_read_by_a_plain_attention_op_is_refused():
    """Its one latent row per token is no K and V pair: the attention op's type rule says so."""
    from test_kv_spec import attention_graph
    from kiln.interface import KVSpec
    from kiln.ir import IRError
    with pytest.raises(IRError, match=r"kv_pages must be \[pages, 2, 1, page_size, 8\], got f32\[pages, 1, 1"):
        attention_graph(KVSpec("latent", 1, 8, 6, "float32", PAGE))


def test_unknown_deepseek_v2_routing_is_refused_at_compile_time():
    from kiln.errors import KilnError
    from kiln.frontend.families import parse_config
    from kiln.testing.tiny import FAMILIES
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
    caches, against the interpreter on the same pipeline's graph; and the expanded form's kernels
    (gather, expanded_attend) in the prefill entry, which runs exactly for the prefill steps."""
    from kiln.passes import run_pipeline
    from kiln.runtime.model import CompiledModel
    model, literal = deepseek
    # the CPU target gives decode steps their own (GEMV) entry
    for expanded_from, steps, kinds in ((0, STEPS, ["mixed", "mixed", "decode"]),
                                        (2, PREFILL_STEPS, ["prefill", "prefill", "decode"])):
        options = CompileOptions(kv_dtype=kv_dtype, mla_expanded_from=expanded_from)
        graph, _ = run_pipeline(literal, "cpu", options=options)
        artifact = CompiledModel(compiled(mla_expanded_from=expanded_from,
                                          **({"kv_dtype": kv_dtype} if kv_dtype else {})))
        artifact.allocate_kv(8 * artifact.bytes_per_page)
        assert [s.dtype for s in artifact.kv_specs] == [s.dtype for s in graph.kv_specs.values()]
        assert [artifact.step_kind(make_step_inputs(step, PAGE)) for step in steps] == kinds
        got = run_steps(artifact.forward, {}, steps)
        for g, w in zip(got, interpreted(graph, model, steps)):
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
    assert "kernel variant mla; mixed steps: kiln_latent; decode steps (up to 7 sequences): kiln_latent" in text
    assert CompiledModel(artifact).bytes_per_token == layers * latent * 4
    quantised = CompiledModel(compiled(kv_dtype="int8"))
    assert quantised.bytes_per_token == layers * (latent + 4)          # a byte per value, a scale per row


def greedy(max_tokens):
    from kiln.runtime.sampler import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_expanded_prefill_generation_equals_transformers(make_model, compiled_family, family):
    """Every prefill chunk (8 tokens, after the cached ones) in the expanded form, decode absorbed."""
    import transformers
    from reference import hf_greedy_uncached
    from kiln.runtime.llm import LLM
    hf = transformers.AutoModelForCausalLM.from_pretrained(make_model(family), attn_implementation="eager").eval()
    llm = LLM(compiled_family(family, dtype="float32", mla_expanded_from=2), kv_memory="8MiB", max_batched_tokens=8)
    ids = random_prompt(30, 7)
    [out] = llm.generate([ids], greedy(12), use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy_uncached(hf, ids, 12)


@pytest.mark.parametrize("expanded_from", [None, 2])      # the target's choice; every prefill chunk expanded
def test_engine_batches_preempts_and_caches_prefixes_on_an_mla_model(compiled, expanded_from):
    """Twelve requests batched equal each alone, also with a pool so small that sequences are
    preempted; a shared prefix hits the prefix cache and keeps the tokens."""
    from kiln.runtime.llm import LLM
    artifact = compiled(**({} if expanded_from is None else {"mla_expanded_from": expanded_from}))
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
