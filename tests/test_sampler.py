"""Sampler: greedy, top-k/top-p filtering, seeded reproducibility, and sampled frequencies."""

import numpy as np
import pytest

from kiln.runtime.sampler import SamplerState, SamplingParams, sample, sample_row


def _state(**kw) -> SamplerState:
    return SamplerState(SamplingParams(**kw))


def _logits(rows: int, vocab: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(rows, vocab)).astype(np.float32) * 3


def test_greedy_is_argmax():
    logits = _logits(8, 50)
    out = sample(logits, [_state(temperature=0) for _ in range(8)])
    np.testing.assert_array_equal(out, np.argmax(logits, axis=1))
    assert out.dtype == np.int64


def test_greedy_ties_pick_lowest_id():
    row = np.array([0.0, 2.0, 1.0, 2.0, 2.0], dtype=np.float32)
    assert sample_row(row, _state(temperature=0)) == 1


@pytest.mark.parametrize("temperature", [0.1, 1.0, 5.0])
def test_top_k_1_is_greedy(temperature):
    logits = _logits(16, 40, seed=1)
    states = [_state(temperature=temperature, top_k=1, seed=i) for i in range(16)]
    np.testing.assert_array_equal(sample(logits, states), np.argmax(logits, axis=1))


def test_top_k_keeps_every_tie_with_the_kth_value():
    """top-k keeps the tokens >= the k-th largest value, ties included (a threshold a GPU applies
    without ordering ids), so top_k=1 with two tokens tied at the top draws both, and nothing else.
    (It used to keep the lowest id among ties, as argmax; greedy still does.)"""
    row = _logits(1, 40, seed=1)[0]
    row[[5, 9]] = row.max() + 1
    picks = {sample_row(row, _state(temperature=t, top_k=1, seed=i)) for i in range(30) for t in (0.1, 5.0)}
    assert picks == {5, 9}
    assert sample_row(row, _state(temperature=0)) == 5


def test_draw_is_the_inverse_cdf_in_token_id_order():
    """Probabilities 0.2, 0.5, 0.3 for ids 0, 1, 2: u in [0, 0.2) picks 0, [0.2, 0.7) picks 1, the rest 2."""
    from kiln.runtime.sampler import draw
    x = np.log(np.array([0.2, 0.5, 0.3])).astype(np.float32)
    picks = [draw(x, SamplingParams(), u) for u in (0.0, 0.19, 0.21, 0.69, 0.71, 1 - 2**-53)]
    assert picks == [0, 0, 1, 1, 2, 2]


def test_top_p_keeps_ties_with_the_nucleus_threshold():
    """0.4, 0.2, 0.2, 0.2: top_p 0.5 is reached at the first 0.2, whose ties are kept with it."""
    row = np.log(np.array([0.4, 0.2, 0.2, 0.2])).astype(np.float32)
    assert set(np.flatnonzero(_frequencies(row, 400, top_p=0.5))) == {0, 1, 2, 3}
    assert set(np.flatnonzero(_frequencies(row, 400, top_p=0.39))) == {0}


def test_same_seed_same_tokens_alone_or_batched():
    vocab, steps = 64, 30
    rng = np.random.default_rng(7)
    stream = rng.normal(size=(steps, vocab)).astype(np.float32)
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=1234)

    alone_state = SamplerState(params)
    alone = [sample(stream[t][None], [alone_state])[0] for t in range(steps)]

    # Same request at row 1, between a greedy row and other sampled rows that come and go.
    target = SamplerState(params)
    others = [SamplerState(SamplingParams(temperature=0)), SamplerState(SamplingParams(seed=99)),
              SamplerState(SamplingParams(temperature=1.3, top_k=5))]
    batched = []
    for t in range(steps):
        rows = [others[0], target] + others[1:1 + t % 3]
        logits = np.concatenate([rng.normal(size=(1, vocab)), stream[t][None],
                                 rng.normal(size=(len(rows) - 2, vocab))]).astype(np.float32)
        batched.append(sample(logits, rows)[1])
    assert alone == batched

    again = SamplerState(params)
    assert [sample_row(stream[t], again) for t in range(steps)] == alone


def test_no_seed_uses_fresh_entropy():
    row = np.zeros(1000, dtype=np.float32)
    draws = [tuple(sample_row(row, s) for _ in range(5)) for s in (_state(), _state())]
    assert draws[0] != draws[1]


def _frequencies(row: np.ndarray, n: int, **kw) -> np.ndarray:
    state = _state(seed=0, **kw)
    ids = np.array([sample_row(row, state) for _ in range(n)])
    return np.bincount(ids, minlength=row.shape[0]) / n


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_frequencies_match_distribution(temperature):
    probs = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    row = np.log(probs).astype(np.float32)
    expected = _softmax(np.log(probs) / temperature)
    n = 20000
    freq = _frequencies(row, n, temperature=temperature)
    # 5 standard errors per token: a false failure is ~1e-6 likely (and the seed is fixed).
    bound = 5 * np.sqrt(expected * (1 - expected) / n)
    assert np.all(np.abs(freq - expected) <= bound), (freq, expected)


def test_top_k_renormalises_over_the_top_k():
    probs = np.array([0.05, 0.4, 0.1, 0.3, 0.15])
    freq = _frequencies(np.log(probs).astype(np.float32), 20000, top_k=3)
    expected = np.where(probs >= 0.15, probs, 0) / (0.4 + 0.3 + 0.15)
    assert freq[0] == 0 and freq[2] == 0
    assert np.max(np.abs(freq - expected)) < 0.01


def test_top_p_never_samples_outside_the_nucleus():
    probs = np.array([0.05, 0.5, 0.02, 0.3, 0.13])
    # Sorted: 0.5, 0.3, 0.13, ... ; cumulative 0.5, 0.8, 0.93: top_p=0.75 keeps {1, 3}.
    freq = _frequencies(np.log(probs).astype(np.float32), 20000, top_p=0.75)
    assert set(np.flatnonzero(freq)) == {1, 3}
    assert abs(freq[1] - 0.5 / 0.8) < 0.01


def test_top_p_keeps_at_least_the_top_token():
    probs = np.array([0.1, 0.6, 0.3])
    freq = _frequencies(np.log(probs).astype(np.float32), 500, top_p=0.01)
    assert freq[1] == 1.0


def test_masked_logits_are_never_sampled():
    row = np.array([0.0, -np.inf, 0.0, -np.inf], dtype=np.float32)
    freq = _frequencies(row, 2000)
    assert freq[1] == 0 and freq[3] == 0


@pytest.mark.parametrize("kw, name", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"seed": "x"}, "seed"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"stop_token_ids": [1, -3]}, "stop_token_ids"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
])
def test_invalid_params_name_the_parameter(kw, name):
    from kiln.errors import ParamError
    with pytest.raises(ParamError, match=name) as e:
        SamplingParams(**kw)
    assert e.value.param == name


def test_top_k_off_values():
    for k in (0, -1):
        assert SamplingParams(top_k=k).top_k == k


def test_batch_shape_mismatch():
    with pytest.raises(ValueError):
        sample(np.zeros((2, 4), dtype=np.float32), [_state()])


# ---------------------------------------------------------------------------- processors (known values)

def test_logit_bias_and_min_tokens_mask_on_known_logits():
    from kiln.runtime.sampler import process_logits
    logits = np.array([1.0, 2.0, 3.0, 0.5], np.float32)
    state = SamplerState(SamplingParams(logit_bias={0: 5.0, 2: -1.0}, min_tokens=2), stop_ids=frozenset({3}))
    assert process_logits(logits, state).tolist() == [6.0, 2.0, 2.0, -np.inf]
    state.append(1)
    state.append(1)                                     # min_tokens reached: the stop id is back
    assert process_logits(logits, state)[3] == 0.5


def test_repetition_presence_and_frequency_penalties_on_known_logits():
    from kiln.runtime.sampler import process_logits
    logits = np.array([2.0, -2.0, 1.0, 4.0], np.float32)
    rep = SamplerState(SamplingParams(repetition_penalty=2.0), prompt_ids=[0, 1])
    rep.append(3)
    # seen tokens 0, 1 (prompt) and 3 (output): positive logits halved, negative ones doubled
    assert process_logits(logits, rep).tolist() == [1.0, -4.0, 1.0, 2.0]
    pen = SamplerState(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt_ids=[0])
    for tok in (2, 2, 3):
        pen.append(tok)
    # the prompt is not penalised; token 2: 0.5 + 2 * 0.25, token 3: 0.5 + 0.25
    assert process_logits(logits, pen).tolist() == [2.0, -2.0, 0.0, 3.25]


def test_min_p_drops_tokens_below_the_fraction_of_the_top_probability():
    # probabilities 0.6, 0.3, 0.1 and min_p 0.4: the threshold is 0.24, so 0.1 goes and 0.3 stays
    logits = np.log(np.array([0.6, 0.3, 0.1]))
    counts = np.zeros(3, int)
    state = _state(temperature=1.0, min_p=0.4, seed=0)
    for _ in range(3000):
        counts[sample(logits[None], [state])[0]] += 1
    assert counts[2] == 0                              # 0.1 < 0.4 * 0.6
    assert abs(counts[0] / 3000 - 2 / 3) < 0.03        # renormalised over 0.6 and 0.3


def test_top_logprobs_are_the_log_softmax_of_the_raw_logits():
    from kiln.runtime.sampler import top_logprobs
    logits = np.array([0.0, np.log(3.0), np.log(6.0)])  # softmax 0.1, 0.3, 0.6
    lp = top_logprobs(logits, 0, 2)
    assert set(lp) == {0, 2, 1}
    assert np.allclose([lp[0], lp[1], lp[2]], np.log([0.1, 0.3, 0.6]))


def test_n_samples_seed_their_generators_apart():
    base = SamplerState(SamplingParams(temperature=1.0, seed=5))
    other = base.fork(1)
    logits = np.zeros((1, 1000))
    a = [sample(logits, [base])[0] for _ in range(20)]
    b = [sample(logits, [other])[0] for _ in range(20)]
    assert a != b
    again = SamplerState(SamplingParams(temperature=1.0, seed=5)).fork(1)
    assert [sample(logits, [again])[0] for _ in range(20)] == b


# ---------------------------------------------------------------------------- seeds, and every accepted combination

@pytest.mark.parametrize("seed", [-1, -(2**63), 2**64 + 5, 2**200])
def test_any_int_seed_is_folded_into_range_and_repeats(seed):
    logits = np.zeros((1, 500))
    draws = [sample(logits, [_state(temperature=1.0, seed=seed)])[0] for _ in range(2)]
    assert draws[0] == draws[1]
    folded = SamplerState(SamplingParams(temperature=1.0, seed=seed % 2**64))
    assert sample(logits, [folded])[0] == draws[0]          # -1 is the same stream as 2**64 - 1


def _maybe(strategy):
    from hypothesis import strategies as st
    return st.one_of(st.none(), strategy)


def _param_strategies():
    from hypothesis import strategies as st
    num = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10**20, 10**20))
    small = st.integers(-3, 70)
    return dict(
        temperature=st.one_of(num, st.floats(0, 3)), top_p=st.one_of(num, st.floats(0, 1)),
        top_k=st.one_of(small, st.integers(-2**70, 2**70)), min_p=st.one_of(num, st.floats(0, 1)),
        seed=_maybe(st.integers(-2**80, 2**80)), max_tokens=small, min_tokens=small, n=st.integers(-1, 4),
        stop=st.lists(st.text(max_size=5), max_size=3), stop_token_ids=st.lists(st.integers(-2, 80), max_size=4),
        ignore_eos=st.booleans(), repetition_penalty=st.one_of(num, st.floats(0, 10)),
        presence_penalty=st.one_of(num, st.floats(-2, 2)), frequency_penalty=st.one_of(num, st.floats(-2, 2)),
        logit_bias=st.dictionaries(st.integers(-2, 80), st.one_of(num, st.floats(-100, 100)), max_size=4),
        logprobs=_maybe(small), prompt_logprobs=_maybe(small))


def test_every_accepted_combination_samples_without_error():
    """Property: any SamplingParams that constructs samples valid tokens, step after step (or
    construction fails with a ParamError naming a field)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from kiln.errors import ParamError
    from kiln.runtime.sampler import top_logprobs
    fields = _param_strategies()

    @settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(kw=st.fixed_dictionaries({}, optional=fields), vocab=st.integers(1, 60),
           steps=st.integers(1, 4), prompt=st.lists(st.integers(0, 59), max_size=6), data=st.data())
    def check(kw, vocab, steps, prompt, data):
        try:
            params = SamplingParams(**kw)
        except ParamError as e:
            assert e.param in fields
            return
        states = [SamplerState(params, [t % vocab for t in prompt], frozenset(params.stop_token_ids), i)
                  for i in range(params.n)]
        for _ in range(steps):
            logits = np.asarray(data.draw(st.lists(st.floats(-1e4, 1e4), min_size=vocab, max_size=vocab)),
                                np.float32)[None].repeat(len(states), 0)
            tokens = sample(logits, states)
            assert all(0 <= t < vocab for t in tokens.tolist())
            for st_, tok in zip(states, tokens.tolist()):
                if params.logprobs is not None:
                    lp = top_logprobs(logits[0], tok, params.logprobs)
                    assert tok in lp and all(v <= 1e-9 for v in lp.values())
                st_.append(tok)
    check()
