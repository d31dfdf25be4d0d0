"""KVSpec: one declaration per layer, read by the verifier, passes, the manifest, inspect and the runtime."""
from __future__ import annotations

import json

import numpy as np
import pytest

from kiln.errors import KilnError
from kiln.interface import KVSpec
from kiln.ir import GraphBuilder, IRError, graph_from_json, graph_to_json, verify


def test_bytes_per_token_counts_k_and_v_rows_of_every_head():
    # 8 KV heads of 64 bfloat16 values, for k and v
    assert KVSpec("full", 8, 64, 64, "bfloat16", 16).bytes_per_token == 2 * 8 * 64 * 2
    # one byte per value plus a float32 scale per row
    assert KVSpec("full", 8, 64, 64, "int8", 16, scales="row").bytes_per_token == 2 * 8 * (64 + 4)
    # MLA: one latent row of kv_lora_rank + rope values per token (DeepSeek: 512 + 64)
    latent = KVSpec("latent", 1, 576, 512, "bfloat16", 16)
    assert latent.bytes_per_token == 576 * 2 and latent.page_shape(3) == (3, 1, 1, 16, 576)
    assert latent.quantized("int8").bytes_per_token == 576 + 4


@pytest.mark.parametrize("fields,words", [
    (dict(kind="sliding"), "window"),
    (dict(kind="full", window=8), "window"),
    (dict(kind="sliding", window=0), "window"),
    (dict(kind="latent"), "latent"),
    (dict(kind="latent", kv_heads=1, v_head_dim=32), "prefix of its keys"),
    (dict(v_head_dim=32), "V head dim 32"),
    (dict(scales="block"), "block"),
])
def test_malformed_specs_are_refused(fields, words):
    base = dict(kind="full", kv_heads=2, k_head_dim=16, v_head_dim=16, dtype="float32", page_size=4)
    with pytest.raises(KilnError, match=words):
        KVSpec(**{**base, **fields})


def attention_graph(spec: KVSpec, read=None):
    """One paged_attention layer over layer 0's declared cache (or, with `read`, over that input)."""
    b = GraphBuilder("attn")
    q = b.input("q", ("tokens", 2 * spec.kv_heads, spec.head_dim), "float32")
    k = b.input("k", ("tokens", spec.kv_heads, spec.head_dim), "float32")
    pages, scales = b.kv_cache(0, spec)
    if read is not None:
        pages = b.input(read, ("pages", 2, spec.kv_heads, spec.page_size, spec.head_dim), spec.dtype)
    index = [b.input(n, (n,), "int32") for n in ("slots", "qi", "pi", "pv", "lpl")]
    return b.output(b.op("paged_attention", q, k, k, pages, *index, *([scales] if scales else []), layer=0,
                         scale=0.5, name="o"))


def test_kv_cache_declares_the_layers_inputs_from_its_spec():
    spec = KVSpec("full", 2, 8, 8, "int8", 4, scales="row")
    graph = verify(attention_graph(spec))
    assert graph.kv_specs == {0: spec}
    assert str(graph.inputs["kv_pages0"]) == "i8[pages, 2, 2, 4, 8]"
    assert str(graph.inputs["kv_scales0"]) == "f32[pages, 2, 2, 4]"
    b = GraphBuilder("twice")
    b.kv_cache(3, spec)
    with pytest.raises(IRError, match="declared twice"):
        b.kv_cache(3, spec)


def test_verify_refuses_attention_off_its_layers_cache():
    spec = KVSpec("full", 2, 8, 8, "float32", 4)
    with pytest.raises(IRError, match=r"reads KV inputs \['other'"):
        verify(attention_graph(spec, read="other"))
    graph = attention_graph(spec)
    graph.kv_specs = {}
    with pytest.raises(IRError, match="layer 0 has no KV spec"):
        verify(graph)
    graph = attention_graph(spec)
    graph.kv_specs[0] = KVSpec("full", 2, 8, 8, "float32", 16)        # the inputs say pages of 4
    with pytest.raises(IRError, match="KV spec says f32\\[pages, 2, 2, 16, 8\\]"):
        verify(graph)


def test_specs_survive_the_json_round_trip():
    graph = attention_graph(KVSpec("sliding", 2, 8, 8, "float32", 4, window=6))
    back = graph_from_json(graph_to_json(graph))
    assert back.kv_specs == graph.kv_specs and isinstance(next(iter(back.kv_specs)), int)


def test_llama_builder_declares_one_spec_per_layer_from_the_config(make_model):
    from kiln.frontend import load_hf_model
    model_dir = make_model("llama")
    cfg = json.loads((model_dir / "config.json").read_text())
    graph = load_hf_model(model_dir).build_graph("bfloat16", 16)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    want = KVSpec("full", cfg["num_key_value_heads"], head_dim, head_dim, "bfloat16", 16)
    assert graph.kv_specs == {i: want for i in range(cfg["num_hidden_layers"])}


def test_manifest_runtime_and_inspect_read_the_specs(llama_cpu):
    from kiln.inspect import summary
    from kiln.runtime.model import CompiledModel
    artifact, hf = llama_cpu
    c = hf.config
    manifest = json.loads((artifact / "manifest.json").read_text())
    layers = manifest["kv"]["layers"]
    assert len(layers) == c.num_hidden_layers
    assert all(KVSpec.from_json(layer) == KVSpec("full", c.num_key_value_heads, c.head_dim, c.head_dim,
                                                  manifest["dtype"], manifest["kv"]["page_size"]) for layer in layers)
    model = CompiledModel(artifact)
    pages = model.allocate_kv(3 * model.bytes_per_page + 1)
    assert pages == 3
    assert model.bytes_per_token == c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 4   # float32
    assert {name: tuple(t.shape) for name, t in model.kv_tensors.items()} == {
        f"kv_pages{i}": (3, 2, c.num_key_value_heads, manifest["kv"]["page_size"], c.head_dim)
        for i in range(c.num_hidden_layers)}
    text = summary(artifact)
    assert f"{model.bytes_per_token} bytes per token over {c.num_hidden_layers} layers" in text
    assert f"layers 0-{c.num_hidden_layers - 1}" in text and "kernel kiln_cpu" in text
    assert np.all([layer["mixed"] == "kiln_cpu" for layer in manifest["attention_layers"]])


def test_verify_refuses_attention_whose_window_is_not_its_layers():
    graph = attention_graph(KVSpec("full", 2, 8, 8, "float32", 4))
    graph.kv_specs[0] = KVSpec("sliding", 2, 8, 8, "float32", 4, window=6)     # the op still attends to all
    with pytest.raises(IRError, match="window 0 differs from layer 0's KV spec \\(sliding, window 6\\)"):
        verify(graph)
