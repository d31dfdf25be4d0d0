"""Every tiny family's float32 CUDA artifact on a GPU: against the reference interpreter on the same
graph (TVM's kernels for full layers, kiln's GPU attention for windowed and soft-capped ones; no fallback kernel), and
greedy generation against transformers' uncached forward."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from paging import make_step_inputs  # noqa: E402

from kiln.testing.tiny import FAMILIES  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from reference import hf_greedy_uncached, random_prompt  # noqa: E402

FAMILY_NAMES = sorted(set(FAMILIES) - {"llama"})       # llama: test_cuda_parity.py and test_cuda_engine.py


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_family_matches_the_interpreter(gpu_family, family):
    from gpu_reference import float32_artifact_and_reference
    from kiln.ir import interpret
    model, graph, weights, kv = float32_artifact_and_reference(gpu_family(family), 16)
    assert not [k for k in model.manifest.kernels if "fallback" in k], "a layer runs the fallback attention"
    ids, pages = random_prompt(29, 5), [1, 6]
    for tokens, start in ((ids, 0), ([7], 29), ([11], 30)):
        step = make_step_inputs([(tokens, start, pages)], model.page_size)
        want = interpret(graph, {**step, **kv}, weights)["logits"]
        got = model.forward(step)
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err <= 1e-4, f"{family}: {err:.2e} of max |logit| from the interpreter"


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_family_greedy_generation_equals_transformers(gpu_family, family):
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampler import SamplingParams
    folder = gpu_family(family)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder / "model", attn_implementation="eager").eval()
    llm = LLM(folder / "cuda-float32", kv_memory="64MiB", max_batched_tokens=8)
    ids = random_prompt(30, 7)
    [out] = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert out.outputs[0].token_ids == hf_greedy_uncached(hf, ids, 12)
