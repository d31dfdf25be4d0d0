"""GGUF files as llama.cpp's converter writes them, imported by kiln: the interpreted graph gives the
logits transformers gives on the original checkpoint (llama.cpp's rewrites of q/k rows, norms, fused and
stacked tensors and rope factors undone), and Q4_0, Q8_0 and Q4_1 blocks are stored bit for bit as gguf-py reads
them (Q4_K's within float16's rounding of its scales)."""
from __future__ import annotations

import numpy as np
import pytest
from gguf_files import converted, quantized, tiny_variant
from paging import interpreted_steps

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kiln.frontend import load_model  # noqa: E402
from kiln.ir import weight_loader  # noqa: E402

PAGE_SIZE = 16
# one of each thing llama.cpp's converter does differently: llama's permuted q/k and rope_freqs tensor
# (Llama 3.1), NEOX rope with q/k norms (Qwen3), norms stored plus one and a window pattern (Gemma 3),
# soft-capped scores and logits (Gemma 2), fused qkv/gate_up with LongRoPE factors as tensors (Phi-3),
# experts stacked in one tensor (Mixtral), a gated shared expert (Qwen2-MoE), multipliers and stacked
# gate/up experts split apart (Granite-MoE), whole-width q/k norms (OLMoE), MLA's kv_b split into k_b
# and v_b with YaRN, group-limited and sigmoid-with-bias routing (DeepSeek-V2, V3)
FAMILIES = ("llama31", "qwen3", "gemma3", "gemma2", "phi3", "mixtral", "qwen2_moe", "granitemoe", "olmoe",
            "deepseek_v2", "deepseek_v3")
# Tiny models shaped as llama.cpp's architectures can hold them: Gemma 2 and 3 files do not store the query
# scale or (older ones) which layers are global (llama.cpp takes 1/sqrt(head_dim) and every sixth layer, as
# the released models have them); DeepSeek files store YaRN's mscale_all_dim alone (llama.cpp takes mscale
# equal to it, as the released models have it; kiln's tiny DeepSeek-V2 makes them differ); llama.cpp's
# Qwen2-MoE has experts in every layer (the tiny model's first is dense)
VARIANTS = {"gemma3": dict(num_hidden_layers=6, query_pre_attn_scalar=32,
                           layer_types=["sliding_attention"] * 5 + ["full_attention"]),
            "gemma2": dict(query_pre_attn_scalar=32), "qwen2_moe": dict(mlp_only_layers=[]),
            "deepseek_v2": dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                 "original_max_position_embeddings": 1024, "mscale": 0.8,
                                                 "mscale_all_dim": 0.8})}


def hf_logits(model_dir, ids) -> np.ndarray:
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").float().eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()


def kiln_logits(path, ids, split: int) -> list[np.ndarray]:
    return interpreted_steps(path, ids, split, PAGE_SIZE)


@pytest.mark.parametrize("family", FAMILIES)
def test_converted_file_gives_transformers_logits(make_model, family):
    model_dir = tiny_variant(family, **VARIANTS[family]) if family in VARIANTS else make_model(family)
    ids = np.random.default_rng(5).integers(3, 300, 24).tolist()
    ref = hf_logits(model_dir, ids)
    got = kiln_logits(converted(model_dir), ids, 21)
    for logits, want in zip(got, ref[20:]):
        np.testing.assert_allclose(logits, want, atol=1e-4 * np.ptp(want), rtol=0)


@pytest.mark.parametrize("qtype, scheme", [("Q4_0", "q4"), ("Q8_0", "q8g"), ("Q4_1", "q4a"), ("Q4_K", "q4k")])
def test_quantised_blocks_are_stored_exactly(make_model, qtype, scheme):
    """A Q4_0 (Q8_0, Q4_1, Q4_K) file compiled for the CPU without --quant: kiln's q4 (q8g, q4a, q4k) holds the
    very numbers gguf-py's dequantiser reads from the file, for every linear (q/k rows permuted back, as
    the file's float rows)."""
    import gguf
    from gguf.quants import dequantize

    from kiln.ir.quant import SCHEMES
    from kiln.options import CompileOptions
    from kiln.passes import run_pipeline
    path = quantized(converted(make_model("llama")), qtype)
    model = load_model(path)
    options = model.default_options(CompileOptions())
    assert (options.quant, options.group_size) == (scheme, 32)
    # the file's F32 output and embedding tables stay float: none is made coarser than the file holds it
    assert not options.quant_lm_head and not options.quant_embedding
    graph, _ = run_pipeline(model.build_graph("float32", PAGE_SIZE), "cpu", options=options)
    load = weight_loader(graph, lambda name: model.weight(name, "float32"),
                         quantizers=model.quantizers({}), load_source=lambda name: model.weight_source(name, "float32"))
    reader = gguf.GGUFReader(path)
    files = {t.name: t for t in reader.tensors}
    checked = 0
    for name, param in graph.params.items():
        recipe = param.recipe or {}
        if recipe.get("quantize") != scheme or recipe["part"] != "q":
            continue
        parts = {part: load(f"{recipe['of']}.{scheme}{suffix}") for part, suffix in (("q", ""), ("scale", "_scale"))}
        got = SCHEMES[scheme].dequantize(parts, group_size=32)
        fused = graph.params.get(recipe["of"])              # qkv, gate/up: the rows of several tensors
        sources = fused.recipe["concat"] if fused is not None and "concat" in (fused.recipe or {}) else [recipe["of"]]
        if not sources[0].startswith("model.layers."):      # the LM head: F32 in this file, quantised by kiln
            continue
        want = []
        for source in sources:
            t = files[model.checkpoint.file_name(source)[0]]
            assert t.tensor_type == gguf.GGMLQuantizationType[qtype]
            want.append(model.checkpoint._undo(source, dequantize(t.data, t.tensor_type)))
        np.testing.assert_array_equal(got, np.concatenate(want))
        checked += len(sources)
    assert checked == 7 * 2                      # q, k, v, o, gate, up, down in both layers
    treatments = {treatment for _, treatment in model.checkpoint.record}
    assert f"{qtype} kept exactly ({scheme} in groups of 32)" in treatments


def test_a_file_of_mixed_types_keeps_each_tensors_format(make_model):
    """Q4_1 matrices with layer 0's value and down projections in Q8_0 (as Q4_K_M keeps some in Q6_K): the
    default compile stores the body q4a and those two q8g, each with the file's numbers; layer 0's fused
    qkv takes q8g, the finer of its parts' formats."""
    from kiln.ir import weight_format
    from kiln.ir.quant import SCHEMES
    from kiln.options import CompileOptions
    from kiln.passes import run_pipeline
    finer = (("blk.0.attn_v.weight", "Q8_0"), ("blk.0.ffn_down.weight", "Q8_0"))
    model = load_model(quantized(converted(make_model("llama")), "Q4_1", finer))
    options = model.default_options(CompileOptions())
    assert (options.quant, options.group_size) == ("q4a", 32)
    assert set(options.tensor_quant) == {("model.layers.0.self_attn.v_proj.weight", "q8g"),
                                         ("model.layers.0.mlp.down_proj.weight", "q8g")}
    graph, _ = run_pipeline(model.build_graph("float32", PAGE_SIZE), "cpu", options=options)
    formats = {node.output: weight_format(node) for node in graph.nodes if node.op == "linear"}
    assert formats["qkv0"] == "q8g" and formats["add1"] == "q8g", formats     # layer 0's qkv, and down + residual
    values = list(formats.values())            # the rest q4a; the F32 LM head stays float
    assert (values.count("q8g"), values.count("none"), values.count("q4a")) == (2, 1, len(values) - 3), formats
    load = weight_loader(graph, lambda name: model.weight(name, "float32"),
                         quantizers=model.quantizers({}), load_source=lambda name: model.weight_source(name, "float32"))
    for layer, scheme in ((0, "q8g"), (1, "q4a")):       # gguf-py's dequantisation of the file's blocks
        down = f"model.layers.{layer}.mlp.down_proj.weight"
        parts = {part: load(f"{down}.{scheme}{suffix}") for part, suffix in (("q", ""), ("scale", "_scale"))}
        np.testing.assert_array_equal(SCHEMES[scheme].dequantize(parts, group_size=32), model.weight(down, "float32"))
    treatments = {treatment for _, treatment in model.checkpoint.record}
    assert {"Q8_0 kept exactly (q8g in groups of 32)", "Q4_1 kept exactly (q4a in groups of 32)"} <= treatments


def test_q4_k_blocks_are_q4k_exactly_and_q4a_within_float16_rounding():
    """Q4_K super-blocks (random bytes: every sub-scale, min and nibble pattern) repacked into q4k give
    what gguf-py's dequantiser gives exactly; into q4a (--quant q4a), each value within float16's rounding
    of its group's scale and minimum."""
    import gguf
    from gguf.quants import dequantize

    from kiln.frontend.gguf_tensors import GGUFBlocks
    from kiln.ir.quant import SCHEMES
    rng = np.random.default_rng(3)
    rows, supers = 24, 3
    raw = rng.integers(0, 256, (rows, supers, 144), dtype=np.uint8)
    raw[..., 0:4] = (rng.uniform(1e-4, 1e-2, (rows, supers, 2)).astype(np.float16)).view(np.uint8)  # d, dmin
    blocks = GGUFBlocks("blk.0.attn_q.weight", gguf.GGMLQuantizationType.Q4_K, raw.reshape(rows, -1), {})
    want = dequantize(raw.reshape(rows, -1), gguf.GGMLQuantizationType.Q4_K)
    exact = blocks.exact_parts("q4k", group_size=32)
    np.testing.assert_array_equal(SCHEMES["q4k"].dequantize(exact, group_size=32), want)
    assert ("blk.0.attn_q.weight", "Q4_K kept exactly (q4k in groups of 32)") in blocks.record
    parts = blocks.exact_parts("q4a", group_size=32)
    got = SCHEMES["q4a"].dequantize(parts, group_size=32)
    table = parts["scale"].astype(np.float32)
    bound = np.repeat((15 * np.abs(table[0::2]) + np.abs(table[1::2])).T, 32, axis=1) * 2.0 ** -10
    assert np.all(np.abs(got - want) <= bound)
    assert np.abs(got - want).max() > 0          # the scales did round: not float32's values
    assert ("blk.0.attn_q.weight", "Q4_K kept nearly (scales and minimums rounded to float16) (q4a in groups of 32)") \
        in blocks.record
