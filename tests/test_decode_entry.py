"""Decode-only steps through their own entry function, with TVM's paged decode kernel.

GPU targets prefer TVM's decode kernel for steps of one new token per sequence and its prefill
kernel otherwise. The CPU target can be given the same kernel table: TVM's CPU kernels take the
very parameters its GPU kernels do, bound by codegen/kernels/tvm_kernels.py. So here, on the CPU, the
decode entry, its choice by the step's shape and the kernels' binding are run and checked against
the reference interpreter; tests/gpu repeats it on CUDA.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from paging import make_kv_pages, make_step_inputs
from reference import random_prompt

pytestmark = pytest.mark.build        # builds with TVM or runs what it built (not in make test-fast)

TVM_KERNELS = {"mixed": ("tvm_prefill",), "decode": ("tvm_decode",)}


def tvm_kernel_target():
    from kiln.targets import target_defaults
    cpu = target_defaults("cpu")
    return replace(cpu, kernels=replace(cpu.kernels, attention=TVM_KERNELS), kv_dtypes=())


@pytest.fixture(scope="module")
def artifact(make_model):
    from artifact_cache import cpu_artifact
    return cpu_artifact(make_model("llama"), target=tvm_kernel_target())


def open_model(artifact):
    from kiln.runtime.model import CompiledModel
    model = CompiledModel(artifact)
    model.allocate_kv(32 * model.bytes_per_page)
    return model


def test_manifest_records_the_decode_entry_and_its_kernels(artifact):
    from kiln.artifact import read_manifest
    from kiln.inspect import summary
    m = read_manifest(artifact).to_json()
    assert m["entries"] == {"mixed": "forward", "decode": "decode"}
    assert m["attention_kernels"] == {"mixed": ["tvm_prefill"], "decode": ["tvm_decode"]}
    # kernels only: TVM's host shape functions are not listed (their number varies between compiles)
    assert set(m["launches_per_step"]["by_kernel"]) <= set(m["kernels"])
    assert not [k for k in m["kernels"] if k.startswith("shape_func")]
    entries = m["launches_per_step"]["entries"]
    assert entries["decode"] == entries["mixed"] == {"kernels": m["launches_per_step"]["total"],
                                                     "host_launches": m["launches_per_step"]["total"]}
    assert "decode steps: tvm_decode" in summary(artifact)


def test_default_cpu_target_decodes_with_gemv_and_prefills_with_gemm(llama_cpu):
    """One attention kernel for every step, but two linear kernels per projection shape: the
    register-blocked GEMM (codegen/kernels/cpu/gemm.py) for steps with chunks, the GEMV schedule for decode."""
    from kiln.artifact import read_manifest
    m = read_manifest(llama_cpu[0]).to_json()
    assert m["entries"] == {"mixed": "forward", "decode": "decode"}
    assert m["attention_kernels"] == {"mixed": ["kiln_cpu"], "decode": ["kiln_cpu"]}
    assert "gemm" in m["linear_kernels"]["mixed"] and "packed_linear" in m["linear_kernels"]["decode"]
    assert "gemm" not in m["linear_kernels"]["decode"]
    gemms = {k.removeprefix("gemm_") for k in m["kernels"] if k.startswith("gemm_")}
    gemvs = {k.removeprefix("linear_") for k in m["kernels"] if k.startswith("linear_packed")}
    assert gemms and gemms == gemvs


def test_steps_match_the_interpreter_and_pick_their_entry(artifact, make_model):
    """Prefill of two sequences, then decode steps of both (the decode entry), then a mixed step of
    a new prompt beside a decode token (the mixed entry), then decode steps of 8 sequences (the
    mixed entry: GEMMs) and of 7 (the decode entry): every step against the interpreter."""
    from kiln.frontend import load_hf_model
    from kiln.ir import interpret, weight_loader
    from kiln.passes import run_pipeline
    model = open_model(artifact)
    hf_model = load_hf_model(make_model("llama"))
    graph, _ = run_pipeline(hf_model.build_graph("float32", model.page_size), tvm_kernel_target())
    weights = weight_loader(graph, lambda name: hf_model.weight(name, "float32"))
    c = hf_model.config
    kv = make_kv_pages(c.num_layers, 32, c.num_kv_heads, model.page_size, c.head_dim)
    a, b = random_prompt(21, 1), random_prompt(35, 2)
    pages_a, pages_b, pages_c = [7, 2], [4, 11, 9], [20, 3]
    steps = [([(a, 0, pages_a), (b, 0, pages_b)], "mixed")]
    for i in range(3):
        steps.append(([([5 + i], len(a) + i, pages_a), ([9 + i], len(b) + i, pages_b)], "decode"))
    steps.append(([([40], len(a) + 3, pages_a), (random_prompt(18, 3), 0, pages_c)], "mixed"))
    # decode_gemm_from (8) sequences decoding: the mixed entry's GEMMs; one fewer: the decode entry
    assert model.decode_gemm_from == 8
    singles = [([30 + i], 0, [21 + i]) for i in range(6)]
    steps.append(([([41], len(a) + 4, pages_a), ([42], len(b) + 3, pages_b), *singles], "mixed"))
    steps.append(([([43], len(a) + 5, pages_a), ([44], len(b) + 4, pages_b), *singles[:5]], "decode"))
    for seqs, kind in steps:
        step = make_step_inputs(seqs, model.page_size)
        assert model.step_kind(step) == kind
        want = interpret(graph, {**step, **kv}, weights)["logits"]
        got = model.forward(step)
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max(), kind


def test_decode_kernel_generates_what_the_prefill_kernel_does(artifact):
    """Greedy generation of a batch with decode steps on the decode kernel, and again with every
    step on the prefill kernel (the decode entry removed): the same tokens."""
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampler import SamplingParams
    prompts = [random_prompt(n, 10 + n) for n in (9, 26, 17)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    runs = []
    for use_decode_entry in (True, False):
        llm = LLM(artifact, kv_memory="4MiB")
        if not use_decode_entry:
            del llm.model.entries["decode"]
        runs.append([r.outputs[0].token_ids for r in llm.generate(prompts, params)])
    assert runs[0] == runs[1]
    assert all(len(tokens) == 20 for tokens in runs[0])


def graph_emulating(artifact, batches):
    """The artifact opened as a CUDA artifact with decode graphs would be: decode steps padded to
    `batches` through fixed buffers, run here by the (uncaptured) decode entry."""
    from kiln.runtime.model import GRAPH_ENTRY, CompiledModel
    model = CompiledModel(artifact)
    model.entries[GRAPH_ENTRY], model.graph_batches = model.entries["decode"], batches
    return model


def test_padded_graph_steps_match_unpadded_steps(artifact):
    """Decode steps padded to batch buckets (scratch-page sequences) give each real sequence the
    logits it gets unpadded; steps beyond the largest bucket and mixed steps take the other entries."""
    plain, padded = open_model(artifact), graph_emulating(artifact, (2, 4))
    num_pages = padded.allocate_kv(32 * padded.bytes_per_page)
    assert padded.kv_tensors["kv_pages0"].shape[0] == num_pages + 1 == plain.kv_tensors["kv_pages0"].shape[0] + 1
    prompts = [random_prompt(n, 30 + n) for n in (7, 19, 33, 12, 5)]
    pages = [[0, 1, 2], [3, 4], [5, 6, 7], [8, 9], [10, 11]]
    lens = [len(p) for p in prompts]
    first = make_step_inputs([(p, 0, pg) for p, pg in zip(prompts, pages)], plain.page_size)
    assert padded.step_kind(first) == "mixed"
    np.testing.assert_allclose(padded.forward(first), plain.forward(first), rtol=1e-5, atol=1e-5)
    for step, live in enumerate([3, 3, 1, 4, 5, 2]):            # sequences 0..live-1 decode one token
        seqs = [([7 + step], lens[i], pages[i]) for i in range(live)]
        inputs = make_step_inputs(seqs, plain.page_size)
        assert padded.step_kind(inputs) == ("decode" if live > 4 else "decode_graph")
        got, want = padded.forward(inputs), plain.forward(inputs)
        assert got.shape == want.shape == (live, plain.vocab_size)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        for i in range(live):
            lens[i] += 1


def test_wide_decode_steps_take_the_wide_entries(artifact):
    """From decode_mma_from sequences decode steps run the wide entries (on CUDA their linears are
    tensor-core GEMMs): padded through the graph buffers up to the largest bucket, unpadded beyond;
    here the mixed entry stands in for them, and each real sequence gets the logits it gets alone."""
    from kiln.runtime.model import WIDE_GRAPH_ENTRY
    plain, padded = open_model(artifact), graph_emulating(artifact, (2, 4))
    padded.entries[WIDE_GRAPH_ENTRY] = padded.entries["decode_wide"] = padded.entries["mixed"]
    padded.decode_mma_from = 3
    padded.allocate_kv(32 * padded.bytes_per_page)
    prompts = [random_prompt(n, 50 + n) for n in (7, 19, 33, 12, 5)]
    pages = [[0, 1, 2], [3, 4], [5, 6, 7], [8, 9], [10, 11]]
    first = make_step_inputs([(p, 0, pg) for p, pg in zip(prompts, pages)], plain.page_size)
    np.testing.assert_allclose(padded.forward(first), plain.forward(first), rtol=1e-5, atol=1e-5)
    lens = [len(p) for p in prompts]
    for step, live in enumerate([2, 3, 4, 5, 1]):
        inputs = make_step_inputs([([7 + step], lens[i], pages[i]) for i in range(live)], plain.page_size)
        want_kind = "decode_graph" if live < 3 else WIDE_GRAPH_ENTRY if live <= 4 else "decode_wide"
        assert padded.step_kind(inputs) == want_kind
        got, want = padded.forward(inputs), plain.forward(inputs)
        assert got.shape == want.shape == (live, plain.vocab_size)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        for i in range(live):
            lens[i] += 1


def test_pad_decode_step_points_padding_at_the_scratch_page():
    from kiln.runtime.step import pad_decode_step
    step = make_step_inputs([([5], 20, [3, 9]), ([6], 3, [4])], 16)
    padded = pad_decode_step(step, 4, scratch_page=50, page_size=16)
    assert padded["tokens"].tolist() == [5, 6, 0, 0] and padded["positions"].tolist() == [20, 3, 0, 0]
    assert padded["page_indptr"].tolist() == [0, 2, 3, 4, 5]
    assert padded["page_values"].tolist() == [3, 9, 4, 50, 50]
    assert padded["last_page_len"].tolist() == [5, 4, 1, 1]
    assert padded["slot_mapping"].tolist() == [9 * 16 + 4, 4 * 16 + 3, 800, 800]
    assert padded["q_indptr"].tolist() == padded["logit_rows"].tolist() + [4] == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="cannot be padded"):
        pad_decode_step(step, 1, scratch_page=50, page_size=16)


def test_step_buffers_reuse_their_memory_and_fixed_ones_never_move():
    import tvm
    from kiln.runtime.step_buffers import StepBuffers
    grow = StepBuffers(tvm.cpu(0))
    first = grow.put("tokens", np.arange(5, dtype=np.int32))
    assert first.numpy().tolist() == list(range(5)) and grow.capacity("tokens") == 5
    grow.put("tokens", np.arange(3, dtype=np.int32) + 10)
    assert grow.capacity("tokens") == 5                  # reused, not reallocated
    assert grow.put("tokens", np.arange(12, dtype=np.int32)).shape == (12,) and grow.capacity("tokens") == 12
    fixed = StepBuffers(tvm.cpu(0), {"tokens": 4}, fixed=True)
    view = fixed.put("tokens", np.array([1, 2], np.int32), length=4)
    assert view.shape == (4,) and view.numpy()[:2].tolist() == [1, 2]
    with pytest.raises(ValueError, match="fixed buffer holds 4"):
        fixed.put("tokens", np.arange(5, dtype=np.int32))


def test_staged_uploads_write_pinned_memory_in_turn_and_never_wait_for_the_stream(monkeypatch):
    """The GPU path of StepBuffers with host memory standing in for the pinned buffers: numpy
    writes the staging buffer (TVM's copy from numpy would synchronise the stream), and the next
    put of a name writes the other buffer, so a copy still queued reads what it was given."""
    import tvm
    from kiln.runtime.step_buffers import STAGING_SLOTS, StepBuffers, host_array
    real_copyfrom = tvm.runtime.Tensor.copyfrom

    def tensors_only(self, source):
        assert not isinstance(source, np.ndarray), "an upload went through TVM's synchronising copy"
        return real_copyfrom(self, source)
    monkeypatch.setattr(tvm.runtime.Tensor, "copyfrom", tensors_only)
    buffers = StepBuffers(tvm.cpu(0), staging_device=tvm.cpu(0))
    steps = [np.arange(4, dtype=np.int32) + 10 * s for s in range(STAGING_SLOTS + 1)]
    for s, array in enumerate(steps):
        assert buffers.put("tokens", array).numpy().tolist() == array.tolist()
        for earlier in range(max(0, s - STAGING_SLOTS + 1), s + 1):   # the slots still in use are intact
            slot = buffers.buffers["tokens"][1][earlier % STAGING_SLOTS][0]
            assert host_array(slot, 4, np.int32).tolist() == steps[earlier].tolist()
    view = buffers.put("rows", np.array([0.5, 2.0]), length=3)
    assert view.shape == (3,) and view.numpy()[:2].tolist() == [0.5, 2.0]
