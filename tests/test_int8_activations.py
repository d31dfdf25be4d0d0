"""int8 activations for q8/q4 linears (act_block): the scheme's known values and error bound, the
quantize pass and pipeline choosing it, and a compiled model using it end to end.

The kernels themselves are held to the interpreter in tests/test_gemm.py; here the interpreter's
rule is held to values worked out by hand and to the float-activation linear it approximates."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.ir import GraphBuilder, interpret
from kiln.ir.quant import quantize_activations
from kiln.options import CompileOptions

torch = pytest.importorskip("torch")

K, N, BLOCK = 64, 12, 32


def test_quantize_activations_known_values():
    """127 / peak times x, rounded half to even; an all-zero block has level 0 and scale 0."""
    x = np.array([[0.5, -1.0, 0.25, 0.0, 0.0, 0.0, 0.0, 0.0]], np.float32)
    q, scale = quantize_activations(x, 4)
    assert q.tolist() == [[[64, -127, 32, 0], [0, 0, 0, 0]]]        # 63.5 -> 64, 31.75 -> 32
    assert scale.tolist() == [[np.float32(1) / np.float32(127), 0.0]]


def _linear(op, weights, act_block, x):
    b = GraphBuilder(op)
    params = [b.param(f"w{i}", w.shape, str(w.dtype)) for i, w in enumerate(weights)]
    attrs = {"format": op.partition("_")[2], **({"group_size": BLOCK} if op == "linear_q4" else {})}
    graph = b.output(b.op("linear", b.input("x", ("tokens", K), "float32"), *params, name="y", act_block=act_block,
                          **attrs))
    return interpret(graph, {"x": x}, {f"w{i}": w for i, w in enumerate(weights)}.__getitem__)["y"]


def _weights(op, rng):
    if op == "linear_q8":
        return [rng.integers(-127, 128, (N, K)).astype(np.int8), rng.uniform(0.001, 0.01, N).astype(np.float32)]
    return [rng.integers(0, 256, (N, K // 2)).astype(np.uint8),
            rng.uniform(0.001, 0.01, (K // BLOCK, N)).astype(np.float16)]


def _dequantised(op, weights) -> np.ndarray:      # W [N, K] in float64, written out independently
    w, scale = weights
    if op == "linear_q8":
        return w.astype(np.float64) * scale.astype(np.float64)[:, None]
    levels = np.empty((N, K))
    levels[:, 0::2], levels[:, 1::2] = (w & 15).astype(np.float64) - 8, (w >> 4).astype(np.float64) - 8
    return levels * np.repeat(scale.astype(np.float64).T, BLOCK, axis=1)


@pytest.mark.parametrize("op", ["linear_q8", "linear_q4"])
def test_activations_on_the_int8_grid_lose_nothing(op):
    """x = level * (peak / 127) with a ±127 in every block quantises to itself: the int8 path
    equals x @ W.T in float64 up to float32 rounding."""
    rng = np.random.default_rng(3)
    weights = _weights(op, rng)
    levels = rng.integers(-127, 128, (5, K)).astype(np.float32)
    levels[:, ::BLOCK] = 127
    peaks = rng.uniform(0.5, 4.0, (5, K // BLOCK)).astype(np.float32)
    x = levels * np.repeat(peaks / np.float32(127), BLOCK, axis=1)
    got = _linear(op, weights, BLOCK, x)
    want = x.astype(np.float64) @ _dequantised(op, weights).T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("op", ["linear_q8", "linear_q4"])
def test_int8_activation_error_is_within_half_a_level_per_input(op):
    """Rounding moves each x by at most half its block's step (peak / 127 / 2), so
    |y_int8 - y_float| <= sum over blocks of step / 2 * sum |W| over the block: a bound the rule
    must meet and that a rule rounding twice as coarsely would break."""
    rng = np.random.default_rng(4)
    weights = _weights(op, rng)
    x = (rng.standard_normal((7, K)) * rng.uniform(0.1, 10, (7, 1))).astype(np.float32)
    w = _dequantised(op, weights)
    half_step = np.abs(x).reshape(7, -1, BLOCK).max(-1) / 127 / 2                  # [rows, blocks]
    bound = half_step @ np.abs(w).reshape(N, -1, BLOCK).sum(-1).T                   # [rows, N]
    error = np.abs(_linear(op, weights, BLOCK, x) - x.astype(np.float64) @ w.T)
    assert (error <= bound * 1.001 + 1e-6).all()
    assert error.max() > 0.05 * bound.max()                                         # it did quantise


def test_pipeline_takes_the_targets_activation_block_and_can_be_told_otherwise(make_model):
    from kiln.errors import KilnError
    from kiln.frontend import load_hf_model
    from kiln.passes import run_pipeline
    from kiln.targets import target_defaults
    graph = load_hf_model(make_model("qwen2")).build_graph("float32", 16)
    block = target_defaults("cpu").activation_block
    for quant in ("q8", "q4"):
        quantised, _ = run_pipeline(graph, "cpu", options=CompileOptions(quant=quant))
        linears = [n for n in quantised.nodes if n.op == "linear" and n.attrs["format"] == quant]
        assert linears and {n.attrs.get("act_block", 0) for n in linears} == {block}
        floats, _ = run_pipeline(graph, "cpu", options=CompileOptions(quant=quant, int8_activations=False))
        assert {n.attrs["act_block"] for n in floats.nodes if n.op == "linear" and n.attrs["format"] == quant} == {0}
    fp8, _ = run_pipeline(graph, "cpu", options=CompileOptions(quant="fp8"))
    assert all(n.attrs.get("act_block", 0) == 0 for n in fp8.nodes)        # fp8 weights: float activations
    with pytest.raises(KilnError, match="--activations int8 is not supported on target cuda"):
        run_pipeline(graph, "cuda", options=CompileOptions(quant="q8", int8_activations=True))


@pytest.mark.parametrize("quant, cosine", [("q8", 0.999), ("q4", 0.98), ("q4k", 0.98)])
def test_compiled_model_runs_int8_kernels_says_so_and_keeps_its_accuracy(make_model, compiled_family, quant, cosine):
    """The default CPU compile of a q8/q4/q4k model: its manifest and `kiln inspect` name the activation
    block and its linears are the int8 GEMM (the decode entry's the int8 GEMV), or on AVX-512 VNNI
    the VNNI kernel in every entry; its last-token logits stay as close to transformers'
    (float32) as tests/test_quant.py holds float activations to; and 6 greedy requests batched give
    each one's tokens alone (every row's levels and dots are its own, whatever the step).
    Compiled against interpreted logits are not compared here: a one-ulp difference upstream can flip
    a level (a ~1e-3 change in these 256-wide models), so that equality is held op by op
    (tests/test_gemm.py)."""
    import transformers
    from reference import last_logit_cosines, random_prompt
    from kiln.artifact import read_manifest
    from kiln.host_cpu import has_pair_dot
    from kiln.inspect import summary
    from kiln.runtime.llm import LLM
    from kiln.runtime.model import CompiledModel
    from kiln.runtime.sampler import SamplingParams
    from kiln.targets.cpu import CPUTarget, host_cpu_target
    if not has_pair_dot(host_cpu_target()):
        pytest.skip("this CPU has no AVX2 (the int8 GEMM's vpmaddwd)")
    model_dir = make_model("qwen2")                  # biases, fused QKV and gate/up: every linear variant
    # the embedding stays float, as in tests/test_quant.py, whose bounds these are
    artifact = compiled_family("qwen2", quant=quant, quant_embedding=False)
    manifest = read_manifest(artifact).to_json()
    assert manifest["quantization"]["activation_block"] == 32
    assert "activations int8 in blocks of 32" in summary(artifact)
    linears = [k for k in manifest["kernels"] if k.startswith(("int8_gem", "vnni", "gemm", "linear"))]
    formats = (quant, "q8") if quant in ("q4", "q4k") else (quant,)    # a 4-bit model's LM head is q8
    if CPUTarget().int8_dot == "vnni":                                # one kernel for every step
        assert linears and all(k.startswith(tuple(f"vnni_{f}" for f in formats)) for k in linears)
        assert any(k.startswith(f"vnni_{quant}") for k in linears)
    else:
        assert linears and all(k.startswith(tuple(f"int8_gem{v}_{f}" for v in "mv" for f in formats)) for k in linears)
        assert any(k.startswith("int8_gemv_") for k in linears)     # the decode entry's
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    compiled = CompiledModel(artifact)
    compiled.allocate_kv(16 * compiled.bytes_per_page)
    assert min(last_logit_cosines(hf, compiled)) >= cosine
    del compiled
    llm = LLM(artifact, kv_memory="8MiB", max_batched_tokens=24)
    prompts = [random_prompt(5 + 3 * i, 40 + i) for i in range(6)]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    alone = [llm.generate([p], greedy, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == alone


def test_interleaved_layouts_known_values():
    """packedNBxF (int8 activations: F = 2 for vpmaddwd's pairs, 4 for vpdpbusd's quads): W[j, k]
    at [j // NB, k // F, F (j % NB) + k % F]."""
    from kiln.selection.layouts import apply_layout, interleave, packed_block, packed_index, stored_shape
    w = np.arange(16 * 8).reshape(16, 8)            # W[j, k] = 8 j + k
    stored = apply_layout("packed8x2", w)
    assert stored.shape == stored_shape("packed8x2", (16, 8)) == (2, 4, 16)
    assert stored[1, 2].tolist() == [8 * j + k for j in range(8, 16) for k in (4, 5)]
    quads = apply_layout("packed8x4", w)
    assert quads.shape == stored_shape("packed8x4", (16, 8)) == (2, 2, 32)
    assert quads[1, 1].tolist() == [8 * j + k for j in range(8, 16) for k in (4, 5, 6, 7)]
    for layout in ("packed8x2", "packed8x4", "packed8"):
        stored = apply_layout(layout, w)
        assert all(stored[packed_index(layout, j, k)] == 8 * j + k for j in range(16) for k in range(8))
    assert (packed_block("packed64x4"), interleave("packed64x4"), interleave("packed64"), interleave("nk")) == (64, 4, 1, 1)
    experts = apply_layout("packed8x2", np.stack([w, w + 1000]))
    assert experts.shape == (2, 2, 4, 16) and experts[1, 0, 0, 1] == 1001


def test_q4_bytes_of_two_blocks_known_values():
    """packedNBx4nS on q4 bytes (neighbouring inputs a byte, the even one low): byte i of each run
    of S bytes holds input i of a run of 2S inputs in its low nibble and input S + i in its high
    one, then the bytes are stored in quads; the gather's reading (nibble_of) finds every level."""
    from kiln.selection.layouts import apply_layout, nibble_of, nibble_span, packed_index
    levels = (np.arange(16)[:, None] + np.arange(16)[None, :]) % 16       # L[j, k] = (j + k) % 16
    q4 = (levels[:, 0::2] | levels[:, 1::2] << 4).astype(np.uint8)     # [16, 8], as ir/quant.py stores them
    stored = apply_layout("packed8x4n4", q4)
    assert stored.shape == (2, 2, 32)
    # stored row 1 of panel 0: bytes 4..7 (the second run: inputs 8..11 low, 12..15 high) of columns 0..7
    assert stored[0, 1].tolist() == [(j + 8 + i) % 16 | (j + 12 + i) % 16 << 4 for j in range(8) for i in range(4)]
    assert nibble_span("packed8x4n4") == 4 and nibble_span("packed8x4") == 0
    for j in range(16):
        for k in range(16):
            byte, high = nibble_of(k, 4)
            assert stored[packed_index("packed8x4n4", j, byte)] >> 4 * high & 15 == levels[j, k]


def test_group_scales_stored_by_panel_known_values():
    """panelsNB: q4 group scales S[g, j] ([groups, out]) at [j // NB, g, j % NB]; group_scales reads
    the stored table back as [g, j]."""
    from kiln.selection.layouts import apply_layout, group_scales, stored_shape
    s = np.arange(4 * 16).reshape(4, 16)           # S[g, j] = 16 g + j
    stored = apply_layout("panels8", s)
    assert stored.shape == stored_shape("panels8", (4, 16)) == (2, 4, 8)
    assert stored[1, 2].tolist() == [16 * 2 + j for j in range(8, 16)]
    view = group_scales(stored, "panels8")
    assert all(view[g, j] == 16 * g + j for g in range(4) for j in range(16))
    assert group_scales(s, "nk") is s


@pytest.mark.build
@pytest.mark.parametrize("op, layout, scale_layout", [
    ("embed_q8", "packed16x2", "nk"), ("embed_q8", "packed16x4", "nk"), ("embed_q4", "packed16x4", "nk"),
    ("embed_q4", "packed16x4n8", "panels16"), ("embed", "packed16x2", "nk")])
def test_a_table_stored_interleaved_gathers_the_interpreters_rows(op, layout, scale_layout):
    """A table tied to a q8/q4 LM head with int8 activations, or to a bf16 head on a CPU with a bf16
    dot, is stored in the head's interleaved layout, a q4 table's scales in the head's (panelsNB for
    the VNNI kernel; tests/test_quant_embedding.py); the gather must still read each row the
    interpreter's embed reads, q8, q4 or float (q4 bytes of neighbouring inputs, or of inputs 8
    apart as the VNNI kernel's 'nS' stores them)."""
    import ml_dtypes
    import tvm
    from tvm import te
    from kiln.codegen.lowering.embed import gather_kernel
    from kiln.ir import GraphBuilder, interpret
    from kiln.selection.formats import WeightFormat
    from kiln.selection.layouts import apply_layout, stored_shape
    from kiln.targets.cpu import host_cpu_target
    vocab, hidden, group = 64, 48, 16
    rng = np.random.default_rng(0)
    if op == "embed":                    # bf16, no scale
        table = rng.standard_normal((vocab, hidden)).astype(ml_dtypes.bfloat16)
        scale, fmt, attrs = None, WeightFormat(), {}     # out: the table's dtype, widened below
    elif op == "embed_q8":
        table = rng.integers(-127, 128, (vocab, hidden)).astype(np.int8)
        scale = (rng.random(vocab) * 0.01).astype(np.float32)
        fmt, attrs = WeightFormat("q8"), {}
    else:
        table = rng.integers(0, 256, (vocab, hidden // 2)).astype(np.uint8)
        scale = (rng.random((hidden // group, vocab)) * 0.01).astype(np.float16)
        fmt, attrs = WeightFormat("q4", group), {"group_size": group}
    ids = np.array([0, 63, 17, 17, 5, 16], np.int32)
    scales = [] if scale is None else [scale]
    b = GraphBuilder("embed")
    graph = b.output(b.op("embed", b.input("ids", ("tokens",), "int32"), b.param("table", table.shape, str(table.dtype)),
                          *[b.param("scale", s.shape, str(s.dtype)) for s in scales], name="out",
                          format=op.partition("_")[2] or "none", **attrs, **({"dtype": "float32"} if scales else {})))
    want = interpret(graph, {"ids": ids}, {"table": table, "scale": scale}.__getitem__)["out"].astype(np.float32)
    ph = [te.placeholder((ids.size,), "int32"), te.placeholder(stored_shape(layout, table.shape), str(table.dtype)),
          *[te.placeholder(stored_shape(scale_layout, s.shape), str(s.dtype)) for s in scales]]
    func = te.create_prim_func([*ph, gather_kernel(vocab, hidden, layout, "float32", fmt, scale_layout)(*ph)])
    built = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=host_cpu_target())
    out = tvm.runtime.tensor(np.zeros((ids.size, hidden), np.float32))
    stored_scales = [apply_layout(scale_layout, s) for s in scales]
    built(*[tvm.runtime.tensor(a) for a in (ids, apply_layout(layout, table), *stored_scales)], out)
    np.testing.assert_array_equal(out.numpy(), want)


def _with_an_outlier_channel(model_dir, out, channel: int = 5):
    """The tiny Llama with input `channel` of layer 0's attention 1000× larger and not read by its q/k/v
    projections (their columns zero, which every weight format keeps exactly), as real models' massive
    activations: float activations lose nothing by it, while an int8 block holding it rounds its other
    inputs to 0."""
    import shutil
    import transformers
    shutil.copytree(model_dir, out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    attention = hf.model.layers[0].self_attn
    with torch.no_grad():
        hf.model.layers[0].input_layernorm.weight[channel] *= 1000
        for proj in (attention.q_proj, attention.k_proj, attention.v_proj):
            proj.weight[:, channel] = 0
    hf.save_pretrained(out)
    return out


@pytest.mark.build
def test_calibration_gives_float_activations_where_int8_measures_harmful(make_model, tmp_path):
    """--calibrate measures each linear's int8-activation error: on a model with an outlier input channel
    the three linears reading it keep float activations (the manifest and `kiln inspect` say so), the rest
    stay int8; the logits then stay as close to transformers' as q8 holds them, while the same compile
    with `--activations int8` falls short (the outlier's block crushed); attach-weights replans it."""
    import transformers
    from artifact_cache import cpu_artifact
    from reference import last_logit_cosines
    from test_attach_weights import weights_digest, without_weights
    from kiln.artifact import read_manifest
    from kiln.host_cpu import has_pair_dot
    from kiln.inspect import summary
    from kiln.runtime.model import CompiledModel
    from kiln.targets.cpu import host_cpu_target
    from kiln.testing.perplexity import calibration_text
    from kiln.weights.attach import attach_weights
    if not has_pair_dot(host_cpu_target()):
        pytest.skip("this CPU has no AVX2 (the int8 GEMM's vpmaddwd)")
    model_dir = _with_an_outlier_channel(make_model("llama"), tmp_path / "outlier")
    text = tmp_path / "calibration.txt"
    text.write_text(calibration_text(8_000))
    measured = cpu_artifact(model_dir, quant="q8", calibrate=str(text))
    forced = cpu_artifact(model_dir, quant="q8", calibrate=str(text), int8_activations=True)
    acts = read_manifest(measured).quantization.calibration["activations"]
    assert acts["float"] == [f"model.layers.0.self_attn.{p}_proj.weight" for p in "kqv"]
    assert acts["largest"][1] > 4 * acts["bound"] and read_manifest(forced).quantization.calibration[
        "activations"]["float"] == []
    shown = summary(measured)
    assert "qkv q8 ×1, q8 on float activations ×1" in shown or "qkv q8 on float activations ×1, q8 ×1" in shown
    assert "float where above 5%: 3" in shown
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    cosines = {}
    for name, artifact in (("measured", measured), ("forced", forced)):
        compiled = CompiledModel(artifact)
        compiled.allocate_kv(16 * compiled.bytes_per_page)
        cosines[name] = min(last_logit_cosines(hf, compiled, prompts=4))
        del compiled
    assert cosines["measured"] >= 0.999 > cosines["forced"], cosines
    bare = without_weights(measured, tmp_path)
    attach_weights(bare, model_dir)
    assert weights_digest(bare) == weights_digest(measured)
