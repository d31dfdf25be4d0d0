"""The quantised embedding: the quantize_embedding pass three ways, the table stored once when it is
tied to the LM head, and compiled q8/q4 artifacts (tied and untied) against the interpreter."""
from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

from kiln.errors import KilnError

from kiln.ir import GraphBuilder, interpret, print_graph, verify, weight_loader
from kiln.ir.quant import SCHEMES
from kiln.options import CompileOptions
from kiln.passes.quantize import Quantize
from kiln.passes.quantize_embedding import QuantizeEmbedding

IDS = {"ids": np.array([3, 1, 15, 0, 3], np.int32)}


def body(graph) -> list[str]:
    return [line for line in print_graph(graph).splitlines() if line.startswith("  %") or line.startswith("  @")]


def rows_graph(vocab=16, hidden=8, dtype="float32"):
    """embed -> cast: the graph's output is the gathered rows themselves."""
    b = GraphBuilder("rows")
    ids = b.input("ids", ("tokens",), "int32")
    h = b.op("embed", ids, b.param("embed.weight", (vocab, hidden), dtype), name="h")
    return verify(b.output(b.op("cast", h, dtype="float32", name="out")))


def lm_graph(tied: bool, dtype: str = "float32"):
    """embed -> linear -> LM head (the embedding table itself when tied) -> cast."""
    b = GraphBuilder("lm")
    ids = b.input("ids", ("tokens",), "int32")
    table = b.param("embed.weight", (16, 8), dtype)
    h = b.op("embed", ids, table, name="h")
    x = b.op("linear", h, b.param("proj.weight", (8, 8), dtype), name="x")
    head = table if tied else b.param("head.weight", (16, 8), dtype)
    return verify(b.output(b.op("cast", b.op("linear", x, head, name="y"), dtype="float32", name="logits")))


def run(graph, weights):
    return interpret(graph, IDS, weight_loader(graph, weights.__getitem__))


# ---------------------------------------------------------------------------- the rewrite

def test_quantize_embedding_rewrite():
    after = QuantizeEmbedding("q8")(Quantize("q8")(lm_graph(tied=False)))
    assert {"  @embed.weight.q8: i8[16, 8] = q8.q(@embed.weight)",
            "  @embed.weight.q8_scale: f32[16] = q8.scale(@embed.weight)"} < set(body(after))
    assert "  %h = embed(%ids, @embed.weight.q8, @embed.weight.q8_scale) {format='q8', dtype='float32'} : f32[tokens, 8]" \
        in body(after)
    assert "  %y = linear(%x, @head.weight.q8, @head.weight.q8_scale) {format='q8'} : f32[tokens, 16]" in body(after)
    assert "embed.weight" not in after.params            # the float table is no longer read


@pytest.mark.parametrize("mode,group", [("q8", 32), ("q4", 4), ("fp8", 32)])
def test_quantize_embedding_shares_a_tied_table_with_the_lm_head(mode, group):
    after = QuantizeEmbedding(mode, group_size=group)(Quantize(mode, group_size=group)(lm_graph(tied=True)))
    embed, head = after.nodes[0], after.nodes[-2]
    assert (embed.op, head.op) == ("embed", "linear") and embed.attrs["format"] == head.attrs["format"] == mode
    assert embed.inputs[1:] == head.inputs[1:3] == [f"embed.weight.{mode}", f"embed.weight.{mode}_scale"]
    assert sorted(p for p in after.params if p.startswith("embed")) == embed.inputs[1:]


def test_quantize_embedding_q4_rewrite():
    after = QuantizeEmbedding("q4", group_size=4)(rows_graph(dtype="bfloat16"))
    assert body(after) == [
        "  @embed.weight.q4: u8[16, 4] = q4.q(@embed.weight, group_size=4)",
        "  @embed.weight.q4_scale: f16[2, 16] = q4.scale(@embed.weight, group_size=4)",
        "  %h = embed(%ids, @embed.weight.q4, @embed.weight.q4_scale) {format='q4', dtype='bfloat16', group_size=4} "
        ": bf16[tokens, 8]",
        "  %out = cast(%h) {dtype='float32'} : f32[tokens, 8]",
    ]


# ---------------------------------------------------------------------------- equivalence

def grid_table(mode, rng, vocab=16, hidden=8, group=4):
    """A table that lies on the scheme's grid: its quantisation is exact."""
    if mode == "q8":
        q = rng.integers(-127, 128, (vocab, hidden))
        q[:, 0] = 127
        return (q * np.float32(2.0) ** rng.integers(-12, -4, (vocab, 1))).astype(np.float32)   # 127 * s / 127 == s
    if mode == "q4":
        q = rng.integers(-7, 8, (vocab, hidden))
        q[:, ::group] = -8                                   # every group's peak is the bottom of the range
        scale = rng.uniform(0.01, 0.1, (vocab, hidden // group)).astype(np.float16).astype(np.float32)
        return (q * np.repeat(scale, group, axis=1)).astype(np.float32)
    import ml_dtypes
    q = (rng.standard_normal((vocab, hidden)) * 100).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    q[:, 0] = 448.0
    return (q * np.float32(2.0) ** rng.integers(-12, -4, (vocab, 1))).astype(np.float32)


@pytest.mark.parametrize("mode", ["q8", "q4", "fp8"])
def test_quantize_embedding_is_exact_on_grid_tables(mode):
    before = rows_graph()
    after = QuantizeEmbedding(mode, group_size=4)(before)
    table = grid_table(mode, np.random.default_rng(7))
    want = interpret(before, IDS, {"embed.weight": table}.__getitem__)["out"]
    np.testing.assert_array_equal(run(after, {"embed.weight": table})["out"], want)


@pytest.mark.parametrize("mode", ["q8", "q4", "fp8"])
def test_quantize_embedding_error_is_bounded_on_random_tables(mode):
    before = rows_graph(vocab=64, hidden=64)
    after = QuantizeEmbedding(mode, group_size=32)(before)
    table = np.random.default_rng(8).standard_normal((64, 64)).astype(np.float32)
    ids = {"ids": np.arange(64, dtype=np.int32)}
    want = interpret(before, ids, {"embed.weight": table}.__getitem__)["out"]
    got = interpret(after, ids, weight_loader(after, {"embed.weight": table}.__getitem__))["out"]
    err, row_max = np.abs(got - want), np.abs(want).max(1, keepdims=True)
    if mode == "q8":          # half a step of max / 127
        assert (err <= row_max / 254 * 1.0001).all()
    elif mode == "fp8":       # 3 mantissa bits: half an ulp of each value (subnormals: of the smallest)
        assert (err <= np.maximum(np.abs(want) / 16, row_max / 448 * 2.0 ** -10) * 1.0001).all()
    else:                     # 16 levels per group of 32: rms error well under a tenth of the rms
        assert np.sqrt((err ** 2).mean()) < 0.1 * np.sqrt((want ** 2).mean())
    assert not np.array_equal(got, want)                     # it did quantise


def test_quantize_embedding_keeps_the_lm_head_output_close():
    """The whole tied model before and after quantize + quantize_embedding: logits within q8 error."""
    before = lm_graph(tied=True)
    rng = np.random.default_rng(3)
    weights = {n: rng.standard_normal(p.type.shape).astype(np.float32) for n, p in before.params.items()}
    after = QuantizeEmbedding("q8")(Quantize("q8")(before))
    want = interpret(before, IDS, weights.__getitem__)["logits"]
    got = run(after, weights)["logits"]
    assert np.abs(got - want).max() <= 0.03 * np.abs(want).max()


# ---------------------------------------------------------------------------- near misses

def test_quantize_embedding_near_miss():
    # q4 groups that do not divide the hidden width: refused, naming the table and the way out
    with pytest.raises(KilnError, match=r"cannot hold the embedding table .*width 12 .*--tensor-quant embedding=q8"):
        QuantizeEmbedding("q4", group_size=8)(rows_graph(hidden=12))
    # an embedding already quantised is left alone
    once = QuantizeEmbedding("q8")(rows_graph())
    assert print_graph(QuantizeEmbedding("q8")(once)) == print_graph(once)
    # a table computed by the graph (not a param) is not quantised
    b = GraphBuilder("computed")
    ids = b.input("ids", ("tokens",), "int32")
    table = b.input("table", (16, 8), "float32")
    g = verify(b.output(b.op("embed", ids, b.op("silu", table), name="h")))
    assert print_graph(QuantizeEmbedding("q8")(g)) == print_graph(g)


def test_pipeline_quantizes_the_embedding_only_when_asked():
    from kiln.passes.pipeline import pipeline_for
    names = lambda **kw: [p.name for p in pipeline_for("cpu", CompileOptions(**kw))]   # noqa: E731
    assert names(quant="q4")[-3:-1] == ["quantize", "quantize_embedding"]
    assert "quantize_embedding" not in names(quant="q4", quant_embedding=False)
    assert "quantize_embedding" not in names()


# ---------------------------------------------------------------------------- storage (lowering only)

def stored(graph, target):
    from kiln.codegen import lower_graph
    from kiln.passes.select_kernels import SelectKernels
    return {w.name: w for w in lower_graph(SelectKernels(target)(graph), target).weights}


@pytest.mark.build
def test_a_tied_table_is_stored_once_quantised_or_float():
    from kiln.targets.cpu import CPUTarget
    from kiln.targets.cuda import CUDATarget
    quantised = QuantizeEmbedding("q8")(Quantize("q8")(lm_graph(tied=True)))
    # the CPU packs linear weights (the head [16, 8] in blocks of 16 rows), GPUs keep them [out, in]
    for target, head, proj in ((CPUTarget(), "@packed16", "@packed8"), (CUDATarget(arch="sm_80"), "", "")):
        assert sorted(stored(quantised, target)) == [f"embed.weight.q8{head}", "embed.weight.q8_scale",
                                                     f"proj.weight.q8{proj}", "proj.weight.q8_scale"]
        # without --quant the gather reads the head's float table in the head's layout: one copy too
        assert sorted(stored(lm_graph(tied=True), target)) == [f"embed.weight{head}", f"proj.weight{proj}"]
    # q8 with int8 activations: the head is stored with the inputs its integer dot takes side by side
    # (AVX2: pairs; VNNI: quads, where the panel fills 512-bit registers), and so is the table it shares
    int8 = QuantizeEmbedding("q8")(Quantize("q8", act_block=4)(lm_graph(tied=True)))
    for dot, head in (("avx2", "packed16x2"), ("vnni", "packed16x4")):
        assert sorted(stored(int8, CPUTarget(int8_dot=dot))) == [f"embed.weight.q8@{head}", "embed.weight.q8_scale",
                                                                 "proj.weight.q8@packed8x2", "proj.weight.q8_scale"]
    # q4 on VNNI: the head's bytes in quads, each byte's nibbles from two activation blocks, its group
    # scales (and so the table's) stored by weight panel; AVX2 keeps them [groups, out], and so does
    # VNNI where a row is one activation block (nothing to pair: the AVX2 kernels read it)
    for block, dot, head, scale in ((4, "avx2", "packed16", "embed.weight.q4_scale"),
                                    (4, "vnni", "packed16x4n4", "embed.weight.q4_scale@panels16"),
                                    (8, "vnni", "packed16", "embed.weight.q4_scale")):
        int4 = QuantizeEmbedding("q4", group_size=8)(Quantize("q4", group_size=8, act_block=block)(lm_graph(tied=True)))
        assert sorted(stored(int4, CPUTarget(int8_dot=dot))) == [f"embed.weight.q4@{head}", scale,
                                                                 "proj.weight.q4@packed8", "proj.weight.q4_scale"]
    # bf16 where the CPU has a bf16 dot: the head (and the table it shares) in input pairs where the
    # panel fills 16 lanes (not the 8-column projection, which the float kernels read)
    for dot, head in ((True, "packed16x2"), (False, "packed16")):
        assert sorted(stored(lm_graph(tied=True, dtype="bfloat16"), CPUTarget(bf16_dot=dot))) == [
            f"embed.weight@{head}", "proj.weight@packed8"]


@pytest.mark.build
def test_no_quant_lm_head_stores_the_float_head_and_the_quantised_embedding():
    from kiln.targets.cpu import CPUTarget
    graph = QuantizeEmbedding("q8")(Quantize("q8", lm_head=False)(lm_graph(tied=True)))
    assert [(n.op, n.attrs.get("format")) for n in graph.nodes] == [("embed", "q8"), ("linear", "q8"),
                                                                     ("linear", "none"), ("cast", None)]
    assert sorted(stored(graph, CPUTarget())) == ["embed.weight.q8", "embed.weight.q8_scale", "embed.weight@packed16",
                                                  "proj.weight.q8@packed8", "proj.weight.q8_scale"]


# ---------------------------------------------------------------------------- compiled CPU artifacts

needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                   reason="transformers is not installed")


def weight_bytes(weights) -> int:
    item = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "uint8": 1, "float8_e4m3fn": 1}
    return sum(item[w["dtype"]] * int(np.prod(w["shape"])) for w in weights)


def table_classes(quant: str) -> tuple:
    """--tensor-quant giving the embedding table and the LM head `quant` (a 4-bit --quant makes them q8)."""
    return (("embedding", quant), ("lm_head", quant)) if quant == "q4" else ()


@pytest.fixture(scope="module", params=[("llama32", "q8"), ("llama32", "q4"), ("llama", "q8"), ("llama", "q4"),
                                        ("llama", "fp8")],
                ids=lambda p: f"{'tied' if p[0] == 'llama32' else 'untied'}-{p[1]}")
def artifact(request, make_model):
    from artifact_cache import cpu_artifact
    from kiln.artifact import read_manifest
    from kiln.runtime.model import CompiledModel
    family, quant = request.param
    model_dir = make_model(family)
    # Float activations: with int8 ones (tests/test_int8_activations.py) these tiny random models
    # with an int8 table move their logits by ~0.7% when the table's scales move by 3e-7 (activation
    # levels flip), so one-ulp kernel differences upstream would decide the comparison below.
    # the table (and the head) in `quant` itself, not the q8 a 4-bit model gives them by default
    out = cpu_artifact(model_dir, quant=quant, int8_activations=False, tensor_classes=table_classes(quant))
    manifest = read_manifest(out).to_json()
    model = CompiledModel(out)
    model.allocate_kv(16 * model.bytes_per_page)
    return family == "llama32", quant, model_dir, out, manifest, model


@pytest.mark.build
@needs_transformers
def test_compiled_quantised_embedding_matches_the_interpreter(artifact):
    """A prefill then two decode steps: compiled logits against the interpreter on the same quantised graph."""
    from paging import make_kv_pages, make_step_inputs
    from reference import random_prompt
    from kiln.frontend import load_hf_model
    from kiln.passes import run_pipeline
    tied, quant, model_dir, _, _, compiled = artifact
    hf_model = load_hf_model(model_dir)
    options = CompileOptions(quant=quant, int8_activations=False, tensor_classes=table_classes(quant))
    graph, _ = run_pipeline(hf_model.build_graph("float32", 16), "cpu", options=options)
    assert (graph.nodes[0].op, graph.nodes[0].attrs["format"]) == ("embed", quant)
    weights = weight_loader(graph, lambda n: hf_model.weight(n, "float32"))
    c = hf_model.config
    kv = make_kv_pages(c.num_layers, 8, c.num_kv_heads, 16, c.head_dim)
    ids = random_prompt(29, 5)
    for step in (make_step_inputs([(ids, 0, [1, 6])], 16), make_step_inputs([([7], 29, [1, 6])], 16),
                 make_step_inputs([([c.vocab_size - 1], 30, [1, 6])], 16)):      # the last row of the table
        want = interpret(graph, {**step, **kv}, weights)["logits"]
        got = compiled.forward(step)
        assert np.abs(got - want).max() / np.abs(want).max() <= 1e-4


@pytest.mark.build
@needs_transformers
def test_compiled_artifact_stores_the_table_once_and_is_smaller(artifact):
    from safetensors import safe_open
    from kiln.codegen import lower_graph
    from kiln.frontend import load_hf_model
    from kiln.inspect import summary
    from kiln.passes import run_pipeline
    from kiln.targets.cpu import CPUTarget
    tied, quant, model_dir, out, manifest, _ = artifact
    assert manifest["quantization"]["embedding"] == quant
    assert manifest["quantization"]["embedding_shared_with_lm_head"] is tied
    with safe_open(str(out / "weights.safetensors"), "np") as f:
        keys = set(f.keys())
    table = [k for k in keys if k.startswith("model.embed_tokens.weight")]
    assert "model.embed_tokens.weight" not in keys                    # no float table
    scheme = SCHEMES[quant]
    assert sorted(table) == sorted(
        [w["name"] for w in manifest["weights"] if w["param"].startswith("model.embed_tokens.weight")])
    assert len(table) == 2 and {w["dtype"] for w in manifest["weights"] if w["name"] in table} == {
        scheme.weight_dtype, scheme.scale_dtype}                      # one quantised table and its scales
    assert ("the embedding table is the LM head's, stored once" in summary(out)) is tied
    assert f"the embedding table {quant}" in summary(out)
    # the same model with the embedding kept in float32 (what kiln stored before)
    hf_model = load_hf_model(model_dir)
    options = CompileOptions(quant=quant, quant_embedding=False, tensor_classes=table_classes(quant)[1:])
    kept, _ = run_pipeline(hf_model.build_graph("float32", 16), "cpu", options=options)
    before = [w.__dict__ for w in lower_graph(kept, CPUTarget()).weights]       # kept: the pipeline ran
    c = hf_model.config
    float_table = c.vocab_size * c.hidden_size * 4
    saved = weight_bytes(before) - weight_bytes(manifest["weights"])
    quantised_table = weight_bytes([w for w in manifest["weights"] if w["name"] in table])
    # tied: the float copy is gone; untied: the float table became a quantised one
    assert saved == float_table - (0 if tied else quantised_table)


@pytest.mark.build
@needs_transformers
def test_no_quant_embedding_keeps_the_table_float(make_model, tmp_path):
    from click.testing import CliRunner
    from kiln.cli import main
    from kiln.inspect import summary
    out = tmp_path / "a"
    result = CliRunner().invoke(main, ["compile", str(make_model("llama32")), "--quant", "q8",
                                       "--no-quant-embedding", "-o", str(out)])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["quantization"]["embedding"] == "none"
    assert manifest["quantization"]["embedding_shared_with_lm_head"] is False
    assert any(w["name"] == "model.embed_tokens.weight" and w["dtype"] == "float32" for w in manifest["weights"])
    assert "the embedding table in float32" in summary(out)


@pytest.mark.build
@needs_transformers
def test_quantised_embedding_error_against_transformers(artifact):
    """Cosine of the last-token logits against transformers in float32. Random weights are a hard case
    for 4 bits (tests/test_quant.py); a tied tiny model's head is its small-valued embedding, scaled up
    by the final norm, so its q4 error is the largest (measured: q8 0.9994, q4 0.915 tied; q8 0.9998,
    q4 0.979, fp8 0.9977 untied). See bench/quant_error.py for a trained model."""
    import transformers
    from reference import last_logit_cosines
    tied, quant, model_dir, _, _, compiled = artifact
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    cosines = last_logit_cosines(hf, compiled)
    assert min(cosines) >= {"q8": 0.999, "q4": 0.9 if tied else 0.97, "fp8": 0.997}[quant]


def test_a_tied_table_quantised_two_ways_is_refused():
    """q4 head in groups of 4, embedding in groups of 8: one param name, two recipes: an error, not a mix."""
    from kiln.ir import IRError
    head = Quantize("q4", group_size=4)(lm_graph(tied=True))
    with pytest.raises(IRError, match="already made by"):
        QuantizeEmbedding("q4", group_size=8)(head)
