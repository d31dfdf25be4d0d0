"""Sliding-window attention end to end on compiled CPU artifacts: greedy generation equal to
transformers' on prompts several windows long, in a page pool that only holds the window; and a
target without windowed kernels refusing at compile time (tests/test_cuda_build.py builds the
windowed families with kiln's GPU attention kernel)."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from reference import hf_greedy_uncached, random_prompt  # noqa: E402

from kiln.options import CompileOptions


@pytest.fixture(scope="module")
def windowed(make_model, compiled_family):
    """family -> (artifact, HF model) for the two windowed tiny families, compiled for the CPU."""
    built = {}
    for family in ("mistral_window", "qwen2_window"):
        hf = transformers.AutoModelForCausalLM.from_pretrained(make_model(family), attn_implementation="eager")
        built[family] = compiled_family(family), hf.eval()
    return built


def llm(artifact, pages, **kw):
    from kiln.runtime.llm import LLM
    from kiln.runtime.model import CompiledModel
    per_page = CompiledModel(artifact).bytes_per_page
    return LLM(artifact, kv_memory=pages * per_page, **kw)


def greedy(n):
    from kiln.runtime.sampler import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_every_layer_windowed_runs_long_generations_in_a_window_sized_pool(windowed):
    """Mistral, window 7, pages of 16: 30 + 40 tokens need 5 pages; the pool has 3 (2 live at once)."""
    artifact, hf = windowed["mistral_window"]
    engine = llm(artifact, pages=3, max_batched_tokens=8)
    assert engine.model.kv_window == 7
    ids = random_prompt(30, 41)
    [out] = engine.generate([ids], greedy(40))
    assert out.outputs[0].token_ids == hf_greedy_uncached(hf, ids, 40)


def test_the_automatic_kv_budget_holds_windows_not_contexts(windowed):
    """"auto" sizes the cache for what each sequence can hold at once: its window (plus a chunk),
    not its whole context, when every layer slides; the mixed Qwen2 still gets whole contexts."""
    from kiln.runtime.llm import LLM
    slides = LLM(windowed["mistral_window"][0], max_num_seqs=4, max_batched_tokens=8)
    # a 7-token window and 8-token chunks touch at most 2 pages of 16: 4 sequences, 8 pages
    assert slides.engine.pool.num_pages == 4 * 2 and "7-token window" in slides.kv_how
    mixed = LLM(windowed["qwen2_window"][0], max_num_seqs=4, max_batched_tokens=8)
    assert mixed.engine.pool.num_pages == 4 * -(-mixed.model.max_context // 16)


def test_mixed_full_and_windowed_layers_keep_every_page(windowed):
    """Qwen2 with layer 0 full and layer 1 windowed (12): a page is freed only outside every layer's
    window, so none is; chunked prefill of a 45-token prompt beside a second sequence."""
    artifact, hf = windowed["qwen2_window"]
    engine = llm(artifact, pages=12, max_batched_tokens=10)
    assert engine.model.kv_window is None
    prompts = [random_prompt(45, 42), random_prompt(19, 43)]
    outs = engine.generate(prompts, greedy(20))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy_uncached(hf, p, 20) for p in prompts]


def test_inspect_and_manifest_show_each_layers_window(windowed):
    from kiln.inspect import summary
    artifact, _ = windowed["qwen2_window"]
    layers = json.loads((artifact / "manifest.json").read_text())["kv"]["layers"]
    assert [(layer["kind"], layer.get("window")) for layer in layers] == [("full", None), ("sliding", 12)]
    text = summary(artifact)
    assert "layer 0       full," in text and "layer 1       sliding window 12," in text


def test_a_target_without_windowed_kernels_refuses_at_compile_time(make_model, tmp_path):
    """TVM's kernels mask causally only: a GPU target limited to them names the layer it cannot run."""
    from dataclasses import replace
    from kiln.compiler import compile_model
    from kiln.errors import KilnError
    from kiln.targets import get_target
    cuda = get_target("cuda", "sm_80")
    tvm_only = replace(cuda, kernels=cuda.kernels.without("kiln_gpu", "kiln_gpu_decode"))
    with pytest.raises(KilnError, match="no attention kernel for paged_attention over a KV cache of sliding window 7"):
        compile_model(make_model("mistral_window"), tmp_path / "cuda", CompileOptions(target=tvm_only), show=None)
    assert not (tmp_path / "cuda").exists()


@pytest.mark.build
def test_a_tokens_logits_do_not_depend_on_how_its_prompt_was_chunked(make_model, tmp_path):
    """The CPU attention kernel sums each query's keys in blocks at fixed positions (multiples of 16
    keys), whatever the step: a prompt prefilled whole, in chunks that cut blocks and windows, or its
    last token decoded alone gives that token the same logits, bit for bit. (The tiny Mistral with
    its window widened to 24 keys, so a query's window spans two blocks.)"""
    import shutil
    import numpy as np
    from paging import make_step_inputs
    from kiln.compiler import compile_model
    from kiln.runtime.model import CompiledModel
    model_dir = shutil.copytree(make_model("mistral_window"), tmp_path / "model")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "sliding_window": 24}))
    compile_model(model_dir, tmp_path / "artifact", CompileOptions(target="cpu"), show=None)
    model = CompiledModel(tmp_path / "artifact")
    model.allocate_kv(8 * model.bytes_per_page)
    ids, pages = random_prompt(45, 5), [3, 0, 7, 1, 5, 2]

    def last_logits(chunks):
        start = 0
        for n in chunks:
            out = model.forward(make_step_inputs([(ids[start:start + n], start, pages)], model.page_size))
            start += n
        return out[0]
    whole = last_logits([45])
    for chunks in ([11, 34], [19, 17, 9], [44, 1]):
        assert np.array_equal(last_logits(chunks), whole), chunks
