"""Every pass three ways: the expected rewrite (printed IR), interpreter equality before and after
on random inputs, and a near-miss graph on which it must not fire. A graph is built with the
GraphBuilder or written as text (ir/parser.py reads print_graph's form)."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.errors import KilnError
from kiln.interface import KVSpec
from kiln.ir import GraphBuilder, interpret, parse_graph, print_graph, verify, weight_format, weight_loader
from kiln.options import CompileOptions
from kiln.passes.fuse_gate_up import FuseGateUp
from kiln.passes.fuse_qkv import FuseQKV
from kiln.passes.fuse_residual_add import FuseResidualAdd
from kiln.passes.quantize import Quantize
from kiln.passes.select_kernels import SelectKernels


def random_weights(graph, seed=0):
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(p.type.shape).astype(np.float32) for name, p in graph.params.items()}


def assert_same_outputs(before, after, seed=0):
    """Run both graphs on the same random inputs and base weights; outputs must agree."""
    rng = np.random.default_rng(seed)
    weights = random_weights(before, seed)
    inputs = {k: rng.standard_normal([5 if isinstance(d, str) else d for d in t.shape]).astype(np.float32)
              for k, t in before.inputs.items()}
    want = interpret(before, inputs, weights.__getitem__)
    got = interpret(after, inputs, weight_loader(after, weights.__getitem__))
    for name in before.outputs:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5)


def body(graph) -> list[str]:
    return [line for line in print_graph(graph).splitlines() if line.startswith("  %") or line.startswith("  @")]


# ---------------------------------------------------------------------------- fuse_qkv

def qkv_graph(bias=True, k_bias=True, n_siblings=3):
    b = GraphBuilder("attn")
    x = b.input("x", ("tokens", 8), "float32")
    outs = []
    for name, width, has_bias in (("q", 8, bias), ("k", 4, k_bias), ("v", 4, bias))[:n_siblings]:
        w = b.param(f"l.{name}_proj.weight", (width, 8), "float32")
        bb = b.param(f"l.{name}_proj.bias", (width,), "float32") if has_bias else None
        outs.append(b.op("linear", x, w, None, bb, name=name))
    return verify(b.output(*outs))


def test_fuse_qkv_rewrite():
    after = FuseQKV()(qkv_graph())
    assert body(after) == [
        "  @l.qkv_proj.weight: f32[16, 8] = concat(@l.q_proj.weight, @l.k_proj.weight, @l.v_proj.weight, axis=0)",
        "  @l.qkv_proj.bias: f32[16] = concat(@l.q_proj.bias, @l.k_proj.bias, @l.v_proj.bias, axis=0)",
        "  %qkv0 = linear(%x, @l.qkv_proj.weight, _, @l.qkv_proj.bias) : f32[tokens, 16]",
        "  %q = slice(%qkv0) {begin=0, end=8} : f32[tokens, 8]",
        "  %k = slice(%qkv0) {begin=8, end=12} : f32[tokens, 4]",
        "  %v = slice(%qkv0) {begin=12, end=16} : f32[tokens, 4]",
    ]


@pytest.mark.parametrize("bias", [True, False])
def test_fuse_qkv_keeps_outputs(bias):
    before = qkv_graph(bias=bias, k_bias=bias)
    after = FuseQKV()(before)
    assert [n.op for n in after.nodes] == ["linear", "slice", "slice", "slice"]
    assert_same_outputs(before, after)


@pytest.mark.parametrize("graph", [qkv_graph(k_bias=False), qkv_graph(n_siblings=2)], ids=["mixed-bias", "two"])
def test_fuse_qkv_near_miss(graph):
    assert body(FuseQKV()(graph)) == body(graph)


# ---------------------------------------------------------------------------- fuse_gate_up

def mlp_graph(swap=False, silu_also_output=False, mismatched=False, act="silu"):
    b = GraphBuilder("mlp")
    x = b.input("x", ("tokens", 8), "float32")
    g = b.op("linear", x, b.param("m.gate_proj.weight", (16, 8), "float32"), name="g")
    u = b.op("linear", x, b.param("m.up_proj.weight", (12 if mismatched else 16, 8), "float32"), name="u")
    if mismatched:
        u = b.op("linear", u, b.param("m.pad.weight", (16, 12), "float32"), name="u2")
    s = b.op(act, g, name="s")
    y = b.op("mul", *((u, s) if swap else (s, u)), name="y")
    out = b.op("linear", y, b.param("m.down_proj.weight", (8, 16), "float32"), name="out")
    return verify(b.output(out, s) if silu_also_output else b.output(out))


@pytest.mark.parametrize("act,fused", [("silu", "swiglu"), ("gelu_tanh", "geglu")])
@pytest.mark.parametrize("swap", [False, True])
def test_fuse_gate_up_rewrite(swap, act, fused):
    after = FuseGateUp()(mlp_graph(swap=swap, act=act))
    assert body(after) == [
        "  @m.down_proj.weight: f32[8, 16]",
        "  @m.gate_up_proj.weight: f32[32, 8] = concat(@m.gate_proj.weight, @m.up_proj.weight, axis=0)",
        "  %gate_up0 = linear(%x, @m.gate_up_proj.weight) : f32[tokens, 32]",
        f"  %y = {fused}(%gate_up0) : f32[tokens, 16]",
        "  %out = linear(%y, @m.down_proj.weight) : f32[tokens, 8]",
    ]


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("swap", [False, True])
def test_fuse_gate_up_keeps_outputs(swap, act):
    before = mlp_graph(swap=swap, act=act)
    assert_same_outputs(before, FuseGateUp()(before))


@pytest.mark.parametrize("graph", [mlp_graph(silu_also_output=True), mlp_graph(mismatched=True),
                                   mlp_graph(act="gelu_tanh", silu_also_output=True)],
                         ids=["silu-used-elsewhere", "up-not-a-projection-of-x", "gelu-used-elsewhere"])
def test_fuse_gate_up_near_miss(graph):
    assert body(FuseGateUp()(graph)) == body(graph)


# ---------------------------------------------------------------------------- the pipeline

def test_pipeline_on_a_real_model_keeps_logits(make_model):
    """The whole pipeline on the tiny Llama: same logits through the interpreter before and after."""
    from paging import make_kv_pages, make_step_inputs
    from kiln.frontend import load_hf_model
    from kiln.passes import run_pipeline
    model = load_hf_model(make_model("qwen2"))       # qwen2: the fused projections carry biases
    before = model.build_graph("float32", 16)
    after, records = run_pipeline(before, "cpu")
    assert [r.name for r in records] == ["raise_patterns", "fuse_append_attend", "specialize_mla", "fuse_qkv",
                                         "fuse_gate_up", "fuse_residual_add", "fuse_rope_attention",
                                         "select_kernels"]
    assert {n.op for n in after.nodes} >= {"paged_attention_fused", "swiglu"} and len(after.nodes) < len(before.nodes)
    assert not {"slice", "rope", "paged_attention"} & {n.op for n in after.nodes}
    ids = np.random.default_rng(0).integers(3, 400, 21).tolist()
    c = model.config
    outs = []
    for graph in (before, after):
        inputs = {**make_step_inputs([(ids, 0, [3, 1])], 16),
                  **make_kv_pages(c.num_layers, 4, c.num_kv_heads, 16, c.head_dim)}
        outs.append(interpret(graph, inputs, weight_loader(graph, lambda n: model.weight(n, "float32")))["logits"])
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-5)


def test_dump_after_each_pass(tmp_path, monkeypatch, make_model):
    from kiln.frontend import load_hf_model
    from kiln.passes import run_pipeline
    from kiln.passes.pipeline import make_dumper
    printed = []
    dump = make_dumper({"fuse_gate_up"}, dump_dir=str(tmp_path), out=printed.append)
    run_pipeline(load_hf_model(make_model("llama")).build_graph("float32", 16), "cpu", dump)
    assert sorted(p.name for p in tmp_path.iterdir())[:6] == ["00-import.txt", "01-raise_patterns.txt",
                                                              "02-fuse_append_attend.txt", "03-specialize_mla.txt",
                                                              "04-fuse_qkv.txt", "05-fuse_gate_up.txt"]
    assert "swiglu" in (tmp_path / "05-fuse_gate_up.txt").read_text()
    assert "swiglu" not in (tmp_path / "00-import.txt").read_text()
    assert len(printed) == 1 and printed[0].startswith("// ----- IR after fuse_gate_up")


@pytest.mark.build
def test_fusion_reduces_kernel_launches_per_step(make_model):
    from artifact_cache import cpu_artifact
    from kiln.artifact import read_manifest

    def compiled(**options):
        return read_manifest(cpu_artifact(make_model("llama"), **options)).to_json()
    fused = compiled()
    # every optimising pass (fuse_append_attend and specialize_mla stay: the kernels implement the
    # fused and absorbed forms only)
    every = {"fuse_qkv", "fuse_gate_up", "fuse_residual_add", "fuse_rope_attention"}
    plain = compiled(disable_passes=every)
    no_rope = compiled(disable_passes={"fuse_rope_attention"})
    L = fused["model"]["config"]["num_layers"]
    launches = {k: m["launches_per_step"]["total"] for k, m in (("fused", fused), ("plain", plain),
                                                                   ("no_rope", no_rope))}
    # each fusion takes kernels out of a step (how many is TVM's lowering's business)
    assert launches["fused"] < launches["no_rope"] < launches["plain"]
    # what each pass rewrote, per layer, as its docstring's rewrite says: q, k, v projections into one
    # and three slices; gate and up into one and silu * mul into swiglu; both residual adds into the
    # projections' epilogues; the q/k ropes, the slices and the head reshapes into the attention op
    ops = {p["name"]: p["ops"] for p in fused["passes"]}
    assert ops["fuse_qkv"] == {"linear": -2 * L, "slice": 3 * L}
    assert ops["fuse_gate_up"] == {"linear": -L, "mul": -L, "silu": -L, "swiglu": L}
    assert ops["fuse_residual_add"] == {"add": -2 * L}
    assert ops["fuse_rope_attention"] == {"paged_attention": -L, "paged_attention_fused": L, "reshape": -3 * L,
                                          "rope": -2 * L, "slice": -3 * L}
    assert [p["name"] for p in fused["passes"]] == ["raise_patterns", "fuse_append_attend", "specialize_mla",
                                                    "fuse_qkv", "fuse_gate_up", "fuse_residual_add",
                                                    "fuse_rope_attention", "select_kernels"]
    assert fused["attention_variants"] == plain["attention_variants"] == ["gqa4"]
    assert [p["name"] for p in plain["passes"]] == ["raise_patterns", "fuse_append_attend", "specialize_mla",
                                                    "select_kernels"]


# ---------------------------------------------------------------------------- fuse_residual_add

def residual_graph(swap=False, proj_used_twice=False, dtype="float32"):
    ty = {"float32": "f32", "float16": "f16"}[dtype]
    return verify(parse_graph(f"""
        graph block(
            %x: {ty}[tokens, 8],
            %r: {ty}[tokens, 6],
        ) {{
          @o.weight: {ty}[6, 8]
          @o.bias: {ty}[6]
          %t = linear(%x, @o.weight, _, @o.bias) : {ty}[tokens, 6]
          %h = add({"%t, %r" if swap else "%r, %t"}) : {ty}[tokens, 6]
          return {"%h, %t" if proj_used_twice else "%h"}
        }}"""))


@pytest.mark.parametrize("swap", [False, True])
def test_fuse_residual_add_rewrite(swap):
    assert body(FuseResidualAdd()(residual_graph(swap))) == [
        "  @o.weight: f32[6, 8]",
        "  @o.bias: f32[6]",
        "  %h = linear(%x, @o.weight, _, @o.bias, %r) : f32[tokens, 6]",
    ]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_fuse_residual_add_keeps_outputs(dtype):
    """Bit-identical also in float16: the fused epilogue rounds where the separate add did."""
    before = residual_graph(dtype=dtype)
    after = FuseResidualAdd()(before)
    rng = np.random.default_rng(1)
    weights = {k: rng.standard_normal(p.type.shape).astype(dtype) for k, p in before.params.items()}
    inputs = {k: rng.standard_normal((5, t.shape[1])).astype(dtype) for k, t in before.inputs.items()}
    want = interpret(before, inputs, weights.__getitem__)["h"]
    got = interpret(after, inputs, weights.__getitem__)["h"]
    np.testing.assert_array_equal(got, want)


def test_fuse_residual_add_near_miss():
    graph = residual_graph(proj_used_twice=True)
    assert body(FuseResidualAdd()(graph)) == body(graph)


# ---------------------------------------------------------------------------- quantize

def head_graph():
    """embed -> linear -> linear (the LM head) -> cast: what quantize sees at the end of a model."""
    b = GraphBuilder("lm")
    ids = b.input("ids", ("tokens",), "int32")
    h = b.op("embed", ids, b.param("embed.weight", (16, 8), "float32"), name="h")
    x = b.op("linear", h, b.param("proj.weight", (8, 8), "float32"), None, b.param("proj.bias", (8,), "float32"),
             name="x")
    y = b.op("linear", x, b.param("head.weight", (16, 8), "float32"), name="y")
    return verify(b.output(b.op("cast", y, dtype="float32", name="logits")))


def test_quantize_rewrite():
    after = Quantize("q8")(head_graph())
    assert [line for line in body(after) if "%" in line] == [
        "  %h = embed(%ids, @embed.weight) : f32[tokens, 8]",
        "  %x = linear(%h, @proj.weight.q8, @proj.weight.q8_scale, @proj.bias) {format='q8'} : f32[tokens, 8]",
        "  %y = linear(%x, @head.weight.q8, @head.weight.q8_scale) {format='q8'} : f32[tokens, 16]",
        "  %logits = cast(%y) {dtype='float32'} : f32[tokens, 16]",
    ]
    assert "  @proj.weight.q8: i8[8, 8] = q8.q(@proj.weight)" in body(after)


def test_quantize_sets_the_activation_block_where_it_divides():
    """act_block 4 divides both widths (8); q4's blocks must also divide its groups (a near miss:
    groups of 4, blocks of 8: float activations); fp8 weights never take one."""
    def blocks(graph):
        return [n.attrs["act_block"] for n in graph.nodes if n.op == "linear"]
    assert blocks(Quantize("q8", act_block=4)(head_graph())) == [4, 4]
    assert blocks(Quantize("q4", group_size=4, act_block=4)(head_graph())) == [4, 4]
    assert blocks(Quantize("q4", group_size=4, act_block=8)(head_graph())) == [0, 0]
    assert blocks(Quantize("fp8", act_block=4)(head_graph())) == [0, 0]


def test_quantize_is_exact_on_representable_weights():
    """Weights that are exactly q * scale with max |q| = 127 per row survive q8 unchanged, so the
    graph before and after must agree (up to float32 summation order)."""
    before = head_graph()
    rng = np.random.default_rng(2)
    weights = random_weights(before)
    for name in ("proj.weight", "head.weight"):
        q = rng.integers(-127, 128, before.params[name].type.shape)
        q[:, 0] = 127
        weights[name] = (q * rng.uniform(0.001, 0.01, (q.shape[0], 1))).astype(np.float32)
    after = Quantize("q8")(before)
    inputs = {"ids": np.array([3, 1, 15, 0], np.int32)}
    want = interpret(before, inputs, weights.__getitem__)["logits"]
    got = interpret(after, inputs, weight_loader(after, weights.__getitem__))["logits"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_quantize_q4_rewrite_and_exactness():
    """q4 groups of 4: weights that are q * an fp16 scale, q in [-8, 7] with a -8 in every group,
    survive unchanged, so the graph's outputs do not move."""
    before = head_graph()
    after = Quantize("q4", group_size=4)(before)
    assert "  %x = linear(%h, @proj.weight.q4, @proj.weight.q4_scale, @proj.bias) {format='q4', group_size=4} : f32[tokens, 8]" \
        in body(after)
    assert "  @proj.weight.q4_scale: f16[2, 8] = q4.scale(@proj.weight, group_size=4)" in body(after)
    rng = np.random.default_rng(5)
    weights = random_weights(before)
    for name in ("proj.weight", "head.weight"):
        n, k = before.params[name].type.shape
        q = rng.integers(-7, 8, (n, k))
        q[:, ::4] = -8                                      # every group's peak is the bottom of the range
        scale = rng.uniform(0.01, 0.1, (n, k // 4)).astype(np.float16).astype(np.float32)
        weights[name] = (q * np.repeat(scale, 4, axis=1)).astype(np.float32)
    inputs = {"ids": np.array([3, 1, 15, 0], np.int32)}
    want = interpret(before, inputs, weights.__getitem__)["logits"]
    got = interpret(after, inputs, weight_loader(after, weights.__getitem__))["logits"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_quantize_gives_named_weights_their_own_scheme_and_fused_ones_the_finest():
    """tensor_modes (a GGUF file's Q6_K tensors beside its Q4_K ones): a weight named there takes that
    scheme; a fused weight whose parts differ takes the scheme of most bits; the rest take `mode`."""
    b = GraphBuilder("mixed")
    x = b.input("x", ("tokens", 8), "float32")
    for name in ("q.weight", "v.weight", "down.weight", "up.weight"):
        b.param(name, (8, 8), "float32")
    qv = b.param("qv.weight", (16, 8), "float32", {"concat": ["q.weight", "v.weight"], "axis": 0})
    y1 = b.op("linear", x, qv, name="y1")
    y2 = b.op("linear", b.op("slice", y1, begin=0, end=8, name="s"), "down.weight", name="y2")
    y3 = b.op("linear", y2, "up.weight", name="y3")
    graph = verify(b.output(b.op("cast", b.op("linear", y3, b.param("head.weight", (16, 8), "float32"), name="y4"),
                                 dtype="float32", name="logits")))
    after = Quantize("q4a", group_size=4, lm_head_mode="q8",
                     tensor_modes=(("v.weight", "q8g"), ("down.weight", "q8g")))(graph)
    formats = {n.output: n.attrs.get("format") for n in after.nodes if n.op == "linear"}
    assert formats == {"y1": "q8g", "y2": "q8g", "y3": "q4a", "y4": "q8"}
    assert "  @qv.weight.q8g_scale: f16[2, 16] = q8g.scale(@qv.weight, group_size=4)" in body(after)
    assert "  @up.weight.q4a_scale: f16[4, 8] = q4a.scale(@up.weight, group_size=4)" in body(after)


def test_quantize_near_miss_keeps_lm_head_and_embedding():
    after = Quantize("q8", lm_head=False)(head_graph())
    ops = {n.output: (n.op, n.attrs.get("format")) for n in after.nodes}
    assert ops == {"h": ("embed", "none"), "x": ("linear", "q8"), "y": ("linear", "none"), "logits": ("cast", None)}
    assert after.params["embed.weight"].type.dtype == "float32"


def test_no_quant_lm_head_keeps_a_soft_capped_head_in_float():
    """Gemma 2 caps its logits after the head (softcap, then the cast): the head is still the head."""
    b = GraphBuilder("lm")
    x = b.input("x", ("tokens", 8), "float32")
    y = b.op("linear", x, b.param("head.weight", (16, 8), "float32"), name="y")
    capped = b.op("softcap", y, cap=30.0, name="capped")
    after = Quantize("q4", lm_head=False, group_size=4)(verify(b.output(b.op("cast", capped, dtype="float32",
                                                                            name="logits"))))
    assert weight_format(next(n for n in after.nodes if n.output == "y")) == "none"


# ---------------------------------------------------------------------------- select_kernels (attention)

def attention_graph(q_heads, kv_heads, variant="auto", pages_dtype="float32", **chosen):
    b = GraphBuilder("attn")
    q = b.input("q", ("tokens", q_heads, 4), "float32")
    k = b.input("k", ("tokens", kv_heads, 4), "float32")
    v = b.input("v", ("tokens", kv_heads, 4), "float32")
    quantized = pages_dtype != "float32"
    pages, scales = b.kv_cache(0, KVSpec("full", kv_heads, 4, 4, pages_dtype, 4, scales="row" if quantized else "none"))
    index = [b.input(n, (n,), "int32") for n in ("slots", "qi", "pi", "pv", "lpl")]
    scales = [scales] if quantized else []
    return verify(b.output(b.op("paged_attention", q, k, v, pages, *index, *scales, layer=0, scale=0.5,
                                variant=variant, name="o", **chosen)))


def select_for(target_name):
    from kiln.targets import target_defaults
    return SelectKernels(target_defaults(target_name))


@pytest.mark.parametrize("heads,variant", [((4, 4), "mha"), ((8, 2), "gqa4"), ((6, 3), "gqa2"), ((8, 1), "mqa")])
@pytest.mark.parametrize("target,kernels", [("cpu", "{'mixed': 'kiln_cpu'}"),
                                            ("cuda", "{'mixed': 'tvm_prefill', 'decode': 'kiln_gpu_decode'}"),
                                            ("rocm", "{'mixed': 'tvm_prefill', 'decode': 'tvm_decode'}")])
def test_select_kernels_records_the_attention_variant_and_kernels(heads, variant, target, kernels):
    after = select_for(target)(attention_graph(*heads))
    assert body(after) == [f"  %o = paged_attention(%q, %k, %v, %kv_pages0, %slots, %qi, %pi, %pv, %lpl) "
                           f"{{layer=0, scale=0.5, variant='{variant}', kernels={kernels}}} "
                           f": f32[tokens, {heads[0]}, 4]"]
    # the text form reads back as the graph it printed
    assert print_graph(parse_graph(print_graph(after))) == print_graph(after)


def test_select_kernels_near_miss_keeps_a_chosen_variant_and_kernels():
    graph = attention_graph(8, 2, variant="mha", kernels={"mixed": "tvm_prefill"})   # by hand
    assert body(select_for("cuda")(graph)) == body(graph)


def test_select_kernels_skips_kernels_that_cannot_read_the_pages():
    """int8 pages: a target preferring TVM's kernels (which read only unquantised pages) falls back
    to the next kernel it lists, and one with no fallback is refused, naming what is missing."""
    from dataclasses import replace
    from kiln.targets import target_defaults
    cpu = target_defaults("cpu")
    graph = attention_graph(8, 2, pages_dtype="int8")
    both = replace(cpu, kernels=replace(cpu.kernels, attention={"mixed": ("tvm_prefill", "kiln_cpu"),
                                                                "decode": ("tvm_decode", "kiln_cpu")}))
    assert "kernels={'mixed': 'kiln_cpu'}" in body(SelectKernels(both)(graph))[0]
    only_tvm = replace(cpu, kernels=cpu.kernels.without("kiln_cpu"))
    with pytest.raises(KilnError, match="no attention kernel for paged_attention over a KV cache of full, .*int8.* "
                                        "in mixed steps"):
        SelectKernels(only_tvm)(graph)


# ---------------------------------------------------------------------------- quantize (fp8)

def test_quantize_fp8_rewrite_and_exactness():
    """Weights that are an e4m3 value times a per-row scale, with 448 (e4m3's peak) in every row,
    survive fp8 unchanged, so the graph's outputs do not move."""
    import ml_dtypes
    before = head_graph()
    after = Quantize("fp8")(before)
    assert "  %x = linear(%h, @proj.weight.fp8, @proj.weight.fp8_scale, @proj.bias) {format='fp8'} : f32[tokens, 8]" \
        in body(after)
    assert "  @proj.weight.fp8: f8e4m3[8, 8] = fp8.q(@proj.weight)" in body(after)
    rng = np.random.default_rng(6)
    weights = random_weights(before)
    for name in ("proj.weight", "head.weight"):
        q = (rng.standard_normal(before.params[name].type.shape) * 100).astype(ml_dtypes.float8_e4m3fn)
        q = q.astype(np.float32)
        q[:, 0] = 448.0
        weights[name] = (q * rng.uniform(0.001, 0.01, (q.shape[0], 1))).astype(np.float32)
    inputs = {"ids": np.array([3, 1, 15, 0], np.int32)}
    want = interpret(before, inputs, weights.__getitem__)["logits"]
    got = interpret(after, inputs, weight_loader(after, weights.__getitem__))["logits"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- quantize_kv

def attention_inputs(n=6, q_heads=8, kv_heads=2, head_dim=4, seed=3, kv=None):
    rng = np.random.default_rng(seed)
    return {"q": rng.standard_normal((n, q_heads, head_dim)).astype(np.float32),
            "k": rng.standard_normal((n, kv_heads, head_dim)).astype(np.float32) if kv is None else kv[0],
            "v": rng.standard_normal((n, kv_heads, head_dim)).astype(np.float32) if kv is None else kv[1],
            "slots": np.arange(4, 4 + n, dtype=np.int32), "qi": np.array([0, n], np.int32),   # pages 1, 2
            "pi": np.array([0, 2], np.int32), "pv": np.array([1, 2], np.int32), "lpl": np.array([n - 4], np.int32)}


@pytest.mark.parametrize("mode,short", [("int8", "i8"), ("fp8", "f8e4m3")])
def test_quantize_kv_rewrite(mode, short):
    from kiln.passes.quantize_kv import QuantizeKV
    after = QuantizeKV(mode)(attention_graph(8, 2))
    text = print_graph(after)
    assert f"%kv_pages0: {short}[pages, 2, 2, 4, 4]" in text and "%kv_scales0: f32[pages, 2, 2, 4]" in text
    assert after.kv_specs[0] == KVSpec("full", 2, 4, 4, {"int8": "int8", "fp8": "float8_e4m3fn"}[mode], 4, scales="row")
    assert body(after) == ["  %o = paged_attention(%q, %k, %v, %kv_pages0, %slots, %qi, %pi, %pv, %lpl, %kv_scales0) "
                           "{layer=0, scale=0.5} : f32[tokens, 8, 4]"]


@pytest.mark.parametrize("mode,peak", [("int8", 127), ("fp8", 448)])
def test_quantize_kv_is_exact_on_representable_rows(mode, peak):
    """K/V rows whose values sit on the storage grid with the row's peak at qmax are stored exactly,
    so attention before and after agrees; the pages hold the stored values and scale 1."""
    import ml_dtypes
    from kiln.passes.quantize_kv import QuantizeKV
    before = attention_graph(8, 2)
    after = QuantizeKV(mode)(before)
    rng = np.random.default_rng(4)
    kv = []
    for _ in range(2):
        grid = rng.integers(-127, 128, (6, 2, 4)).astype(np.float32)
        if mode == "fp8":
            grid = (rng.standard_normal((6, 2, 4)) * 100).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
        grid[..., 0] = peak
        kv.append(grid / 64)                     # scale 1/64: exact in float32
    inputs = attention_inputs(kv=kv)
    want = interpret(before, {**inputs, "kv_pages0": np.zeros((3, 2, 2, 4, 4), np.float32)}, lambda n: None)["o"]
    storage = np.int8 if mode == "int8" else ml_dtypes.float8_e4m3fn
    pages, scales = np.zeros((3, 2, 2, 4, 4), storage), np.zeros((3, 2, 2, 4), np.float32)
    got = interpret(after, {**inputs, "kv_pages0": pages, "kv_scales0": scales}, lambda n: None)["o"]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(pages[1, 0, :, 0].astype(np.float32), kv[0][0] * 64)   # slot 4: page 1, row 0
    np.testing.assert_array_equal(scales[1, :, :, 0], np.full((2, 2), 1 / 64, np.float32))


def test_quantize_kv_error_is_small_on_random_rows():
    from kiln.passes.quantize_kv import QuantizeKV
    before = attention_graph(8, 2)
    inputs = attention_inputs()
    want = interpret(before, {**inputs, "kv_pages0": np.zeros((3, 2, 2, 4, 4), np.float32)}, lambda n: None)["o"]
    got = interpret(QuantizeKV("int8")(before), {**inputs, "kv_pages0": np.zeros((3, 2, 2, 4, 4), np.int8),
                                                "kv_scales0": np.zeros((3, 2, 2, 4), np.float32)},
                  lambda n: None)["o"]
    assert 0 < np.abs(got - want).max() < 0.02 * np.abs(want).max()


def test_quantize_kv_near_miss_leaves_a_quantised_cache():
    from kiln.passes.quantize_kv import QuantizeKV
    once = QuantizeKV("int8")(attention_graph(8, 2))
    assert once.kv_specs[0] == KVSpec("full", 2, 4, 4, "int8", 4, scales="row")
    twice = QuantizeKV("fp8")(once)                                      # already quantised: left alone
    assert print_graph(twice) == print_graph(once) and twice.kv_specs == once.kv_specs


# ---------------------------------------------------------------------------- fuse_append_attend

def split_attention_graph(kv_dtype="float32", second_reader=False, other_layer=False):
    """kv_append then paged_attend over layer 0's cache, as the frontend emits them."""
    b = GraphBuilder("attn")
    q = b.input("q", ("tokens", 8, 4), "float32")
    k = b.input("k", ("tokens", 2, 4), "float32")
    v = b.input("v", ("tokens", 2, 4), "float32")
    quantized = kv_dtype != "float32"
    pages, scales = b.kv_cache(0, KVSpec("full", 2, 4, 4, kv_dtype, 4, scales="row" if quantized else "none"))
    if other_layer:
        b.kv_cache(1, KVSpec("full", 2, 4, 4, kv_dtype, 4))
    index = [b.input(n, (n,), "int32") for n in ("slots", "qi", "pi", "pv", "lpl")]
    scales = [scales] if quantized else []
    written = b.op("kv_append", k, v, pages, index[0], *scales, layer=0, name="kv")
    out = b.op("paged_attend", q, written, *index[1:], *scales, layer=0, scale=0.5, name="o")
    if second_reader:
        return verify(b.output(out, b.op("paged_attend", q, written, *index[1:], *scales, layer=0, scale=0.5,
                                         name="o2")))
    return verify(b.output(out))


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_fuse_append_attend_rewrite(kv_dtype):
    from kiln.passes.fuse_append_attend import FuseAppendAttend
    scales = ", %kv_scales0" if kv_dtype == "int8" else ""
    assert body(FuseAppendAttend()(split_attention_graph(kv_dtype))) == [
        f"  %o = paged_attention(%q, %k, %v, %kv_pages0, %slots, %qi, %pi, %pv, %lpl{scales}) {{layer=0, scale=0.5}} "
        ": f32[tokens, 8, 4]"]


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_fuse_append_attend_keeps_outputs_and_pages(kv_dtype):
    """The split ops' references and paged_attention's (written apart) agree, pages included."""
    from kiln.passes.fuse_append_attend import FuseAppendAttend
    before = split_attention_graph(kv_dtype)
    outs, pages = [], []
    for graph in (before, FuseAppendAttend()(before)):
        cache = {"kv_pages0": np.zeros((3, 2, 2, 4, 4), np.int8 if kv_dtype == "int8" else np.float32)}
        if kv_dtype == "int8":
            cache["kv_scales0"] = np.zeros((3, 2, 2, 4), np.float32)
        inputs = attention_inputs()
        outs.append(interpret(graph, {**{n: inputs[n] for n in ("q", "k", "v", "slots", "qi", "pi", "pv", "lpl")},
                                      **cache}, lambda n: None)["o"])
        pages.append(cache)
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    for name in pages[0]:
        np.testing.assert_array_equal(pages[1][name], pages[0][name])
    assert np.abs(outs[0]).max() > 0


def test_fuse_append_attend_near_miss_leaves_an_append_read_twice():
    from kiln.passes.fuse_append_attend import FuseAppendAttend
    graph = split_attention_graph(second_reader=True)
    assert body(FuseAppendAttend()(graph)) == body(graph)


def test_quantize_kv_quantises_both_split_ops():
    from kiln.passes.quantize_kv import QuantizeKV
    after = QuantizeKV("int8")(split_attention_graph())
    assert body(after)[0].startswith("  %kv = kv_append(%k, %v, %kv_pages0, %slots, %kv_scales0) {layer=0} : i8[")
    assert body(after)[1].startswith("  %o = paged_attend(%q, %kv, %qi, %pi, %pv, %lpl, %kv_scales0)")


# ---------------------------------------------------------------------------- fuse_rope_attention

def rope_attention_graph(k_positions_differ=False, v_begin=12, norm=None, k_norm=None, k_eps=1e-6):
    """The shape fuse_qkv leaves: slices of one qkv [tokens, (2 + 2·1)·4], ropes, reshapes, attention;
    with `norm` "head" (Qwen3) or "all" (OLMo 2), q and k RMS-normed before rope (k as `k_norm`)."""
    b = GraphBuilder("attn")
    qkv = b.input("qkv", ("tokens", 16), "float32")
    pos = b.input("pos", ("tokens",), "int32")
    pos2 = b.input("pos2", ("tokens",), "int32")
    inv = b.param("rope.inv_freq", (2,), "float32")

    def normed(x, name, heads, how, eps=1e-6):
        if how == "head":
            per_head = b.op("rms_norm", b.op("reshape", x, shape=("tokens", heads, 4)), b.param(name, (4,), "float32"),
                            eps=eps)
            return b.op("reshape", per_head, shape=("tokens", heads * 4))
        if how == "all":
            return b.op("rms_norm", x, b.param(name, (heads * 4,), "float32"), eps=eps)
        return x
    q = normed(b.op("slice", qkv, begin=0, end=8), "q_norm", 2, norm)
    k = normed(b.op("slice", qkv, begin=8, end=12), "k_norm", 1, norm if k_norm is None else k_norm, k_eps)
    q = b.op("reshape", b.op("rope", q, pos, inv, head_dim=4), shape=("tokens", 2, 4))
    k = b.op("reshape", b.op("rope", k, pos2 if k_positions_differ else pos, inv,
                             head_dim=4), shape=("tokens", 1, 4))
    v = b.op("reshape", b.op("slice", qkv, begin=v_begin, end=v_begin + 4), shape=("tokens", 1, 4))
    pages, _ = b.kv_cache(0, KVSpec("full", 1, 4, 4, "float32", 4))
    index = [b.input(n, (n,), "int32") for n in ("slots", "qi", "pi", "pv", "lpl")]
    return verify(b.output(b.op("paged_attention", q, k, v, pages, *index, layer=0, scale=0.5, name="o")))


def test_fuse_rope_attention_rewrite():
    from kiln.passes.fuse_rope_attention import FuseRopeAttention
    assert body(FuseRopeAttention()(rope_attention_graph())) == [
        "  @rope.inv_freq: f32[2]",
        "  %o = paged_attention_fused(%qkv, %pos, @rope.inv_freq, %kv_pages0, %slots, %qi, %pi, %pv, %lpl) "
        "{layer=0, scale=0.5, q_heads=2, kv_heads=1, head_dim=4} : f32[tokens, 2, 4]"]


@pytest.mark.parametrize("norm,per_head", [("head", True), ("all", False)])
def test_fuse_rope_attention_rewrite_with_qk_norm(norm, per_head):
    from kiln.passes.fuse_rope_attention import FuseRopeAttention
    lines = body(FuseRopeAttention()(rope_attention_graph(norm=norm)))
    width = 4 if per_head else 8
    assert lines[:3] == ["  @rope.inv_freq: f32[2]", f"  @q_norm: f32[{width}]", f"  @k_norm: f32[{width // 2 if not per_head else 4}]"]
    assert lines[3] == (f"  %qk_norm0 = qk_norm(%qkv, @q_norm, @k_norm) {{q_heads=2, kv_heads=1, head_dim=4, "
                        f"per_head={per_head}, eps=1e-06}} : f32[tokens, 16]")
    assert lines[4].startswith("  %o = paged_attention_fused(%qk_norm0, %pos, @rope.inv_freq, %kv_pages0,")
    assert len(lines) == 5


@pytest.mark.parametrize("norm", [None, "head", "all"])
def test_fuse_rope_attention_keeps_outputs(norm):
    from kiln.passes.fuse_rope_attention import FuseRopeAttention
    before = rope_attention_graph(norm=norm)
    rng = np.random.default_rng(7)
    inputs = {"qkv": rng.standard_normal((6, 16)).astype(np.float32), "pos": np.arange(6, dtype=np.int32),
              "pos2": np.arange(6, dtype=np.int32), **{k: v for k, v in attention_inputs().items()
                                                      if k in ("slots", "qi", "pi", "pv", "lpl")}}
    inv = {"rope.inv_freq": np.array([1.0, 0.01], np.float32),
           **{name: rng.standard_normal(p.type.shape).astype(np.float32) for name, p in before.params.items()
              if "norm" in name}}
    outs, pages = [], []
    for graph in (before, FuseRopeAttention()(before)):
        pages.append(np.zeros((3, 2, 1, 4, 4), np.float32))
        outs.append(interpret(graph, {**inputs, "kv_pages0": pages[-1]}, inv.__getitem__)["o"])
    # two independent references (rope + paged_attention, and paged_attention_fused's own walk):
    # the same rotated keys are written exactly; attention agrees to float32 rounding
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(pages[1], pages[0])
    assert np.abs(pages[0]).max() > 0


@pytest.mark.parametrize("graph", [rope_attention_graph(k_positions_differ=True), rope_attention_graph(v_begin=11),
                                   rope_attention_graph(norm="head", k_norm="none"),
                                   rope_attention_graph(norm="head", k_norm="all"),
                                   rope_attention_graph(norm="all", k_eps=1e-5)],
                         ids=["k-rotated-by-other-positions", "v-not-the-last-part", "only-q-normed",
                              "q-per-head-k-over-all", "q-and-k-norms-differ"])
def test_fuse_rope_attention_near_miss(graph):
    from kiln.passes.fuse_rope_attention import FuseRopeAttention
    assert body(FuseRopeAttention()(graph)) == body(graph)


def test_every_pass_takes_the_one_form():
    """A dataclass with a name of its own, as --print-after and --disable-pass call it."""
    import dataclasses
    from kiln.passes.graph_pass import GraphPass
    from kiln.passes.pipeline import pipeline_for
    for target, options in (("cpu", {"quant": "q4", "kv_dtype": "int8"}), ("cuda", {"quant": "fp8"})):
        passes = pipeline_for(target, CompileOptions(**options))
        names = [p.name for p in passes]
        assert all(isinstance(p, GraphPass) and dataclasses.is_dataclass(p) for p in passes)
        assert "" not in names and len(set(names)) == len(names)
