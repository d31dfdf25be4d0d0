"""Every supported family compiles for the CPU and matches transformers; bfloat16 stays close."""
from __future__ import annotations

import numpy as np
import pytest
from paging import make_step_inputs

from kiln.options import CompileOptions
from kiln.testing.tiny import FAMILIES

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.build        # builds with TVM or runs what it built (not in make test-fast)


def hf_logits(model_dir, ids):
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()       # every position: [len, vocab]


def open_artifact(artifact):
    from kiln.runtime.model import CompiledModel
    model = CompiledModel(artifact)
    model.allocate_kv(16 * model.bytes_per_page)
    return model


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"llama"}))     # llama: tests/test_compiled_cpu.py
def test_family_prefill_and_decode(make_model, compiled_family, family):
    model_dir = make_model(family)
    model = open_artifact(compiled_family(family))
    ids = np.random.default_rng(3).integers(3, 500, 40).tolist()
    ref = hf_logits(model_dir, ids)
    pages = [4, 0, 9]
    got = model.forward(make_step_inputs([(ids[:37], 0, pages)], model.page_size))
    np.testing.assert_allclose(got[0], ref[36], atol=1e-4, rtol=0)
    for t in range(37, 40):                     # decode the rest one token at a time
        got = model.forward(make_step_inputs([([ids[t]], t, pages)], model.page_size))
        np.testing.assert_allclose(got[0], ref[t], atol=1e-4, rtol=0)


def test_bfloat16_cpu_artifact_is_close_to_float32_reference(make_model, compiled_family):
    """A bfloat16 artifact: close to transformers (float32), and to the interpreter on the same
    bfloat16 graph in a prefill and the decode steps after it. Its linears are the bf16 dot kernel
    (codegen/kernels/cpu/bf16_linear.py) in every entry on a CPU with AVX-512 BF16, else the float32 GEMM and GEMV."""
    from kiln.targets.cpu import CPUTarget
    model_dir = make_model("llama")
    model = open_artifact(compiled_family("llama", dtype="bfloat16"))
    assert model.manifest.dtype == "bfloat16"
    linears = [k for k in model.manifest.kernels if k.startswith(("bf16dot", "gemm", "linear"))]
    family = ("bf16dot",) if CPUTarget().bf16_dot else ("gemm", "linear")
    assert linears and {k.split("_")[0] for k in linears} == set(family)
    ids = np.random.default_rng(4).integers(3, 500, 27).tolist()
    ref = hf_logits(model_dir, ids)
    pages = [2, 5]
    got = [model.forward(make_step_inputs([(ids[:24], 0, pages)], model.page_size))[0]]
    got += [model.forward(make_step_inputs([([ids[t]], t, pages)], model.page_size))[0] for t in range(24, 27)]
    assert np.abs(got[0] - ref[23]).max() / np.abs(ref[23]).max() < 0.15
    assert np.corrcoef(got[0], ref[23])[0, 1] > 0.99
    # Against the interpreter on the same bfloat16 graph (each op rounded to bfloat16 as the kernels
    # round it): codegen error alone. Measured 7e-3 (1.5 bfloat16 ulps of the largest logit, ~13);
    # 2e-2 is ~4 ulps, and catches codegen errors that the bounds above let through.
    from paging import kv_pages_for
    from kiln.frontend import load_hf_model
    from kiln.ir import interpret, weight_loader
    from kiln.passes import run_pipeline
    hf_model = load_hf_model(model_dir)
    graph, _ = run_pipeline(hf_model.build_graph("bfloat16", model.page_size), "cpu")
    kv = kv_pages_for(graph.kv_specs, 6)
    weights = weight_loader(graph, lambda name: hf_model.weight(name, "bfloat16"))
    steps = [make_step_inputs([(ids[:24], 0, pages)], model.page_size)]
    steps += [make_step_inputs([([ids[t]], t, pages)], model.page_size) for t in range(24, 27)]
    for step, logits in zip(steps, got):
        want = interpret(graph, {**step, **kv}, weights)["logits"][0].astype(np.float32)
        assert np.abs(logits - want).max() / np.abs(want).max() < 2e-2


def test_bfloat16_greedy_requests_batched_equal_each_alone(compiled_family):
    """Every row of a bf16 linear sums its own products in one order whatever the step brings
    (micro-tiles of rows or one row), so 6 greedy requests batched give each one's tokens alone."""
    from reference import random_prompt
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampler import SamplingParams
    llm = LLM(compiled_family("qwen2", dtype="bfloat16"), kv_memory="8MiB", max_batched_tokens=24)
    prompts = [random_prompt(5 + 3 * i, 40 + i) for i in range(6)]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    alone = [llm.generate([p], greedy, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == alone


def test_float16_on_cpu_is_refused(make_model, tmp_path):
    from kiln.compiler import compile_model
    from kiln.errors import KilnError
    with pytest.raises(KilnError, match="float16 is not supported on target cpu"):
        compile_model(make_model("llama"), tmp_path / "a", CompileOptions(target="cpu", dtype="float16"), show=None)


def test_sharded_checkpoint_gives_the_same_artifact_weights(make_model, tmp_path):
    """A checkpoint saved in shards (model.safetensors.index.json) imports the same tensors."""
    from kiln.frontend import load_hf_model
    src = make_model("qwen2")
    hf = transformers.AutoModelForCausalLM.from_pretrained(src)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="300KB")
    assert (sharded / "model.safetensors.index.json").exists()
    a, b = load_hf_model(src), load_hf_model(sharded)
    for name in a.build_graph("float32", 16).params:
        np.testing.assert_array_equal(a.weight(name, "float32"), b.weight(name, "float32"))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_greedy_generation_equals_transformers(make_model, compiled_family, family):
    """The engine end to end, chunked prefill of a prompt longer than every tiny window."""
    from reference import hf_greedy_uncached, random_prompt
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampler import SamplingParams
    hf = transformers.AutoModelForCausalLM.from_pretrained(make_model(family), attn_implementation="eager").eval()
    llm = LLM(compiled_family(family), kv_memory="8MiB", max_batched_tokens=8)
    ids = random_prompt(30, 7)
    [out] = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert out.outputs[0].token_ids == hf_greedy_uncached(hf, ids, 12)


@pytest.mark.parametrize("quant", ["q8", "q4"])
@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"qwen2", "qwen2_window"}))    # those: tests/test_quant.py
def test_quantised_family_matches_interpreter_on_the_same_quantised_weights(make_model, compiled_family, family,
                                                                            quant):
    """A prefill then a decode step: codegen error alone, the quantised weights being the same."""
    from paging import kv_pages_for
    from kiln.frontend import load_hf_model
    from kiln.ir import interpret, weight_loader
    from kiln.passes import run_pipeline
    # float activations: with int8 ones a one-ulp difference upstream can flip an activation level
    # (tests/test_int8_activations.py tests those kernels against the interpreter op by op)
    model = open_artifact(compiled_family(family, quant=quant, int8_activations=False))
    hf_model = load_hf_model(make_model(family))
    graph, _ = run_pipeline(hf_model.build_graph("float32", model.page_size), "cpu",
                            options=CompileOptions(quant=quant, int8_activations=False))
    weights = weight_loader(graph, lambda n: hf_model.weight(n, "float32"))
    kv = kv_pages_for(graph.kv_specs, 8)
    ids = np.random.default_rng(5).integers(3, 500, 29).tolist()
    for step in (make_step_inputs([(ids, 0, [1, 6])], model.page_size),
                 make_step_inputs([([7], 29, [1, 6])], model.page_size)):
        want = interpret(graph, {**step, **kv}, weights)["logits"]
        got = model.forward(step)
        assert np.abs(got - want).max() / np.abs(want).max() <= 1e-4
