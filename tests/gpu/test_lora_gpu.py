"""LoRA adapters on a GPU: a CUDA artifact with 4 slots (tests/gpu/make_bundle.py's "lora" variant) runs a
step mixing 4 adapters and the base model, against the reference interpreter on the same graph, weights and
adapter slots in float16 (the interpreter is held to transformers + peft on the CPU: tests/test_lora.py),
and in the engine its decode steps (CUDA graphs) give each adapter's greedy tokens as its mixed steps do."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from paging import make_kv_pages, make_step_inputs  # noqa: E402

from kiln.options import CompileOptions  # noqa: E402


@pytest.fixture(scope="module")
def lora_bundle(gpu_bundle, tmp_path_factory):
    from conftest import ARCH
    from make_bundle import compile_variant
    if not (gpu_bundle / "cuda-lora" / "manifest.json").exists():      # a bundle made before the variant
        compile_variant(gpu_bundle / "model", gpu_bundle, ARCH, "lora")
    from kiln.testing.lora import write_random_adapter
    config = json.loads((gpu_bundle / "model" / "config.json").read_text())
    root = tmp_path_factory.mktemp("gpu-adapters")
    adapters = [write_random_adapter(root / f"a{i}", config, rank, 40 + i, b_scale=0.3)
                for i, rank in enumerate((16, 8, 4, 12))]
    return gpu_bundle, adapters


def test_a_mixed_step_on_the_gpu_matches_the_interpreter(lora_bundle):
    from kiln.frontend import load_hf_model
    from kiln.interface import LORA_SLOTS
    from kiln.ir import interpret, weight_loader
    from kiln.passes import run_pipeline
    from kiln.runtime.lora import read_adapter, slot_rows
    from kiln.runtime.model import CompiledModel
    bundle, adapters = lora_bundle
    compiled = CompiledModel(bundle / "cuda-lora")
    compiled.allocate_kv(8 * compiled.bytes_per_page)
    slot_of = [2, 0, 3, 1, -1]
    stacks = {}
    for i, folder in enumerate(adapters):
        rows = slot_rows(read_adapter(folder), compiled.lora)
        compiled.write_lora_slot(slot_of[i], rows)
        for name, array in rows.items():
            stacks.setdefault(name, np.zeros((4, *array.shape), np.float16))[slot_of[i]] = array
    rng = np.random.default_rng(8)
    prompts = [rng.integers(3, 400, n).tolist() for n in (9, 14, 5, 11, 7)]
    step = make_step_inputs([(ids, 0, [i]) for i, ids in enumerate(prompts)], compiled.page_size)
    step[LORA_SLOTS] = np.concatenate([np.full(len(ids), s, np.int32) for ids, s in zip(prompts, slot_of)])
    got = compiled.forward(step)
    model = load_hf_model(bundle / "model")
    graph, _ = run_pipeline(model.build_graph("float16", compiled.page_size), "cuda",
                            options=CompileOptions(max_loras=4, max_lora_rank=16))
    c = model.config
    pages = make_kv_pages(c.num_layers, len(prompts), c.num_kv_heads, compiled.page_size, c.head_dim, np.float16)
    want = interpret(graph, {**step, **pages, **stacks}, weight_loader(graph, lambda n: model.weight(n, "float16")))
    want = want["logits"].astype(np.float32)
    scale = np.abs(want).max()
    assert np.abs(got - want).max() < 1e-2 * scale
    base = want[-1]
    assert all(np.abs(want[i] - base).max() > 0.05 * scale for i in range(4))     # adapters move the logits


def test_decode_graph_steps_keep_each_adapters_tokens(lora_bundle):
    from kiln.runtime.llm import LLM
    from kiln.runtime.lora import LoRARequest
    from kiln.runtime.sampler import SamplingParams
    bundle, adapters = lora_bundle
    loras = [LoRARequest(f"a{i}", i + 1, str(folder)) for i, folder in enumerate(adapters)] + [None]
    rng = np.random.default_rng(9)
    prompts = [rng.integers(3, 400, 8 + i).tolist() for i in range(5)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = LLM(bundle / "cuda-lora", kv_memory="64MiB")
    graphs = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False, lora_request=loras)]
    llm.model.entries.pop("decode_graph", None)            # every decode step on the plain decode entry
    llm.model.graph_batches = ()
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False, lora_request=loras)]
    assert graphs == plain and len({tuple(t) for t in graphs}) == 5
