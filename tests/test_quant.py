"""Quantised artifacts: codegen error (compiled vs the interpreter on the same quantised weights)
and quantisation error (vs transformers in float32) measured separately."""
from __future__ import annotations

import numpy as np
import pytest

from paging import make_kv_pages, make_step_inputs

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from reference import hf_last_logits, random_prompt  # noqa: E402


@pytest.fixture(scope="module")
def q8(make_model, tmp_path_factory):
    from kiln.compiler import compile_model
    from kiln.runtime.model import CompiledModel
    model_dir = make_model("qwen2")                # biases, fused QKV and gate/up: every linear variant
    out = tmp_path_factory.mktemp("q8") / "artifact"
    manifest = compile_model(model_dir, out, target="cpu", quant="q8", show=None)
    model = CompiledModel(out)
    model.allocate_kv(16 * model.bytes_per_page)
    return model_dir, manifest, model


def test_q8_artifact_stores_int8_weights(q8):
    _, manifest, _ = q8
    assert manifest["quantization"]["weights"] == "q8"
    int8 = [w for w in manifest["weights"] if w["dtype"] == "int8"]
    assert len(int8) == 2 * 4 + 1                   # per layer qkv, o, gate_up, down; plus the LM head
    assert not any(k.startswith("dequant") for k in manifest["kernels"])


def test_q8_compiled_matches_interpreter_on_the_same_quantised_weights(q8):
    from kiln.frontend import load_hf_model
    from kiln.ir import interpret, weight_loader
    from kiln.passes import run_pipeline
    model_dir, _, compiled = q8
    hf_model = load_hf_model(model_dir)
    graph, _ = run_pipeline(hf_model.build_graph("float32", 16), "cpu", quant="q8")
    ids = random_prompt(29, 5)
    step = make_step_inputs([(ids, 0, [1, 6])], 16)
    c = hf_model.config
    want = interpret(graph, {**step, **make_kv_pages(c.num_layers, 8, c.num_kv_heads, 16, c.head_dim)},
                     weight_loader(graph, lambda n: hf_model.weight(n, "float32")))["logits"]
    got = compiled.forward(step)
    assert np.abs(got - want).max() / np.abs(want).max() <= 1e-4


def test_q8_quantisation_error_is_small(q8):
    model_dir, _, compiled = q8
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    cosines = []
    for seed in range(8):
        ids = random_prompt(20 + seed, 100 + seed)
        got = compiled.forward(make_step_inputs([(ids, 0, [seed, 9])], 16))[0]
        ref = hf_last_logits(hf, ids)
        cosines.append(float(got @ ref / np.linalg.norm(got) / np.linalg.norm(ref)))
    assert min(cosines) >= 0.999, cosines
