"""Device sampling (codegen/lowering/sampling.py, runtime/device_sampler.py) built for this CPU: the compiled
functions pick what the NumPy sampler (runtime/sampler.py) picks on the same logits and seeds, and
the same module builds for CUDA."""
from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from kiln.runtime.sampler import (SamplerState, SamplingParams, draw, process_logits,  # noqa: E402
                                  sample, top_logprobs)

pytestmark = pytest.mark.build        # builds with TVM or runs what it built (not in make test-fast)

VOCAB = 3000


@pytest.fixture(scope="module")
def vm():
    from tvm import relax
    from kiln.codegen.pipelines import relax_pipeline
    from kiln.codegen.lowering.sampling import add_sampling_functions
    from kiln.targets.cpu import CPUTarget
    target = CPUTarget()
    mod = add_sampling_functions(tvm.IRModule())
    with target.tvm_target():
        mod = relax_pipeline(target)(mod)
    return relax.VirtualMachine(target.build(mod), tvm.cpu())


@pytest.fixture
def sampler(vm):
    from kiln.runtime.device_sampler import DeviceSampler
    return DeviceSampler(vm, tvm.cpu())


def _logits(rows: int, vocab: int = VOCAB, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).normal(size=(rows, vocab)) * 3).astype(np.float32)


def _states(params: list[dict], prompt=(), stop_ids=frozenset()) -> list[SamplerState]:
    return [SamplerState(SamplingParams(**kw), list(prompt), frozenset(stop_ids)) for kw in params]


def _run_both(sampler, steps: int, params: list[dict], seed: int, prompt=(), stop_ids=frozenset(), rows=None):
    """Sample `steps` times with fresh states for each implementation; return both token lists."""
    host, device = _states(params, prompt, stop_ids), _states(params, prompt, stop_ids)
    picked = ([], [])
    for step in range(steps):
        logits = _logits(len(params) + 2, seed=seed * 100 + step)
        chosen = rows if rows is not None else list(range(len(params)))
        a = sample(logits[chosen], host)
        b = sampler.sample(tvm.runtime.tensor(logits), device, rows)
        for states, tokens, out in ((host, a, picked[0]), (device, b, picked[1])):
            out.append(tokens.tolist())
            for st, tok in zip(states, tokens.tolist()):
                st.append(tok)
    return picked


COMBINATIONS = {
    "greedy": dict(temperature=0),
    "temperature": dict(temperature=0.8),
    "hot": dict(temperature=2.5),
    "top_k": dict(temperature=1.0, top_k=20),
    "top_p": dict(temperature=0.9, top_p=0.8),
    "min_p": dict(temperature=1.2, min_p=0.02),
    "all_filters": dict(temperature=0.7, top_k=50, top_p=0.9, min_p=0.01),
    "penalties": dict(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.7),
    "greedy_penalties": dict(temperature=0, repetition_penalty=1.8, frequency_penalty=1.5),
    "bias": dict(temperature=0.6, top_p=0.95, logit_bias={7: 8.0, 11: -100.0, VOCAB + 5: 3.0}),
    "min_tokens": dict(temperature=0.9, min_tokens=3),
    "everything": dict(temperature=0.8, top_k=40, top_p=0.85, min_p=0.005, repetition_penalty=1.2,
                       presence_penalty=-0.4, frequency_penalty=0.3, logit_bias={3: 5.0}, min_tokens=2),
}


@pytest.mark.parametrize("name", COMBINATIONS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_device_picks_the_numpy_tokens(sampler, name, seed):
    params = [dict(COMBINATIONS[name], seed=seed * 10 + i) for i in range(5)]
    host, device = _run_both(sampler, 4, params, seed, prompt=[1, 2, 3, 5, 8, 13, 21], stop_ids={2, 6, 10})
    assert host == device


def test_mixed_batch_with_shared_and_skipped_logit_rows(sampler):
    """Greedy, plain, sorted and penalised rows in one batch; two states read one logits row (the
    n > 1 samples of a request) and logits row 1 is nobody's (a prompt-logprobs row)."""
    kinds = ["greedy", "temperature", "top_p", "penalties", "all_filters", "greedy_penalties", "bias"]
    params = [dict(COMBINATIONS[k], seed=40 + i) for i, k in enumerate(kinds)]
    rows = [0, 2, 2, 3, 4, 5, 6]
    host, device = _run_both(sampler, 5, params, 7, prompt=[4, 4, 9], stop_ids={1}, rows=rows)
    assert host == device


def test_greedy_takes_the_lowest_id_among_ties(sampler):
    logits = _logits(3)
    logits[0, [17, 5, 900]] = 50.0
    logits[1, :] = -np.inf                                   # every token masked: token 0
    states = _states([dict(temperature=0)] * 3)
    out = sampler.sample(tvm.runtime.tensor(logits), states)
    assert out.tolist()[:2] == [5, 0]
    assert out.tolist() == sample(logits, _states([dict(temperature=0)] * 3)).tolist()


def test_top_k_keeps_every_tie_with_the_kth_value(sampler):
    """top_k=2 with three tokens tied at the 2nd value keeps all three: over many seeds both
    implementations draw each of them (and the same one each time)."""
    row = np.full(VOCAB, -20.0, np.float32)
    row[[3, 40, 41, 500]] = [5.0, 4.0, 4.0, 4.0]
    logits = np.repeat(row[None], 60, axis=0)
    params = [dict(temperature=1.0, top_k=2, seed=i) for i in range(60)]
    host = sample(logits, _states(params))
    device = sampler.sample(tvm.runtime.tensor(logits), _states(params))
    assert host.tolist() == device.tolist()
    assert set(device.tolist()) == {3, 40, 41, 500}


@pytest.mark.parametrize("top_p, kept", [(0.3999, {0}), (0.4001, {0, 1}), (0.6999, {0, 1}), (0.7001, {0, 1, 2})])
def test_top_p_boundaries(sampler, top_p, kept):
    """probabilities 0.4, 0.3, 0.2, 0.1: the nucleus grows by one token as top_p crosses 0.4 and 0.7."""
    row = np.log(np.array([0.4, 0.3, 0.2, 0.1])).astype(np.float32)
    logits = np.repeat(row[None], 200, axis=0)
    params = [dict(temperature=1.0, top_p=top_p, seed=i) for i in range(200)]
    host = sample(logits, _states(params))
    device = sampler.sample(tvm.runtime.tensor(logits), _states(params))
    assert host.tolist() == device.tolist()
    assert set(device.tolist()) == kept


def test_masked_stop_ids_are_never_drawn_until_min_tokens(sampler):
    logits = _logits(4)
    logits[:, 9] = 100.0                                     # the stop id would win every draw
    params = [dict(temperature=t, min_tokens=2, seed=i) for i, t in enumerate([0, 1.0, 0.5, 2.0])]
    host, device = _states(params, stop_ids={9}), _states(params, stop_ids={9})
    for step in range(3):
        a, b = sample(logits, host), sampler.sample(tvm.runtime.tensor(logits), device)
        assert a.tolist() == b.tolist()
        assert (9 in b.tolist()) == (step == 2)
        for st_a, st_b, tok in zip(host, device, b.tolist()):
            st_a.append(tok)
            st_b.append(tok)


def test_the_draw_is_a_function_of_the_uniform(vm):
    """The compiled draw equals `draw` for given uniforms, including 0 and the largest below 1, and
    other uniforms pick other tokens (near miss: the uniform is not ignored)."""
    x = _logits(6)
    rows = np.arange(6, dtype=np.int32)
    temperature, min_p = np.full(6, 0.9), np.full(6, 0.001)
    top_k, top_p = np.array([0, 10, 0, 100, 5, 0], np.int32), np.array([1.0, 1.0, 0.8, 0.95, 1.0, 0.5])
    for uniform in (np.array([0.0, 1 - 2**-53, 0.5, 0.25, 0.75, 0.999]), np.random.default_rng(3).random(6)):
        plain = vm["sample_plain"](tvm.runtime.tensor(x), rows, temperature, min_p, uniform).numpy()
        ranked = vm["sample_sorted"](tvm.runtime.tensor(x), rows, temperature, top_k, top_p, min_p,
                                     uniform).numpy()
        for i in range(6):
            assert plain[i] == draw(x[i], SamplingParams(temperature=0.9, min_p=0.001), uniform[i])
            p = SamplingParams(temperature=0.9, min_p=0.001, top_k=int(top_k[i]), top_p=float(top_p[i]))
            assert ranked[i] == draw(x[i], p, uniform[i])
        shifted = vm["sample_plain"](tvm.runtime.tensor(x), rows, temperature, min_p, (uniform + 0.37) % 1).numpy()
        assert (shifted != plain).any()


def test_penalties_give_the_numpy_processed_logits_exactly(vm):
    from kiln.runtime.device_sampler import DeviceSampler
    logits = _logits(3)
    params = [dict(repetition_penalty=1.5, presence_penalty=0.25, frequency_penalty=0.5, logit_bias={1: 2.5}),
              dict(temperature=0), dict(logit_bias={2999: -3.0}, min_tokens=1)]
    states = _states(params, prompt=[0, 1, 2, 50], stop_ids={7})
    for st in states:
        for tok in (5, 5, 50, 2999):
            st.append(tok)
    states[2] = _states(params[2:], stop_ids={7})[0]        # no output yet: stop id 7 is masked
    processed = DeviceSampler(vm, tvm.cpu())._penalized(tvm.runtime.tensor(logits), np.arange(3, dtype=np.int32),
                                                        states, VOCAB).numpy()
    for i, st in enumerate(states):
        np.testing.assert_array_equal(processed[i], process_logits(logits[i], st))
    assert processed[2, 7] == -np.inf and processed[1].tolist() == logits[1].tolist()


def test_only_rows_with_penalties_send_entries(sampler, monkeypatch):
    calls = []
    real = sampler.fn["penalties"]
    monkeypatch.setitem(sampler.fn, "penalties", lambda *args: calls.append(args[3].numpy()) or real(*args))
    logits = tvm.runtime.tensor(_logits(3))
    sampler.sample(logits, _states([dict(seed=1), dict(temperature=0), dict(top_p=0.5, seed=2)]))
    assert calls == []                                       # no row uses penalties: no call at all
    sampler.sample(logits, _states([dict(seed=1), dict(logit_bias={4: 1.0, 8: 2.0}), dict(seed=2)]))
    assert [c.tolist() for c in calls] == [[4, 8]]           # the entries are row 1's two biased tokens


def test_logprobs_match_the_numpy_ones(sampler):
    logits = _logits(5)
    logits[4, [10, 20, 30]] = 40.0                           # ties: the lowest ids first, as NumPy
    rows, tokens, ks = [0, 2, 2, 3, 4], [5, 77, 1000, 2999, 30], [0, 1, 5, 20, 3]
    got = sampler.top_logprobs(tvm.runtime.tensor(logits), rows, tokens, ks)
    for r, tok, k, lp in zip(rows, tokens, ks, got):
        want = top_logprobs(logits[r], tok, k)
        assert list(lp) == list(want)
        np.testing.assert_allclose(list(lp.values()), list(want.values()), atol=1e-5, rtol=0)


def test_any_params_and_logits_pick_the_numpy_tokens(vm):
    """Property: for any accepted params, small vocabularies (top_k >= vocab, every token masked),
    extreme logits and temperatures (z = +-inf), both implementations pick the same tokens."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from kiln.runtime.device_sampler import DeviceSampler
    sampler = DeviceSampler(vm, tvm.cpu())
    params = st.fixed_dictionaries({}, optional=dict(
        temperature=st.one_of(st.just(0.0), st.floats(0, 3)), top_p=st.floats(0.01, 1), top_k=st.integers(-1, 70),
        min_p=st.floats(0, 1), seed=st.integers(0, 2**64 - 1), min_tokens=st.integers(0, 3),
        repetition_penalty=st.floats(0.1, 10), presence_penalty=st.floats(-2, 2), frequency_penalty=st.floats(-2, 2),
        logit_bias=st.dictionaries(st.integers(0, 80), st.floats(-100, 100), max_size=3)))

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(kws=st.lists(params, min_size=1, max_size=4), vocab=st.integers(1, 60), data=st.data(),
           prompt=st.lists(st.integers(0, 59), max_size=5), stops=st.sets(st.integers(0, 59), max_size=3))
    def check(kws, vocab, data, prompt, stops):
        kws = [{"seed": i, **kw, "max_tokens": 3} for i, kw in enumerate(kws)]     # seeded: the same draws
        prompt = [t % vocab for t in prompt]
        host, device = _states(kws, prompt, stops), _states(kws, prompt, stops)
        for _ in range(3):
            logits = np.array(data.draw(st.lists(st.lists(st.floats(-1e4, 1e4, width=32) | st.just(-np.inf),
                                                          min_size=vocab, max_size=vocab),
                                                 min_size=len(kws), max_size=len(kws))), np.float32)
            a, b = sample(logits, host), sampler.sample(tvm.runtime.tensor(logits), device)
            assert a.tolist() == b.tolist()
            for st_a, st_b, tok in zip(host, device, a.tolist()):
                st_a.append(tok)
                st_b.append(tok)
    check()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_sampling_functions_build_for_cuda(tmp_path):
    """The same module compiles for sm_90 (in a fresh process: the CUDA loader must come before TVM),
    every kernel into the fatbin; it cannot run here."""
    script = textwrap.dedent(f"""
        import time
        from kiln.targets.cuda import make_target
        target = make_target("sm_90")
        import tvm
        from kiln.codegen.pipelines import relax_pipeline
        from kiln.codegen.lowering.sampling import add_sampling_functions
        start = time.perf_counter()
        with target.tvm_target():
            mod = relax_pipeline(target)(add_sampling_functions(tvm.IRModule()))
        from kiln.codegen.launches import kernel_names
        kernels = kernel_names(mod)
        target.export_library(target.build(mod), {str(tmp_path / "sampling.so")!r})
        print(" ".join(kernels))
        print(round(time.perf_counter() - start, 1))
    """)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    kernels, seconds = proc.stdout.split("\n")[-3:-1]
    library = (tmp_path / "sampling.so").read_bytes()
    assert b"__global__" not in library and b"sm_90" in library
    for name in kernels.split():
        assert f"{name}_kernel".encode() in library, name
    for name in ("penalize", "greedy", "inverse_cdf", "sort", "gpu_2d_continuous_cumsum", "topk"):
        assert name in kernels.split()
    assert time.perf_counter() - start < 120, f"the CUDA build took {seconds} s"


class FixedGrammar:
    """A grammar stand-in: the same random allowed set at every step (what the mask does is the
    point, not which language it comes from)."""

    def __init__(self, seed: int, vocab: int = VOCAB, share: float = 0.05):
        self.mask = np.random.default_rng(seed).random(vocab) < share

    def allowed(self):
        return self.mask

    def accept(self, token):
        assert self.mask[token], f"token {token} drawn outside the mask"
        return True


@pytest.mark.parametrize("name", ["greedy", "temperature", "all_filters", "everything"])
def test_grammar_masks_give_the_numpy_tokens(sampler, name):
    """Constrained rows (masked on the device by apply_token_mask) beside a free one, with penalties."""
    assert sampler.masks
    params = [{**COMBINATIONS[name], "seed": 1}, {**COMBINATIONS[name], "seed": 2}, dict(temperature=0.9, seed=3)]

    def states():
        out = _states(params, prompt=[5, 9, 9])
        for i, st in enumerate(out[:2]):
            st.grammar = FixedGrammar(i)
        return out
    host, device = states(), states()
    for step in range(4):
        logits = _logits(4, seed=step)
        a = sample(logits[[0, 2, 3]], host)
        b = sampler.sample(tvm.runtime.tensor(logits), device, [0, 2, 3])
        assert a.tolist() == b.tolist()
        for st_h, st_d, tok in zip(host, device, a.tolist()):
            st_h.append(tok)
            st_d.append(tok)
    assert all(host[i].grammar.mask[t] for i in range(2) for t in host[i].output_counts)


def test_an_artifact_without_the_mask_function_draws_constrained_rows_on_the_host(sampler):
    from kiln.runtime.device_sampler import DeviceLogits
    del sampler.fn["mask"]                       # as an artifact compiled before structured output
    assert not sampler.masks
    params = [dict(temperature=0.8, seed=4), dict(temperature=0, seed=5)]
    host, device = _states(params), _states(params)
    host[0].grammar = device[0].grammar = FixedGrammar(7)
    logits = _logits(3, seed=9)
    assert sample(logits[[1, 2]], host).tolist() == DeviceLogits(tvm.runtime.tensor(logits), sampler).sample(
        [1, 2], device).tolist()
