"""The engine sampling where the logits are: a CPU artifact built with the compiled sampler (as every
GPU artifact is) generates what the same model generates with the NumPy sampler, for greedy, seeded,
penalised and filtered requests together, n > 1, and with logprobs and prompt logprobs."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from reference import random_prompt

pytestmark = pytest.mark.build        # builds with TVM or runs what it built (not in make test-fast)


@pytest.fixture(scope="module")
def artifacts(make_model, llama_cpu):
    """(device-sampling artifact, host-sampling artifact) of the same tiny Llama."""
    from artifact_cache import cpu_artifact
    from kiln.targets import target_defaults
    return cpu_artifact(make_model("llama"), target=replace(target_defaults("cpu"), device_sampling=True)), llama_cpu[0]


def requests():
    from kiln.runtime.sampler import SamplingParams
    base = dict(max_tokens=12, ignore_eos=True)
    params = [SamplingParams(temperature=0.0, **base),
              SamplingParams(temperature=0.8, seed=1, **base),
              SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=2, **base),
              SamplingParams(temperature=0.7, min_p=0.1, seed=3, n=2, **base),
              SamplingParams(temperature=1.0, seed=4, repetition_penalty=1.3, presence_penalty=0.5,
                             frequency_penalty=0.4, logit_bias={7: 5.0, 9: -100.0}, **base),
              SamplingParams(temperature=0.0, logprobs=3, prompt_logprobs=2, **base),
              SamplingParams(temperature=0.9, top_p=0.5, seed=5, logprobs=2, **base)]
    return [random_prompt(5 + 3 * i, 70 + i) for i in range(len(params))], params


def test_device_sampling_generates_what_numpy_sampling_does(artifacts):
    from kiln.runtime.llm import LLM
    device, host = (LLM(a, kv_memory="8MiB") for a in artifacts)
    assert device.model.sampler is not None and host.model.sampler is None
    prompts, params = requests()
    got, want = (llm.generate(prompts, params, use_tqdm=False) for llm in (device, host))
    for g, w in zip(got, want):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
        for gc, wc in zip(g.outputs, w.outputs):
            assert (gc.logprobs is None) == (wc.logprobs is None)
            for gl, wl in zip(gc.logprobs or [], wc.logprobs or []):
                assert gl.keys() == wl.keys() and all(abs(gl[t] - wl[t]) < 1e-4 for t in gl)
        assert len(g.prompt_logprobs or []) == len(w.prompt_logprobs or [])
        for gl, wl in zip(g.prompt_logprobs or [], w.prompt_logprobs or []):
            if gl is not None:
                assert gl.keys() == wl.keys() and all(abs(gl[t] - wl[t]) < 1e-4 for t in gl)


def test_manifest_says_where_sampling_runs(artifacts):
    from kiln.artifact import read_manifest
    device, host = (read_manifest(a, verify=False) for a in artifacts)
    assert device.sampling == "device" and host.sampling == "host"
    assert {"greedy", "inverse_cdf", "penalize"} <= set(device.kernels)
    assert not {"greedy", "inverse_cdf", "penalize"} & set(host.kernels)


@pytest.mark.parametrize("which", ["device", "host"])
def test_one_step_ahead_generates_what_the_synchronous_engine_does(artifacts, which):
    """The one-step-ahead engine (runtime/overlap.py) on a CompiledModel's launches (runtime/launch.py):
    with device sampling, each step's placeholder tokens are copied from the step before's sampled
    ids where they were drawn; with host sampling, filled on the host. Greedy, seeded, filtered,
    penalised, n > 1, logprobs and prompt logprobs give the synchronous engine's outputs."""
    from kiln.runtime.launch import Computed, OnDevice
    from kiln.runtime.llm import LLM
    from kiln.runtime.overlap import OverlapEngine
    artifact = artifacts[0] if which == "device" else artifacts[1]
    sync, ahead = LLM(artifact, kv_memory="8MiB"), LLM(artifact, kv_memory="8MiB", overlap=True)
    assert isinstance(ahead.engine, OverlapEngine) and not isinstance(sync.engine, OverlapEngine)
    prompts, params = requests()
    want = sync.generate(prompts, params, use_tqdm=False)
    launched = []
    launch = ahead.model.launch
    ahead.model.launch = lambda *a: launched.append(launch(*a)) or launched[-1]
    got = ahead.generate(prompts, params, use_tqdm=False)
    assert {type(h) for h in launched} == {OnDevice if which == "device" else Computed}
    for g, w in zip(got, want):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
        assert [c.finish_reason for c in g.outputs] == [c.finish_reason for c in w.outputs]
        for gc, wc in zip(g.outputs, w.outputs):
            assert (gc.logprobs is None) == (wc.logprobs is None)
            for gl, wl in zip(gc.logprobs or [], wc.logprobs or []):
                assert gl.keys() == wl.keys() and all(abs(gl[t] - wl[t]) < 1e-5 for t in gl)
        assert g.prompt_logprobs == w.prompt_logprobs


def test_ids_come_back_through_pinned_memory_in_each_states_place(artifacts):
    """runtime/launch.py's read-back, its CUDA calls replaced by host copies: each sampling group's
    ids are copied to this turn's buffer in turn, and the result puts every id in its state's place
    (the CUDA path cannot run here; this runs all of it but the driver)."""
    import ctypes
    import tvm
    from kiln.runtime.launch import Launcher, OnDevice
    from kiln.runtime.llm import LLM

    class HostCopies:                      # cudaMemcpyAsync and events, on the host
        def __init__(self):
            self.recorded = []

        def copy_async(self, dst, src, nbytes, kind):
            ctypes.memmove(dst, src, nbytes)

        def new_event(self):
            return object()

        def record(self, event):
            self.recorded.append(event)

        def wait(self, event):
            assert event in self.recorded

    llm = LLM(artifacts[0], kv_memory="8MiB")
    launcher = Launcher(llm.model, HostCopies(), tvm.cpu(0))
    groups = [([0, 3], tvm.runtime.tensor(np.array([11, 44], np.int32))),
              ([2], tvm.runtime.tensor(np.array([33], np.int32))), ([1], tvm.runtime.tensor(np.array([22], np.int32)))]
    for turn in range(3):                  # the buffers are taken in turn
        handle = OnDevice(groups, 4, None, launcher._read_back(groups, 4))
        assert handle.readback is not None and handle.result()[0].tolist() == [11, 22, 33, 44]
        assert handle.source(3) == (groups[0][1], 1) and handle.source(1) == (groups[2][1], 0)
