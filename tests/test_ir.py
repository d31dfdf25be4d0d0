"""The IR itself: builder and verifier errors, printer, JSON round trip, the op table, the interpreter.

Plain NumPy: no torch, no transformers, no model files.
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
from op_examples import EXAMPLES as STEP_EXAMPLES
from paging import make_kv_pages, make_step_inputs

from kiln.frontend.decoder import build_graph
from kiln.frontend.families import parse_config
from kiln.interface import KVSpec
from kiln.ir import (
    OPS,
    GraphBuilder,
    IRError,
    TensorType,
    graph_from_json,
    graph_to_json,
    interpret,
    parse_graph,
    print_graph,
    verify,
)
from kiln.options import CompileOptions

H, V = 8, 11   # hidden size and vocab of the hand-built graphs


def small_mlp():
    """embed -> rms_norm -> linear(+bias) -> silu * linear -> linear -> add -> reshape -> cast."""
    b = GraphBuilder("mlp")
    ids = b.input("ids", ("tokens",), "int32")
    h = b.op("embed", ids, b.param("embed", (V, H), "float32"), name="h")
    x = b.op("rms_norm", h, b.param("norm.weight", (H,), "float32"), eps=1e-5, name="x")
    gate = b.op("linear", x, b.param("gate.weight", (16, H), "float32"), None, b.param("gate.bias", (16,), "float32"))
    up = b.op("linear", x, b.param("up.weight", (16, H), "float32"))
    act = b.op("mul", b.op("silu", gate), up)
    out = b.op("add", h, b.op("linear", act, b.param("down.weight", (H, 16), "float32")))
    out = b.op("reshape", out, shape=("tokens", 2, H // 2))
    return b.output(b.op("cast", out, dtype="float16", name="out"))


def random_weights(graph, seed=0):
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(p.type.shape).astype(np.float32) for name, p in graph.params.items()}


def tiny_llama_config(**overrides):
    cfg = dict(architectures=["LlamaForCausalLM"], vocab_size=V, hidden_size=16, intermediate_size=32,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
               tie_word_embeddings=True, **overrides)
    return parse_config(cfg)


# ---------------------------------------------------------------------------- builder and verifier

def test_builder_type_errors_name_the_node():
    b = GraphBuilder("g")
    x = b.input("x", ("tokens", H), "float32")
    y = b.input("y", ("tokens", H + 1), "float32")
    with pytest.raises(IRError, match=r"%bad_add = add: operands must have the same type"):
        b.op("add", x, y, name="bad_add")
    with pytest.raises(IRError, match=r"%bad_lin = linear: weight must be \[out, 8\]"):
        b.op("linear", x, b.param("w", (4, H + 1), "float32"), name="bad_lin")
    with pytest.raises(IRError, match=r"%n: op rms_norm needs attribute 'eps'"):
        b.op("rms_norm", x, b.param("nw", (H,), "float32"), name="n")
    with pytest.raises(IRError, match=r"%n2: op rms_norm has no attribute\(s\) \['epsilon'\]"):
        b.op("rms_norm", x, b.param("nw2", (H,), "float32"), eps=1e-5, epsilon=1e-5, name="n2")
    with pytest.raises(IRError, match=r"%r = reshape: reshape of f32\[tokens, 8\] .* changes the element count"):
        b.op("reshape", x, shape=("tokens", 3), name="r")
    with pytest.raises(IRError, match=r"unknown op 'softmax'"):
        b.op("softmax", x)
    b.op("silu", x, name="s")
    with pytest.raises(IRError, match=r"%s is defined twice"):
        b.op("silu", x, name="s")


def test_verifier_accepts_built_graphs():
    verify(small_mlp())
    verify(build_graph(tiny_llama_config(), "float32", page_size=4))


def test_verifier_catches_wrong_declared_type():
    g = small_mlp()
    i = next(k for k, n in enumerate(g.nodes) if n.output == "x")
    g.nodes[i] = dataclasses.replace(g.nodes[i], type=TensorType(("tokens", H), "float16"))
    with pytest.raises(IRError, match=r"%x = rms_norm: declared type f16\[tokens, 8\] but the type rule gives "
                                      r"f32\[tokens, 8\]"):
        verify(g)


def test_verifier_catches_use_before_def():
    g = small_mlp()
    g.nodes[0], g.nodes[1] = g.nodes[1], g.nodes[0]      # rms_norm now reads %h before embed defines it
    with pytest.raises(IRError, match=r"%x = rms_norm: input %h is used before it is defined"):
        verify(g)


def test_verifier_catches_bad_attributes_and_outputs():
    g = small_mlp()
    g.nodes[1] = dataclasses.replace(g.nodes[1], attrs={})
    with pytest.raises(IRError, match=r"%x = rms_norm.*eps"):
        verify(g)
    g = small_mlp()
    g.outputs = ["nowhere"]
    with pytest.raises(IRError, match=r"output %nowhere is not defined"):
        verify(g)


# ---------------------------------------------------------------------------- printer and JSON

def test_printer_lines():
    text = print_graph(small_mlp())
    lines = text.splitlines()
    assert lines[0] == "graph mlp("
    assert "    %ids: i32[tokens]," in lines
    assert "  @norm.weight: f32[8]" in lines
    assert "  %h = embed(%ids, @embed) : f32[tokens, 8]" in lines
    assert "  %x = rms_norm(%h, @norm.weight) {eps=1e-05} : f32[tokens, 8]" in lines       # defaults left out
    assert "  %linear1 = linear(%x, @up.weight) : f32[tokens, 16]" in lines
    assert "  %out = cast(%reshape0) {dtype='float16'} : f16[tokens, 2, 4]" in lines
    assert lines[-2:] == ["  return %out", "}"]


def test_builder_drops_an_absent_trailing_optional_input():
    b = GraphBuilder("g")
    x = b.input("x", (2, H), "float32")
    b.op("linear", x, b.param("w", (3, H), "float32"), None, name="y")
    graph = b.output("y")
    assert graph.nodes[0].inputs == ["x", "w"]
    assert "  %y = linear(%x, @w) : f32[2, 3]" in print_graph(graph).splitlines()


@pytest.mark.parametrize("make", [small_mlp, lambda: build_graph(tiny_llama_config(), "float32", 16)],
                         ids=["mlp", "llama"])
def test_json_round_trip(make):
    g = make()
    back = graph_from_json(graph_to_json(g))
    verify(back)
    assert print_graph(back) == print_graph(g)
    assert back.meta == g.meta
    assert graph_to_json(back) == graph_to_json(g)


# ---------------------------------------------------------------------------- the op table

def test_every_op_has_type_rule_reference_and_doc():
    for name, opdef in OPS.items():
        assert opdef.name == name
        assert callable(opdef.type_rule), name
        assert callable(opdef.reference), name
        assert opdef.doc, f"op {name} has no docstring"
        assert all(isinstance(i, str) and i for i in opdef.inputs), name
        assert all(0 <= m < len(opdef.inputs) for m in opdef.mutates), name


# op -> a one-node graph and its NumPy expectation; the test below checks every op in OPS has one.
def _one_node(op, inputs, attrs=None):
    b = GraphBuilder(op)
    names = [None if t is None else b.input(f"in{i}", *t) for i, t in enumerate(inputs)]
    return b.output(b.op(op, *names, name="y", **(attrs or {})))


def _lora_row(x, a, b):   # modules q (columns 0..3: A rows 0, 1) and k (columns 4, 5: A rows 2, 3)
    return np.concatenate([x @ a[0:2].T @ b[:, 0:4], x @ a[2:4].T @ b[:, 4:6]])


def _rot(x, pos, inv):   # rotate-half rope, written as complex rotation of pairs (i, i + D/2)
    half = x.shape[-1] // 2
    z = (x[..., :half] + 1j * x[..., half:]) * np.exp(1j * pos[:, None, None] * inv[None, None, :])
    return np.concatenate([z.real, z.imag], -1)


def _q4_weight(packed, scale, group):   # written out nibble by nibble, independently of kiln's code
    n, half = packed.shape
    w = np.zeros((n, 2 * half))
    for j in range(n):
        for k in range(2 * half):
            nibble = (int(packed[j, k // 2]) >> (4 * (k % 2))) & 15
            w[j, k] = (nibble - 8) * float(scale[k // group, j])
    return w


def _q4k_weight(packed, table):  # per 256 inputs 20 rows: group g's 6-bit scale 2g, depth 2g + 1; d, -dmin bytes
    n, half = packed.shape
    w = np.zeros((n, 2 * half))
    for j in range(n):
        for k in range(2 * half):
            nibble = (int(packed[j, k // 2]) >> (4 * (k % 2))) & 15
            rows = table[20 * (k // 256):20 * (k // 256) + 20, j]
            d, negative_dmin = (float(np.frombuffer(bytes(rows[r:r + 2]), np.float16)[0]) for r in (16, 18))
            group = k % 256 // 32
            w[j, k] = nibble * d * int(rows[2 * group]) + negative_dmin * int(rows[2 * group + 1])
    return w


def _q4k_inputs(rng):
    table = rng.integers(0, 64, (40, 5)).astype(np.uint8)            # 6-bit numbers, then float16 factors' bytes
    for rows in (slice(16, 20), slice(36, 40)):
        table[rows] = (rng.standard_normal((5, 2)) * 0.01).astype(np.float16).view(np.uint8).reshape(5, 4).T
    return {"in0": rng.standard_normal((3, 512)).astype(np.float32),
            "in1": rng.integers(0, 256, (5, 256)).astype(np.uint8), "in2": table}


def _q4a_weight(packed, table, group):  # likewise: group g's scale in row 2g of the table, its minimum in 2g + 1
    n, half = packed.shape
    w = np.zeros((n, 2 * half))
    for j in range(n):
        for k in range(2 * half):
            nibble = (int(packed[j, k // 2]) >> (4 * (k % 2))) & 15
            w[j, k] = nibble * float(table[2 * (k // group), j]) + float(table[2 * (k // group) + 1, j])
    return w


def _head_rms(x, w):
    """Per-head RMSNorm of x [T, H * 4] in float64."""
    heads = x.reshape(len(x), -1, 4).astype(np.float64)
    return (heads / np.sqrt((heads ** 2).mean(-1, keepdims=True) + 1e-6) * w).reshape(len(x), -1)


def _torch_gelu_tanh(x):
    import torch
    return torch.nn.functional.gelu(torch.from_numpy(np.ascontiguousarray(x)), approximate="tanh").numpy()


EXAMPLES = {
    "add": (lambda: _one_node("add", [((3, 4), "float32")] * 2), lambda a: a["in0"] + a["in1"]),
    "mul": (lambda: _one_node("mul", [((3, 4), "float32")] * 2), lambda a: a["in0"] * a["in1"]),
    "silu": (lambda: _one_node("silu", [((3, 4), "float32")]), lambda a: a["in0"] / (1 + np.exp(-a["in0"]))),
    "sigmoid": (lambda: _one_node("sigmoid", [((3, 4), "float32")]), lambda a: 1 / (1 + np.exp(-a["in0"]))),
    "sqrt": (lambda: _one_node("sqrt", [((3, 4), "float32")]), lambda a: np.sqrt(a["in0"])),
    "reciprocal": (lambda: _one_node("reciprocal", [((3, 4), "float32")]), lambda a: 1 / a["in0"]),
    "cos": (lambda: _one_node("cos", [((3, 4), "float32")]), lambda a: np.cos(a["in0"])),
    "sin": (lambda: _one_node("sin", [((3, 4), "float32")]), lambda a: np.sin(a["in0"])),
    "bcast_mul": (lambda: _one_node("bcast_mul", [((3, 2, 4), "float32"), ((3, 1, 4), "float32")]),
                  lambda a: a["in0"] * a["in1"]),
    "bcast_add": (lambda: _one_node("bcast_add", [((3, 4), "float32"), ((4,), "float32")]),
                  lambda a: a["in0"] + a["in1"]),
    "add_scalar": (lambda: _one_node("add_scalar", [((3, 4), "float32")], {"value": 0.25}), lambda a: a["in0"] + 0.25),
    "mean_last": (lambda: _one_node("mean_last", [((3, 4), "float32")]), lambda a: a["in0"].mean(-1, keepdims=True)),
    "concat": (lambda: _one_node("concat", [((3, 2, 4), "float32"), ((3, 2, 1), "float32")]),
               lambda a: np.concatenate([a["in0"], a["in1"]], -1)),
    "cast": (lambda: _one_node("cast", [((3, 4), "float32")], {"dtype": "float16"}),
             lambda a: a["in0"].astype(np.float16)),
    "reshape": (lambda: _one_node("reshape", [(("tokens", 4), "float32")], {"shape": ("tokens", 2, 2)}),
                lambda a: a["in0"].reshape(3, 2, 2)),
    "embed": (lambda: _one_node("embed", [((3,), "int32"), ((V, 4), "float32")]),
              lambda a: a["in1"][a["in0"]]),
    "embed/q8": (lambda: _one_node("embed", [((3,), "int32"), ((V, 4), "int8"), ((V,), "float32")],
                                   {"format": "q8", "dtype": "float32"}),
                 lambda a: (a["in1"].astype(np.float64) * a["in2"][:, None])[a["in0"]]),
    "embed/fp8": (lambda: _one_node("embed", [((3,), "int32"), ((V, 4), "float8_e4m3fn"), ((V,), "float32")],
                                    {"format": "fp8", "dtype": "float32"}),
                  lambda a: (a["in1"].astype(np.float64) * a["in2"][:, None])[a["in0"]]),
    "embed/q4": (lambda: _one_node("embed", [((3,), "int32"), ((V, 4), "uint8"), ((2, V), "float16")],
                                   {"format": "q4", "dtype": "float32", "group_size": 4}),
                 lambda a: _q4_weight(a["in1"], a["in2"], 4)[a["in0"]]),
    "linear": (lambda: _one_node("linear", [((3, 4), "float32"), ((5, 4), "float32"), None, ((5,), "float32")]),
               lambda a: a["in0"] @ a["in1"].T + a["in3"]),
    "rms_norm": (lambda: _one_node("rms_norm", [((3, 4), "float32"), ((4,), "float32")], {"eps": 1e-6}),
                 lambda a: a["in1"] * a["in0"] / np.sqrt((a["in0"] ** 2).mean(-1, keepdims=True) + 1e-6)),
    "rope": (lambda: _one_node("rope", [((3, 16), "float32"), ((3,), "int32"), ((4,), "float32")], {"head_dim": 8}),
             lambda a: _rot(a["in0"].reshape(3, 2, 8), a["in1"], a["in2"]).reshape(3, 16)),
    "linear/q8": (lambda: _one_node("linear", [((3, 4), "float32"), ((5, 4), "int8"), ((5,), "float32")],
                                    {"format": "q8"}),
                  lambda a: a["in0"] @ (a["in1"].astype(np.float64) * a["in2"][:, None]).T),
    "linear/fp8": (lambda: _one_node("linear", [((3, 4), "float32"), ((5, 4), "float8_e4m3fn"),
                                                ((5,), "float32")], {"format": "fp8"}),
                   lambda a: a["in0"] @ (a["in1"].astype(np.float64) * a["in2"][:, None]).T),
    "linear/q4": (lambda: _one_node("linear", [((3, 8), "float32"), ((5, 4), "uint8"), ((2, 5), "float16")],
                                    {"format": "q4", "group_size": 4}),
                  lambda a: a["in0"] @ _q4_weight(a["in1"], a["in2"], 4).T),
    "linear/q4 f32 scales": (lambda: _one_node("linear", [((3, 8), "float32"), ((5, 4), "uint8"), ((2, 5), "float32")],
                                               {"format": "q4", "group_size": 4, "scale_dtype": "float32"}),
                             lambda a: a["in0"] @ _q4_weight(a["in1"], a["in2"], 4).T),
    "linear/q8g": (lambda: _one_node("linear", [((3, 8), "float32"), ((5, 8), "int8"), ((2, 5), "float16")],
                                     {"format": "q8g", "group_size": 4}),
                   lambda a: a["in0"] @ (a["in1"].astype(np.float64) * np.repeat(a["in2"].T, 4, axis=1)).T),
    "linear/q4a": (lambda: _one_node("linear", [((3, 8), "float32"), ((5, 4), "uint8"), ((4, 5), "float16")],
                                     {"format": "q4a", "group_size": 4}),
                   lambda a: a["in0"] @ _q4a_weight(a["in1"], a["in2"], 4).T),
    "linear/q4k": (lambda: _one_node("linear", [((3, 512), "float32"), ((5, 256), "uint8"), ((40, 5), "uint8")],
                                     {"format": "q4k", "group_size": 32}),
                   lambda a: a["in0"] @ _q4k_weight(a["in1"], a["in2"]).T, _q4k_inputs),
    "slice": (lambda: _one_node("slice", [((3, 10), "float32")], {"begin": 2, "end": 7}),
              lambda a: a["in0"][:, 2:7]),
    "swiglu": (lambda: _one_node("swiglu", [((3, 8), "float32")]),
               lambda a: a["in0"][:, :4] / (1 + np.exp(-a["in0"][:, :4])) * a["in0"][:, 4:]),
    "geglu": (lambda: _one_node("geglu", [((3, 8), "float32")]),
              lambda a: _torch_gelu_tanh(a["in0"][:, :4]) * a["in0"][:, 4:]),
    "gelu_tanh": (lambda: _one_node("gelu_tanh", [((3, 4), "float32")]), lambda a: _torch_gelu_tanh(a["in0"])),
    "mul_scalar": (lambda: _one_node("mul_scalar", [((3, 4), "float32")], {"value": 2.5}), lambda a: a["in0"] * 2.5),
    "softcap": (lambda: _one_node("softcap", [((3, 4), "float32")], {"cap": 0.7}),
                lambda a: 0.7 * np.tanh(a["in0"] / 0.7)),
    "qk_norm": (lambda: _one_node("qk_norm", [((3, 16), "float32"), ((4,), "float32"), ((4,), "float32")],
                                  {"q_heads": 2, "kv_heads": 1, "head_dim": 4, "per_head": True, "eps": 1e-6}),
                lambda a: np.concatenate([_head_rms(a["in0"][:, :8], a["in1"]), _head_rms(a["in0"][:, 8:12], a["in2"]),
                                          a["in0"][:, 12:]], axis=1)),
    "take_rows": (lambda: _one_node("take_rows", [((5, 4), "float32"), ((2,), "int32")]),
                  lambda a: a["in0"][a["in1"]]),
    "sigmoid_gate": (lambda: _one_node("sigmoid_gate", [((3, 4), "float32"), ((3, 1), "float32")]),
                     lambda a: a["in0"] / (1 + np.exp(-a["in1"]))),
    "head_linear": (lambda: _one_node("head_linear", [((3, 2, 4), "float32"), ((2, 4, 5), "float32")]),
                    lambda a: np.stack([a["in0"][:, h] @ a["in1"][h] for h in range(2)], axis=1)),
    # two adapter slots of rank 2 over a fused output of two modules (4 + 2 columns); row 1 uses none
    "lora": (lambda: _one_node("lora", [((3, 6), "float32"), ((3, 4), "float32"), ((2, 4, 4), "float32"),
                                        ((2, 2, 6), "float32"), ((3,), "int32")],
                               {"modules": ("m.q_proj", "m.k_proj"), "rows": (4, 2), "rank": 2}),
             lambda a: a["in0"] + np.stack([_lora_row(a["in1"][t], a["in2"][s], a["in3"][s]) if s >= 0
                                            else 0 * a["in0"][t] for t, s in enumerate(a["in4"])]),
             lambda rng: {**{f"in{i}": rng.standard_normal(shape).astype(np.float32)
                             for i, shape in enumerate([(3, 6), (3, 4), (2, 4, 4), (2, 2, 6)])},
                          "in4": np.array([1, -1, 0], np.int32)}),
}


EXAMPLES.update(STEP_EXAMPLES)       # (make, expect, inputs): ops over a step's pages, routing, MLA


def _example_inputs(graph, rng):
    arrays = {}
    for k, t in graph.inputs.items():
        shape = [3 if isinstance(d, str) else d for d in t.shape]
        if t.dtype == "int32":     # indices: valid rows of the op's table / x
            arrays[k] = rng.integers(0, 3, shape).astype(np.int32)
        elif t.dtype == "int8":    # quantised weights
            arrays[k] = rng.integers(-127, 128, shape).astype(np.int8)
        elif t.dtype == "uint8":   # packed int4 weights
            arrays[k] = rng.integers(0, 256, shape).astype(np.uint8)
        elif t.dtype == "float8_e4m3fn":
            import ml_dtypes
            arrays[k] = (rng.standard_normal(shape) * 50).astype(ml_dtypes.float8_e4m3fn)
        else:
            arrays[k] = rng.standard_normal(shape).astype(t.dtype)
    return arrays


def test_every_op_has_a_reference_example():
    """Every op of the table, and every weight format of an op that reads weights (key "op/format"),
    has an example here or in tests/op_examples.py."""
    from kiln.ir.quant import SCHEMES
    missing = sorted(set(OPS) - {key.split("/")[0] for key in EXAMPLES})
    linear_only = {"q8g", "q4a", "q4k"}   # an embedding table or experts of a q8g (q4a, q4k) model are q8 (q4)
    missing += sorted(f"{op}/{fmt}" for op in ("linear", "embed", "moe_experts") for fmt in SCHEMES
                      if f"{op}/{fmt}" not in EXAMPLES and (op == "linear" or fmt not in linear_only))
    assert not missing, f"ops without an interpreter example in tests/test_ir.py: {missing}"


@pytest.mark.parametrize("fmt, weight, scale, scale_dtype, message", [
    ("q4", ((5, 4), "uint8"), ((2, 5), "float16"), "float32", r"scale must be f32\[2, 5\]"),
    ("q4", ((5, 4), "uint8"), ((2, 5), "float32"), "", r"scale must be f16\[2, 5\]"),
    ("q4", ((5, 4), "uint8"), ((2, 5), "float16"), "bfloat16", "only the float16 scale tables"),
    ("q4k", ((5, 256), "uint8"), ((40, 5), "float32"), "float32", "only the float16 scale tables"),
    ("q8", ((5, 8), "int8"), ((5,), "float32"), "float32", "scale_dtype applies to the grouped formats"),
])
def test_a_linears_scale_dtype_is_checked(fmt, weight, scale, scale_dtype, message):
    """scale_dtype float32 widens a float16 group-scale table (a file's float32 scales kept); nothing else."""
    inputs = 512 if fmt == "q4k" else 8
    attrs = {"format": fmt, "scale_dtype": scale_dtype, **({"group_size": 32 if fmt == "q4k" else 4}
                                                            if fmt != "q8" else {})}
    with pytest.raises(IRError, match=message):
        verify(_one_node("linear", [((3, inputs), "float32"), weight, scale], attrs))


@pytest.mark.parametrize("op", sorted(EXAMPLES))
def test_op_reference_matches_numpy(op):
    make, expect, *inputs = EXAMPLES[op]
    g = verify(make())
    rng = np.random.default_rng(0)
    arrays = inputs[0](rng) if inputs else _example_inputs(g, rng)
    # the expectation sees the inputs as they were (an op that writes the KV pages writes them in place)
    want = expect({k: v.astype(np.float64) if v.dtype.kind == "f" else v.copy() for k, v in arrays.items()})
    got = interpret(g, arrays, lambda name: None)["y"]
    assert got.dtype == np.dtype(g.nodes[-1].type.dtype) and got.shape == want.shape
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=1e-5, atol=1e-5)


def without_meta(graph):
    return dataclasses.replace(graph, meta={})


@pytest.mark.parametrize("op", sorted(EXAMPLES))
def test_text_round_trip_of_every_op(op):
    """The parser reads back what the printer wrote: attributes at their defaults (left out), absent
    optional inputs, params, KV specs."""
    graph = verify(EXAMPLES[op][0]())
    assert parse_graph(print_graph(graph)) == without_meta(graph)


@pytest.mark.parametrize("family,target,options", [
    ("llama", "cpu", {"quant": "q4", "kv_dtype": "int8"}), ("gemma2", "cpu", {"quant": "q8", "kv_dtype": "fp8"}),
    ("mixtral", "cuda", {"quant": "q4"}), ("deepseek_v2", "cpu", {"quant": "fp8"}),
    ("qwen2", "cuda", {"quant": "fp8", "kv_dtype": "int8"})])
def test_text_round_trip_after_every_pass(make_model, family, target, options):
    """Real graphs as each pass leaves them, with every recipe form (concat, stack, deinterleave,
    absorb, quantised parts) and quantised attributes."""
    from kiln.frontend import load_hf_model
    from kiln.passes import run_pipeline
    from kiln.targets import target_defaults
    tgt = target_defaults(target)
    graph = load_hf_model(make_model(family)).build_graph(tgt.default_dtype, tgt.page_size)
    stages = [graph]
    run_pipeline(graph, tgt, lambda name, after: stages.append(after), options=CompileOptions(**options))
    recipes = {next(iter(p.recipe)) for g in stages for p in g.params.values() if p.recipe}
    assert "concat" in recipes and "quantize" in recipes
    for g in stages:
        assert parse_graph(print_graph(g)) == without_meta(g)


@pytest.mark.parametrize("text,message", [
    ("graph g(\n) {\n  %y = no_such_op(%x) : f32[2]\n  return %y\n}", "unknown op 'no_such_op'"),
    ("graph g(\n    %x: f33[2],\n) {\n  return %x\n}", "bad type 'f33[2]'"),
    ("graph g(\n    %x: f32[2],\n) {\n  %y = relu %x\n  return %y\n}", "bad node line"),
    ("g(%x)", "starts with 'graph NAME('")])
def test_parser_names_what_it_cannot_read(text, message):
    with pytest.raises(IRError, match=re.escape(message)):
        parse_graph(text)


# ---------------------------------------------------------------------------- the interpreter

def test_interpreter_small_graph_matches_numpy():
    g = verify(small_mlp())
    w = random_weights(g)
    ids = np.array([3, 0, 10, 3, 7], np.int32)
    got = interpret(g, {"ids": ids}, w.__getitem__)["out"]

    h = w["embed"][ids].astype(np.float64)
    x = w["norm.weight"] * h / np.sqrt((h ** 2).mean(-1, keepdims=True) + 1e-5)
    gate = x @ w["gate.weight"].T + w["gate.bias"]
    act = gate / (1 + np.exp(-gate)) * (x @ w["up.weight"].T)
    want = (h + act @ w["down.weight"].T).reshape(5, 2, H // 2)
    assert got.dtype == np.float16 and got.shape == (5, 2, H // 2)
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=2e-3, atol=2e-3)


def test_interpreter_checks_inputs():
    g = small_mlp()
    w = random_weights(g)
    with pytest.raises(IRError, match="missing graph inputs"):
        interpret(g, {}, w.__getitem__)
    with pytest.raises(IRError, match="expected dtype int32"):
        interpret(g, {"ids": np.zeros(3, np.int64)}, w.__getitem__)


def _attention_graph(hq, hkv, d, page_size, split=False, window=0, softcap=0.0):
    """One attention layer: paged_attention, or (split) kv_append then paged_attend."""
    b = GraphBuilder("attn")
    q = b.input("q", ("tokens", hq, d), "float32")
    k = b.input("k", ("tokens", hkv, d), "float32")
    v = b.input("v", ("tokens", hkv, d), "float32")
    spec = KVSpec("sliding", hkv, d, d, "float32", page_size, window=window) if window else \
        KVSpec("full", hkv, d, d, "float32", page_size)
    pages, _ = b.kv_cache(0, spec)
    slots, *idx = [b.input(n, (dim,), "int32") for n, dim in (("slot_mapping", "tokens"), ("q_indptr", "seqs1"),
                                                              ("page_indptr", "seqs1"), ("page_values", "nnz"),
                                                              ("last_page_len", "seqs"))]
    attrs = dict(layer=0, scale=0.3, window=window, softcap=softcap, name="y")
    if split:
        written = b.op("kv_append", k, v, pages, slots, layer=0)
        return verify(b.output(b.op("paged_attend", q, written, *idx, **attrs)))
    return verify(b.output(b.op("paged_attention", q, k, v, pages, slots, *idx, **attrs)))


def _dense_causal_attention(q, k, v, scale, window=0, softcap=0.0):
    """q [n, Hq, D] against all of k, v [L, Hkv, D]; query i sees keys j <= L - n + i (and, with a
    window, j > L - n + i - window); scores soft-capped when softcap > 0."""
    n, hq, _ = q.shape
    L, hkv, _ = k.shape
    out = np.zeros(q.shape)
    for h in range(hq):
        kh, vh = k[:, h // (hq // hkv)], v[:, h // (hq // hkv)]
        for i in range(n):
            last = L - n + i
            first = max(0, last - window + 1) if window else 0
            s = (kh[first:last + 1] @ q[i, h]) * scale
            if softcap:
                s = softcap * np.tanh(s / softcap)
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ vh[first:last + 1]
    return out


@pytest.mark.parametrize("split,window,softcap", [(False, 0, 0.0), (True, 0, 0.0), (False, 3, 0.7), (True, 3, 0.7)],
                         ids=["paged_attention", "kv_append+paged_attend", "paged_attention-window-softcap",
                              "split-window-softcap"])
def test_paged_attention_matches_dense_attention(split, window, softcap):
    """Two steps over shuffled pages: a prefill of two sequences, then a decode and a prefill chunk."""
    hq, hkv, d, ps = 4, 2, 8, 4
    g = _attention_graph(hq, hkv, d, ps, split, window, softcap)
    rng = np.random.default_rng(0)
    kv = make_kv_pages(1, 6, hkv, ps, d, fill=np.nan)         # NaN: reading an unwritten slot shows
    pages = {"a": [4, 1, 5], "b": [2, 0]}
    keys = {"a": np.zeros((0, hkv, d), np.float32), "b": np.zeros((0, hkv, d), np.float32)}
    vals = dict(keys)

    def run(step):    # step: [(sequence, number of new tokens)]
        qkv = {s: [rng.standard_normal((n, h, d)).astype(np.float32) for h in (hq, hkv, hkv)] for s, n in step}
        inputs = make_step_inputs([([0] * n, len(keys[s]), pages[s]) for s, n in step], ps)
        for k in ("tokens", "positions", "logit_rows"):
            del inputs[k]
        for j, name in enumerate("qkv"):
            inputs[name] = np.concatenate([qkv[s][j] for s, _ in step])
        got = interpret(g, {**inputs, **kv}, lambda name: None)["y"]
        at = 0
        for s, n in step:
            q, k, v = qkv[s]
            keys[s], vals[s] = np.concatenate([keys[s], k]), np.concatenate([vals[s], v])
            want = _dense_causal_attention(q.astype(np.float64), keys[s].astype(np.float64),
                                           vals[s].astype(np.float64), 0.3, window, softcap)
            np.testing.assert_allclose(got[at:at + n], want, rtol=1e-5, atol=1e-5, err_msg=f"sequence {s}")
            at += n

    run([("a", 6), ("b", 3)])
    run([("b", 1), ("a", 5)])
    # the cache holds each token's k and v at the slot its page table names
    slots = np.array([pages["a"][p // ps] * ps + p % ps for p in range(11)])
    np.testing.assert_array_equal(kv["kv_pages0"][slots // ps, 0, :, slots % ps], keys["a"])
    np.testing.assert_array_equal(kv["kv_pages0"][slots // ps, 1, :, slots % ps], vals["a"])


def test_make_step_inputs():
    x = make_step_inputs([([7, 8, 9], 0, [5, 2]), ([4], 17, [1, 3, 6])], page_size=16)
    expect = dict(tokens=[7, 8, 9, 4], positions=[0, 1, 2, 17], q_indptr=[0, 3, 4], page_indptr=[0, 1, 3],
                  page_values=[5, 1, 3], last_page_len=[3, 2], slot_mapping=[80, 81, 82, 3 * 16 + 1],
                  logit_rows=[2, 3], kv_slots=[80, 81, 82, *range(16, 32), 48, 49], kv_indptr=[0, 3, 21])
    assert set(x) == set(expect)
    for k, v in expect.items():
        assert x[k].dtype == np.int32 and x[k].tolist() == v, k
    with pytest.raises(ValueError, match="need 2 pages"):
        make_step_inputs([([1] * 20, 0, [0])], page_size=16)


def test_step_choice_picks_the_alternative_for_prefill_steps():
    """Every sequence with at least min_tokens new tokens: the alternative; any shorter: the default."""
    g = verify(_one_node("step_choice", [((2,), "float32"), ((2,), "float32"), ((3,), "int32")], {"min_tokens": 3}))
    default, alternative = np.array([1, 2], np.float32), np.array([3, 4], np.float32)
    for q_indptr, want in (([0, 3, 7], alternative), ([0, 3, 5], default), ([0, 1, 2], default)):
        got = interpret(g, {"in0": default, "in1": alternative, "in2": np.array(q_indptr, np.int32)}, None)["y"]
        assert got.tolist() == want.tolist(), q_indptr


def test_kv_row_quantisation_known_values():
    """int8: scale = max|x| / 127, q = x / scale rounded half to even; fp8: x / scale in e4m3."""
    from kiln.ir.quant import KV_SCHEMES
    q, scale = KV_SCHEMES["int8"].quantize_rows(np.array([[1.0, -2.0, 0.5, 0.0], [0, 0, 0, 0]], np.float32))
    assert scale.tolist() == [np.float32(2 / 127), 1.0]
    assert q.tolist() == [[64, -127, 32, 0], [0, 0, 0, 0]]          # 63.5 -> 64, 31.75 -> 32
    q, scale = KV_SCHEMES["fp8"].quantize_rows(np.array([[0.25, -1.0, 0.3]], np.float32))
    assert scale.tolist() == [np.float32(1 / 448)]
    assert q.astype(np.float32).tolist() == [[112.0, -448.0, 128.0]]   # 134.4 lies between e4m3's 128 and 144


@pytest.mark.parametrize("module,attrs", [
    ("gemma2.modeling_gemma2.Gemma2RMSNorm", {"offset": 1.0, "weight_in_float32": True}),
    ("olmo2.modeling_olmo2.Olmo2RMSNorm", {"weight_in_float32": True}),
    ("llama.modeling_llama.LlamaRMSNorm", {}),
])
def test_rms_norm_variants_equal_transformers_in_bfloat16(module, attrs):
    """Where each family rounds (and Gemma's 1 + w) decides bfloat16 results: compared bit for bit."""
    import importlib
    torch = pytest.importorskip("torch")
    path, cls = module.rsplit(".", 1)
    norm = getattr(importlib.import_module(f"transformers.models.{path}"), cls)(64, eps=1e-6)
    rng = np.random.default_rng(3)
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(rng.standard_normal(64).astype(np.float32) * 0.5))
        norm = norm.to(torch.bfloat16)
        x = torch.from_numpy(rng.standard_normal((5, 64)).astype(np.float32) * 3).to(torch.bfloat16)
        want = norm(x).float().numpy()
    b = GraphBuilder("norm")
    y = b.op("rms_norm", b.input("x", ("tokens", 64), "bfloat16"), b.param("w", (64,), "bfloat16"), eps=1e-6, **attrs)
    graph = b.output(y)
    import ml_dtypes
    got = interpret(graph, {"x": x.float().numpy().astype(ml_dtypes.bfloat16)},
                    {"w": norm.weight.detach().float().numpy().astype(ml_dtypes.bfloat16)}.__getitem__)[y]
    np.testing.assert_array_equal(got.astype(np.float32), want)
