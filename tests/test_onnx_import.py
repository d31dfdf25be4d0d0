"""ONNX decoders compiled by kiln (frontend/onnx_*.py) against onnxruntime on the same file: ONNX Runtime GenAI
builder's fp32 and int4 models and torch.onnx.export's of tiny Llama, Qwen2 and Phi-3; MatMulNBits blocks kept as
kiln's q4; the raising patterns as IR text; and files kiln must refuse, on one line naming the node."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxruntime_genai")
pytest.importorskip("transformers")

from onnx_files import ORTDecoder, genai_model, hf_model, torch_export  # noqa: E402
from paging import interpreted_steps, kv_pages_for, make_step_inputs  # noqa: E402

from kiln.errors import KilnError  # noqa: E402
from kiln.frontend import load_model  # noqa: E402
from kiln.ir import interpret, parse_graph, print_graph, weight_loader  # noqa: E402

FAMILIES = ("llama", "qwen2", "phi3")
PAGE_SIZE = 16


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, int(n)).tolist() for n in rng.integers(4, 40, count)]


def kiln_interpreted(folder, ids: list[int], split: int) -> list[np.ndarray]:
    return interpreted_steps(folder, ids, split, PAGE_SIZE)


def ort_rows(folder, ids: list[int], split: int, optimized: bool = True) -> list[np.ndarray]:
    ort = ORTDecoder(folder, optimized)
    rows = [ort.step(ids[:split])[-1]]
    return rows + [ort.step([ids[t]])[-1] for t in range(split, len(ids))]


@pytest.mark.parametrize("family", FAMILIES)
def test_builder_fp32_graph_interpreted_gives_onnxruntime_logits(family):
    folder = genai_model(family, "fp32")
    ids = prompts(1, 3)[0] + [7, 9, 11]
    for got, want in zip(kiln_interpreted(folder, ids, len(ids) - 3), ort_rows(folder, ids, len(ids) - 3)):
        np.testing.assert_allclose(got, want, atol=1e-4 * np.ptp(want), rtol=0)


@pytest.mark.build
@pytest.mark.parametrize("family", FAMILIES)
def test_builder_fp32_compiled_gives_onnxruntime_logits_through_prefill_and_decode(family):
    from artifact_cache import cpu_artifact

    folder = genai_model(family, "fp32")
    _compiled_gives_onnxruntime_logits(folder, cpu_artifact(folder), prompts(1, 4)[0] + [40] * 25, 8)


# onnxruntime's CPU kernels compute a float16 file in float16, kiln in float32 on the same numbers: its roundings
# (measured: 5e-4 of the range on the tiny models) bound the difference
FLOAT16_TOLERANCE = 2e-3


@pytest.mark.parametrize("family", ("llama", "qwen2"))
@pytest.mark.parametrize("precision, provider", [("fp16", "cuda"), ("int4", "cuda"), ("fp16", "cpu")])
def test_builder_float16_files_interpreted_give_onnxruntime_logits(family, precision, provider):
    """The builder's files for CUDA: float16 weights and activations, or int4 blocks with float16 scales; GQA
    rotating q and k itself with float16 cos/sin caches. Its float16 file for CPUs: RotaryEmbedding on q and k,
    keys and values concatenated to the past and repeated for MultiHeadAttention, an additive mask."""
    folder = genai_model(family, precision, provider=provider)
    ids = prompts(1, 3)[0] + [7, 9, 11]
    wanted = ort_rows(folder, ids, len(ids) - 3, optimized=provider == "cuda")
    for got, want in zip(kiln_interpreted(folder, ids, len(ids) - 3), wanted, strict=True):
        np.testing.assert_allclose(got, want, atol=FLOAT16_TOLERANCE * np.ptp(want), rtol=0)


@pytest.mark.build
@pytest.mark.parametrize("precision, provider", [("fp16", "cuda"), ("int4", "cuda"), ("fp16", "cpu")])
def test_builder_float16_files_compiled_for_the_cpu_give_onnxruntime_logits(precision, provider):
    """Compiled for the CPU with no flags: float32 on the float16 files' numbers; the int4 CUDA file's blocks as
    q4 exactly (float16 scales) on float activations, as its MatMulNBits compute (no accuracy level)."""
    import json

    from artifact_cache import cpu_artifact
    folder = genai_model("llama", precision, provider=provider)
    artifact = cpu_artifact(folder)
    manifest = json.loads((artifact / "manifest.json").read_text())
    if precision == "int4":
        assert manifest["quantization"]["weights"] == "q4" and manifest["quantization"]["activation_block"] == 0
        assert list(manifest["source"]["treatments"]) == ["int4 blocks of 32 kept exactly (q4 in groups of 32)"]
    _compiled_gives_onnxruntime_logits(folder, artifact, prompts(1, 4)[0] + [40] * 25, 8, tolerance=FLOAT16_TOLERANCE,
                                       optimized=provider == "cuda")


@pytest.mark.parametrize("provider", ("cuda", "cpu"))
def test_builder_bfloat16_files_give_the_bfloat16_models_logits(provider):
    """onnxruntime's CPU kernels do not run the builder's bfloat16 files (no bfloat16 MatMul), so the reference is
    transformers' model with its weights rounded to bfloat16, as the files store them, computing in float32 as
    kiln does; the files' bfloat16 rotation tables give back the model's frequencies."""
    import torch
    import transformers
    folder = genai_model("llama", "bf16", provider=provider)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_model("llama"), attn_implementation="eager").eval()
    ids = prompts(1, 3)[0] + [7, 9, 11]
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.to(torch.bfloat16).float())
        logits = hf(torch.tensor([ids])).logits[0].numpy()
    wanted = [logits[len(ids) - 4], *logits[len(ids) - 3:]]
    for got, want in zip(kiln_interpreted(folder, ids, len(ids) - 3), wanted, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4 * np.ptp(want), rtol=0)


def _compiled_gives_onnxruntime_logits(folder, artifact, ids: list[int], decode: int, tolerance: float = 1e-4,
                                       optimized: bool = True) -> None:
    """The compiled artifact's logits equal onnxruntime's on the file, within `tolerance` of their range: a
    prefill, then `decode` single steps (past a page boundary, on pages out of order)."""
    from kiln.runtime.model import CompiledModel
    model = CompiledModel(artifact)
    model.allocate_kv(16 * model.bytes_per_page)
    pages = [5, 2, 9, 1]
    ort = ORTDecoder(folder, optimized)
    want = ort.step(ids[:-decode])[-1]
    got = model.forward(make_step_inputs([(ids[:-decode], 0, pages)], model.page_size))[0]
    np.testing.assert_allclose(got, want, atol=tolerance * np.ptp(want), rtol=0)
    for t in range(len(ids) - decode, len(ids)):
        want = ort.step([ids[t]])[-1]
        got = model.forward(make_step_inputs([([ids[t]], t, pages)], model.page_size))[0]
        np.testing.assert_allclose(got, want, atol=tolerance * np.ptp(want), rtol=0)


def _float_compute(folder, out):
    """A copy of an int4 file whose MatMulNBits compute in float (accuracy_level 0), as kiln with float
    activations does: the file's function without either side's int8 rounding of activations."""
    import shutil

    import onnx
    shutil.copytree(folder, out)
    proto = onnx.load(str(out / "model.onnx"), load_external_data=False)
    for node in proto.graph.node:
        for attr in node.attribute:
            if attr.name == "accuracy_level":
                attr.i = 0
    onnx.save(proto, str(out / "model.onnx"))
    return out


@pytest.mark.build
def test_the_builders_cuda_int4_file_compiles_for_cuda_with_its_blocks_kept(tmp_path):
    """For --target cuda (built here with nvcc, run on the GPU machine): float16, the blocks as q4 exactly (their
    float16 scales as the file has them) on float activations, kiln's tensor-core GEMM and GEMV reading them."""
    import shutil
    import subprocess
    import sys

    from kiln.artifact import read_manifest
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not installed")
    out = tmp_path / "artifact"        # kiln compiles CUDA in a process of its own (TVM's CUDA runtime)
    folder = genai_model("llama", "int4", provider="cuda")
    done = subprocess.run([sys.executable, "-m", "kiln.cli", "compile", str(folder), "--target", "cuda", "-o", str(out)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    m = read_manifest(out)
    q = m.quantization
    assert (m.dtype, q.weights, q.group_size, q.activation_block, q.scale_dtype) == ("float16", "q4", 32, 0, None)
    assert list(m.source["treatments"]) == ["int4 blocks of 32 kept exactly (q4 in groups of 32)"]
    assert m.linear_kernels == {"mixed": ["mma"], "decode": ["gemv"], "decode_wide": ["mma"]}
    library = (out / m.library).read_bytes()
    assert all(f"{name}_kernel".encode() in library for name in m.kernels)


def _weightless_int4_artifact(tmp_path):
    """(the int4 file's folder, its compiled artifact, a copy with the weights taken out, as compile --no-weights
    leaves one)."""
    import json
    import shutil

    from artifact_cache import cpu_artifact

    from kiln.artifact import MANIFEST, WEIGHTS
    folder = genai_model("llama", "int4")
    artifact = cpu_artifact(folder)
    bare = shutil.copytree(artifact, tmp_path / "bare")
    (bare / WEIGHTS).unlink()
    manifest = json.loads((bare / MANIFEST).read_text())
    del manifest["files"][WEIGHTS]
    (bare / MANIFEST).write_text(json.dumps({**manifest, "weights_source": "absent"}))
    return folder, artifact, bare


@pytest.mark.build
def test_attach_weights_writes_the_int4_files_bytes_as_compile_does(tmp_path):
    """`kiln attach-weights` on an artifact of the builder's int4 file with its weights taken out: the passes
    planned from the manifest keep the file's float32 scales, and the weights file has compile's bytes."""
    from kiln.artifact import WEIGHTS, read_manifest
    from kiln.weights.attach import attach_weights
    from kiln.inspect import summary
    folder, artifact, bare = _weightless_int4_artifact(tmp_path)
    assert read_manifest(artifact).quantization.scale_dtype == "float32"
    assert "weights q4 in groups of 32 with float32 scales" in summary(artifact)
    attach_weights(bare, folder)
    assert read_manifest(bare).files[WEIGHTS]["blake3"] == read_manifest(artifact).files[WEIGHTS]["blake3"]


@pytest.mark.build
def test_fill_weights_draws_float32_scale_tables(tmp_path):
    """`kiln fill-weights` on a weightless artifact of the int4 file: its float32 scale tables drawn as the
    float16 ones are, and the artifact runs to finite, varied logits."""
    from kiln.runtime.model import CompiledModel
    from kiln.weights.generated import fill_weights
    _, _, bare = _weightless_int4_artifact(tmp_path)
    manifest = fill_weights(bare)
    assert {w.dtype for w in manifest.weights if w.param.endswith("q4_scale")} == {"float32"}
    model = CompiledModel(bare)
    model.allocate_kv(8 * model.bytes_per_page)
    logits = model.forward(make_step_inputs([([3, 17, 42, 99, 7], 0, [2, 5])], model.page_size))
    assert np.isfinite(logits).all() and (logits.std(axis=1) > 1e-3).all()


def _greedy_tokens_equal(artifact, ort_folder) -> int:
    """Of 8 prompts, how many give onnxruntime's 32 greedy tokens on `ort_folder` when run from `artifact`."""
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampler import SamplingParams
    asked = prompts(8, 5)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    got = [r.outputs[0].token_ids for r in LLM(artifact, kv_memory="16MiB").generate(asked, params, use_tqdm=False)]
    ort = ORTDecoder(ort_folder)
    return sum(g == ort.greedy(p, 32) for g, p in zip(got, asked))


@pytest.mark.build
@pytest.mark.parametrize("family", FAMILIES)
def test_builder_int4_in_float_keeps_onnxruntimes_greedy_tokens(family, tmp_path):
    """The file's 4-bit blocks as kiln's q4 on float activations: 32 greedy tokens equal onnxruntime's on most of
    8 prompts, when onnxruntime computes in float too."""
    from artifact_cache import cpu_artifact
    folder = genai_model(family, "int4")
    equal = _greedy_tokens_equal(cpu_artifact(folder, int8_activations=False), _float_compute(folder, tmp_path / "f"))
    assert equal >= 6, f"{equal} of 8 prompts gave onnxruntime's 32 greedy tokens"


@pytest.mark.build
@pytest.mark.parametrize("family", FAMILIES)
def test_builder_int4_keeps_onnxruntimes_greedy_tokens(family):
    """As compiled by default: the blocks as q4 with the file's float32 scales, int8 activations in blocks of 32
    as MatMulNBits' accuracy level 4 rounds them: 32 greedy tokens equal onnxruntime's on most of 8 prompts
    (measured on a Zen 4: 7, 6 and 8 of 8; with the scales rounded to float16, 3, 2 and 4). Where a token
    differs, one activation rounded to the other int8 level has moved a near tie."""
    from artifact_cache import cpu_artifact
    folder = genai_model(family, "int4")
    equal = _greedy_tokens_equal(cpu_artifact(folder), folder)
    assert equal >= 5, f"{equal} of 8 prompts gave onnxruntime's 32 greedy tokens"


@pytest.mark.parametrize("extra, scheme, block", [((), "q4", 32), (("block_size=128",), "q4", 128),
                                                 (("is_symmetric=false",), "q4a", 32)])
def test_int4_blocks_are_kept_nibble_for_nibble(extra, scheme, block, tmp_path):
    """MatMulNBits' blocks become kiln's q4 (symmetric) or q4a (zero points) in groups of the file's block size,
    chosen when --quant names none: the same bytes, the float32 scales kept (on CPUs) or rounded to float16
    (elsewhere); the weight the file means, (nibble - zero point) · scale, comes back exactly (q4a: within
    float32's rounding of its minimum, -zero point · scale) or within float16's rounding; the interpreted graph
    gives onnxruntime's logits where onnxruntime computes in float."""
    import onnx
    from onnx import numpy_helper

    from kiln.ir.quant import SCHEMES
    from kiln.options import CompileOptions
    folder = genai_model("llama", "int4", *extra)
    model = load_model(folder)
    options = model.default_options(CompileOptions())
    assert (options.quant, options.group_size, options.quant_lm_head, options.quant_embedding) == \
        (scheme, block, True, False)
    proto = onnx.load(str(folder / "model.onnx"))
    node = next(n for n in proto.graph.node if n.op_type == "MatMulNBits" and "o_proj" in n.name)
    inits = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    packed, scales = inits[node.input[1]], inits[node.input[2]]
    rows = packed.shape[0]
    zero = np.full((rows, packed.shape[1]), 8.0, np.float32)
    if len(node.input) > 3 and node.input[3]:
        zp = inits[node.input[3]].reshape(rows, -1)
        zero = np.stack([zp & 15, zp >> 4], -1).reshape(rows, -1)[:, :packed.shape[1]].astype(np.float32)
    nibbles = np.stack([packed & 15, packed >> 4], -1).reshape(rows, -1, block).astype(np.float32)
    want = ((nibbles - zero[..., None]) * scales.reshape(rows, -1, 1)).reshape(rows, -1)
    name = "model.layers.0.self_attn.o_proj.weight"
    np.testing.assert_allclose(model.weight(name, "float32"), want, rtol=1e-6, atol=1e-7)
    parts = model.quantizers({})[scheme](model.weight_source(name, "float32"), group_size=block)
    assert options.scale_dtype == "float32" and parts["scale"].dtype == np.float32
    assert np.array_equal(parts["q"], packed.reshape(rows, -1))
    np.testing.assert_allclose(SCHEMES[scheme].dequantize(parts, group_size=block), want, rtol=0,
                               atol=0 if scheme == "q4" else float(np.abs(want).max()) * 2 ** -23)
    for asked in (CompileOptions(target="cuda"), CompileOptions(scale_dtype="float16")):   # GPU kernels; the user
        rounded = load_model(folder)
        assert rounded.default_options(asked).scale_dtype == "float16"
        parts = rounded.quantizers({})[scheme](rounded.weight_source(name, "float32"), group_size=block)
        assert parts["scale"].dtype == np.float16
        np.testing.assert_allclose(SCHEMES[scheme].dequantize(parts, group_size=block), want, rtol=0,
                                   atol=float(np.abs(scales).max()) * 8 * 2 ** -10)
    with pytest.raises(KilnError, match="--group-scales float32 is for --target cpu"):
        CompileOptions(target="cuda", scale_dtype="float32")
    ids = prompts(1, 9)[0] + [3, 5]
    ort_folder = _float_compute(folder, tmp_path / "float")
    for got, want in zip(kiln_interpreted(folder, ids, len(ids) - 2), ort_rows(ort_folder, ids, len(ids) - 2)):
        np.testing.assert_allclose(got, want, atol=1e-4 * np.ptp(want), rtol=0)


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_a_tied_table_is_read_through_its_transpose_or_its_blocks(precision, tmp_path):
    """The builder's tied model gathers embeddings from the LM head's weight: transposed (fp32) or as 4-bit
    blocks (GatherBlockQuantized, int4); the interpreted graph gives onnxruntime's logits (computing in float)."""
    folder = genai_model("tied", precision)
    ops = {n.op_type for n in __import__("onnx").load(str(folder / "model.onnx"), load_external_data=False).graph.node}
    assert ("Transpose" if precision == "fp32" else "GatherBlockQuantized") in ops
    reference = _float_compute(folder, tmp_path / "float") if precision == "int4" else folder
    ids = prompts(1, 10)[0] + [8, 2]
    for got, want in zip(kiln_interpreted(folder, ids, len(ids) - 2), ort_rows(reference, ids, len(ids) - 2)):
        np.testing.assert_allclose(got, want, atol=1e-4 * np.ptp(want), rtol=0)


def test_a_local_window_attends_as_onnxruntime_does(tmp_path):
    """GroupQueryAttention's local_window_size (the builder writes Mistral's and Phi-3's sliding window there):
    kiln's sliding layers give onnxruntime's logits on a prompt and decode steps past the window."""
    def edit(proto):
        for node in proto.graph.node:
            for attr in node.attribute:
                if attr.name == "local_window_size":
                    attr.i = 7
    folder = _edited(tmp_path, edit)
    assert {spec.window for spec in load_model(folder).build_graph("float32", PAGE_SIZE).kv_specs.values()} == {7}
    ids = prompts(1, 11)[0] + list(range(20, 40))
    for got, want in zip(kiln_interpreted(folder, ids, len(ids) - 4), ort_rows(folder, ids, len(ids) - 4)):
        np.testing.assert_allclose(got, want, atol=1e-4 * np.ptp(want), rtol=0)


def test_longrope_tables_chosen_by_length_compile_as_the_hf_directory_does():
    """Phi-3's LongRoPE as the builder writes it (short and long tables, an If on the sequence's length): kiln
    takes the short tables and the original context, as it compiles LongRoPE from the HF directory, and gives
    onnxruntime's logits within that context."""
    folder = genai_model("phi3_longrope", "fp32")
    model = load_model(folder)
    assert model.config.max_context == load_model(hf_model("phi3_longrope")).config.max_context == 64
    assert any("LongRoPE's short tables: contexts up to 64 tokens" in what for _, what in model.translation.record)
    ids = prompts(1, 3)[0][:24] + list(range(40, 60))       # within the three pages of 16 it interprets on
    for got, want in zip(kiln_interpreted(folder, ids, len(ids) - 3), ort_rows(folder, ids, len(ids) - 3), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4 * np.ptp(want), rtol=0)


def test_weights_are_named_by_their_roles():
    graph = load_model(genai_model("qwen2", "int4")).translation.graph
    names = set(graph.params)
    assert {"model.embed_tokens.weight", "model.layers.1.self_attn.qkv_proj.weight",
            "model.layers.1.self_attn.qkv_proj.bias", "model.layers.1.self_attn.o_proj.weight",
            "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight",
            "model.layers.1.mlp.down_proj.weight", "model.layers.1.input_layernorm.weight",
            "model.layers.1.post_attention_layernorm.weight", "model.norm.weight", "lm_head.weight"} <= names


def test_the_found_model_is_the_one_the_builder_was_given():
    import json
    folder = genai_model("qwen2", "fp32")
    hf = json.loads((hf_model("qwen2") / "config.json").read_text())
    c = load_model(folder).config
    assert (c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) \
        == (hf["num_hidden_layers"], hf["hidden_size"], hf["intermediate_size"], hf["num_attention_heads"],
            hf["num_key_value_heads"], hf["head_dim"], hf["vocab_size"])
    assert abs(c.rope_theta - hf["rope_parameters"]["rope_theta"]) < 1e-2 * hf["rope_parameters"]["rope_theta"]


# ---------------------------------------------------------------------- torch.onnx.export's graphs


# (family, opset): the exporter's default spells attention, RMSNorm and rotary out; opset 23 writes ONNX's ops
EXPORTS = [*((family, None) for family in (*FAMILIES, "tied")), *((family, 23) for family in FAMILIES)]


@pytest.mark.parametrize("family, opset", EXPORTS)
def test_torch_export_interpreted_gives_onnxruntime_logits(family, opset):
    """Attention as MatMul/Softmax over Concat(past, new), RMSNorm as Pow/ReduceMean/Sqrt/Reciprocal, rotary as
    Slice/Neg/Concat/Mul on Cos/Sin of the positions (or, opset 23, ONNX's Attention, RMSNormalization and
    RotaryEmbedding): translated, then raised, through prefill and decode."""
    from kiln.passes.raise_patterns import RaisePatterns
    folder = torch_export(family, opset)
    ids = prompts(1, 12)[0] + [7, 9, 11]
    want = ort_rows(folder, ids, len(ids) - 3)
    for got, row in zip(kiln_interpreted(folder, ids, len(ids) - 3), want):
        np.testing.assert_allclose(got, row, atol=1e-4 * np.ptp(row), rtol=0)
    model = load_model(folder)
    raised = RaisePatterns()(model.build_graph("float32", PAGE_SIZE))
    ids_step = make_step_inputs([(ids, 0, [3, 0, 5])], PAGE_SIZE)
    weights = weight_loader(raised, lambda name: model.weight(name, "float32"))
    got = interpret(raised, {**ids_step, **kv_pages_for(raised.kv_specs, 6)}, weights)["logits"][0]
    np.testing.assert_allclose(got, ort_rows(folder, ids, len(ids))[0], atol=1e-4 * np.ptp(got), rtol=0)


@pytest.mark.parametrize("family, opset", EXPORTS)
def test_torch_export_raises_to_the_graph_of_the_hf_directory(family, opset):
    """After raise_patterns the exported graph is the one kiln builds from the HF directory it came from: the same
    ops and the same weights by the same names (so the same fusions, kernels and quantisation policy apply)."""
    from collections import Counter

    from kiln.passes.raise_patterns import RaisePatterns
    raised = RaisePatterns()(load_model(torch_export(family, opset)).build_graph("float32", PAGE_SIZE))
    direct = load_model(hf_model(family)).build_graph("float32", PAGE_SIZE)
    assert Counter(n.op for n in raised.nodes) == Counter(n.op for n in direct.nodes)
    assert {n: p.type for n, p in raised.params.items()} == {n: p.type for n, p in direct.params.items()}
    assert raised.kv_specs == direct.kv_specs


@pytest.mark.build
@pytest.mark.parametrize("family, opset", [("llama", None), ("phi3", None), ("llama", 23)])
def test_torch_export_compiled_gives_onnxruntime_logits(family, opset):
    from artifact_cache import cpu_artifact

    folder = torch_export(family, opset)
    _compiled_gives_onnxruntime_logits(folder, cpu_artifact(folder), prompts(1, 13)[0] + [40] * 20, 6)


# ---------------------------------------------------------------------- the raising patterns, as IR text


def _raised(text: str) -> str:
    from kiln.passes.raise_patterns import RaisePatterns
    return print_graph(RaisePatterns()(parse_graph(text)))


def test_sigmoid_times_its_input_is_raised_to_silu():
    before = """
        graph g(
            %x: f32[tokens, 8],
            %u: f32[tokens, 8],
        ) {
          %s = sigmoid(%x) : f32[tokens, 8]
          %a = mul(%s, %x) : f32[tokens, 8]
          %y = mul(%a, %u) : f32[tokens, 8]
          return %y
        }"""
    after = """
        graph g(
            %x: f32[tokens, 8],
            %u: f32[tokens, 8],
        ) {
          %a = silu(%x) : f32[tokens, 8]
          %y = mul(%a, %u) : f32[tokens, 8]
          return %y
        }"""
    assert _raised(before) == print_graph(parse_graph(after))


def test_a_sigmoid_read_elsewhere_or_of_another_value_is_refused_by_name():
    text = """
        graph g(
            %x: f32[tokens, 8],
            %u: f32[tokens, 8],
        ) {
          %s = sigmoid(%x) : f32[tokens, 8]
          %a = mul(%s, %x) : f32[tokens, 8]
          %t = sigmoid(%u) : f32[tokens, 8]
          %b = mul(%t, %x) : f32[tokens, 8]
          %y = add(%a, %s) : f32[tokens, 8]
          %z = add(%y, %b) : f32[tokens, 8]
          return %z
        }"""
    with pytest.raises(KilnError, match=r"%s = sigmoid\(%x\) is part of no pattern kiln raises"):
        _raised(text)
    without_b = text.replace("%t = sigmoid(%u) : f32[tokens, 8]\n", "").replace("%b = mul(%t, %x)", "%b = mul(%u, %x)")
    with pytest.raises(KilnError, match=r"%s = sigmoid"):     # %s is read by the add too
        _raised(without_b)


def test_the_final_norm_moves_after_the_row_choice():
    before = """
        graph g(
            %x: f32[tokens, 8],
            %rows: i32[rows],
        ) {
          @w: f32[8]
          @head: f32[16, 8]
          %n = rms_norm(%x, @w) {eps=1e-05} : f32[tokens, 8]
          %r = take_rows(%n, %rows) : f32[rows, 8]
          %l = linear(%r, @head) : f32[rows, 16]
          return %l
        }"""
    after = """
        graph g(
            %x: f32[tokens, 8],
            %rows: i32[rows],
        ) {
          @w: f32[8]
          @head: f32[16, 8]
          %rows0 = take_rows(%x, %rows) : f32[rows, 8]
          %r = rms_norm(%rows0, @w) {eps=1e-05} : f32[rows, 8]
          %l = linear(%r, @head) : f32[rows, 16]
          return %l
        }"""
    assert _raised(before) == print_graph(parse_graph(after))
    rng = np.random.default_rng(0)
    inputs = {"x": rng.standard_normal((5, 8)).astype(np.float32), "rows": np.array([4, 1], np.int32)}
    weights = {"w": rng.standard_normal(8).astype(np.float32), "head": rng.standard_normal((16, 8)).astype(np.float32)}
    np.testing.assert_allclose(interpret(parse_graph(after), inputs, weights.get)["l"],
                               interpret(parse_graph(before), inputs, weights.get)["l"], rtol=1e-6)


def _same_function(before: str, after: str, inputs: dict, weights: dict) -> None:
    """The raised text is `after`, and both compute the same on `inputs`."""
    assert _raised(before) == print_graph(parse_graph(after))
    out = parse_graph(before).outputs[0]
    np.testing.assert_allclose(interpret(parse_graph(after), inputs, weights.get)[out],
                               interpret(parse_graph(before), inputs, weights.get)[out], rtol=2e-5, atol=2e-6)


def test_an_rms_norm_spelled_out_is_raised():
    before = """
        graph g(
            %x: f32[tokens, 8],
        ) {
          @w: f32[8]
          %q = mul(%x, %x) : f32[tokens, 8]
          %m = mean_last(%q) : f32[tokens, 1]
          %e = add_scalar(%m) {value=1e-06} : f32[tokens, 1]
          %r = sqrt(%e) : f32[tokens, 1]
          %i = reciprocal(%r) : f32[tokens, 1]
          %n = bcast_mul(%x, %i) : f32[tokens, 8]
          %y = bcast_mul(%n, @w) : f32[tokens, 8]
          return %y
        }"""
    after = """
        graph g(
            %x: f32[tokens, 8],
        ) {
          @w: f32[8]
          %y = rms_norm(%x, @w) {eps=1e-06} : f32[tokens, 8]
          return %y
        }"""
    rng = np.random.default_rng(1)
    _same_function(before, after, {"x": rng.standard_normal((5, 8)).astype(np.float32)},
                   {"w": rng.standard_normal(8).astype(np.float32)})


ROPE_BEFORE = """
    graph g(
        %positions: i32[tokens],
        %x: f32[tokens, 2, 8],
    ) {
      @inv: f32[4]
      %p = reshape(%positions) {shape=('tokens', 1)} : i32[tokens, 1]
      %pf = cast(%p) {dtype='float32'} : f32[tokens, 1]
      %f = bcast_mul(%pf, @inv) : f32[tokens, 4]
      %t = concat(%f, %f) : f32[tokens, 8]
      %c = cos(%t) : f32[tokens, 8]
      %s = sin(%t) : f32[tokens, 8]
      %cu = reshape(%c) {shape=('tokens', 1, 8)} : f32[tokens, 1, 8]
      %su = reshape(%s) {shape=('tokens', 1, 8)} : f32[tokens, 1, 8]
      %a = bcast_mul(%x, %cu) : f32[tokens, 2, 8]
      %lo = slice(%x) {begin=0, end=4} : f32[tokens, 2, 4]
      %hi = slice(%x) {begin=4, end=8} : f32[tokens, 2, 4]
      %n = mul_scalar(%hi) {value=-1.0} : f32[tokens, 2, 4]
      %h = concat(%n, %lo) : f32[tokens, 2, 8]
      %b = bcast_mul(%h, %su) : f32[tokens, 2, 8]
      %y = add(%a, %b) : f32[tokens, 2, 8]
      return %y
    }"""


def test_a_rotary_embedding_spelled_out_is_raised_to_rope():
    after = """
        graph g(
            %positions: i32[tokens],
            %x: f32[tokens, 2, 8],
        ) {
          @inv: f32[4]
          %heads_flat0 = reshape(%x) {shape=('tokens', 16)} : f32[tokens, 16]
          %rope0 = rope(%heads_flat0, %positions, @inv) {head_dim=8} : f32[tokens, 16]
          %y = reshape(%rope0) {shape=('tokens', 2, 8)} : f32[tokens, 2, 8]
          return %y
        }"""
    rng = np.random.default_rng(2)
    inputs = {"positions": np.array([0, 3, 17, 100, 4], np.int32),
              "x": rng.standard_normal((5, 2, 8)).astype(np.float32)}
    _same_function(ROPE_BEFORE, after, inputs, {"inv": (1.0 / 10000 ** (np.arange(4) / 4)).astype(np.float32)})


def test_a_rotation_by_other_halves_stays_and_is_refused():
    text = ROPE_BEFORE.replace("{begin=0, end=4} : f32[tokens, 2, 4]", "{begin=0, end=3} : f32[tokens, 2, 3]") \
        .replace("%h = concat(%n, %lo) : f32[tokens, 2, 8]", "%h = concat(%n, %lo) : f32[tokens, 2, 7]") \
        .replace("%b = bcast_mul(%h, %su) : f32[tokens, 2, 8]\n      %y = add(%a, %b)",
                 "%b = concat(%h, %lo) : f32[tokens, 2, 10]\n      %y = add(%a, %a)")
    with pytest.raises(KilnError, match="is part of no pattern kiln raises"):
        _raised(text)


def test_a_split_gate_up_projection_is_raised_to_swiglu_and_reshapes_fold():
    before = """
        graph g(
            %x: f32[tokens, 8],
        ) {
          %r = reshape(%x) {shape=('tokens', 2, 4)} : f32[tokens, 2, 4]
          %v = reshape(%r) {shape=('tokens', 8)} : f32[tokens, 8]
          %g = slice(%v) {begin=0, end=4} : f32[tokens, 4]
          %u = slice(%v) {begin=4, end=8} : f32[tokens, 4]
          %a = silu(%g) : f32[tokens, 4]
          %y = mul(%a, %u) : f32[tokens, 4]
          return %y
        }"""
    after = """
        graph g(
            %x: f32[tokens, 8],
        ) {
          %y = swiglu(%x) : f32[tokens, 4]
          return %y
        }"""
    _same_function(before, after, {"x": np.random.default_rng(3).standard_normal((5, 8)).astype(np.float32)}, {})


@pytest.mark.parametrize("dtype, rtol", [("float32", 1e-6), ("float16", 1e-3), ("bfloat16", 1e-2)])
def test_rope_tables_give_back_their_frequencies_and_factor(dtype, rtol):
    """Tables as the builder stores them (float32 for CPU files, float16 or bfloat16 for CUDA ones) give back
    their frequencies and factor within their rounding; a table that is not one rotation is refused at each."""
    import ml_dtypes

    from kiln.frontend.onnx_attention import rope_from_tables
    stored = np.dtype(getattr(ml_dtypes, dtype, dtype))
    inv = (1.0 / 500000.0 ** (np.arange(0, 64, 2) / 64)).astype(np.float32)
    angle = np.arange(8192, dtype=np.float32)[:, None] * inv
    found, mscale, deviation = rope_from_tables((1.2 * np.cos(angle)).astype(stored),
                                                (1.2 * np.sin(angle)).astype(stored))
    np.testing.assert_allclose(found, inv, rtol=rtol)
    assert abs(mscale - 1.2) < ml_dtypes.finfo(stored).eps and deviation <= 1
    noise = np.random.default_rng(0).standard_normal(angle.shape) * 1e-2
    assert rope_from_tables((np.cos(angle) + noise).astype(stored), np.sin(angle).astype(stored))[2] > 1


# ---------------------------------------------------------------------- bad files


def _edited(tmp_path, edit, family="llama", source=None):
    """A copy of the builder's fp32 file (or of the folder `source`) with `edit(model)` applied."""
    import shutil

    import onnx
    source = source or genai_model(family, "fp32")
    folder = tmp_path / "model"
    shutil.copytree(source, folder)
    proto = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    edit(proto)
    onnx.save(proto, str(folder / "model.onnx"))
    return folder


def _node(proto, op_type):
    return next(n for n in proto.graph.node if n.op_type == op_type)


def _refused(folder) -> str:
    with pytest.raises(KilnError) as e:
        load_model(folder)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_an_op_kiln_cannot_raise_is_named_with_its_node(tmp_path):
    def edit(proto):
        _node(proto, "Sigmoid").op_type = "Tanh"
    message = _refused(_edited(tmp_path, edit))
    assert "/model/layers.0/mlp/act_fn/Sigmoid" in message and "(Tanh)" in message and "cannot raise" in message


def test_a_sigmoid_outside_silu_is_refused_when_compiled(tmp_path):
    from kiln.compiler import compile_model
    from kiln.options import CompileOptions

    def edit(proto):
        mul = next(n for n in proto.graph.node if n.op_type == "Mul" and "act_fn" in n.name)
        mul.input[0] = mul.input[1]                 # sigmoid(x) · sigmoid(x)
    with pytest.raises(KilnError, match="sigmoid.* is part of no pattern kiln raises"):
        compile_model(_edited(tmp_path, edit), tmp_path / "out", CompileOptions(target="cpu"), show=None)
    assert not (tmp_path / "out").exists()


def test_a_graph_without_past_keys_and_values_is_not_a_decoder(tmp_path):
    def edit(proto):
        keep = [i for i in proto.graph.input if not i.name.startswith("past")]
        del proto.graph.input[:]
        proto.graph.input.extend(keep)
    assert "not a decoder with a KV cache" in _refused(_edited(tmp_path, edit))


def test_an_opset_out_of_range_is_refused(tmp_path):
    def edit(proto):
        next(o for o in proto.opset_import if o.domain == "").version = 30
    assert "opset 30" in _refused(_edited(tmp_path, edit))


def test_logits_that_are_not_the_heads_product_are_refused(tmp_path):
    """Logits scaled after the head (a softcap's first step) are not rows kiln can choose before the head."""
    import onnx

    def edit(proto):
        head = next(n for n in proto.graph.node if "logits" in n.output)
        head.output[0] = "head_product"
        scale = onnx.numpy_helper.from_array(np.asarray(0.5, np.float32), "half")
        proto.graph.initializer.append(scale)
        proto.graph.node.append(onnx.helper.make_node("Mul", ["head_product", "half"], ["logits"], name="scaled"))
    assert "not a MatMul of the hidden states by the LM head" in _refused(_edited(tmp_path, edit))


@pytest.mark.parametrize("op, attribute, value, why", [
    ("RotaryEmbedding", "interleaved", 1, "rotates interleaved pairs"),
    ("Attention", "qk_matmul_output_mode", 1, "asks for scores"),
])
def test_onnx_attention_ops_kiln_cannot_follow_are_refused_by_name(tmp_path, op, attribute, value, why):
    """opset 23's RotaryEmbedding and Attention: what kiln's rope and attention do not do is refused, naming
    the node."""
    def edit(proto):
        node = _node(proto, op)
        next(a for a in node.attribute if a.name == attribute).i = value
    message = _refused(_edited(tmp_path, edit, source=torch_export("llama", 23)))
    assert f"({op})" in message and why in message


def test_an_if_that_is_not_longropes_choice_is_refused(tmp_path):
    """Branches swapped (the long tables while the sequence fits): no longer LongRoPE's choice, refused by name."""
    def edit(proto):
        node = _node(proto, "If")
        for attr in node.attribute:
            attr.name = {"then_branch": "else_branch", "else_branch": "then_branch"}[attr.name]
    message = _refused(_edited(tmp_path, edit, source=genai_model("phi3_longrope", "fp32")))
    assert "(If)" in message and "LongRoPE" in message


def test_interleaved_rotary_is_refused_naming_the_attention(tmp_path):
    def edit(proto):
        attr = next(a for a in _node(proto, "GroupQueryAttention").attribute if a.name == "rotary_interleaved")
        attr.i = 1
    message = _refused(_edited(tmp_path, edit))
    assert "GroupQueryAttention" in message and "rotary_interleaved=1" in message


def test_kiln_compile_refuses_on_one_line_and_leaves_nothing(tmp_path):
    from click.testing import CliRunner

    from kiln.cli import main

    def edit(proto):
        _node(proto, "Sigmoid").op_type = "Tanh"
    folder = _edited(tmp_path, edit)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["compile", str(folder / "model.onnx"), "-o", str(out)])
    assert result.exit_code == 2, result.output
    assert "Tanh" in result.output and len(result.output.strip().splitlines()) == 1
    assert not out.exists()
